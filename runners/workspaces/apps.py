from django.apps import AppConfig


class WorkspacesConfig(AppConfig):
    name = "runners.workspaces"
    label = "workspaces"
    verbose_name = "Interactive workspaces"

    def ready(self) -> None:
        from runners.workspaces import receivers  # noqa: F401  (a workspace's job ended: the workspace stopped)

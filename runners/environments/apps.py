from django.apps import AppConfig


class EnvironmentsConfig(AppConfig):
    name = "runners.environments"
    label = "environments"
    verbose_name = "Environments"

    def ready(self) -> None:
        from runners.environments import receivers  # noqa: F401  (connects the receivers)

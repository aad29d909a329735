from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "runners.jobs"
    label = "jobs"
    verbose_name = "Training jobs"

    def ready(self) -> None:
        from runners.jobs import receivers  # noqa: F401  (connects the receivers)

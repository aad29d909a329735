from django.apps import AppConfig


class UsageConfig(AppConfig):
    name = "runners.usage"
    label = "usage"
    verbose_name = "Utilization, usage and cost"

    def ready(self) -> None:
        from runners.usage import receivers  # noqa: F401  (connects to the jobs' and quotas' signals)

from django.apps import AppConfig


class RunnersConfig(AppConfig):
    name = "runners"
    verbose_name = "Environments, inventory and partitions"

    def ready(self) -> None:
        from runners import signals  # noqa: F401  (connects the receivers)

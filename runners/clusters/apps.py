from django.apps import AppConfig


class ClustersConfig(AppConfig):
    name = "runners.clusters"
    label = "clusters"
    verbose_name = "Inventory and partitions"

    def ready(self) -> None:
        from runners.clusters import receivers  # noqa: F401  (connects the receivers)

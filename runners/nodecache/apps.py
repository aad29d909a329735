from django.apps import AppConfig


class NodeCacheConfig(AppConfig):
    name = "runners.nodecache"
    label = "nodecache"
    verbose_name = "Node caches"

    def ready(self) -> None:
        from runners.nodecache import receivers  # noqa: F401  (attempts' ends, /metrics)

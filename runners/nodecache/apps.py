from django.apps import AppConfig


class NodeCacheConfig(AppConfig):
    name = "runners.nodecache"
    label = "nodecache"
    verbose_name = "Node caches"

from django.apps import AppConfig


class BundlesConfig(AppConfig):
    name = "runners.bundles"
    label = "bundles"
    verbose_name = "Code bundles"

from django.apps import AppConfig


class RegistryConfig(AppConfig):
    name = "runners.registry"
    label = "registry"
    verbose_name = "Model registry"

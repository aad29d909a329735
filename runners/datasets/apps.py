from django.apps import AppConfig


class DatasetsConfig(AppConfig):
    name = "runners.datasets"
    label = "datasets"
    verbose_name = "Datasets"

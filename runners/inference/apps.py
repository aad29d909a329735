from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "runners.inference"
    label = "inference"
    verbose_name = "Inference endpoints"

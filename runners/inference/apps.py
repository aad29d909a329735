from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "runners.inference"
    label = "inference"
    verbose_name = "Inference endpoints"

    def ready(self) -> None:
        from runners.inference import receivers  # noqa: F401  (model versions in use, replicas' weights URLs)

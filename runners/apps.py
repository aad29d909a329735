from django.apps import AppConfig


class RunnersConfig(AppConfig):
    name = "runners"

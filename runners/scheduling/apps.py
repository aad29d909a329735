from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "runners.scheduling"
    label = "scheduling"
    verbose_name = "Scheduling cycle"

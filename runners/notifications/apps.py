from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    name = "runners.notifications"
    label = "notifications"
    verbose_name = "Notifications (mail and webhooks)"

    def ready(self) -> None:
        from runners.notifications import receivers  # noqa: F401  (answers the lower apps' signals)

from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants and members"

    def ready(self) -> None:
        from tenants import receivers  # noqa: F401  (connects them)

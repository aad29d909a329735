"""The one place where API querysets are scoped to the caller's tenants.

Every tenant-owned API view inherits ``TenantScopedMixin``. It owns
``get_queryset``: subclasses refine the already-scoped queryset in
``refine_queryset`` and cannot replace the scoping by accident (defining
``get_queryset`` in a subclass is a TypeError at import time). A view that
truly needs unscoped access must override ``dangerously_get_queryset`` and
say why.
"""

from django.db.models import QuerySet

from tenants.selectors import tenant_list


class TenantScopedMixin:
    # The lookup path from the view's model to Tenant ("tenant", "environment__tenant", ...);
    # "" when the model is Tenant itself.
    scope_field = "tenant"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "get_queryset" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} overrides get_queryset, which would skip tenant scoping; "
                "override refine_queryset (or dangerously_get_queryset, with a comment saying why) instead."
            )

    def base_queryset(self) -> QuerySet:
        return self.queryset.all()

    def refine_queryset(self, queryset: QuerySet) -> QuerySet:
        return queryset

    def dangerously_get_queryset(self) -> QuerySet | None:
        return None

    def get_queryset(self) -> QuerySet:
        unscoped = self.dangerously_get_queryset()
        if unscoped is not None:
            return unscoped
        tenants = tenant_list(user=self.request.user)
        queryset = self.base_queryset()
        if self.scope_field:
            queryset = queryset.filter(**{f"{self.scope_field}__in": tenants})
        else:
            queryset = queryset.filter(pk__in=tenants.values("pk"))
        return self.refine_queryset(queryset)

"""The /api/v1/ router and the API-wide exception handling."""

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions
from rest_framework.routers import DefaultRouter
from rest_framework.views import exception_handler as drf_exception_handler

from quotas.api import (
    FlavorViewSet,
    NodePoolViewSet,
    NodeViewSet,
    PartitionChangeViewSet,
    PartitionProfileViewSet,
    QuotaViewSet,
)
from tenants.api import EnvironmentViewSet, MemberViewSet, TenantViewSet

router = DefaultRouter()
router.register("tenants", TenantViewSet, basename="tenant")
router.register(r"tenants/(?P<tenant_slug>[a-z0-9-]+)/members", MemberViewSet, basename="tenant-member")
router.register("environments", EnvironmentViewSet, basename="environment")
router.register("flavors", FlavorViewSet, basename="flavor")
router.register("quotas", QuotaViewSet, basename="quota")
router.register("partition-profiles", PartitionProfileViewSet, basename="partition-profile")
router.register("node-pools", NodePoolViewSet, basename="node-pool")
router.register("nodes", NodeViewSet, basename="node")
router.register("partition-changes", PartitionChangeViewSet, basename="partition-change")


def exception_handler(exc, context):
    """Turn a service's Django ValidationError into a 400 that names the field."""
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        exc = exceptions.ValidationError(detail=detail)
    return drf_exception_handler(exc, context)

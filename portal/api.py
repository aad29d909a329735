"""The /api/v1/ router and the API-wide exception handling."""

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import InterfaceError, OperationalError, connection
from rest_framework import exceptions
from rest_framework.routers import DefaultRouter
from rest_framework.views import exception_handler as drf_exception_handler

from common import errors
from quotas.api import FlavorViewSet, QuotaViewSet
from runners.clusters.api import NodePoolViewSet, NodeViewSet, PartitionChangeViewSet, PartitionProfileViewSet
from runners.environments.api import EnvironmentViewSet
from runners.inference.api import EndpointViewSet
from runners.jobs.api import JobViewSet
from runners.nodecache.api import NodeCacheViewSet
from runners.notifications.api import NotificationPreferenceViewSet, WebhookViewSet
from runners.workspaces.api import WorkspaceViewSet
from tenants.api import ApiTokenViewSet, MemberViewSet, TenantViewSet

router = DefaultRouter()
router.register("tokens", ApiTokenViewSet, basename="token")
router.register("tenants", TenantViewSet, basename="tenant")
router.register(r"tenants/(?P<tenant_slug>[a-z0-9-]+)/members", MemberViewSet, basename="tenant-member")
router.register("environments", EnvironmentViewSet, basename="environment")
router.register("flavors", FlavorViewSet, basename="flavor")
router.register("quotas", QuotaViewSet, basename="quota")
router.register("partition-profiles", PartitionProfileViewSet, basename="partition-profile")
router.register("node-pools", NodePoolViewSet, basename="node-pool")
router.register("nodes", NodeViewSet, basename="node")
router.register("node-caches", NodeCacheViewSet, basename="node-cache")
router.register("partition-changes", PartitionChangeViewSet, basename="partition-change")
router.register("jobs", JobViewSet, basename="job")
router.register("endpoints", EndpointViewSet, basename="endpoint")
router.register("workspaces", WorkspaceViewSet, basename="workspace")
router.register(r"tenants/(?P<tenant_slug>[a-z0-9-]+)/webhooks", WebhookViewSet, basename="tenant-webhook")
router.register("notification-preferences", NotificationPreferenceViewSet, basename="notification-preference")


class DatabaseUnavailable(exceptions.APIException):
    status_code = 503
    default_detail = ("The database could not be reached; nothing was changed by this request unless a retry "
                      "says otherwise. Retry (with the same Idempotency-Key for a submit).")
    default_code = "database_unavailable"


class ConflictError(exceptions.APIException):
    status_code = 409
    default_detail = "This does not fit the object's current state."
    default_code = "conflict"


def exception_handler(exc, context):
    """Map the portal's own exceptions (common.errors) to HTTP; a ValidationError is a 400 naming the field."""
    if isinstance(exc, errors.NotFound):
        exc = exceptions.NotFound(str(exc))
    elif isinstance(exc, errors.Conflict):
        exc = ConflictError(str(exc))
    elif isinstance(exc, errors.TooMany):
        exc = exceptions.Throttled(detail=str(exc))
    elif isinstance(exc, (OperationalError, InterfaceError)):
        # A lost connection (a restarted or failed-over database), a deadlock or a serialization failure:
        # transient, so a 503 the client may retry. A bad query (DataError, ProgrammingError) stays a 500:
        # that is a bug to see, not a reason to retry. The connection is dropped if it broke, so the next
        # request opens a fresh one.
        connection.close_if_unusable_or_obsolete()
        response = drf_exception_handler(DatabaseUnavailable(), context)
        response["Retry-After"] = "2"
        return response
    elif isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        exc = exceptions.ValidationError(detail=detail)
    return drf_exception_handler(exc, context)

"""Reads of endpoints: a user sees those of the tenants they belong to (staff all); anyone else's is NotFound."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from common.errors import NotFound
from runners.inference.models import EndpointState, InferenceEndpoint
from tenants.selectors import tenant_list


def endpoint_list(*, user: AbstractBaseUser, tenant=None) -> QuerySet[InferenceEndpoint]:
    queryset = InferenceEndpoint.objects.filter(tenant__in=tenant_list(user=user)).select_related(
        "tenant", "flavor", "environment", "source_job", "model_version")
    return queryset.filter(tenant=tenant) if tenant is not None else queryset


def endpoint_get(*, user: AbstractBaseUser, endpoint_id) -> InferenceEndpoint:
    try:
        return endpoint_list(user=user).get(id=endpoint_id)
    except (InferenceEndpoint.DoesNotExist, ValueError, TypeError):
        raise NotFound("No such endpoint.") from None


def endpoint_serving(*, user: AbstractBaseUser, tenant_slug: str, name: str) -> InferenceEndpoint | None:
    """The live endpoint a generate request names, among the caller's tenants; None for anyone else's."""
    return endpoint_list(user=user).filter(tenant__slug=tenant_slug, name=name).exclude(
        state=EndpointState.STOPPED).first()

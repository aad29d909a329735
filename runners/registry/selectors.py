"""Reads of the model registry, scoped to the caller's tenants: another tenant's model reads as one that does not
exist (NotFound, naming the field that named it)."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Max, QuerySet

from common.errors import NotFound
from runners.registry.models import ModelVersion
from tenants.models import Tenant
from tenants.selectors import tenant_list


def version_list(*, user: AbstractBaseUser, tenant: Tenant | None = None, name: str | None = None
                 ) -> QuerySet[ModelVersion]:
    queryset = ModelVersion.objects.kept().filter(tenant__in=tenant_list(user=user)).select_related(
        "tenant", "created_by")
    if tenant is not None:
        queryset = queryset.filter(tenant=tenant)
    if name is not None:
        queryset = queryset.filter(name=name)
    return queryset


def model_list(*, user: AbstractBaseUser, tenant: Tenant) -> list[dict]:
    """The tenant's models, by name: how many versions, the newest, and when it was promoted."""
    rows = (version_list(user=user, tenant=tenant).values("name")
            .annotate(versions=Count("id"), newest=Max("version"), updated_at=Max("created_at")).order_by("name"))
    return list(rows)


def model_versions(*, user: AbstractBaseUser, tenant: Tenant, name: str, field: str = "model"
                   ) -> QuerySet[ModelVersion]:
    """Every version of one model, newest first; NotFound naming ``field`` when the tenant has no such model."""
    return _versions(version_list(user=user, tenant=tenant), tenant, name, field)


def version_get(*, user: AbstractBaseUser, tenant: Tenant, name: str, version=None, field: str = "model",
                version_field: str = "version") -> ModelVersion:
    """One version of a model (the newest when ``version`` is None); NotFound naming the field that is wrong."""
    return _version(version_list(user=user, tenant=tenant), tenant, name, version, field, version_field)


def tenant_version_get(*, tenant: Tenant, name: str, version=None, field: str = "model",
                       version_field: str = "version") -> ModelVersion:
    """As ``version_get``, for a service that has already checked the caller's role in ``tenant``."""
    return _version(ModelVersion.objects.kept().filter(tenant=tenant), tenant, name, version, field, version_field)


def version_of_replica_weights(*, version_id: int, sha256: str) -> ModelVersion | None:
    """The kept version of this id whose weights are ``sha256`` (what a signed weights URL names), else None."""
    return ModelVersion.objects.kept().filter(id=version_id, weights_sha256=sha256).first()


def _versions(queryset: QuerySet[ModelVersion], tenant: Tenant, name, field: str) -> QuerySet[ModelVersion]:
    versions = queryset.filter(name=name).order_by("-version") if isinstance(name, str) else queryset.none()
    if not versions.exists():
        raise NotFound(f"{field}: tenant {tenant.slug} has no model {name!r}.")
    return versions


def _version(queryset, tenant: Tenant, name, version, field: str, version_field: str) -> ModelVersion:
    versions = _versions(queryset, tenant, name, field)
    if version is None or version == "latest":
        return versions.first()
    if isinstance(version, bool) or not isinstance(version, int):
        raise NotFound(f"{version_field}: model {name} has no version {version!r}.")
    found = versions.filter(version=version).first()
    if found is None:
        if ModelVersion.objects.filter(tenant=tenant, name=name, version=version, deleted_at__isnull=False).exists():
            raise NotFound(f"{version_field}: model {name} version {version} was deleted.")
        newest = versions.first().version
        raise NotFound(f"{version_field}: model {name} has no version {version}; its versions are 1 to {newest}.")
    return found


def version_lock(version: ModelVersion) -> ModelVersion:
    """Lock a version's row for the caller's transaction (a deploy or rollout about to serve it); NotFound naming
    ``source.version`` when it was deleted meanwhile."""
    locked = ModelVersion.objects.select_for_update().filter(id=version.id, deleted_at__isnull=True).first()
    if locked is None:
        raise NotFound(f"source.version: model {version.name} version {version.version} was deleted.")
    return locked

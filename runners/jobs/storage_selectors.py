"""Reads of a tenant's checkpoint storage: its quota, what the store holds of it after deduplication, its
retention policy, and what a proposed policy would free, all scoped to the caller's tenants."""

from __future__ import annotations

from decimal import Decimal

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Sum

from common.errors import NotFound
from quotas.models import TenantStorage
from quotas.storage_services import retention_parse
from runners.jobs import checkpoint_store
from runners.jobs.models import Checkpoint, Job
from tenants.models import Role, Tenant
from tenants.selectors import tenant_get, user_has_role


def storage_summary(*, user: AbstractBaseUser, tenant: Tenant) -> dict:
    """The tenant's storage as its pages and the API show it (any member reads it)."""
    tenant_get(user=user, slug=tenant.slug)
    storage = TenantStorage.objects.filter(tenant=tenant).first()
    quota_gb = None if storage is None or storage.quota_gb is None else storage.quota_gb
    held = (Checkpoint.objects.filter(job__tenant=tenant, store_state="durable")
            .aggregate(count=Count("id"), file_bytes=Sum("bytes")))
    return {
        "tenant": tenant.slug,
        "quota_gb": None if quota_gb is None else str(quota_gb),
        "quota_bytes": None if quota_gb is None else int(Decimal(quota_gb) * checkpoint_store.BYTES_PER_GB),
        "used_bytes": checkpoint_store.tenant_stored_bytes(tenant.id),
        "durable_checkpoints": held["count"],
        "durable_file_bytes": held["file_bytes"] or 0,
        "retention": retention_parse(storage.retention if storage else None).to_json()
        if storage is not None and storage.retention is not None else None,
        "can_set_retention": user_has_role(user=user, tenant=tenant, at_least=Role.ADMIN),
        "can_set_quota": bool(user.is_staff),
        "updated_at": storage.updated_at if storage else None,
    }


def retention_preview(*, user: AbstractBaseUser, tenant: Tenant, policy, job_id: int | None = None) -> dict:
    """What a proposed policy (its JSON form; None keeps everything) would delete now, nothing saved: for the
    tenant's jobs that follow the tenant's policy, or, given a job of the tenant, for that job alone."""
    tenant_get(user=user, slug=tenant.slug)
    parsed = retention_parse(policy)
    if job_id is not None and not Job.objects.filter(tenant=tenant, id=job_id).exists():
        raise NotFound("No such job in this tenant.")
    preview = checkpoint_store.retention_preview(tenant_id=tenant.id, policy=parsed, job_id=job_id)
    # Beside what the store drops by (after deduplication): the checkpoints' own file sizes.
    for job in preview["jobs"]:
        job["file_bytes"] = (Checkpoint.objects.filter(job_id=job["job"], step__in=job["steps"])
                             .aggregate(size=Sum("bytes"))["size"] or 0)
    return {"policy": parsed.to_json(), "job": job_id, **preview,
            "file_bytes": sum(job["file_bytes"] for job in preview["jobs"])}

"""Reads of datasets, with the one visibility rule: a tenant sees its own datasets and those shared with it.

Anything else reads exactly as a dataset that does not exist (NotFound, a 404; ``UnknownDataset`` naming the
field ``datasets`` in a job's spec). Readers see sealed versions only: an open or failed version exists for
nobody but its own tenant's uploads.

A dataset is named by its bare name in its own tenant. Another tenant names a shared one
``<owner>/<name>``, or by its bare name when it has no dataset of that name itself and exactly one shared
with it bears it.
"""

from __future__ import annotations

import re

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Q, QuerySet

from common.errors import Invalid, NotFound
from runners.datasets.models import (
    NAME_PATTERN,
    Dataset,
    DatasetShare,
    DatasetUse,
    DatasetVersion,
    VersionShard,
    VersionState,
)
from tenants.models import Tenant
from tenants.selectors import tenant_get

REFERENCE = re.compile(rf"^(?:(?P<owner>[a-z0-9-]+)/)?(?P<name>{NAME_PATTERN})$")
LATEST = "latest"


class UnknownDataset(Invalid):
    """A job's spec names a dataset or version the tenant cannot read (none, unsealed, or another tenant's
    unshared one: the same words): a 404 naming ``datasets`` to the API."""

    def __init__(self, message: str):
        super().__init__("datasets", message)


def visible(tenant: Tenant) -> QuerySet[Dataset]:
    """The datasets the tenant may read: its own and those shared with it."""
    shared = DatasetShare.objects.filter(tenant=tenant).values("dataset_id")
    return Dataset.objects.filter(Q(tenant=tenant) | Q(id__in=shared)).select_related("tenant")


def reference_of(dataset: Dataset, tenant: Tenant) -> str:
    """How the tenant names the dataset: its bare name when it owns it, ``owner/name`` when it is shared with it."""
    return dataset.name if dataset.tenant_id == tenant.id else f"{dataset.tenant.slug}/{dataset.name}"


def dataset_resolve(tenant: Tenant, reference) -> Dataset:
    """The dataset the tenant names (``name`` or ``owner/name``); NotFound for any it cannot read."""
    match = REFERENCE.match(reference) if isinstance(reference, str) else None
    if match is None:
        raise NotFound(f"No dataset {reference!r}: a dataset's name, or owner/name for one shared with you.")
    owner, name = match.group("owner"), match.group("name")
    candidates = visible(tenant).filter(name=name)
    if owner is not None:
        found = candidates.filter(tenant__slug=owner).first()
    else:
        found = candidates.filter(tenant=tenant).first()
        if found is None:
            shared = list(candidates[:2])
            if len(shared) > 1:
                raise NotFound(f"Several datasets named {name!r} are shared with {tenant.slug}; name one as owner/{name}.")
            found = shared[0] if shared else None
    if found is None:
        raise NotFound(f"Tenant {tenant.slug} has no dataset {reference!r}.")
    return found


def dataset_get(*, user: AbstractBaseUser, tenant_slug: str, reference: str) -> tuple[Tenant, Dataset]:
    """(the caller's tenant, the dataset it names); NotFound for a tenant or dataset the user cannot see."""
    tenant = tenant_get(user=user, slug=tenant_slug)
    return tenant, dataset_resolve(tenant, reference)


def dataset_list(*, user: AbstractBaseUser, tenant_slug: str) -> tuple[Tenant, QuerySet[Dataset]]:
    tenant = tenant_get(user=user, slug=tenant_slug)
    return tenant, visible(tenant).order_by("tenant__slug", "name")


def sealed_versions(dataset: Dataset) -> QuerySet[DatasetVersion]:
    return dataset.versions.filter(state=VersionState.SEALED).order_by("-number")


def version_get(dataset: Dataset, number, *, sealed: bool = True) -> DatasetVersion:
    """One version by number ("latest" or None: the newest sealed); NotFound for one that is not (yet) readable."""
    versions = sealed_versions(dataset) if sealed else dataset.versions.all()
    if number in (None, LATEST):
        found = versions.first()
    elif isinstance(number, int) and not isinstance(number, bool) or (isinstance(number, str) and number.isdigit()):
        found = versions.filter(number=int(number)).first()
    else:
        raise NotFound(f"No version {number!r} of {dataset.name}: a version's number, or latest.")
    if found is None:
        raise NotFound(f"Dataset {dataset.name} has no sealed version {number}." if number not in (None, LATEST)
                       else f"Dataset {dataset.name} has no sealed version yet.")
    return found


def latest_version(dataset: Dataset) -> DatasetVersion | None:
    return sealed_versions(dataset).first()


def version_shards(version: DatasetVersion) -> QuerySet[VersionShard]:
    return version.shard_rows.order_by("position")


def version_index(version: DatasetVersion, *, offset: int = 0, limit: int = 1000) -> list[dict]:
    """The version's files in order, each with the shard that holds it: [{"path", "bytes", "shard"}]."""
    rows, seen = [], 0
    for shard in version_shards(version).only("position", "members"):
        members = shard.members or []
        if seen + len(members) <= offset:
            seen += len(members)
            continue
        for name, size in members:
            if seen >= offset:
                rows.append({"path": name, "bytes": size, "shard": shard.position})
                if len(rows) >= limit:
                    return rows
            seen += 1
    return rows


def held_shards(tenant: Tenant) -> QuerySet[VersionShard]:
    """The stored shards of every version the tenant may read (own or shared, any state): shards it need not send
    again. A shard is stored once for everybody, but a tenant that never sent nor could read one has to send it:
    knowing a hash is not having the bytes."""
    return VersionShard.objects.filter(stored=True, version__dataset__in=visible(tenant))


def uses_of(version: DatasetVersion, tenants) -> QuerySet[DatasetUse]:
    """The jobs of these tenants that named the version."""
    return version.uses.filter(tenant__in=tenants).order_by("-created_at")


def dataset_summaries(tenant: Tenant) -> list[dict]:
    """Each dataset the tenant sees with its newest sealed version, its sealed versions' count and how many jobs of
    the tenant used it: for the page and the list."""
    summaries = []
    datasets = visible(tenant).annotate(
        sealed=Count("versions", filter=Q(versions__state=VersionState.SEALED), distinct=True),
    ).order_by("tenant__slug", "name")
    for dataset in datasets:
        latest = latest_version(dataset)
        jobs = DatasetUse.objects.filter(version__dataset=dataset, tenant=tenant).values("job_id").distinct().count()
        summaries.append({"dataset": dataset, "reference": reference_of(dataset, tenant), "latest": latest,
                          "versions": dataset.sealed, "jobs": jobs, "own": dataset.tenant_id == tenant.id})
    return summaries


# --- For the jobs layer -------------------------------------------------------------------------------


def spec_versions(tenant: Tenant, entries) -> list[tuple[str, DatasetVersion]]:
    """The versions a spec's ``datasets`` names, each (the reference, the version): an omitted version or "latest"
    is the newest sealed one. Invalid naming ``datasets`` for a malformed list; UnknownDataset for a dataset or
    version the tenant cannot read."""
    if not isinstance(entries, list):
        raise Invalid("datasets", 'A list of {"name": ..., "version": N or "latest"}.')
    if len(entries) > 16:
        raise Invalid("datasets", "At most 16 datasets per job.")
    found, seen = [], set()
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) - {"name", "version"} or not isinstance(entry.get("name"), str):
            raise Invalid("datasets", 'Each dataset is {"name": ..., "version": N or "latest"}.')
        version = entry.get("version")
        if version is not None and version != LATEST and (isinstance(version, bool) or not isinstance(version, int)
                                                          or version < 1):
            raise Invalid("datasets", f"{entry['name']}: a version is a number from 1, or latest.")
        try:
            dataset = dataset_resolve(tenant, entry["name"])
            row = version_get(dataset, version)
        except NotFound as exc:
            raise UnknownDataset(str(exc)) from None
        reference = reference_of(dataset, tenant)
        if reference in seen:
            raise Invalid("datasets", f"{reference} is named twice.")
        seen.add(reference)
        found.append((reference, row))
    return found


def mounts_for_job_spec(tenant: Tenant, spec: dict) -> list[tuple[str, int, list[tuple[str, int]]]]:
    """(name, version, [(sha256, bytes) per shard in order]) of each dataset a job's spec names, access checked."""
    mounts = []
    for entry in spec.get("datasets") or []:
        try:
            dataset = dataset_resolve(tenant, entry["name"])
            version = version_get(dataset, entry["version"])
        except NotFound as exc:
            raise UnknownDataset(str(exc)) from None
        shards = list(version_shards(version).values_list("sha256", "bytes"))
        mounts.append((entry["name"], version.number, shards))
    return mounts


def blobs_for_job_spec(tenant: Tenant, spec: dict) -> list[tuple[str, int]]:
    """The (sha256, bytes) of every shard the job's datasets hold, each once, access checked (UnknownDataset)."""
    blobs: dict[str, int] = {}
    for _name, _version, shards in mounts_for_job_spec(tenant, spec):
        for sha256, size in shards:
            blobs.setdefault(sha256, size)
    return list(blobs.items())


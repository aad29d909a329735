"""A tenant's checkpoint storage over the API: read by every member, the retention policy set by admins and
owners, the quota by staff, each change audited; a proposed policy previewed (what it would delete and free)
before anything is saved; bad input a 400 naming the field; another tenant's a 404."""

from datetime import UTC, datetime, timedelta

import pytest

from audit.models import AuditEntry
from quotas.models import TenantStorage
from runners.jobs.models import Checkpoint, Job, JobMetric

pytestmark = pytest.mark.integration

URL = "/api/v1/tenants/{}/storage/"
MB = 10**6
START = datetime(2026, 11, 2, tzinfo=UTC)


def _chunk(name: str) -> str:
    return (name * 64)[:64]


def _job(tenant, environment, flavor, name, state="succeeded", spec=None) -> Job:
    return Job.objects.create(tenant=tenant, environment=environment, name=name, flavor=flavor, replicas=1,
                              gpus_per_replica=1, state=state, spec={"template": "pytorch-ddp", **(spec or {})})


def _durable(job, step, chunk_names: str, *, loss: float) -> Checkpoint:
    """A stored checkpoint whose chunks are one MB each, named by letter (a shared letter: a deduplicated chunk)."""
    JobMetric.objects.create(job=job, attempt=1, step=step, loss=loss)
    chunks = [[_chunk(name), MB] for name in chunk_names]
    return Checkpoint.objects.create(
        job=job, step=step, uri=f"file:///step-{step}.pt", bytes=10 * MB, created_at=START + timedelta(hours=step),
        store_state="durable", durable_at=START + timedelta(hours=step), stored_bytes=len(chunks) * MB,
        manifest={"version": 1, "sha256": _chunk(str(step)), "bytes": 10 * MB, "chunks": chunks})


@pytest.fixture
def history(tenant, acme_env, flavors):
    """Job "base": four checkpoints sharing chunk f (a frozen base), each adding its own; job "own" has a policy
    of its own keeping its newest."""
    base = _job(tenant, acme_env, flavors["h100-80gb"], "base")
    for step, names, loss in ((1, "fa", 0.9), (2, "fb", 0.5), (3, "fc", 0.7), (4, "fd", 0.8)):
        _durable(base, step, names, loss=loss)
    own = _job(tenant, acme_env, flavors["h100-80gb"], "own", spec={"checkpoint_retention": {"keep_newest": 1}})
    _durable(own, 1, "g", loss=1.0)
    _durable(own, 2, "h", loss=1.0)
    return {"base": base, "own": own}


def test_a_member_reads_the_storage_and_a_proposed_policy_is_previewed_before_it_is_saved(
        client_for, viewer, tenant, history):
    client = client_for(viewer)
    read = client.get(URL.format(tenant.slug))
    assert read.status_code == 200, read.content
    assert read.json()["used_bytes"] == 7 * MB  # f once, a to d, g and h
    assert read.json()["durable_checkpoints"] == 6 and read.json()["retention"] is None
    assert read.json()["can_set_retention"] is False

    preview = client.post(URL.format(tenant.slug) + "preview/", {"retention": {"keep_newest": 1, "keep_best": 1}},
                          format="json")
    assert preview.status_code == 200, preview.content
    body = preview.json()
    # "base" keeps step 4 (newest) and 2 (best loss); "own" follows its own policy (its newest).
    assert {job["name"]: job["steps"] for job in body["jobs"]} == {"base": [1, 3], "own": [1]}
    assert body["checkpoints"] == 3
    assert body["bytes_freed"] == 3 * MB  # chunks a, c, g; f stays, named by the kept ones
    assert body["file_bytes"] == 30 * MB
    # One job alone, under the proposed policy as its own.
    alone = client.post(URL.format(tenant.slug) + "preview/",
                        {"retention": {"keep_every": 2}, "job": history["own"].id}, format="json").json()
    assert alone["jobs"] == [{"job": history["own"].id, "name": "own", "steps": [1], "file_bytes": 10 * MB}]
    # Nothing was saved or discarded.
    assert not TenantStorage.objects.filter(tenant=tenant).exists()
    assert Checkpoint.objects.filter(store_state="durable").count() == 6


def test_an_owner_sets_the_retention_and_staff_the_quota_each_audited(client_for, owner, staff, tenant):
    saved = client_for(owner).patch(URL.format(tenant.slug), {"retention": {"keep_newest": 3, "keep_every": 10}},
                                    format="json")
    assert saved.status_code == 200, saved.content
    assert saved.json()["retention"]["keep_newest"] == 3 and saved.json()["retention"]["keep_best"] is None
    assert client_for(owner).patch(URL.format(tenant.slug), {"quota_gb": 5}, format="json").status_code == 403
    quota = client_for(staff).patch(URL.format(tenant.slug), {"quota_gb": "2.5"}, format="json")
    assert quota.status_code == 200 and quota.json()["quota_bytes"] == 2_500_000_000
    assert quota.json()["retention"]["keep_every"] == 10  # left out: kept
    entries = list(AuditEntry.objects.filter(action="storage.updated").order_by("id"))
    assert [(e.actor.username, e.before, e.after) for e in entries] == [
        (owner.username, {"quota_gb": None, "retention": None},
         {"quota_gb": None, "retention": {"keep_newest": 3, "keep_best": None, "keep_every": 10, "metric": "loss",
                                          "smaller_is_better": True}}),
        (staff.username, entries[0].after, {**entries[0].after, "quota_gb": "2.500"}),
    ]
    assert client_for(staff).patch(URL.format(tenant.slug), {"quota_gb": None}, format="json").json()["quota_gb"] is None


def test_a_member_cannot_set_the_retention_and_an_outsider_gets_404(client_for, teammate, outsider, tenant):
    assert client_for(teammate).patch(URL.format(tenant.slug), {"retention": {"keep_newest": 1}},
                                      format="json").status_code == 403
    for method, path in (("get", ""), ("patch", ""), ("post", "preview/")):
        body = {} if method == "get" else {"data": {"retention": None}, "format": "json"}
        answer = getattr(client_for(outsider), method)(URL.format(tenant.slug) + path, **body)
        assert answer.status_code == 404, (method, answer.content)


@pytest.mark.parametrize(("body", "field"), [
    ({"retention": {"keep_newest": -1}}, "retention.keep_newest"),
    ({"retention": {"keep_every": 0}}, "retention.keep_every"),
    ({"retention": {"keep_forever": 1}}, "retention.keep_forever"),
    ({"retention": [3]}, "retention"),
    ({"quota_gb": "lots"}, "quota_gb"),
    ({"quota_gb": -1}, "quota_gb"),
])
def test_bad_settings_get_400_naming_the_field(client_for, staff, tenant, body, field):
    answer = client_for(staff).patch(URL.format(tenant.slug), body, format="json")
    assert answer.status_code == 400 and field in answer.json(), answer.content
    assert not AuditEntry.objects.filter(action="storage.updated").exists()


def test_a_preview_of_a_bad_policy_or_another_tenants_job_is_refused(client_for, owner, tenant, globex_env, flavors):
    client = client_for(owner)
    bad = client.post(URL.format(tenant.slug) + "preview/", {"retention": {"keep_best": "two"}}, format="json")
    assert bad.status_code == 400 and "retention.keep_best" in bad.json()
    theirs = _job(globex_env.tenant, globex_env, flavors["h100-80gb"], "theirs")
    answer = client.post(URL.format(tenant.slug) + "preview/", {"retention": None, "job": theirs.id}, format="json")
    assert answer.status_code == 404

"""The audit log holds one entry per change, with the right actor, for every kind of change: made
through the API with real tokens where the API offers it, through the services otherwise."""

from decimal import Decimal

import pytest

from audit.models import AuditEntry
from quotas.models import PartitionKind, Quota, ResourceFlavor
from runners.clusters.models import NodePool
from runners.jobs.models import Job
from runners.nvidia import mig
from runners.scheduling import services as scheduling
from tenants.models import Membership, TokenInfo
from tests.support.jobs import give_quota, job_data, play_launch, submit

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


class Trail:
    """The entries added since the last look."""

    def __init__(self):
        self.mark = AuditEntry.objects.order_by("-id").values_list("id", flat=True).first() or 0

    def new(self) -> list[AuditEntry]:
        entries = list(AuditEntry.objects.filter(id__gt=self.mark).order_by("id"))
        if entries:
            self.mark = entries[-1].id
        return entries

    def one(self, action: str, actor: str, tenant: str = "") -> AuditEntry:
        """The one entry the last change added: its action, actor and tenant as expected."""
        entries = self.new()
        assert [(e.action, e.actor_name, e.tenant_slug) for e in entries] == [(action, actor, tenant)], entries
        return entries[0]


def _ok(answer, status: int):
    assert answer.status_code == status, (answer.status_code, getattr(answer, "data", answer.content))
    return answer.json() if answer.content else None


def _new_flavor_shape() -> tuple[str, str, str]:
    """A MIG shape of the H100 no flavor has yet."""
    for profile in mig.gpu_model("H100-80GB").profiles:
        if not ResourceFlavor.objects.filter(kind=PartitionKind.MIG, gpu_model="H100-80GB", mig_profile=profile).exists():
            return PartitionKind.MIG, "H100-80GB", profile
    raise AssertionError("every H100 MIG profile has a flavor already")


def test_tenants_members_flavors_prices_quotas_and_partitions(flavors, tenant, owner, staff, make_user, client_for):
    make_user("ivan")
    make_user("nina")
    as_staff = client_for(staff)
    trail = Trail()

    # Tenants and members.
    _ok(as_staff.post("/api/v1/tenants/", {"slug": "initech", "name": "Initech"}), 201)
    entry = trail.one("tenant.created", "sam", "initech")
    assert entry.actor_id == staff.id and entry.after == {"slug": "initech", "name": "Initech"} and entry.before is None
    _ok(as_staff.post("/api/v1/tenants/initech/members/", {"username": "ivan", "role": "admin"}), 201)
    entry = trail.one("member.added", "sam", "initech")
    assert entry.after == {"username": "ivan", "role": "admin"}
    ivan = Membership.objects.get(user__username="ivan").user
    as_ivan = client_for(ivan)
    trail.new()  # the token made for ivan's client
    _ok(as_ivan.post("/api/v1/tenants/initech/members/", {"username": "nina", "role": "member"}), 201)
    trail.one("member.added", "ivan", "initech")
    _ok(as_ivan.delete("/api/v1/tenants/initech/members/nina/"), 204)
    entry = trail.one("member.removed", "ivan", "initech")
    assert entry.before == {"username": "nina", "role": "member"} and entry.after is None

    # Flavors and prices.
    kind, model, profile = _new_flavor_shape()
    _ok(as_staff.post("/api/v1/flavors/", {"name": "h100-new-slice", "kind": kind, "gpu_model": model,
                                          "mig_profile": profile}), 201)
    entry = trail.one("flavor.created", "sam")
    assert entry.object_type == "resourceflavor" and entry.after["mig_profile"] == profile
    _ok(as_staff.patch("/api/v1/flavors/h100-new-slice/", {"description": "A new slice."}), 200)
    entry = trail.one("flavor.updated", "sam")
    assert entry.before == {"description": ""} and entry.after == {"description": "A new slice."}
    _ok(as_staff.post("/api/v1/flavors/h100-new-slice/prices/", {"price_per_hour": "1.2500", "currency": "usd",
                                                                 "effective_from": "2026-01-01T00:00:00Z"}), 201)
    entry = trail.one("price.updated", "sam")
    assert entry.before is None and entry.after["price_per_hour"] == "1.2500" and entry.after["currency"] == "USD"
    _ok(as_staff.post("/api/v1/flavors/h100-new-slice/prices/", {"price_per_hour": "1.5", "currency": "USD",
                                                                 "effective_from": "2026-06-01T00:00:00Z"}), 201)
    entry = trail.one("price.updated", "sam")
    assert entry.before["price_per_hour"] == "1.2500" and entry.after["price_per_hour"] == "1.5000"

    # Quotas: created, changed, removed.
    body = _ok(as_staff.post("/api/v1/quotas/", {"tenant": "acme", "flavor": "h100-80gb", "guaranteed": 2, "max": 4}), 201)
    entry = trail.one("quota.created", "sam", "acme")
    assert entry.before is None and entry.after == {"flavor": "h100-80gb", "guaranteed": 2, "max": 4,
                                                    "fair_share_weight": "1", "max_priority": 100}
    _ok(as_staff.patch(f"/api/v1/quotas/{body['id']}/", {"max": 6}), 200)
    entry = trail.one("quota.updated", "sam", "acme")
    assert (entry.before["max"], entry.after["max"], entry.after["guaranteed"]) == (4, 6, 2)
    _ok(as_staff.delete(f"/api/v1/quotas/{body['id']}/"), 204)
    entry = trail.one("quota.deleted", "sam", "acme")
    assert entry.before["max"] == 6 and entry.after is None
    assert not Quota.objects.filter(id=body["id"]).exists()

    # Partition profiles and changes.
    pool = NodePool.objects.filter(gpu_model="T4").first()
    assert pool is not None, "the demo cluster has a T4 pool"
    _ok(as_staff.post("/api/v1/partition-profiles/", {"name": "t4-share-3", "gpu_model": "T4", "kind": "timeslice",
                                                      "replicas": 3}), 201)
    entry = trail.one("partition_profile.created", "sam")
    assert entry.after["replicas"] == 3
    _ok(as_staff.post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "t4-share-3"}), 202)
    entry = trail.one("partition_change.requested", "sam")
    assert entry.after == {"profile": "t4-share-3", "pool": pool.name, "drain": "wait"}

    # A refused change leaves no entry.
    _ok(as_staff.post("/api/v1/quotas/", {"tenant": "acme", "flavor": "h100-80gb", "guaranteed": 5, "max": 4}), 400)
    _ok(as_ivan.post("/api/v1/tenants/initech/members/", {"username": "nina", "role": "owner"}), 403)
    assert trail.new() == []


def test_tokens_created_and_revoked(owner, staff, client_for):
    trail = Trail()
    as_owner = client_for(owner)
    entry = trail.one("token.created", "olivia")
    assert entry.after["name"] == "test client" and "token" not in entry.after
    body = _ok(as_owner.post("/api/v1/tokens/", {"name": "ci"}), 201)
    entry = trail.one("token.created", "olivia")
    assert entry.object_id == str(body["id"]) and body["token"] not in str(entry.after)
    _ok(as_owner.delete(f"/api/v1/tokens/{body['id']}/"), 204)
    entry = trail.one("token.revoked", "olivia")
    assert entry.before["name"] == "ci" and entry.object_id == str(body["id"])
    # Staff revoke anyone's: the actor is staff.
    other = _ok(as_owner.post("/api/v1/tokens/", {"name": "laptop"}), 201)
    trail.new()
    _ok(client_for(staff).delete(f"/api/v1/tokens/{other['id']}/"), 204)
    assert [(e.action, e.actor_name) for e in trail.new()] == [("token.created", "sam"), ("token.revoked", "sam")]
    # Signing out of the API revokes the token in use.
    _ok(as_owner.delete("/api/v1/auth/token/"), 204)
    entry = trail.one("token.revoked", "olivia")
    assert entry.before["name"] == "test client"
    assert not TokenInfo.objects.filter(token__user=owner).exists()
    # A token made outside the services (the Django admin gives knox's own form) is recorded too.
    from knox.models import AuthToken
    from rest_framework.test import APIClient

    _, secret = AuthToken.objects.create(owner)
    bare = APIClient()
    bare.credentials(HTTP_AUTHORIZATION=f"Token {secret}")
    _ok(bare.delete("/api/v1/auth/token/"), 204)
    entry = trail.one("token.revoked", "olivia")
    assert entry.object_type == "authtoken" and entry.object_id == "" and entry.before["user"] == "olivia"


def test_environments_and_jobs_submitted_cancelled_and_preempted(
    flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env, client_for, settings,
):
    settings.PREEMPTION_GRACE_PERIOD_S = 30
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    as_owner = client_for(owner)
    trail = Trail()

    body = _ok(as_owner.post("/api/v1/environments/", {"tenant": "acme", "name": "scratch"}), 201)
    entry = trail.one("environment.created", "olivia", "acme")
    assert entry.after["name"] == "scratch"
    _ok(as_owner.delete(f"/api/v1/environments/{body['id']}/"), 202)
    trail.one("environment.deleted", "olivia", "acme")

    job = _ok(as_owner.post("/api/v1/jobs/", job_data(acme_env, name="first", replicas=1)), 201)
    entry = trail.one("job.submitted", "olivia", "acme")
    assert entry.object_id == str(job["id"]) and entry.after["state"] == "queued"
    _ok(as_owner.post(f"/api/v1/jobs/{job['id']}/cancel/"), 202)
    entry = trail.one("job.cancelled", "olivia", "acme")
    assert entry.before == {"state": "queued"} and entry.after == {"state": "cancelled"}
    # A second cancel changes nothing and adds nothing.
    assert as_owner.post(f"/api/v1/jobs/{job['id']}/cancel/").status_code == 409
    assert trail.new() == []

    # A job past the quota is refused: no entry.
    _ok(as_owner.post("/api/v1/jobs/", job_data(acme_env, name="huge", replicas=4, gpus_per_replica=8)), 400)
    assert trail.new() == []

    # Preemption: the scheduler takes borrowed GPUs back for globex's job, and says so.
    borrower = submit(owner, acme_env, name="borrower", replicas=2, gpus_per_replica=8,
                      topology={"level": "none", "mode": "preferred"})
    trail.one("job.submitted", "olivia", "acme")
    scheduling.cycle_run()
    play_launch(borrower)
    owed = submit(outsider, globex_env, name="owed", replicas=1, gpus_per_replica=8, priority=50)
    trail.one("job.submitted", "oscar", "globex")
    scheduling.cycle_run()
    entry = trail.one("job.preempted", "scheduler", "acme")
    assert entry.actor_id is None and entry.object_id == str(borrower.id)
    assert entry.before == {"state": "running"}
    assert entry.after["state"] == "preempted" and entry.after["for_job"] == owed.name
    assert entry.after["for_tenant"] == "globex"
    assert Job.objects.get(id=borrower.id).state == "preempted"

    # Deleting an environment cancels its jobs: each cancel is recorded with who deleted it.
    waiting = submit(owner, acme_env, name="waiting", replicas=1)
    trail.new()
    _ok(as_owner.delete(f"/api/v1/environments/{acme_env.id}/"), 202)
    actions = sorted((e.action, e.actor_name, e.object_id) for e in trail.new())
    assert actions == sorted([
        ("environment.deleted", "olivia", str(acme_env.id)),
        ("job.cancelled", "olivia", str(borrower.id)),
        ("job.cancelled", "olivia", str(waiting.id)),
    ])


def test_endpoints_created_scaled_rolled_out_and_stopped(flavors, tenant, owner, acme_env, client_for, settings):
    from tests.support.endpoints import trained_job

    settings.PREEMPTION_GRACE_PERIOD_S = 30
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    job = trained_job(actor=owner, environment=acme_env)
    as_owner = client_for(owner)
    trail = Trail()
    body = {"tenant": "acme", "environment": acme_env.id, "name": "chat", "source": {"job": job.id},
            "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 2, "warm_replicas": 0}
    endpoint = _ok(as_owner.post("/api/v1/endpoints/", body), 201)
    # A job's checkpoint is promoted to a model version first, then the endpoint serves that version.
    promoted, entry = trail.new()
    assert [(e.action, e.actor_name, e.tenant_slug) for e in (promoted, entry)] == [
        ("model.promoted", "olivia", "acme"), ("endpoint.created", "olivia", "acme")]
    assert promoted.after["job"] == job.id
    assert entry.after["min_replicas"] == 1 and entry.after["source"]["job"] == job.id
    _ok(as_owner.post(f"/api/v1/endpoints/{endpoint['id']}/scale/", {"max_replicas": 3}), 202)
    entry = trail.one("endpoint.scaled", "olivia", "acme")
    assert entry.before["max_replicas"] == 2 and entry.after["max_replicas"] == 3
    _ok(as_owner.post(f"/api/v1/endpoints/{endpoint['id']}/rollout/", {"source": {"job": job.id}}), 202)
    entry = trail.one("endpoint.rolled_out", "olivia", "acme")
    assert entry.before["generation"] + 1 == entry.after["generation"]
    _ok(as_owner.post(f"/api/v1/endpoints/{endpoint['id']}/stop/"), 202)
    entry = trail.one("endpoint.stopped", "olivia", "acme")
    assert entry.after["desired_replicas"] == 0
    # Scaling a stopped endpoint is refused: no entry.
    assert as_owner.post(f"/api/v1/endpoints/{endpoint['id']}/scale/", {"max_replicas": 2}).status_code == 409
    assert trail.new() == []


def test_a_guarantee_shrunk_by_a_repartition_is_recorded_per_tenant(flavors, tenant, staff):
    from quotas import services as quota_services

    flavor = flavors["h100-80gb"]
    give_quota(tenant, flavor, guaranteed=4, max=8)
    trail = Trail()
    quota_services.guarantees_shrink(actor=staff, flavor=flavor, capacity=2, reason="Pool re-cut.")
    entry = trail.one("quota.reduced", "sam", "acme")
    assert entry.before == {"guaranteed": 4} and entry.after == {"guaranteed": 2, "reason": "Pool re-cut."}
    assert Decimal(Quota.objects.get(tenant=tenant, flavor=flavor).guaranteed) == 2

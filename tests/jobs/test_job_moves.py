"""A move to make room, end to end: a real Celery worker (and its beat), real script jobs in the sandbox.

The demo cluster's two H100 nodes have 8 GPUs each. Two 7-GPU jobs fill them and push two 1-GPU jobs (acme's and
globex's) onto different nodes; the 7-GPU jobs end and two 4-GPU jobs take their place, one a node. Each node has 3
GPUs free, 6 in all, and globex's 4-GPU job fits on neither. Globex turned moves off, so the scheduler moves acme's
1-GPU job: it checkpoints on the stop at the step it reached, resumes on the other node at the next step, and the
4-GPU job is placed on the node it left. Globex's own 1-GPU job is never touched. The cycle-by-cycle account
(both are admitted in the cycle after the move's stop) is tests/scheduling/test_cycle_defrag.py.
"""

import pytest

from runners.clusters.registry import get_backend
from runners.jobs.models import Job
from runners.scheduling.models import JobMove
from tests.jobs.test_job_worker import HOLDER, _start_worker, _state_is, _supervisors_alive, wait_for
from tests.support import invariants
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment, script_bundle

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

ONE_NODE = {"level": "none", "mode": "required"}

# Counts steps of 0.1 s until it is stopped; on the stop it checkpoints the step it reached, and a new attempt
# starts from the step after it.
COUNTER = '''
import time

import gpuportal

ctx = gpuportal.init(metrics_interval_s=0)
state = ctx.load()
step = state["step"] if state else 0
print(f"starting after step {step}", flush=True)
while True:
    with ctx.busy():
        time.sleep(0.1)
    step += 1
    ctx.report(step, loss=1.0 / step)
    if ctx.should_stop():
        ctx.checkpoint(step, {"step": step})
        print(f"stopped at step {step}: {ctx.stop_reason}", flush=True)
        break
'''


@pytest.fixture
def cluster(settings, tenant, other_tenant, owner, outsider, tmp_path):
    settings.PREEMPTION_GRACE_PERIOD_S = 30
    settings.BUNDLE_STORAGE_URL = f"file://{tmp_path / 'bundle-storage'}"
    settings.BUNDLE_STORAGE_OPTIONS = {}
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=4, max=12)
    for script in ("holder", "counter"):
        for slug in ("acme", "globex"):
            (tmp_path / script / slug).mkdir(parents=True)
    return {
        "acme": ready_environment(actor=owner, tenant=tenant),
        "globex": ready_environment(actor=outsider, tenant=other_tenant, name="vision"),
        "holder": {slug: script_bundle(t, user, tmp_path / "holder" / slug, HOLDER)
                   for slug, t, user in (("acme", tenant, owner), ("globex", other_tenant, outsider))},
        "counter": {slug: script_bundle(t, user, tmp_path / "counter" / slug, COUNTER)
                    for slug, t, user in (("acme", tenant, owner), ("globex", other_tenant, outsider))},
    }


def _submit(api, cluster, slug, name, gpus, script):
    bundle = cluster[script][slug]
    return api.post("/api/v1/jobs/", job_data(
        cluster[slug], name=name, replicas=1, gpus_per_replica=gpus, topology=ONE_NODE, template="script",
        bundle=bundle.sha256, command=["python", "train.py"], hyperparameters={}, checkpoint_every_steps=0, env={},
        memory_mib_per_replica=2048,
    ), format="json").json()["id"]


def _node(job_id, number=1) -> str:
    return Job.objects.get(id=job_id).attempts.get(number=number).placement[0]["node"]


def test_a_job_that_fits_nowhere_gets_room_by_moving_a_job_that_resumes_at_its_exact_step(
    cluster, celery_worker_factory, client_for, owner, outsider, settings, client
):
    acme, globex = client_for(owner), client_for(outsider)
    assert globex.patch("/api/v1/tenants/globex/", {"allow_moves": False}, format="json").status_code == 200
    _start_worker(celery_worker_factory, settings)
    baseline = invariants.baseline()

    wide = [_submit(acme, cluster, "acme", f"wide-{n}", 7, "holder") for n in (1, 2)]
    for job_id in wide:
        wait_for(_state_is(job_id, "running"), timeout_s=60, message="a 7-GPU job to run")
    small = {slug: _submit(api, cluster, slug, "small", 1, "counter") for slug, api in (("acme", acme), ("globex", globex))}
    for job_id in small.values():
        wait_for(_state_is(job_id, "running"), timeout_s=60, message="a 1-GPU job to run")
    assert _node(small["acme"]) != _node(small["globex"])
    for job_id in wide:
        assert acme.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 202
    for job_id in wide:
        wait_for(_state_is(job_id, "cancelled"), timeout_s=60, message="a 7-GPU job to be cancelled")
    big = [_submit(acme, cluster, "acme", f"big-{n}", 4, "holder") for n in (1, 2)]
    for job_id in big:
        wait_for(_state_is(job_id, "running"), timeout_s=60, message="a 4-GPU job to run")
    assert _node(big[0]) != _node(big[1])
    origin = _node(small["acme"])

    # Globex's 4-GPU job fits on no node: acme's 1-GPU job is moved off `origin`, and it is placed there.
    gang = _submit(globex, cluster, "globex", "gang", 4, "holder")
    wait_for(lambda: Job.objects.get(id=small["acme"]).attempts.filter(number=1, outcome="preempted").exists(),
             timeout_s=60, message="the acme 1-GPU job's first attempt to end, moved")
    wait_for(_state_is(gang, "running"), timeout_s=60, message="the 4-GPU job to run where room was made")
    wait_for(lambda: Job.objects.get(id=small["acme"]).attempts.filter(number=2, started_at__isnull=False).exists(),
             timeout_s=60, message="the moved job to start again")
    assert _node(gang) == origin
    assert invariants.check(get_backend(), baseline=baseline) == []
    moved = Job.objects.get(id=small["acme"])
    first, second = moved.attempts.order_by("number")
    assert first.exit_code == 75 and first.reason.startswith("Moved to make room: 4 whole H100-80GB GPUs free")
    assert second.placement[0]["node"] != origin
    move = JobMove.objects.get()
    assert (move.job_id, move.for_job_id, move.from_node, move.to_node) == (moved.id, gang, origin, _node(moved.id, 2))
    gang_gpus = set(Job.objects.get(id=gang).attempts.get().placement[0]["gpus"])
    assert set(first.placement[0]["gpus"]) <= gang_gpus, "it takes the GPU the move freed"

    # The exact step: the checkpoint is of the step the first attempt reached, and the second goes on from the next.
    wait_for(lambda: any(point["attempt"] == 2 and point["step"] >= second.resumed_from_step + 5
                         for point in acme.get(f"/api/v1/jobs/{moved.id}/metrics/").json()["series"])
             if Job.objects.get(id=moved.id).attempts.get(number=2).resumed_from_step else False,
             timeout_s=60, message="the moved job to report five steps past its checkpoint")
    second.refresh_from_db()
    series = acme.get(f"/api/v1/jobs/{moved.id}/metrics/").json()["series"]
    before = [point["step"] for point in series if point["attempt"] == 1]
    after = [point["step"] for point in series if point["attempt"] == 2]
    assert before == list(range(1, second.resumed_from_step + 1)), "no step lost to the move"
    assert after[0] == second.resumed_from_step + 1 and after == list(range(after[0], after[0] + len(after)))

    # Globex turned moves off: its own 1-GPU job runs where it started, never stopped.
    kept = Job.objects.get(id=small["globex"])
    assert kept.state == "running" and kept.attempts.count() == 1
    # The job page says why it moved, and with what gain; the audit log of each tenant has its side.
    client.force_login(owner)
    page = client.get(f"/jobs/{moved.id}/").content.decode()
    assert "Moved to make room" in page and "4 whole H100-80GB GPUs free together on " + origin in page
    entries = acme.get("/api/v1/audit/?action=job.moved").json()
    assert entries["count"] == 1 and entries["results"][0]["after"]["for_job"] == "gang"

    for api, job_id in ((acme, moved.id), (globex, kept.id), (globex, gang), (acme, big[0]), (acme, big[1])):
        assert api.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 202
    wait_for(lambda: not any(_supervisors_alive(job_id) for job_id in [*wide, *big, *small.values(), gang]),
             timeout_s=60, message="no job process left")

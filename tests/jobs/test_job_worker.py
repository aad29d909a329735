"""Jobs end to end with a real Celery worker (and its beat) and real training processes.

Tenant acme (guaranteed 8, max 16 H100s) runs a long job within its guarantee and a
2-replica job borrowing the other 8; globex (guaranteed 4) then asks for 4 H100s, which
reclaims its guarantee by preempting the borrowing job. That job checkpoints, requeues,
resumes from its checkpoint and succeeds. A lost node is survived the same way.

CPU: the long job within the guarantee (the "holder") only has to hold its 8 GPUs, so it is a script job that
sleeps until it is stopped, not a trainer training flat out for the whole test; the trainers run one thread
per rank (cpu_milli_per_replica 1000) and the borrower and the claimant small batches (TRAINER), which still
make the loss fall over the borrower's 800 steps.
"""

import json
import os

import pytest

from runners.clusters.registry import get_backend
from runners.jobs.models import Job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment, script_bundle
from tests.support.worker import wait_for as _wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

WORKER = dict(beat=True, SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1)
# The trainers' settings: one thread per rank, small batches (the default 32 x 64 costs ~2.5x the CPU a step).
TRAINER = dict(cpu_milli_per_replica=1000, hyperparameters={"batch_size": 8, "seq_len": 16})

# The holder: idle until it is stopped (SIGTERM, through the SDK), then it checkpoints where it got to and ends.
HOLDER = '''
import json, time

import gpuportal

ctx = gpuportal.init()
ticks = 0
while not ctx.should_stop():
    time.sleep(0.2)
    ticks += 1
folder = ctx.job_dir / f"state-{ticks}"
folder.mkdir()
(folder / "state.json").write_text(json.dumps({"ticks": ticks}))
ctx.checkpoint(ticks, folder)
print(f"stopped after {ticks} ticks: {ctx.stop_reason}", flush=True)
'''


def _job(job_id) -> Job:
    return Job.objects.get(id=job_id)


def _jobs_now() -> str:
    """Every job's state, reason and attempts: what a timeout message needs."""
    return "\n".join(
        f"job {job.id} {job.name}: {job.state} ({job.reason}); attempts "
        + "; ".join(f"{a.number}:{a.outcome or 'open'} {a.reason} exit={a.exit_code}" for a in job.attempts.all())
        for job in Job.objects.order_by("id")
    )


def wait_for(predicate, **kwargs):
    try:
        return _wait_for(predicate, **kwargs)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_jobs_now()}") from None


def _metrics(client, job_id):
    return client.get(f"/api/v1/jobs/{job_id}/metrics/").json()["series"]


def _state_is(job_id, *states):
    return lambda: _job(job_id).state in states


def _supervisors_alive(job_id) -> list[int]:
    alive = []
    for attempt in _job(job_id).attempts.all():
        pid_file = get_backend().jobs.attempt_dir(job_id, attempt.number) / "supervisor.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text().split()[0])
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
    return alive


@pytest.fixture
def cluster(settings, tenant, other_tenant, owner, outsider, tmp_path):
    settings.PREEMPTION_GRACE_PERIOD_S = 30
    # The holder's bundle is stored here; the worker is told so (_start_worker).
    settings.BUNDLE_STORAGE_URL = f"file://{tmp_path / 'bundle-storage'}"
    settings.BUNDLE_STORAGE_OPTIONS = {}
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16, max_priority=100)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=4, max=12, max_priority=100)
    return {
        "acme": ready_environment(actor=owner, tenant=tenant),
        "globex": ready_environment(actor=outsider, tenant=other_tenant, name="vision"),
    }


def _start_worker(celery_worker_factory, settings):
    return celery_worker_factory(**WORKER, BUNDLE_STORAGE_URL=settings.BUNDLE_STORAGE_URL,
                                 BUNDLE_STORAGE_OPTIONS=json.dumps(settings.BUNDLE_STORAGE_OPTIONS))


def test_a_borrowing_job_is_preempted_for_a_guarantee_checkpoints_resumes_and_succeeds(
    cluster, celery_worker_factory, client_for, owner, outsider, tenant, settings, tmp_path
):
    _start_worker(celery_worker_factory, settings)
    acme, globex = client_for(owner), client_for(outsider)
    # Within acme's guarantee: 8 H100s on one node, held (idle) until it is cancelled at the end.
    bundle = script_bundle(tenant, owner, tmp_path, HOLDER)
    holder = acme.post("/api/v1/jobs/", job_data(
        cluster["acme"], name="holder", replicas=1, gpus_per_replica=8, checkpoint_every_steps=0,
        topology={"level": "none", "mode": "required"}, template="script", bundle=bundle.sha256,
        command=["python", "train.py"], hyperparameters={}, cpu_milli_per_replica=1000, env={},
    ), format="json").json()["id"]
    wait_for(_state_is(holder, "running"), timeout_s=60, message="the holder to run")

    # alice's 2-replica job, topology node required: borrows the other node's 8 GPUs. A checkpoint every 100 steps
    # (each one is copied into the checkpoint store by a task of the worker), and one more when it is preempted.
    job_id = acme.post("/api/v1/jobs/", job_data(
        cluster["acme"], name="llm-pretrain", replicas=2, gpus_per_replica=4, steps=800, checkpoint_every_steps=100,
        topology={"level": "node", "mode": "required"}, **TRAINER,
    ), format="json").json()["id"]
    wait_for(_state_is(job_id, "running"), timeout_s=60, message="the 2-replica job to run")
    first = _job(job_id).attempts.get(number=1)
    assert len({replica["node"] for replica in first.placement}) == 1, "both replicas on one node"
    assert {replica["node"] for replica in first.placement}.isdisjoint(
        {replica["node"] for replica in _job(holder).attempts.get().placement}
    )
    wait_for(lambda: _job(job_id).checkpoints.filter(step__gte=20).exists(), timeout_s=90,
             message="a checkpoint at step 20 or beyond")

    # globex claims its guarantee: the borrower is preempted, not the holder.
    claimant = globex.post("/api/v1/jobs/", job_data(
        cluster["globex"], name="claim", replicas=1, gpus_per_replica=4, steps=30, checkpoint_every_steps=10,
        priority=50, topology={"level": "none", "mode": "required"}, **TRAINER,
    ), format="json").json()["id"]
    wait_for(lambda: _job(job_id).attempts.filter(number=1, outcome="preempted").exists(), timeout_s=60,
             message="the borrower's first attempt to end preempted")
    first.refresh_from_db()
    assert first.exit_code == 75, "it checkpointed on SIGTERM and exited with the documented code"
    assert _job(holder).state == "running"
    wait_for(_state_is(claimant, "succeeded"), timeout_s=90, message="globex's job to succeed")
    # The resumed trainer shares two cores with the rest of the suite (the fault tests' gunicorns, other
    # trainers): once seen still running after 120 s, resumed from step 31 and progressing.
    wait_for(_state_is(job_id, "succeeded"), timeout_s=240, message="the preempted job to resume and succeed")

    job = _job(job_id)
    attempts = list(job.attempts.order_by("number"))
    assert [a.outcome for a in attempts] == ["preempted", "succeeded"]
    resumed = attempts[1].resumed_from_step
    assert resumed is not None and resumed >= 20, "resumed from a checkpoint, not from zero"
    series = _metrics(acme, job_id)
    steps = [point["step"] for point in series]
    assert steps == list(range(1, 801)), "every step once: the count went on across the resume"
    assert min(p["step"] for p in series if p["attempt"] == 2) == resumed + 1
    assert series[-1]["loss"] < series[0]["loss"], "the loss fell"
    states = [event.to_state for event in job.events.all()]
    assert states[:4] == ["queued", "admitted", "launching", "running"]
    assert "preempted" in states and states[-1] == "succeeded"
    body = acme.get(f"/api/v1/jobs/{job_id}/").json()
    assert body["attempts"][1]["resumed_from_step"] == resumed and body["checkpoints"]
    assert "finished all 800 steps" in acme.get(f"/api/v1/jobs/{job_id}/logs/?replica=0&tail=5").json()["text"]

    # Cancelling the holder stops it with the grace period (SIGTERM, seen through the SDK): it ends cancelled.
    assert acme.post(f"/api/v1/jobs/{holder}/cancel/").status_code == 202
    wait_for(_state_is(holder, "cancelled"), timeout_s=60, message="the holder to be cancelled")
    assert _job(holder).attempts.get().outcome == "cancelled"
    wait_for(lambda: not _supervisors_alive(holder) and not _supervisors_alive(job_id), timeout_s=20,
             message="no job process left")


def test_a_node_lost_mid_run_requeues_the_job_which_resumes_elsewhere(
    cluster, celery_worker_factory, client_for, owner, settings
):
    _start_worker(celery_worker_factory, settings)
    acme = client_for(owner)
    # The trainer's default batches (not TRAINER's small ones): its 200 steps must outlast the wait for a checkpoint
    # and the node going down. One thread per rank all the same (what the backend gives two ranks on two cores).
    job_id = acme.post("/api/v1/jobs/", job_data(
        cluster["acme"], name="survivor", replicas=2, gpus_per_replica=2, steps=200, checkpoint_every_steps=20,
        topology={"level": "node", "mode": "required"}, cpu_milli_per_replica=1000,
    ), format="json").json()["id"]
    wait_for(lambda: _job(job_id).checkpoints.filter(step__gte=20).exists(), timeout_s=90, message="a checkpoint")
    lost = _job(job_id).attempts.get(number=1).placement[0]["node"]
    get_backend().set_node_down(lost)
    wait_for(lambda: _job(job_id).attempts.filter(number=1, outcome="node_lost").exists(), timeout_s=30,
             message="the attempt to end node_lost")
    wait_for(_state_is(job_id, "succeeded"), timeout_s=120, message="the job to resume on another node and succeed")
    second = _job(job_id).attempts.get(number=2)
    assert {replica["node"] for replica in second.placement} != {lost}
    assert second.resumed_from_step >= 20
    assert [point["step"] for point in _metrics(acme, job_id)][-1] == 200

"""The job path under chaos: two real workers, random submits, cancels, environment deletes, lost nodes,
redelivered messages and a killed worker, every backend call delayed a random while, and the
invariants (tests/support/invariants.py) checked every half second and once more after everything
drained.

The suite runs a short form on the local backend: one fixed seed for 30 seconds (it was 60), each
rarer operation (environment delete, lost node, worker kill) brought sooner the first time where it
could come past two thirds of the run (``_settings``; in 30 s the first worker kill after 10-20 s
instead of 20-40, the next ones 20-40 s apart as before), and every 8th operation one of a kind not
yet done, if any. It asserts that every kind of operation ran at least once (submit, cancel,
redelivery, the driver's own cycle and reconcile pass, environment delete, lost node, a worker
SIGKILLed and replaced), that the invariants were checked at least once a second and never broken,
and that borrowed GPUs were reclaimed for a guarantee. Where the machine is slow and one of these has
not happened by the end, the run goes on until it has, a minute at most (the old length). The
Kubernetes stand-in's run keeps its 40 s (shorter runs, tried at 15 and 20 s, seldom saw three
attempts succeed on a loaded machine and had to go on longer), with the same first-time rule, the
same every-kind assertion and three successes, going on up to a minute for them.

The long form, as long as asked: ``CHAOS_SECONDS=300 CHAOS_KUBERNETES_SECONDS=300 [CHAOS_SEED=S]``
on this file (``bench/long_tests.sh chaos 300``), which from a minute (40 s on the stand-in) on also
asserts the old marks, over 50 submits and over 5 cancels; or ``bench/jobs_chaos.py --seconds N
--seed S``, the same driver (tests/support/chaos.py) with the minute-long intervals.
"""

import os

import pytest

from tests.support.chaos import EVERY_S, FACTORY_QUICK, OPERATIONS, ChaosRun, ChaosSettings, StandInCluster, Workers

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

SEED = int(os.environ.get("CHAOS_SEED", "20261"))
SECONDS = float(os.environ.get("CHAOS_SECONDS", "30"))
KUBERNETES_SECONDS = float(os.environ.get("CHAOS_KUBERNETES_SECONDS", "40"))


def _settings(seconds: float) -> ChaosSettings:
    """The seeded settings; a rarer operation whose interval (EVERY_S) could put its first time past two thirds of a
    run this short comes first sooner, that interval scaled to end there (the next ones keep EVERY_S's), so that a
    short run still does it."""
    first_s = {}
    for name, (low, high) in EVERY_S.items():
        scale = seconds * 2 / 3 / high
        if scale < 1:
            first_s[name] = (low * scale, high * scale)
    return ChaosSettings(seed=SEED, first_s=first_s, owed_every=8)


def _every_kind_done(run: ChaosRun) -> bool:
    return all(run.done(name) for name in [*OPERATIONS, *EVERY_S])


def _reclaimed_for_a_guarantee() -> bool:
    from runners.jobs.models import JobAttempt

    return JobAttempt.objects.filter(outcome="preempted", reason__startswith="Preempted for job").exists()


def _succeeded(count: int) -> bool:
    from runners.jobs.models import JobAttempt

    return JobAttempt.objects.filter(outcome="succeeded").count() >= count


def _assert_every_kind_ran(run: ChaosRun, summary: dict[str, int]) -> None:
    for name in [*OPERATIONS, *EVERY_S]:
        assert run.done(name) >= 1, f"the run never did {name}: {summary}"


def test_random_submits_cancels_deletes_and_lost_nodes_keep_every_invariant(settings, tmp_path):
    from runners.clusters.registry import get_backend

    config = _settings(SECONDS)
    settings.CLUSTER_BACKEND_FACTORY = FACTORY_QUICK
    settings.PREEMPTION_GRACE_PERIOD_S = config.grace_period_s
    get_backend.cache_clear()
    workers = Workers(config, tmp_path)
    run = ChaosRun(config, workers=workers)
    run.setup()
    try:
        workers.start()
        run.run(SECONDS, until=lambda: _every_kind_done(run) and _reclaimed_for_a_guarantee(),
                max_seconds=max(SECONDS, 60))
        summary = run.drain(timeout_s=120)
        logs = workers.logs()  # before the stop, whose SIGTERMs leave tracebacks of their own
    finally:
        workers.stop()
    print(f"\nchaos seed {SEED}, {SECONDS:.0f}s: {summary}")

    assert not run.violations, "\n".join(run.violations[:20])
    assert "Traceback" not in logs, "no task failed with an error"
    if SECONDS >= 60:  # the long form's marks; the short form's are every kind at least once (below)
        assert summary["submit"] > 50 and summary["cancel"] > 5, summary
    assert summary["environment_delete"] >= 2 and summary["node_loss"] >= 1, summary
    assert summary["preempted_for_guarantee"] >= 1, "borrowed GPUs were reclaimed for a guarantee at least once"
    assert summary.get("job_queued", 0) == 0 and summary["checks"] >= SECONDS, summary
    _assert_every_kind_ran(run, summary)


def test_the_kubernetes_backend_under_chaos_keeps_every_invariant(settings, tmp_path, kubernetes_cluster):
    """The same driver against the API stand-in: pods bound where placed, stopped with the grace period,
    gone with their node; the driver plays the trainers (a pod exits 0 once its steps are done)."""
    from runners.clusters.registry import get_backend
    from tests.support.k8s import gpu_node

    config = _settings(KUBERNETES_SECONDS)
    for node in ("gpu-a", "gpu-b"):
        kubernetes_cluster.put(gpu_node(node))
    cluster = StandInCluster(kubernetes_cluster, config.step_s)
    settings.CLUSTER_BACKEND_FACTORY = cluster.factory
    settings.PREEMPTION_GRACE_PERIOD_S = config.grace_period_s
    get_backend.cache_clear()
    workers = Workers(config, tmp_path, factory=cluster.factory)
    run = ChaosRun(config, cluster=cluster, workers=workers)
    run.setup()
    try:
        workers.start()
        run.run(KUBERNETES_SECONDS, until=lambda: _every_kind_done(run) and _succeeded(3),
                max_seconds=max(KUBERNETES_SECONDS, 60))
        summary = run.drain(timeout_s=120)
        logs = workers.logs()  # before the stop, whose SIGTERMs leave tracebacks of their own
    finally:
        workers.stop()
    print(f"\nchaos on the Kubernetes stand-in, seed {SEED}, {KUBERNETES_SECONDS:.0f}s: {summary}")

    assert not run.violations, "\n".join(run.violations[:20])
    assert "Traceback" not in logs, "no task failed with an error"
    if KUBERNETES_SECONDS >= 40:  # the long form's marks; the short form's are every kind at least once (below)
        assert summary["submit"] > 50 and summary["cancel"] > 5, summary
    assert summary["node_loss"] >= 1, summary
    assert summary.get("attempt_succeeded", 0) >= 3 and summary.get("job_queued", 0) == 0, summary
    assert summary["checks"] >= KUBERNETES_SECONDS, summary
    _assert_every_kind_ran(run, summary)


def test_the_checker_names_each_kind_of_violation(settings, tenant, owner):
    """The invariants are only as good as the checker: each rule, broken on purpose, is reported by name."""
    import time

    from django.utils import timezone

    from runners.clusters.registry import get_backend
    from runners.jobs import services as jobs
    from runners.jobs.models import Job, JobAttempt
    from runners.scheduling import services as scheduling
    from tests.support import invariants
    from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment

    settings.CLUSTER_BACKEND_FACTORY = FACTORY_QUICK
    settings.PREEMPTION_GRACE_PERIOD_S = 1
    get_backend.cache_clear()
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    base = invariants.baseline()
    one_gpu = dict(replicas=1, gpus_per_replica=1, topology={"level": "none", "mode": "required"}, env={})
    first, second = (jobs.job_submit(actor=owner, data=job_data(environment, name=f"j{n}", **one_gpu)) for n in (1, 2))
    scheduling.cycle_run()
    assert invariants.check(get_backend(), baseline=base) == []

    # Both on one GPU; the first "running" with its attempt unstarted; past max and capacity.
    placement = JobAttempt.objects.get(job=first).placement
    JobAttempt.objects.filter(job=second).update(placement=placement)
    Job.objects.filter(id=first.id).update(state="running")
    Job.objects.filter(id=second.id).update(replicas=4, state_changed_at=timezone.now() - timezone.timedelta(hours=1))
    # A third job queued with no reason, and an ended attempt whose replicas still run.
    third = jobs.job_submit(actor=owner, data=job_data(environment, name="j3", **one_gpu))
    Job.objects.filter(id=third.id).update(reason="")
    ended = JobAttempt.objects.create(job=third, number=1, placement=placement,
                                      ended_at=timezone.now() - timezone.timedelta(seconds=30), outcome="cancelled")
    get_backend()._write(third.id, 1, {"started": time.time(), "duration": 60, "ranks": [0], "end": None})

    found = "\n".join(invariants.check(get_backend(), stuck_after_s=60, slack_s=1, baseline=base))
    assert f"job {first.id} (acme/j1, running) is running with open attempts [1], 0 of them started" in found
    assert f"GPU {placement[0]['node']}/{placement[0]['gpus'][0]} is held whole and by another replica too" in found
    assert f"tenant acme holds 5 units of h100-80gb, past its max 4: jobs {first.id}, {second.id}" in found
    assert f"job {second.id} (acme/j2, admitted) has waited" in found
    assert f"job {third.id} (acme/j3, queued) waits in the queue with no reason" in found
    assert f"attempt {third.id}/{ended.number} ended cancelled" in found and "QuickJobs record" in found

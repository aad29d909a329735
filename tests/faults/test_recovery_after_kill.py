"""A worker SIGKILLed mid-launch while Redis is down and comes back empty: the surviving worker and the beat recover.

Two workers and a beat on a Redis of the test's own (no persistence). Worker A takes the job's
launch, starts its replicas and sleeps (CHAOS_LAUNCH_DELAY_AFTER); worker B is idle. A is
SIGKILLed and Redis is killed; it stays down DOWN_S seconds and comes back empty, so only the
database says a launch was under way. Then:

- The beat, whose due tasks cannot be sent while Redis is down, writes one line per failed send
  (Celery wrote the stack and the traceback with it: thousands of lines each, rendered with
  locals, and the beat froze while writing them).
- Worker B is consuming again soon after Redis is back (Celery's waits between tries grow by 2 s
  a try: after 13 s down it came back 7 s late, and then drained the beat's expired messages).
- B launches the job again once A's lease ran out: running on its first attempt, its replicas
  not started twice.

The time from the SIGKILL to running is printed. bench/recovery_after_kill.py runs this test
again and again for the figure, with the lease and the outage of its choice
(FAULTS_RECOVERY_LEASE_S, FAULTS_RECOVERY_DOWN_S).
"""

import os
import re
import time
from datetime import datetime

import pytest

from runners.clusters.registry import get_backend
from runners.jobs import services as jobs
from runners.jobs.models import Job
from tests.faults import support
from tests.support.chaos import FACTORY_QUICK
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment
from tests.support.worker import WorkerProcess, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

DOWN_S = float(os.environ.get("FAULTS_RECOVERY_DOWN_S") or 13)
LEASE_S = float(os.environ.get("FAULTS_RECOVERY_LEASE_S") or 3)
CONNECTED = re.compile(r"^(\S+Z) \[info\s*\] Connected to redis", re.MULTILINE)


def _connected_at(log: str) -> list[float]:
    return [datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() for stamp in CONNECTED.findall(log)]


def test_a_worker_killed_mid_launch_with_the_broker_down_is_recovered_from_promptly(
    settings, tmp_path, tenant, owner, record_property
):
    settings.CLUSTER_BACKEND_FACTORY = FACTORY_QUICK
    get_backend.cache_clear()
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    environment = ready_environment(actor=owner, tenant=tenant)
    broker = support.PrivateRedis(tmp_path / "redis.log").start()
    common = dict(
        CELERY_BROKER_URL=broker.url, CLUSTER_BACKEND_FACTORY=FACTORY_QUICK, CHAOS_STEP_S=1,
        JOB_LAUNCH_LEASE_S=LEASE_S, SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1,
        CELERY_VISIBILITY_TIMEOUT_S=3600,  # nothing comes back by the broker's own redelivery here
    )
    doomed = WorkerProcess(tmp_path / "worker-a.log", CHAOS_LAUNCH_DELAY_S=600, CHAOS_LAUNCH_DELAY_AFTER="true",
                           PGAPPNAME="faults-worker-a", **common)
    survivor = WorkerProcess(tmp_path / "worker-b.log", PGAPPNAME="faults-worker-b", **common)
    the_beat = support.beat(tmp_path / "beat.log", PGAPPNAME="faults-beat", **common)
    try:
        doomed.start()
        the_beat.start(ready=b"beat: Starting")
        job = jobs.job_submit(actor=owner, data=job_data(
            environment, replicas=1, gpus_per_replica=1, steps=3600, checkpoint_every_steps=0,
            topology={"level": "none", "mode": "required"}, max_runtime_s=7200,
        ))
        backend = get_backend()
        wait_for(lambda: Job.objects.get(id=job.id).state == "launching" and backend._read(job.id, 1) is not None,
                 timeout_s=60, message="worker A to have started the replicas (it then sleeps)")
        started = backend._read(job.id, 1)["started"]
        survivor.start()

        doomed.kill()
        killed_at = time.monotonic()
        broker.kill()
        beat_log_before = len(the_beat.output())
        time.sleep(DOWN_S)
        broker.start()
        back_at = time.time()

        wait_for(lambda: Job.objects.get(id=job.id).state == "running", timeout_s=LEASE_S + 60, interval_s=0.1,
                 message="the job to run after its launcher and its message were lost")
        figure = time.monotonic() - killed_at
    finally:
        the_beat.stop()
        doomed.stop()
        survivor.stop()
        broker.kill()
    record_property("kill_to_running_s", round(figure, 2))
    reconnected = [at - back_at for at in _connected_at(survivor.output()) if at >= back_at - 1]
    print(f"\n{figure:.1f}s from the SIGKILL to running ({DOWN_S}s of it with Redis down); worker B connected "
          f"again {reconnected[0] if reconnected else float('nan'):.1f}s after Redis was back")

    outage = the_beat.output()[beat_log_before:]
    failed_sends = [line for line in outage.splitlines() if "Message Error" in line]
    assert failed_sends, "the beat tried to send while Redis was down"
    assert "Traceback" not in outage and "format_stack" not in outage, outage[:3000]
    assert all(line.count("Message Error") == 1 for line in failed_sends)

    assert reconnected and reconnected[0] <= 4, f"worker B reconnected {reconnected} s after Redis was back"

    job.refresh_from_db()
    assert [(a.number, a.ended_at) for a in job.attempts.all()] == [(1, None)]
    assert backend._read(job.id, 1)["started"] == started, "the replicas were not started twice"
    assert figure <= DOWN_S + LEASE_S + 15, figure

"""The cycle's per-victim path reads nothing per victim: its queries grow with the victims only by what it writes."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from runners.jobs import attempts
from runners.jobs.models import AttemptOutcome, Job, JobState
from runners.scheduling import services as scheduling
from tests.support.jobs import give_quota, play_launch, submit

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

ANYWHERE = {"level": "none", "mode": "preferred"}


def _reads_of_a_cycle() -> tuple[int, dict]:
    with CaptureQueriesContext(connection) as queries:
        result = scheduling.cycle_run()
    reads = [q["sql"] for q in queries.captured_queries if q["sql"].lstrip().upper().startswith("SELECT")]
    return len(reads), result


def test_a_cycle_preempting_six_victims_reads_no_more_than_one_preempting_two(
    flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env
):
    """Before the fix each victim's tenant was read on its own (the audit entry and the count by tenant)."""
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    borrowed = [submit(owner, acme_env, name=f"borrow-{n}", replicas=1, topology=ANYWHERE) for n in range(16)]
    scheduling.cycle_run()
    for job in borrowed:
        play_launch(job)

    first = submit(outsider, globex_env, name="owed-a", replicas=1, gpus_per_replica=2, priority=50, topology=ANYWHERE)
    reads_for_two, result = _reads_of_a_cycle()
    assert len(result["preempted"]) == 2
    for job_id in result["preempted"]:  # the victims stopped as asked, and wait again
        attempt = Job.objects.get(id=job_id).attempts.get(ended_at__isnull=True)
        assert attempts.attempt_end(job_id, attempt.id, outcome=AttemptOutcome.PREEMPTED, reason="stopped")
    scheduling.cycle_run()
    play_launch(first)

    submit(outsider, globex_env, name="owed-b", replicas=1, gpus_per_replica=6, priority=50, topology=ANYWHERE)
    reads_for_six, result = _reads_of_a_cycle()
    assert len(result["preempted"]) == 6
    assert Job.objects.filter(state=JobState.PREEMPTED).count() == 6
    assert reads_for_six == reads_for_two

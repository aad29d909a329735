"""Helpers for usage tests: a day to count on, and jobs whose attempts ran at the times a test gives."""

from datetime import UTC, datetime, timedelta

from runners.jobs.models import Job, JobAttempt

DAY = datetime(2026, 11, 2, tzinfo=UTC)
LATER = datetime(2026, 12, 1, tzinfo=UTC)  # "now" for the scenarios: everything has ended


def at(hours: float, days: int = 0) -> datetime:
    return DAY + timedelta(days=days, hours=hours)


def job_with_attempts(environment, flavor, name, units, intervals, state="succeeded") -> Job:
    """A job of `units` one-GPU replicas whose attempts ran over `intervals`, (start, end) each (end None: still
    open); an ended attempt succeeded."""
    made = Job.objects.create(
        tenant=environment.tenant, environment=environment, name=name, spec={"template": "pytorch-ddp"},
        flavor=flavor, replicas=units, gpus_per_replica=1, state=state,
    )
    for number, (start, end) in enumerate(intervals, start=1):
        attempt = JobAttempt.objects.create(job=made, number=number, placement=[])
        JobAttempt.objects.filter(id=attempt.id).update(admitted_at=start, started_at=start, ended_at=end,
                                                        outcome="succeeded" if end else "")
    return made

"""How the pages show why a job is where it is: the reason's words as written (escaped, so never a link:
a reason may name another tenant's job, which the reader cannot open) and the time that goes with it
(a queued job's projected start, a stopping job's deadline) in the portal's time zone, with how far off
it is. Reasons themselves hold no clock time: the scheduler cannot know the reader's zone."""

from django import template
from django.utils import timezone

from runners.jobs.models import JobState

register = template.Library()


def _relative(seconds: float) -> str:
    """'in under a minute', 'in about 20 minutes', 'in about 3 hours', 'in about 2 days'."""
    if seconds < 60:
        return "in under a minute"
    for size, unit, below in ((60, "minute", 3600), (3600, "hour", 36 * 3600), (86400, "day", None)):
        if below is None or seconds < below:
            count = max(1, round(seconds / size))
            return f"in about {count} {unit}{'' if count == 1 else 's'}"
    return ""  # not reached: the last unit has no bound


@register.filter
def moment(value, now=None) -> str:
    """A time as a reader takes it: 'in about 20 minutes, at 14:05 UTC' (the date too when not today);
    a time already past reads 'any moment now (due at 14:05 UTC)'."""
    if not value:
        return ""
    now = now or timezone.now()
    local = timezone.localtime(value)
    clock = local.strftime("%H:%M")
    if local.date() != timezone.localtime(now).date():
        clock = f"{local:%b} {local.day}, {clock}"
    clock = f"{clock} {local.tzname()}"
    seconds = (value - now).total_seconds()
    if seconds <= 0:
        return f"any moment now (due at {clock})"
    return f"{_relative(seconds)}, at {clock}"


def reason_time(job, now=None) -> dict | None:
    """The time that goes with the job's reason now, with what it means, or None."""
    if job.state == JobState.QUEUED and job.projected_start:
        return {"label": "Expected to start", "at": job.projected_start, "text": moment(job.projected_start, now)}
    if job.state in (JobState.PREEMPTED, JobState.CANCELLING) and job.stop_deadline:
        return {"label": "Stopped at the latest", "at": job.stop_deadline, "text": moment(job.stop_deadline, now)}
    return None


@register.inclusion_tag("frontend/_job_reason.html")
def job_reason(job, compact: bool = False) -> dict:
    """The job's reason and its time: paragraphs on the job page, one line in a list (compact)."""
    return {"job": job, "when": reason_time(job), "compact": compact}

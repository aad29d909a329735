"""What the portal's Celery tasks share."""

from collections.abc import Callable


def backoff_s(retries: int, cap_s: int) -> int:
    """Exponential backoff for the next retry: 2, 4, 8 ... seconds, at most cap_s."""
    return min(2 ** (retries + 1), cap_s)


def retry_or_give_up(
    task, exc: Exception, *, give_up: Callable[[str], None], before_retry: Callable[[str], None] | None = None, cap_s: int
) -> str:
    """Retry a bound task after a transient error, or record the failure once its retries are spent."""
    if task.request.retries >= task.max_retries:
        give_up(str(exc))
        return "failed"
    if before_retry is not None:
        before_retry(str(exc))
    raise task.retry(exc=exc, countdown=backoff_s(task.request.retries, cap_s))

"""Celery tasks of utilization and cost: sampling every open attempt's devices, and settling the ledger."""

from celery import shared_task

from runners.usage import budgets, ledger, sampling


@shared_task(name="runners.tasks.usage_sample")
def usage_sample(_kicked_at: float | None = None) -> dict:
    """Read and store every open attempt's devices, then downsample what has aged."""
    result = sampling.sample_run()
    result["downsampled"] = sampling.downsample_run()
    return result


@shared_task(name="runners.tasks.usage_settle", acks_late=True)
def usage_settle(job_ids: list[int] | None = None) -> dict:
    """Write the ledger: the ended attempts of these jobs (an attempt just ended), or the whole sweep.

    Idempotent (an item's entries are brought to its truth, never added twice), so a redelivered
    message does no harm; the budgets are checked after every settle.
    """
    written = ledger.settle_jobs(job_ids) if job_ids else ledger.settle_run()["entries"]
    return {"entries": written, "alerts": budgets.budgets_check()}

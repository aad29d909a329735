"""Celery tasks of utilization and cost: sampling every open attempt's devices, and settling the ledger."""

from celery import shared_task

from common.dispatch import send_task
from runners.usage import budgets, ledger, sampling


@shared_task(name="runners.tasks.usage_sample")
def usage_sample(_kicked_at: float | None = None) -> dict:
    """Read and store every open attempt's devices."""
    return sampling.sample_run()


@shared_task(name="runners.tasks.usage_settle", acks_late=True)
def usage_settle(job_ids: list[int] | None = None) -> dict:
    """Write the ledger: the ended attempts of these jobs (an attempt just ended), or the whole sweep.

    Idempotent (an item's entries are brought to its truth, never added twice), so a redelivered
    message does no harm. A sweep that spends USAGE_SETTLE_BUDGET_S stops and sends the next one. The periodic sweep also checks the budgets and downsamples what has aged;
    an attempt's end does neither, so many ending together cost only their own settling.
    """
    if job_ids:
        return {"entries": ledger.settle_jobs(job_ids)}
    settled = ledger.settle_run()
    if settled["more"]:
        # Stopped at its time budget with work left: the next sweep goes on now, not at the next beat.
        send_task("runners.tasks.usage_settle")
    return {"entries": settled["entries"], "alerts": budgets.budgets_check(), "downsampled": sampling.downsample_run()}

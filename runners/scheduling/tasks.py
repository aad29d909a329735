"""The scheduling cycle's Celery task.

Each task has an explicit, stable name (the module path it had before the apps were split):
renaming one strands the messages queued under the old name, so tests/test_task_names.py lists
them all.
"""

from celery import shared_task

from runners.scheduling import services as scheduling


@shared_task(name="runners.tasks.scheduler_cycle", acks_late=True)
def scheduler_cycle(kicked_at: float | None = None) -> dict:
    """One scheduler cycle (beat every SCHEDULER_CYCLE_INTERVAL_S, and kicked on submit, finish and cancel).

    A kick that a cycle started after has nothing left to do (that cycle saw what the kick was
    for) and returns at once, so a burst of submits costs one cycle, not one per submit. A kick
    waits for a cycle in progress (it may have started before the kick) and is dropped if another
    kick's cycle ran meanwhile. The beat's run never waits: with a cycle in progress (another
    worker's, or a second beat's) it is skipped, and the next period's does the work.
    """
    if kicked_at is not None and scheduling.cycle_ran_since(kicked_at):
        return {"skipped": True}
    if kicked_at is None:
        result = scheduling.cycle_run(wait=False)
    else:
        result = scheduling.cycle_run(unless_ran_since=kicked_at)
    return {key: len(value) if isinstance(value, list) else value for key, value in result.items()}

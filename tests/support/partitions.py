"""Drive a partition change step by step in the test process, as the task's re-enqueued runs would."""

import time


def drive_partition_change(change_id: int, *, max_steps: int = 500) -> str:
    """Run `partition_change_step` until the change finishes (or cannot be claimed); returns its state.

    Each step's delay is honoured, as the countdown of the task it would send.
    """
    from runners.clusters.services import partition_change_step

    lease = None
    for _ in range(max_steps):
        state, delay_s, lease = partition_change_step(change_id=change_id, lease=lease)
        if delay_s is None:
            return state
        time.sleep(delay_s)
    raise AssertionError(f"partition change {change_id} did not finish in {max_steps} steps (state {state})")

"""What jobs tell the apps above them, which they never import.

- ``attempts_ended`` (``job_ids``): one or more attempts of these jobs ended (finished, failed,
  preempted, cancelled or lost), sent inside the transaction that ended them. A receiver that
  does work defers it to ``transaction.on_commit``; a metering app settles what they held.
"""

from django.dispatch import Signal

attempts_ended = Signal()


def ended(*job_ids: int) -> None:
    attempts_ended.send(sender=None, job_ids=[job_id for job_id in job_ids if job_id is not None])

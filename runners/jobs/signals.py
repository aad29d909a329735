"""What jobs tell the apps above them, which they never import.

- ``attempts_ended`` (``job_ids``): one or more attempts of these jobs ended (finished, failed,
  preempted, cancelled or lost), sent inside the transaction that ended them. A receiver that
  does work defers it to ``transaction.on_commit``; a metering app settles what they held.
- ``serving_weights_url`` (``job``, ``attempt``): asked while an inference replica's launch is built, when it
  serves a model version's weights. A receiver answers the URL the replica's pod may fetch them from, signed
  for that attempt (the inference layer, through the registry), or "".
"""

from django.dispatch import Signal

attempts_ended = Signal()
serving_weights_url = Signal()


def ended(*job_ids: int) -> None:
    attempts_ended.send(sender=None, job_ids=[job_id for job_id in job_ids if job_id is not None])

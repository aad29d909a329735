"""What jobs tell the apps above them, which they never import.

- ``attempts_ended`` (``job_ids``): one or more attempts of these jobs ended (finished, failed,
  preempted, cancelled or lost), sent inside the transaction that ended them. A receiver that
  does work defers it to ``transaction.on_commit``; a metering app settles what they held.
- ``serving_weights_url`` (``job``, ``attempt``): asked while an inference replica's launch is built, when it
  serves a model version's weights. A receiver answers the URL the replica's pod may fetch them from, signed
  for that attempt (the inference layer, through the registry), or "".
- ``workspace_launch`` (``job``): asked while a workspace's launch is built (a job of kind "workspace"). Its
  receiver (runners.workspaces) answers the ``WorkspaceSettings`` fields of the workspace that job started:
  its id, base URL, key and home folder. The key stays out of the job's spec, which members read.
"""

from django.dispatch import Signal

attempts_ended = Signal()
serving_weights_url = Signal()
workspace_launch = Signal()


def ended(*job_ids: int) -> None:
    attempts_ended.send(sender=None, job_ids=[job_id for job_id in job_ids if job_id is not None])

"""What environments ask of the apps above them (jobs now, inference next), which they never import.

- ``environment_deleting`` (``environment``, ``reason``, ``actor``): sent inside the delete's
  transaction, with the tenant's and the environment's rows locked; each receiver cancels its work in
  the environment there and then (work that runs is told to stop after commit), in the name of
  ``actor`` (the user who deleted it, None for the portal's own work) in the audit log.
- ``environment_work_left`` (``environment_id``): asked by the teardown; each receiver answers what
  of its work still runs there ("2 job attempt(s)"), or nothing. The namespace goes only once no
  receiver answers, so nothing outlives the namespace it ran in.
- ``environment_failed`` (``environment_id``): the environment's state just became ``failed`` (the
  backend refused it for good, or its retries ran out); sent once, by whoever moved it there. A
  receiver that does work defers it to ``transaction.on_commit`` (notifications mail and call webhooks).
"""

from django.dispatch import Signal

environment_deleting = Signal()
environment_work_left = Signal()
environment_failed = Signal()


def work_left(environment_id: int) -> list[str]:
    """What still runs in the environment, as the apps above describe it; empty when nothing does."""
    return [answer for _receiver, answer in environment_work_left.send(sender=None, environment_id=environment_id)
            if answer]

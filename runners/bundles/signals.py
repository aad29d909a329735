"""What bundles ask the apps above them, which they never import.

- ``bundle_in_use`` (``bundle``): sent before a bundle is deleted, inside the transaction that deletes it,
  with the bundle's row locked. A receiver answers with the names of what still needs it (a jobs
  layer: its queued and running jobs that run the bundle, e.g. ``["job 12", "job 15"]``); any answer
  refuses the delete (409 naming them). A job submitted with a bundle should lock the bundle's row
  (``services.get_bundle(..., for_update=True)``) so a delete cannot pass between its check and the
  job's insert.
"""

from django.dispatch import Signal

bundle_in_use = Signal()


def users_of(bundle) -> list[str]:
    """What the receivers say still needs the bundle (empty: nothing does)."""
    names: list[str] = []
    for _receiver, answer in bundle_in_use.send(sender=type(bundle), bundle=bundle):
        names += list(answer or [])
    return names

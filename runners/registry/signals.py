"""What the registry asks the apps above it, which it never imports.

- ``version_in_use`` (``version``): sent before a model version is deleted, inside the transaction that deletes
  it, with the version's row locked. A receiver answers with the names of what still serves it (the inference
  layer: its endpoints that serve the version, or whose replicas still run it, e.g. ``["endpoint chat"]``); any
  answer refuses the delete (409 naming them). A deploy or rollout that names a version locks its row
  (``selectors.version_lock``) so a delete cannot pass between its check and the endpoint's write.
"""

from django.dispatch import Signal

version_in_use = Signal()


def users_of(version) -> list[str]:
    """What the receivers say still serves the version (empty: nothing does)."""
    names: list[str] = []
    for _receiver, answer in version_in_use.send(sender=type(version), version=version):
        names += list(answer or [])
    return sorted(set(names))

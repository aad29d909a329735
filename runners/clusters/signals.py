"""What the inventory asks of the apps above it, which it never imports.

- ``placed_on_nodes`` (``nodes``: names): each receiver answers ``{node: ["namespace/name", ...]}``
  for the work it has placed there, running or about to (an admitted job counts), so no
  re-partitioning pulls a node from under it.
- ``nodes_draining`` (``nodes``, ``reason``): nodes are drained for a partition change; each
  receiver checkpoints and stops its own work there through its own path and answers the workload
  names (``job-<id>``) it stopped. The backend evicts whatever nobody claimed.
- ``capacity_changed`` (``capacities``: {flavor id: units}, ``at``): flavors' schedulable capacity
  changed, sent inside the transaction that wrote it (a metering app keeps the history).
"""

from django.dispatch import Signal

placed_on_nodes = Signal()
nodes_draining = Signal()
capacity_changed = Signal()


def placed(nodes: list[str]) -> dict[str, list[str]]:
    """Per node, the work the apps above have placed there."""
    found: dict[str, list[str]] = {}
    for _receiver, answer in placed_on_nodes.send(sender=None, nodes=list(nodes)):
        for node, names in (answer or {}).items():
            found.setdefault(node, []).extend(names)
    return found


def drain(nodes: list[str], *, reason: str) -> set[str]:
    """Ask the apps above to stop their work on these nodes; the workload names they stopped."""
    stopped: set[str] = set()
    for _receiver, answer in nodes_draining.send(sender=None, nodes=list(nodes), reason=reason):
        stopped |= set(answer or ())
    return stopped

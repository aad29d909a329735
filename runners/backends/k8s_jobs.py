"""How training attempts stand on Kubernetes, read from their pods: pure functions and a watch cache.

No HTTP here: the backend hands `WatchedList` two callables (one list, one watch
from a resourceVersion) and asks the functions below what the pods it keeps
say. That keeps the rules testable on plain dicts.

- `WatchedList` keeps one kind's objects current: a list, then watches that
  resume from the last resourceVersion seen. A watch answered with 410 Gone
  (an ERROR event holding a 410 Status, or HTTP 410) means the history was
  compacted: it lists again and reports what changed meanwhile, pods that went
  away included, so no change is lost.
- `PodTracker` remembers, per attempt, each replica's exit code and replicas
  whose pod vanished before it finished, beyond the life of the pod objects.
- `attempt_status` turns that into the portal's `AttemptStatus`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from runners.backends.base import AttemptStatus, TransientBackendError
from runners.backends.job_manifests import (
    ATTEMPT_LABEL,
    COMPLETION_INDEX_ANNOTATION,
    JOB_LABEL,
    PLACEMENT_ANNOTATION,
)


class WatchGone(Exception):
    """The watch's resourceVersion is older than the server keeps: list again."""


Key = tuple[str, str]  # (namespace, name)


def key_of(obj: dict) -> Key:
    metadata = obj.get("metadata") or {}
    return metadata.get("namespace", ""), metadata.get("name", "")


@dataclass
class WatchedList:
    """One kind's objects, kept current by list + watch; `on_change(old, new)` hears every change (new None: gone)."""

    list_fn: Callable[[], tuple[list[dict], str]]
    watch_fn: Callable[[str], Iterable[dict]]
    on_change: Callable[[dict | None, dict | None], None] = lambda old, new: None
    items: dict[Key, dict] = field(default_factory=dict)
    resource_version: str | None = None
    lists: int = 0

    def sync(self) -> None:
        """Bring the objects up to date: the first call lists; later ones watch from where the last stopped."""
        if self.resource_version is None:
            self._relist()
            return
        try:
            for event in self.watch_fn(self.resource_version):
                self._apply(event)
        except WatchGone:
            self._relist()

    def _apply(self, event: dict) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise WatchGone(obj.get("message", ""))
            raise TransientBackendError(f"The watch ended with an error: {obj.get('message', obj)}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            self.resource_version = version or self.resource_version
            return
        key = key_of(obj)
        old = self.items.get(key)
        if kind == "DELETED":
            self.items.pop(key, None)
            self.on_change(old or obj, None)
        else:
            self.items[key] = obj
            self.on_change(old, obj)
        self.resource_version = version or self.resource_version

    def _relist(self) -> None:
        items, version = self.list_fn()
        fresh = {key_of(obj): obj for obj in items}
        for key, old in self.items.items():
            if key not in fresh:
                self.on_change(old, None)  # went away while nobody watched
        for key, obj in fresh.items():
            if self.items.get(key) != obj:
                self.on_change(self.items.get(key), obj)
        self.items = fresh
        self.resource_version = version
        self.lists += 1


# --- One pod --------------------------------------------------------------------------


def attempt_of(pod: dict) -> tuple[int, int] | None:
    """(job id, attempt number) from the pod's labels; None for a pod that is not a training replica."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        return int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL])
    except (KeyError, ValueError):
        return None


def pod_rank(pod: dict) -> int | None:
    try:
        return int(((pod.get("metadata") or {}).get("annotations") or {})[COMPLETION_INDEX_ANNOTATION])
    except (KeyError, ValueError):
        return None


TRAINER_CONTAINER = "trainer"


def pod_exit_code(pod: dict) -> int | None:
    """The trainer container's exit code once it terminated, else None (an injected sidecar does not count)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != TRAINER_CONTAINER:
            continue
        terminated = (status.get("state") or {}).get("terminated")
        if terminated is not None:
            return int(terminated.get("exitCode", 1))
    phase = (pod.get("status") or {}).get("phase")
    return {"Succeeded": 0, "Failed": 1}.get(phase)


def _placement(pod: dict) -> dict[str, str]:
    """Completion index -> node, as the portal wrote it on the pod template."""
    try:
        placement = json.loads(((pod.get("metadata") or {}).get("annotations") or {})[PLACEMENT_ANNOTATION])
    except (KeyError, ValueError):
        return {}
    return placement if isinstance(placement, dict) else {}


def placed_node(pod: dict) -> str | None:
    """The node the portal placed this pod's completion index on."""
    return _placement(pod).get(str(pod_rank(pod)))


def needs_binding(pod: dict, scheduler_name: str) -> bool:
    spec = pod.get("spec") or {}
    metadata = pod.get("metadata") or {}
    return (
        spec.get("schedulerName") == scheduler_name
        and not spec.get("nodeName")
        and not metadata.get("deletionTimestamp")
        and (pod.get("status") or {}).get("phase", "Pending") == "Pending"
    )


def binding_body(pod: dict, node: str) -> dict:
    """The v1 Binding a scheduler posts to pods/<name>/binding."""
    metadata = pod["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": metadata["name"], "namespace": metadata["namespace"], "uid": metadata.get("uid")},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }


# --- Attempts --------------------------------------------------------------------------


@dataclass
class PodTracker:
    """What the pods of each attempt have said, kept after the pod objects are gone."""

    exits: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)
    vanished: dict[tuple[int, int], dict[int, str]] = field(default_factory=dict)
    replicas: dict[tuple[int, int], int] = field(default_factory=dict)
    # The node each vanished replica was on: pod GC force-deletes the pods of a deleted node.
    vanished_nodes: dict[tuple[int, int], dict[int, str]] = field(default_factory=dict)

    def changed(self, old: dict | None, new: dict | None) -> None:
        pod = new or old
        attempt = attempt_of(pod) if pod else None
        rank = pod_rank(pod) if pod else None
        if attempt is None or rank is None:
            return
        placement = _placement(pod)
        if placement:
            self.replicas[attempt] = len(placement)
        code = pod_exit_code(pod)
        if code is not None:
            self.exits.setdefault(attempt, {})[rank] = code
            self.vanished.get(attempt, {}).pop(rank, None)
        elif new is None and rank not in self.exits.get(attempt, {}):
            name = pod["metadata"]["name"]
            self.vanished.setdefault(attempt, {})[rank] = f"Pod {name} (replica {rank}) was deleted before it finished."
            node = (pod.get("spec") or {}).get("nodeName")
            if node:
                self.vanished_nodes.setdefault(attempt, {})[rank] = node

    def forget(self, attempt: tuple[int, int]) -> None:
        self.exits.pop(attempt, None)
        self.vanished.pop(attempt, None)
        self.replicas.pop(attempt, None)
        self.vanished_nodes.pop(attempt, None)


def node_lost_reason(node_name: str, node: dict | None, *, lost_after_s: float, now: datetime) -> str | None:
    """Why the node counts as lost (gone, or not Ready for longer than lost_after_s), or None."""
    if node is None:
        return f"Node {node_name} is gone from the cluster."
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") != "Ready" or condition.get("status") == "True":
            continue
        since = _parse_time(condition.get("lastTransitionTime"))
        if since is None or (now - since).total_seconds() >= lost_after_s:
            return f"Node {node_name} has not been Ready since {condition.get('lastTransitionTime')}."
    return None


def job_finished(job: dict | None) -> str | None:
    """'Complete' or 'Failed' once the Job controller has decided (FailureTarget counts as Failed), else None."""
    for condition in ((job or {}).get("status") or {}).get("conditions") or []:
        if condition.get("status") != "True":
            continue
        if condition.get("type") == "Complete":
            return "Complete"
        if condition.get("type") in ("Failed", "FailureTarget"):
            return "Failed"
    return None


def attempt_status(
    *,
    replicas: int,
    pods: list[dict],
    exits: dict[int, int],
    vanished: dict[int, str],
    job: dict | None,
    lost_nodes: dict[str, str],
    vanished_nodes: dict[int, str] | None = None,
) -> AttemptStatus:
    """How one attempt stands, from its pods now, what its pods said before, its Job, and lost nodes.

    `job` matters when some replica has neither a live pod nor a known exit code (this
    process never saw it end, or it never got a pod): then the Job's own verdict decides.
    """
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if node in lost_nodes and pod_exit_code(pod) is None:
            return AttemptStatus("lost", exit_codes=dict(exits), reason=lost_nodes[node], node_lost=True)
    for rank, node in sorted((vanished_nodes or {}).items()):
        if rank in vanished and node in lost_nodes:
            return AttemptStatus("lost", exit_codes=dict(exits), reason=lost_nodes[node], node_lost=True)
    if replicas and all(rank in exits for rank in range(replicas)):
        return AttemptStatus("exited", exit_codes=dict(exits))
    if vanished:
        return AttemptStatus("lost", exit_codes=dict(exits), reason=vanished[min(vanished)])
    live = [pod for pod in pods if pod_exit_code(pod) is None]
    verdict = job_finished(job)
    if verdict == "Complete":
        # Every index succeeded, whether or not this process saw each pod end.
        return AttemptStatus("exited", exit_codes={rank: exits.get(rank, 0) for rank in range(replicas or len(exits))})
    if verdict == "Failed" and not live:
        if any(code != 0 for code in exits.values()):
            return AttemptStatus("exited", exit_codes=dict(exits))
        condition = next(c for c in job["status"]["conditions"] if c.get("type") in ("Failed", "FailureTarget"))
        return AttemptStatus("lost", exit_codes=dict(exits), reason=f"The Job failed: {condition.get('reason')}: "
                                                                     f"{condition.get('message', '')}".strip())
    if not pods and not exits and job is None:
        return AttemptStatus("lost", reason="Its Job and pods are gone from the cluster.")
    return AttemptStatus("running", exit_codes=dict(exits))


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)

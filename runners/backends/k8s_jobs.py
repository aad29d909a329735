"""How attempts stand on Kubernetes, read from their pods: pure functions and a watch cache.

Training replicas are the pods of an indexed Job (rank: the completion index); an inference
replica is the one pod of a Deployment (rank 0, written on its template). Both carry the job
and attempt labels and the placement, so everything below reads them alike.

No HTTP here: the backend hands `WatchedList` two callables (one list, one watch
from a resourceVersion) and asks the functions below what the pods it keeps
say. That keeps the rules testable on plain dicts.

- `WatchedList` keeps one kind's objects current: a list, then watches that
  resume from the last resourceVersion seen. A watch answered with 410 Gone
  (an ERROR event holding a 410 Status, or HTTP 410) means the history was
  compacted: it lists again and reports what changed meanwhile, pods that went
  away included, so no change is lost. `read` is the network half of a sync and `take`
  applies what it brought, so the backend holds its cache's lock only for the second.
- `PodTracker` remembers, per attempt, each replica's exit code, replicas whose pod
  vanished before it finished, and replicas the cluster stopped (evicted, or refused by
  the kubelet: `pod_disruption`), beyond the life of the pod objects.
- `attempt_status` turns that into the portal's `AttemptStatus`.
- `read_progress` reads the tagged records of rank 0's log incrementally: the pod log
  API with `timestamps=true`, `sinceTime` and `limitBytes`, from a cursor the portal keeps
  (see `LogCursor`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
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
from runners.backends.serve_manifests import RANK_ANNOTATION, SERVER_CONTAINER
from runners.workloads import progress


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
        self.take(self.read())

    def read(self) -> tuple[str, object]:
        """The network half of a sync, changing nothing here: ("list", (items, version)) or ("events", [...]).

        A watch answered with 410 (HTTP 410, or an ERROR event holding one) is followed by one list.
        One reader at a time (the caller's lock); `take` applies the result, under the caller's other lock.
        """
        if self.resource_version is None:
            return "list", self.list_fn()
        try:
            events = list(self.watch_fn(self.resource_version))
        except WatchGone:
            return "list", self.list_fn()
        if any(event.get("type") == "ERROR" and (event.get("object") or {}).get("code") == 410 for event in events):
            return "list", self.list_fn()
        return "events", events

    def take(self, read: tuple[str, object]) -> None:
        """Apply what `read` brought: a list replaces the objects (reporting what changed), events apply in order."""
        kind, payload = read
        if kind == "list":
            self._relist(payload)
            return
        for event in payload:
            self._apply(event)

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

    def _relist(self, listed: tuple[list[dict], str] | None = None) -> None:
        items, version = listed if listed is not None else self.list_fn()
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
    """The replica's rank: a training pod's completion index, or a serving pod's rank annotation."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    try:
        return int(annotations.get(COMPLETION_INDEX_ANNOTATION) or annotations[RANK_ANNOTATION])
    except (KeyError, ValueError):
        return None


TRAINER_CONTAINER = "trainer"
# The container whose exit and log are the replica's, whichever kind it is (an injected sidecar never is).
WORKLOAD_CONTAINERS = (TRAINER_CONTAINER, SERVER_CONTAINER)


def workload_container(pod: dict) -> str:
    """The name of the pod's workload container (the trainer's, unless the pod runs the server)."""
    names = [container.get("name") for container in (pod.get("spec") or {}).get("containers") or []]
    return next((name for name in names if name in WORKLOAD_CONTAINERS), TRAINER_CONTAINER)


def pod_exit_code(pod: dict) -> int | None:
    """The workload container's exit code once it terminated, else None (an injected sidecar does not count).

    A serving pod restarts its container in place (restartPolicy Always, or its liveness probe
    failed): the exit the kubelet restarted it from (`lastState`) ends the replica's attempt all
    the same, since retries are the portal's, with a new attempt. A training pod never restarts.
    """
    status = _workload_status(pod)
    terminated = (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get("terminated")
    if terminated is not None:
        return int(terminated.get("exitCode", 1))
    if pod_refused(pod):
        return None  # the kubelet never ran it: no exit of the workload's (see pod_disruption)
    phase = (pod.get("status") or {}).get("phase")
    return {"Succeeded": 0, "Failed": 1}.get(phase)


def pod_refused(pod: dict) -> bool:
    """Whether the pod failed with a reason before its workload container ever ran: the kubelet refused
    it at admission (`OutOf<resource>` for a GPU, CPU or memory it lacks, `UnexpectedAdmissionError`, ...)."""
    status = pod.get("status") or {}
    workload = _workload_status(pod)
    ran = (workload.get("state") or {}).get("terminated") or (workload.get("lastState") or {}).get("terminated")
    return status.get("phase") == "Failed" and bool(status.get("reason")) and not ran


def pod_disruption(pod: dict) -> str | None:
    """Why the cluster, not the portal nor the workload, stopped this pod; None if it did not.

    An eviction (the API's, through a PodDisruptionBudget; the kubelet's under node pressure;
    a taint or a preemption) marks the pod with a DisruptionTarget condition, or (older kubelets)
    fails it with reason Evicted; a pod the kubelet refused at admission fails with a reason
    and no container ever run (see pod_refused).
    """
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = metadata.get("name", "")
    node = (pod.get("spec") or {}).get("nodeName") or "its node"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            return f"Pod {name} was evicted from {node} ({condition.get('reason')}: {condition.get('message', '')})".strip() + "."
    if status.get("phase") == "Failed" and status.get("reason") == "Evicted":
        return f"Pod {name} was evicted from {node} (Evicted: {status.get('message', '')})".strip() + "."
    if pod_refused(pod):
        return (f"The kubelet on {node} refused pod {name} ({status.get('reason')}: "
                f"{status.get('message', '')})").strip() + "."
    return None


def pod_finished(pod: dict) -> bool:
    """Whether the workload container has stopped for good (a serving container restarted from a crash runs again)."""
    if (_workload_status(pod).get("state") or {}).get("terminated") is not None:
        return True
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _workload_status(pod: dict) -> dict:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((status for status in statuses if status.get("name") in WORKLOAD_CONTAINERS), {})


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
    # Replicas the cluster stopped (evicted, or refused by the kubelet), with why, once their pod is over.
    disrupted: dict[tuple[int, int], dict[int, str]] = field(default_factory=dict)

    def changed(self, old: dict | None, new: dict | None) -> None:
        pod = new or old
        attempt = attempt_of(pod) if pod else None
        rank = pod_rank(pod) if pod else None
        if attempt is None or rank is None:
            return
        placement = _placement(pod)
        if placement:
            self.replicas[attempt] = len(placement)
        why = pod_disruption(pod)
        if why is not None and (new is None or pod_finished(pod)):
            self.disrupted.setdefault(attempt, {})[rank] = why
            self.vanished.get(attempt, {}).pop(rank, None)
        code = pod_exit_code(pod)
        if code is not None:
            self.exits.setdefault(attempt, {})[rank] = code
            self.vanished.get(attempt, {}).pop(rank, None)
        elif new is None and rank not in self.exits.get(attempt, {}) and rank not in self.disrupted.get(attempt, {}):
            name = pod["metadata"]["name"]
            self.vanished.setdefault(attempt, {})[rank] = f"Pod {name} (replica {rank}) was deleted before it finished."
            node = (pod.get("spec") or {}).get("nodeName")
            if node:
                self.vanished_nodes.setdefault(attempt, {})[rank] = node

    def _tables(self) -> tuple[dict, ...]:
        return self.exits, self.vanished, self.replicas, self.vanished_nodes, self.disrupted

    def forget(self, attempt: tuple[int, int]) -> None:
        for table in self._tables():
            table.pop(attempt, None)

    def prune(self, keep: set[tuple[int, int]]) -> None:
        """Drop every attempt but these (the ones the portal holds open), whoever ended the others."""
        for table in self._tables():
            for attempt in [attempt for attempt in table if attempt not in keep]:
                del table[attempt]

    def attempts(self) -> set[tuple[int, int]]:
        """Every attempt something is remembered of."""
        return set().union(*self._tables())


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


def job_verdict(job: dict | None) -> tuple[str, dict] | None:
    """('Complete' or 'Failed', the condition that says so) once the Job controller has decided, else None.

    Only a condition whose status is "True" counts (a controller may leave a condition "False");
    FailureTarget counts as Failed.
    """
    for condition in ((job or {}).get("status") or {}).get("conditions") or []:
        if condition.get("status") != "True":
            continue
        if condition.get("type") == "Complete":
            return "Complete", condition
        if condition.get("type") in ("Failed", "FailureTarget"):
            return "Failed", condition
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
    disrupted: dict[int, str] | None = None,
) -> AttemptStatus:
    """How one attempt stands, from its pods now, what its pods said before, its Job, and lost nodes.

    `job` matters when some replica has neither a live pod nor a known exit code (this
    process never saw it end, or it never got a pod): then the Job's own verdict decides. For an
    inference replica `job` is its Deployment, which has no verdict: it only says the attempt
    still exists while its pod does not (yet).
    """
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if node in lost_nodes and pod_exit_code(pod) is None:
            return AttemptStatus("lost", exit_codes=dict(exits), reason=lost_nodes[node], node_lost=True)
    for rank, node in sorted((vanished_nodes or {}).items()):
        if rank in vanished and node in lost_nodes:
            return AttemptStatus("lost", exit_codes=dict(exits), reason=lost_nodes[node], node_lost=True)
    signalled = (0, progress.EXIT_CHECKPOINTED_ON_SIGNAL)
    if disrupted and all(code in signalled for code in exits.values()) and not (
        replicas and all(exits.get(rank) == 0 for rank in range(replicas))
    ):
        # Evicted (its trainer checkpointed on SIGTERM, or was gone before it could say) or refused by
        # the kubelet: the cluster stopped it, not a failure of the job's own. The gang cannot go on.
        return AttemptStatus("preempted", exit_codes=dict(exits), reason=disrupted[min(disrupted)])
    if replicas and all(rank in exits for rank in range(replicas)):
        return AttemptStatus("exited", exit_codes=dict(exits))
    if vanished:
        return AttemptStatus("lost", exit_codes=dict(exits), reason=vanished[min(vanished)])
    live = [pod for pod in pods if pod_exit_code(pod) is None]
    verdict, condition = job_verdict(job) or (None, {})
    if verdict == "Complete":
        # Every index succeeded, whether or not this process saw each pod end.
        return AttemptStatus("exited", exit_codes={rank: exits.get(rank, 0) for rank in range(replicas or len(exits))})
    if verdict == "Failed" and not live:
        if any(code != 0 for code in exits.values()):
            return AttemptStatus("exited", exit_codes=dict(exits))
        # The condition that decided (status "True"), not merely the first one of its type.
        return AttemptStatus("lost", exit_codes=dict(exits), reason=f"The Job failed: {condition.get('reason')}: "
                                                                     f"{condition.get('message', '')}".strip())
    if not pods and not exits and job is None:
        return AttemptStatus("lost", reason="Its Job (or Deployment) and pods are gone from the cluster.")
    return AttemptStatus("running", exit_codes=dict(exits))


# The reason the Job and ReplicaSet controllers record when the API server refuses a pod they create.
FAILED_CREATE = "FailedCreate"
# What the event recorder puts before the message of similar events it combined into one.
_COMBINED = "(combined from similar events): "
# How a FailedCreate message starts: the controller's words and the pod the server refused, whose
# name is new on each try (so left out: the reason stays the same while the refusal does).
_REFUSED_POD = re.compile(r'^(?:Error creating: )?(?:pods "[^"]*" is forbidden: )?')


def pods_refused(events: list[dict], *, uid: str = "", name_prefix: str = "") -> str:
    """Why the cluster refuses to create an attempt's pods: the newest Warning FailedCreate Event about
    its Job (the Job's `uid`) or its ReplicaSets (names starting with `name_prefix`); "" when none says so.

    The controllers keep trying, so the newest refusal is the one that holds now: an admission
    message such as `Error creating: pods "job-7-1-1-x2k9p" is forbidden: exceeded quota: ...`, given
    from its reason on (`exceeded quota: ...`).
    """
    refusals = []
    for event in events:
        involved = event.get("involvedObject") or {}
        if event.get("type") != "Warning" or event.get("reason") != FAILED_CREATE:
            continue
        if (uid and involved.get("uid") == uid) or (name_prefix and (involved.get("name") or "").startswith(name_prefix)):
            refusals.append(event)
    if not refusals:
        return ""
    newest = max(refusals, key=lambda event: (event.get("lastTimestamp") or event.get("eventTime") or "",
                                              event.get("count") or 0))
    message = _REFUSED_POD.sub("", (newest.get("message") or "").removeprefix(_COMBINED).strip(), count=1)
    return f"Waiting for its pods: the cluster refuses to create them ({message})."


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


# --- Progress: rank 0's tagged log lines, read incrementally --------------------------------
#
# What the pod log API does (the kubelet's ReadLogs, behind the API server):
# - `timestamps=true` prefixes each line with its time as RFC3339 with nine fractional digits
#   and a space (`2026-12-03T10:00:05.123456789Z step 10 ...`);
# - `sinceTime` keeps the lines whose time is not before it: inclusive, and with one-second
#   resolution, since the API server hands it on to the kubelet formatted as RFC3339 without
#   fractions;
# - `limitBytes` stops the answer after that many bytes, timestamps included, cutting the last
#   line wherever the limit falls;
# - only the current log file is served: lines rotated away are gone.

_TIMESTAMP = re.compile(rb"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2}) ")
# What every tagged line holds (the tags' common start), to pass over the others cheaply.
_TAG_MARK = os.path.commonprefix([progress.METRIC_TAG, progress.CHECKPOINT_TAG]).encode() or b" "

Stamp = tuple[int, int]  # (Unix seconds, nanoseconds)


def log_stamp(line: bytes) -> Stamp | None:
    """When a line of a `timestamps=true` log was written, or None if it carries no timestamp."""
    match = _TIMESTAMP.match(line)
    if match is None:
        return None
    base, fraction, zone = (group.decode() if group else "" for group in match.groups())
    try:
        seconds = datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone)).timestamp()
    except ValueError:
        return None
    return int(seconds), int(fraction.ljust(9, "0")) if fraction else 0


def since_time(seconds: int) -> str:
    """A `sinceTime` query value: RFC3339 in UTC, to the second, as the API server passes it on."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _line_digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()[:16]


@dataclass(frozen=True)
class LogCursor:
    """How far the portal has read one pod's log, kept by the portal as a plain dict between reads.

    The next read asks for `sinceTime=since` (or the whole log, when since is None). Since
    sinceTime is inclusive and to the second, that read starts again with lines already read
    in that second: the first `skip` lines of the answer are those, and `digest` (of the last of
    them, timestamp included) checks that they still are. If they are not (the kubelet rotated
    the log file meanwhile, and serves only the new one), every line after `last`, the exact
    time of the last line read, counts as new.
    """

    job_id: int
    attempt: int
    pod_uid: str
    since: int | None = None
    skip: int = 0
    digest: str = ""
    last: Stamp | None = None

    def as_dict(self) -> dict:
        cursor: dict = {"job_id": self.job_id, "attempt": self.attempt, "pod_uid": self.pod_uid, "skip": self.skip}
        if self.since is not None:
            cursor["since"] = since_time(self.since)
        if self.digest:
            cursor["digest"] = self.digest
        if self.last is not None:
            cursor["last"] = list(self.last)
        return cursor

    @classmethod
    def resume(cls, cursor: dict, *, job_id: int, attempt: int, pod_uid: str) -> "LogCursor":
        """Where to go on in this pod's log: the cursor's place if it is this attempt's and this pod's, else the start."""
        fresh = cls(job_id, attempt, pod_uid)
        if not isinstance(cursor, dict) or (cursor.get("job_id"), cursor.get("attempt"), cursor.get("pod_uid")) != (
            job_id, attempt, pod_uid
        ):
            return fresh
        try:
            since = cursor.get("since")
            last = cursor.get("last")
            return cls(
                job_id, attempt, pod_uid,
                since=int(datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp()) if since else None,
                skip=max(0, int(cursor.get("skip", 0))),
                digest=str(cursor.get("digest", "")),
                last=(int(last[0]), int(last[1])) if last else None,
            )
        except (TypeError, ValueError, IndexError, AttributeError):
            return fresh  # not a cursor this backend wrote


@dataclass(frozen=True)
class ProgressChunk:
    """The records one answer of the log API held, and the cursor for the next read."""

    metrics: list[dict]
    checkpoints: list[dict]
    cursor: LogCursor
    # The second whose remaining lines were given up on: more of them than one read may
    # return (or one line longer than that) would otherwise stop the log from being read on.
    skipped_second: int | None = None
    # The SDK's stop records (`PORTAL_STOPPED {...}`): the script checkpointed on a stop and exits 0.
    stops: list[dict] = field(default_factory=list)
    # The SDK's dataset read records (`PORTAL_DATASET {...}`).
    datasets: list[dict] = field(default_factory=list)


def read_progress(data: bytes, cursor: LogCursor, *, limit: int) -> ProgressChunk:
    """The records in `data` (an answer to `timestamps=true`, `sinceTime` from the cursor, `limitBytes=limit`) not read before.

    Only whole lines count: a line the limit cut, or one still being written, comes whole next time.
    """
    lines = data.split(b"\n")
    complete, cut = lines[:-1], lines[-1]
    new = _unread(complete, cursor)
    records = progress.parse_log_records("\n".join(_payload(line) for line in new if _TAG_MARK in line))
    metrics, checkpoints, stops, datasets = records.metrics, records.checkpoints, records.stops, records.datasets
    if len(data) >= limit and not new:
        # The whole answer was lines read before (or one longer line): reading from here again
        # would bring the same. Go on from the second after the line that could not be read.
        blocked = log_stamp(cut) or (log_stamp(complete[-1]) if complete else None)
        if blocked is not None:
            moved = LogCursor(cursor.job_id, cursor.attempt, cursor.pod_uid, since=blocked[0] + 1)
            return ProgressChunk(metrics, checkpoints, moved, skipped_second=blocked[0], stops=stops,
                                 datasets=datasets)
    if not complete:
        return ProgressChunk(metrics, checkpoints, cursor, stops=stops, datasets=datasets)
    last_stamp = log_stamp(complete[-1])
    if last_stamp is None:
        # No timestamps (not what the API sends with timestamps=true): count lines from where this read began.
        since, skip, last_stamp = cursor.since, len(complete), cursor.last
    else:
        # A read from `since` brings back every line of this answer from that second on: count them.
        # (Going back until a line more than a second older: stdout and stderr may interleave
        # slightly out of order, never by that much.)
        since, skip = last_stamp[0], 0
        for line in reversed(complete):
            stamp = log_stamp(line)
            if stamp is None or stamp[0] >= since:
                skip += 1
            elif stamp[0] < since - 1:
                break
    moved = LogCursor(cursor.job_id, cursor.attempt, cursor.pod_uid, since=since, skip=skip,
                      digest=_line_digest(complete[-1]), last=last_stamp)
    return ProgressChunk(metrics, checkpoints, moved, stops=stops, datasets=datasets)


def _unread(lines: list[bytes], cursor: LogCursor) -> list[bytes]:
    """The lines of an answer read from cursor.since that the cursor has not been past."""
    if cursor.skip == 0:
        return lines
    if len(lines) >= cursor.skip and _line_digest(lines[cursor.skip - 1]) == cursor.digest:
        return lines[cursor.skip:]
    # The lines read before are not where they were: the log was rotated. What is left of
    # them is what was written up to `last`; the rest is new.
    if cursor.last is None:
        return lines
    unread = []
    for line in lines:
        stamp = log_stamp(line)
        if stamp is not None and (stamp < cursor.last or (stamp == cursor.last and _line_digest(line) == cursor.digest)):
            continue
        unread.append(line)
    return unread


def _payload(line: bytes) -> str:
    match = _TIMESTAMP.match(line)
    return (line[match.end():] if match else line).decode(errors="replace")

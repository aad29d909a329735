"""The node cache agent on Kubernetes: a CSI node plugin that publishes a pod's datasets from the node's cache.

One agent runs on every node of a pool (the DaemonSet of `runners.backends.cache_manifests`), privileged, as
root, beside the upstream node-driver-registrar, which registers the driver ``cache.portal.gpu`` with the
kubelet. It serves, over the unix socket the DaemonSet mounts (``--csi-socket``), the CSI v1 Identity service
(GetPluginInfo, GetPluginCapabilities, Probe) and the Node calls a kubelet makes for an ephemeral volume
(NodeGetCapabilities, NodeGetInfo, NodePublishVolume, NodeUnpublishVolume); the messages are
`runners/workloads/csi/csi.proto`, the spec's subset.

NodePublishVolume, for a tenant's pod that mounts its datasets volume:

1. the volume's attributes must be a grant the portal signed for the pod's namespace
   (`runners.storage.cache_grants`: an HMAC keyed by the agents' token, the namespace the kubelet's, from
   podInfoOnMount); anything else is PERMISSION_DENIED, nothing filled or mounted;
2. every blob the grant names is filled into the node's cache (`runners.storage.nodecache`) from the blob store
   (``PORTAL_DATA_STORAGE``: {"url", "options"}, the agent's Secret), checked against its key, pinned for the
   volume (holder ``vol-<hash of the volume id>``) and linked into the volume's view folder, with the datasets'
   manifest ``datasets.json`` (paths as the pod sees them, under the grant's mount path). A blob whose bytes do
   not hash to its key is refused (DATA_LOSS), a missing one is FAILED_PRECONDITION, a full cache
   RESOURCE_EXHAUSTED: the kubelet retries, the pod waits in ContainerCreating with the message as its event,
   and the pins taken so far are dropped;
3. the view is bind-mounted at the target path and the bind remounted read-only: the pod sees its attempt's
   blobs and the manifest, nothing else of the cache, and cannot write.

NodeUnpublishVolume unmounts the target and releases the volume's pins. Both are idempotent (the kubelet
repeats them); each publish is recorded under ``<cache>/agent/`` so that, after a restart, the pins of a
volume unpublished while the agent was down (its target no longer mounted) are released.

The agent reports its cache to the portal: every ``--report-interval-s`` and soon after each publish or
unpublish, it POSTs the cache's snapshot (`nodecache.snapshot_json`) with its node's name to
``PORTAL_URL/api/v1/node-caches/report/``, authenticated by its token (``PORTAL_AGENT_TOKEN``); the portal
brings the node's CachedBlob and NodeCacheState rows to it. A report that fails is logged and the next one
carries the whole snapshot again.

Pure: no Django, no portal app; grpcio, protobuf, the stdlib and `runners.storage`.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import hashlib
import json
import logging
import os
import re
import signal
import threading
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf import wrappers_pb2

from runners.storage import cache_grants
from runners.storage.blobs import BlobMissing, BlobStore, HashMismatch
from runners.storage.cache_grants import CSI_DRIVER, DATASETS_MANIFEST
from runners.storage.nodecache import BlobWanted, CacheFull, FillFailed, NodeCache, snapshot_json
from runners.workloads.csi import csi_pb2, csi_pb2_grpc

logger = logging.getLogger("runners.workloads.cache_agent")

VERSION = "1"
TOKEN_VARIABLE = "PORTAL_AGENT_TOKEN"
STORAGE_VARIABLE = "PORTAL_DATA_STORAGE"  # the same shape the local backend hands its supervisor
PORTAL_URL_VARIABLE = "PORTAL_URL"
REPORT_PATH = "/api/v1/node-caches/report/"
RECORDS_DIR = "agent"
REPORT_TIMEOUT_S = 30.0

# mount(2) and umount2(2) flags (linux/mount.h).
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mount(source: str | None, target: str, flags: int) -> None:
    if _libc.mount(source.encode() if source else None, target.encode(), None, flags, None) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"mount {source} on {target}: {os.strerror(number)}")


def bind_read_only(source: Path, target: Path) -> None:
    """Bind `source` at `target` and make that bind read-only (a bind takes its read-only flag on a remount)."""
    _mount(str(source), str(target), MS_BIND)
    try:
        _mount(None, str(target), MS_REMOUNT | MS_BIND | MS_RDONLY)
    except OSError:
        unmount(target)
        raise


def unmount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), 0) != 0:
        number = ctypes.get_errno()
        if number == errno.EBUSY:  # still open in a process of the pod being torn down: detach it
            if _libc.umount2(str(target).encode(), MNT_DETACH) == 0:
                return
            number = ctypes.get_errno()
        if number not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point (any more)
            raise OSError(number, f"umount {target}: {os.strerror(number)}")


def is_mounted(path: Path) -> bool:
    """Whether something is mounted at `path` (/proc/self/mountinfo; os.path.ismount misses a bind mount of a
    folder of the same filesystem, which is what a view is)."""
    wanted = os.path.realpath(path)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return os.path.ismount(path)
    for line in lines:
        fields = line.split(" ")
        # The mount point is the fifth field, with space, tab, newline and backslash written in octal.
        point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
        if point == wanted:
            return True
    return False


def holder_of(volume_id: str) -> str:
    """The cache's holder name for a volume: the kubelet's volume id, hashed to a folder-safe name."""
    return "vol-" + hashlib.sha256(volume_id.encode()).hexdigest()[:48]


class Refused(Exception):
    """A call the agent answers with a gRPC error: its code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Agent:
    """The node's cache and what publishing a volume from it means; the gRPC servicers call this."""

    def __init__(self, *, cache: NodeCache, node: str, grant_key: bytes, storage: dict,
                 reported: threading.Event | None = None) -> None:
        self.cache = cache
        self.node = node
        self.grant_key = grant_key
        self.storage = storage
        self.stores: dict[str, BlobStore] = {}
        self.records = cache.root / RECORDS_DIR
        self.records.mkdir(parents=True, exist_ok=True)
        os.chmod(self.records, 0o700)
        self.report_soon = reported or threading.Event()
        # One publish or unpublish of a volume at a time (the kubelet may repeat a call while one runs).
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def _lock(self, holder: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(holder, threading.Lock())

    def _store(self, kind: str) -> BlobStore:
        if kind not in self.stores:
            self.stores[kind] = BlobStore(self.storage["url"], kind, self.storage.get("options") or {})
        return self.stores[kind]

    # --- publish ------------------------------------------------------------------------------------

    def publish(self, *, volume_id: str, target_path: str, context: dict[str, str]) -> None:
        if not volume_id or not target_path:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "volume_id and target_path are required")
        try:
            grant = cache_grants.verify(self.grant_key, context)
        except cache_grants.GrantRefused as exc:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"refused: {exc}") from None
        holder = holder_of(volume_id)
        target = Path(target_path)
        with self._lock(holder):
            if is_mounted(target):
                return  # published already: the kubelet repeats a call that timed out on its side
            view = self._fill(grant, holder)
            target.mkdir(parents=True, exist_ok=True)
            self._record(holder, volume_id=volume_id, target=target, grant=grant)
            try:
                bind_read_only(view, target)
            except OSError as exc:
                self._forget(holder)
                raise Refused(grpc.StatusCode.INTERNAL, f"could not mount the view at {target}: {exc}") from None
        logger.info("Published job %s attempt %s (%s) at %s: %d blobs", grant.job, grant.attempt, grant.namespace,
                    target, len(grant.blobs()))
        self.report_soon.set()

    def _fill(self, grant: cache_grants.Grant, holder: str) -> Path:
        """Fill and pin every blob of the grant for `holder` and write its manifest; the view folder."""
        try:
            for shard, kind in grant.blobs():
                self.cache.fill_view(self._store(kind), [BlobWanted(shard.sha256, shard.bytes, kind)], holder=holder)
        except BaseException as exc:
            self.cache.release(holder)  # nothing half-pinned stays behind a refused publish
            self.report_soon.set()
            if isinstance(exc, (HashMismatch, ValueError)):
                raise Refused(grpc.StatusCode.DATA_LOSS,
                              f"a blob in the store is not what its key names; refused: {exc}") from None
            if isinstance(exc, BlobMissing):
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"blob {exc} is not in the store; the data it belongs to is gone") from None
            if isinstance(exc, CacheFull):
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"node {self.node}'s cache cannot hold the job's data: {exc}") from None
            if isinstance(exc, (FillFailed, OSError)):
                raise Refused(grpc.StatusCode.UNAVAILABLE, f"could not fill node {self.node}'s cache: {exc}") from None
            raise
        view = self.cache.view_dir(holder)
        view.mkdir(parents=True, exist_ok=True)  # a dataset of no shards still has its manifest
        os.chmod(view, 0o755)
        manifest = {
            dataset.name: {"version": dataset.version, "shards": [
                {"sha256": shard.sha256, "bytes": shard.bytes, "path": f"{grant.mount}/{shard.sha256}"}
                for shard in dataset.shards]}
            for dataset in grant.datasets
        }
        temp = view / f".{DATASETS_MANIFEST}.tmp"
        temp.write_text(json.dumps(manifest, indent=1))
        os.chmod(temp, 0o444)
        os.replace(temp, view / DATASETS_MANIFEST)
        return view

    # --- unpublish ----------------------------------------------------------------------------------

    def unpublish(self, *, volume_id: str, target_path: str) -> None:
        if not volume_id or not target_path:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "volume_id and target_path are required")
        holder = holder_of(volume_id)
        target = Path(target_path)
        with self._lock(holder):
            try:
                if is_mounted(target):
                    unmount(target)
                if target.is_dir():
                    target.rmdir()
            except OSError as exc:
                raise Refused(grpc.StatusCode.INTERNAL, f"could not unmount {target}: {exc}") from None
            self._forget(holder)
        logger.info("Unpublished %s", target)
        self.report_soon.set()

    # --- what was published, across restarts --------------------------------------------------------

    def _record(self, holder: str, *, volume_id: str, target: Path, grant: cache_grants.Grant) -> None:
        record = {"volume_id": volume_id, "target": str(target), "namespace": grant.namespace, "job": grant.job,
                  "attempt": grant.attempt}
        temp = self.records / f".{holder}.tmp"
        temp.write_text(json.dumps(record))
        os.replace(temp, self.records / f"{holder}.json")

    def _forget(self, holder: str) -> None:
        self.cache.release(holder)
        (self.records / f"{holder}.json").unlink(missing_ok=True)

    def release_stale(self) -> int:
        """Release the pins of every volume whose target is no longer mounted (unpublished while the agent was
        down, or a publish cut half-way), and of holders no record names; the number of holders released."""
        released = 0
        recorded = set()
        for path in sorted(self.records.glob("vol-*.json")):
            holder = path.stem
            try:
                target = Path(json.loads(path.read_text())["target"])
            except (OSError, ValueError, KeyError):
                target = None
            if target is not None and is_mounted(target):
                recorded.add(holder)
                continue
            self._forget(holder)
            released += 1
        for holder in self.cache.holders():
            if holder.startswith("vol-") and holder not in recorded:
                self.cache.release(holder)
                released += 1
        return released

    # --- the report to the portal --------------------------------------------------------------------

    def report(self, portal_url: str, token: str) -> dict:
        """POST the cache's snapshot to the portal; its answer (rows added and removed)."""
        body = json.dumps({"node": self.node, "snapshot": snapshot_json(self.cache.snapshot())}).encode()
        request = urllib.request.Request(
            portal_url.rstrip("/") + REPORT_PATH, data=body, method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=REPORT_TIMEOUT_S) as response:
            return json.loads(response.read() or b"{}")


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    def GetPluginInfo(self, request, context):
        return csi_pb2.GetPluginInfoResponse(name=CSI_DRIVER, vendor_version=VERSION)

    def GetPluginCapabilities(self, request, context):
        # A node plugin of ephemeral volumes only: no controller service, no topology constraints.
        return csi_pb2.GetPluginCapabilitiesResponse()

    def Probe(self, request, context):
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))


class NodeServicer(csi_pb2_grpc.NodeServicer):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def NodeGetCapabilities(self, request, context):
        # No stage step: each ephemeral volume is published straight at its pod's target.
        return csi_pb2.NodeGetCapabilitiesResponse()

    def NodeGetInfo(self, request, context):
        return csi_pb2.NodeGetInfoResponse(node_id=self.agent.node)

    def NodePublishVolume(self, request, context):
        if request.volume_capability.WhichOneof("access_type") == "block":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the datasets volume is a filesystem, not a block device")
        try:
            self.agent.publish(volume_id=request.volume_id, target_path=request.target_path,
                               context=dict(request.volume_context))
        except Refused as exc:
            logger.warning("NodePublishVolume %s at %s: %s", request.volume_id, request.target_path, exc)
            context.abort(exc.code, str(exc))
        return csi_pb2.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request, context):
        try:
            self.agent.unpublish(volume_id=request.volume_id, target_path=request.target_path)
        except Refused as exc:
            logger.warning("NodeUnpublishVolume %s at %s: %s", request.volume_id, request.target_path, exc)
            context.abort(exc.code, str(exc))
        return csi_pb2.NodeUnpublishVolumeResponse()


def serve(agent: Agent, socket_path: str, *, workers: int = 8) -> grpc.Server:
    """The gRPC server on the unix socket, started."""
    socket = Path(socket_path)
    socket.parent.mkdir(parents=True, exist_ok=True)
    socket.unlink(missing_ok=True)  # a socket left by the agent's previous run
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityServicer(), server)
    csi_pb2_grpc.add_NodeServicer_to_server(NodeServicer(agent), server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    return server


def report_loop(agent: Agent, portal_url: str, token: str, interval_s: float, stopped: threading.Event) -> None:
    """Report every `interval_s`, and soon after a publish or an unpublish, until `stopped`."""
    while not stopped.is_set():
        agent.report_soon.clear()
        try:
            agent.report(portal_url, token)
        except (OSError, ValueError) as exc:  # an HTTPError is an OSError too
            logger.warning("Could not report node %s's cache to %s: %s", agent.node, portal_url, exc)
        agent.report_soon.wait(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.workloads.cache_agent", description=__doc__.split("\n")[0])
    parser.add_argument("--csi-socket", required=True, help="the unix socket the kubelet calls (the plugin folder's)")
    parser.add_argument("--cache", required=True, help="the node's cache folder")
    parser.add_argument("--capacity-bytes", required=True, type=int, help="the most the cache holds")
    parser.add_argument("--node", required=True, help="this node's name (NodeGetInfo's node_id, and the report's)")
    parser.add_argument("--report-interval-s", type=float, default=60.0, help="how often the cache is reported")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    token = os.environ.get(TOKEN_VARIABLE, "")
    if not token:
        parser.error(f"{TOKEN_VARIABLE} is not set: the agent checks every volume's grant with it")
    try:
        storage = json.loads(os.environ.get(STORAGE_VARIABLE) or "{}")
    except ValueError as exc:
        parser.error(f"{STORAGE_VARIABLE} is not JSON: {exc}")
    if not isinstance(storage, dict) or not storage.get("url"):
        parser.error(f"{STORAGE_VARIABLE} names no blob store ({{\"url\": ..., \"options\": {{...}}}})")
    agent = Agent(cache=NodeCache(args.cache, args.capacity_bytes), node=args.node,
                  grant_key=cache_grants.grant_key(token), storage=storage)
    released = agent.release_stale()
    if released:
        logger.info("Released the pins of %d volumes no longer mounted", released)
    server = serve(agent, args.csi_socket)
    stopped = threading.Event()
    portal_url = os.environ.get(PORTAL_URL_VARIABLE, "")
    if portal_url:
        threading.Thread(target=report_loop, args=(agent, portal_url, token, args.report_interval_s, stopped),
                         name="report", daemon=True).start()
    else:
        logger.warning("%s is not set: the portal will not learn what this node's cache holds", PORTAL_URL_VARIABLE)

    def stop(signum, frame):
        stopped.set()
        agent.report_soon.set()
        server.stop(grace=10)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    logger.info("Cache agent of node %s serving %s on %s (cache %s, %d bytes)", args.node, CSI_DRIVER,
                args.csi_socket, args.cache, args.capacity_bytes)
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

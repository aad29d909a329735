"""The Kubernetes node cache agent as the kubelet meets it: a real process serving CSI over a unix socket, called
with a gRPC client exactly as the kubelet calls it (NodeGetInfo, NodePublishVolume with the volume context the
portal's manifest builder writes plus the kubelet's pod information, NodeUnpublishVolume), against a folder
store. What a pod then reads at the target path is a read-only bind mount of its attempt's blobs and the
datasets' manifest; a forged grant, a grant copied into another namespace and a blob whose bytes are not its
key are refused; the agent's report fills the portal's rows of the node's cache."""

import dataclasses
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from runners.backends import cache_manifests
from runners.backends.base import DatasetMount, ShardRef
from runners.backends.job_manifests import training_job_manifest
from runners.clusters.models import Node
from runners.nodecache.models import CachedBlob, NodeCacheState
from runners.storage import cache_grants
from runners.storage.blobs import BlobStore
from runners.storage.nodecache import NodeCache
from runners.workloads.cache_agent import is_mounted
from runners.workloads.csi import csi_pb2, csi_pb2_grpc
from tests.backends.test_job_manifests import OPTIONS, make_launch

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "agent-token-for-the-test"
NAMESPACE = "acme--train"
CAPACITY = 10_000_000


def _can_bind_mount(tmp_path) -> str | None:
    """None when this process may bind-mount (root with CAP_SYS_ADMIN), else why not."""
    if os.geteuid() != 0:
        return "the agent bind-mounts the view, which takes root"
    source, target = tmp_path / "probe-a", tmp_path / "probe-b"
    source.mkdir()
    target.mkdir()
    done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        return f"bind mounts are not allowed here: {done.stderr.strip()}"
    subprocess.run(["umount", str(target)], check=True)
    return None


@pytest.fixture
def agent(tmp_path, live_server, settings, inventory):
    why_not = _can_bind_mount(tmp_path)
    if why_not:
        pytest.skip(why_not)
    settings.CACHE_AGENT_TOKEN = TOKEN
    node = Node.objects.order_by("name").first()
    storage = {"url": f"file://{tmp_path / 'store'}", "options": {}}
    socket = tmp_path / "plugin" / "csi.sock"
    env = {**os.environ, "PORTAL_AGENT_TOKEN": TOKEN, "PORTAL_DATA_STORAGE": json.dumps(storage),
           "PORTAL_URL": live_server.url, "PYTHONPATH": str(ROOT)}
    log = open(tmp_path / "agent.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "runners.workloads.cache_agent", "--csi-socket", str(socket),
         "--cache", str(tmp_path / "cache"), "--capacity-bytes", str(CAPACITY), "--node", node.name,
         "--report-interval-s", "30"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"unix://{socket}")
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield dataclasses.make_dataclass("Agent", ["node", "store", "cache", "identity", "csi", "tmp", "log"])(
            node, BlobStore(storage["url"], "shards"), tmp_path / "cache", csi_pb2_grpc.IdentityStub(channel),
            csi_pb2_grpc.NodeStub(channel), tmp_path, tmp_path / "agent.log")
    finally:
        channel.close()
        process.terminate()
        process.wait(timeout=30)
        log.close()
        # A test that failed half-way leaves no mount behind in the temporary folder.
        for line in Path("/proc/self/mounts").read_text().splitlines():
            if str(tmp_path) in line.split()[1]:
                subprocess.run(["umount", "-l", line.split()[1]], check=False)


def _volume_context(shards: list[ShardRef], *, namespace: str = NAMESPACE, pod: str = "llm-0-abcde") -> dict:
    """The attributes the portal's manifest builder signs into a training pod's datasets volume, and what the
    kubelet adds (podInfoOnMount)."""
    launch = dataclasses.replace(make_launch(namespace=NAMESPACE), datasets=(DatasetMount("corpus", 3, tuple(shards)),))
    manifest = training_job_manifest(launch, **OPTIONS, cache_grant_key=cache_grants.grant_key(TOKEN))
    (volume,) = [volume for volume in manifest["spec"]["template"]["spec"]["volumes"]
                 if volume["name"] == cache_manifests.DATASETS_VOLUME]
    return {**volume["csi"]["volumeAttributes"], cache_grants.POD_NAMESPACE: namespace, cache_grants.POD_NAME: pod,
            cache_grants.POD_UID: "0f6c1a52-8d1e-4f0e-9a3c-2f4a5b6c7d8e", cache_grants.EPHEMERAL: "true"}


def _publish(agent, volume_id: str, context: dict) -> Path:
    target = agent.tmp / "pods" / volume_id / "volumes" / "kubernetes.io~csi" / "datasets" / "mount"
    target.parent.mkdir(parents=True, exist_ok=True)  # the kubelet makes the parent, the plugin the target
    agent.csi.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
        volume_id=volume_id, target_path=str(target), readonly=True, volume_context=context,
        volume_capability=csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(),
            access_mode=csi_pb2.VolumeCapability.AccessMode(
                mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_READER_ONLY))), timeout=60)
    return target


def _refused(agent, volume_id: str, context: dict) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _publish(agent, volume_id, context)
    target = agent.tmp / "pods" / volume_id / "volumes" / "kubernetes.io~csi" / "datasets" / "mount"
    assert not is_mounted(target)
    return refused.value


def _pins(agent) -> set[str]:
    return NodeCache(agent.cache, CAPACITY).holders()


def _poll(condition, *, what: str, deadline_s: float = 30.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {deadline_s} s: {what}")


def test_the_agent_publishes_a_pods_granted_shards_read_only_refuses_forgeries_and_reports_its_cache(agent):
    info = agent.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert info.name == cache_manifests.CSI_DRIVER
    assert agent.identity.Probe(csi_pb2.ProbeRequest()).ready.value is True
    assert agent.csi.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).node_id == agent.node.name
    assert list(agent.csi.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest()).capabilities) == []

    contents = [os.urandom(3000), os.urandom(5000)]
    shards = [ShardRef(*agent.store.put_bytes(data)) for data in contents]
    foreign = ShardRef(*agent.store.put_bytes(b"another tenant's shard" * 100))

    # Published: the target is a read-only mount of the two shards and the manifest, nothing else.
    context = _volume_context(shards)
    target = _publish(agent, "csi-0a1b2c", context)
    assert is_mounted(target)
    assert sorted(os.listdir(target)) == sorted([shard.sha256 for shard in shards] + ["datasets.json"])
    manifest = json.loads((target / "datasets.json").read_text())
    assert manifest == {"corpus": {"version": 3, "shards": [
        {"sha256": shard.sha256, "bytes": shard.bytes, "path": f"{cache_manifests.DATASETS_MOUNT}/{shard.sha256}"}
        for shard in shards]}}
    for shard, data in zip(shards, contents):
        assert (target / shard.sha256).read_bytes() == data
    with pytest.raises(OSError) as written:
        (target / "extra").write_bytes(b"x")
    assert written.value.errno == errno.EROFS
    # The kubelet repeats a publish that timed out on its side: the same answer, nothing mounted twice.
    _publish(agent, "csi-0a1b2c", context)
    assert sum(1 for line in Path("/proc/self/mounts").read_text().splitlines() if str(target) in line) == 1

    # A tenant's own pod spec naming another tenant's shard by its hash: the grant no longer matches.
    forged = dict(context)
    datasets = json.loads(forged["datasets"])
    datasets[0]["shards"].append([foreign.sha256, foreign.bytes])
    forged["datasets"] = json.dumps(datasets, separators=(",", ":"))
    assert _refused(agent, "csi-forged", forged).code() == grpc.StatusCode.PERMISSION_DENIED
    # The portal's grant copied into a pod of another namespace, and a volume with no grant at all.
    elsewhere = _refused(agent, "csi-elsewhere", {**context, cache_grants.POD_NAMESPACE: "other--team"})
    assert elsewhere.code() == grpc.StatusCode.PERMISSION_DENIED
    bare = {key: value for key, value in context.items() if key != cache_grants.GRANT}
    assert _refused(agent, "csi-bare", bare).code() == grpc.StatusCode.PERMISSION_DENIED
    assert not NodeCache(agent.cache, CAPACITY).blob_path(foreign.sha256).exists()

    # A blob in the store whose bytes are not its key: refused, nothing of it cached or pinned.
    corrupt = ShardRef(*agent.store.put_bytes(b"the bytes the portal hashed" * 50))
    Path(agent.store.path(corrupt.sha256)).chmod(0o644)
    Path(agent.store.path(corrupt.sha256)).write_bytes(b"bytes changed in the store" * 50 + b"!!")
    mismatch = _refused(agent, "csi-corrupt", _volume_context([shards[0], corrupt]))
    assert mismatch.code() == grpc.StatusCode.DATA_LOSS and corrupt.sha256 in mismatch.details()
    assert not NodeCache(agent.cache, CAPACITY).blob_path(corrupt.sha256).exists()
    assert len(_pins(agent)) == 1  # the published volume's only

    # The report: the portal's rows of the node's cache are what the agent holds.
    def reported() -> bool:
        held = set(CachedBlob.objects.filter(node=agent.node).values_list("sha256", flat=True))
        return held == {shard.sha256 for shard in shards}
    _poll(reported, what="the agent's report of its two shards")
    state = NodeCacheState.objects.get(node=agent.node)
    assert (state.capacity_bytes, state.bytes_held, state.pinned_bytes) == (CAPACITY, 8000, 8000)

    # Unpublished: the mount and the target are gone and the pins released; the blobs stay cached.
    agent.csi.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="csi-0a1b2c", target_path=str(target)),
                                  timeout=30)
    assert not target.exists() and _pins(agent) == set()
    agent.csi.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="csi-0a1b2c", target_path=str(target)),
                                  timeout=30)  # again, as the kubelet may: still fine
    _poll(lambda: NodeCacheState.objects.get(node=agent.node).pinned_bytes == 0,
          what="the report after the unpublish")
    assert CachedBlob.objects.filter(node=agent.node).count() == 2

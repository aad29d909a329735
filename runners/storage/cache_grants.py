"""What a pod may read from its node's cache on Kubernetes: a grant the portal signs into the pod's CSI volume.

A tenant's pod reads its datasets from a CSI ephemeral volume (`runners.backends.cache_manifests`), which the
node's cache agent publishes (`runners.workloads.cache_agent`). The volume's attributes are part of the pod
spec, and a tenant may write pod specs of its own in its namespace, so the attributes alone prove nothing.
The portal therefore signs them: the blobs the attempt may read (each dataset version's shards, a serving
replica's weights), the job and attempt, where the pod mounts the volume, and the namespace the pod must run
in, under an HMAC-SHA256 keyed by `grant_key` of the cache agents' token (the Secret ``portal-cache-agent``,
``CACHE_AGENT_TOKEN`` on the portal). The agent computes the same HMAC over the attributes it is handed and
compares, and takes the namespace from the kubelet (``csi.storage.k8s.io/pod.namespace``, podInfoOnMount),
never from the attributes:

- a shard added to, or swapped in, the list (another tenant's, by its hash) breaks the HMAC: refused;
- a grant copied into a pod of another namespace (another tenant's) does not match that namespace: refused;
- a tenant has no key to sign with: only the portal and the agents hold the token.

A pod of the same namespace may reuse a grant the portal made for that namespace: it reads what the portal
already let that tenant's attempt read. The signed strings are the attribute values themselves, so nothing
is re-encoded between signing and checking.

Pure: stdlib and ``runners.storage.blobs``; no Django.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

from runners.storage.blobs import SHA256

# The CSI driver's name, shared by the manifests that name it and the agent that answers for it, and the file
# in a published view (and in a local attempt's view) that tells the script where each dataset's shards are.
CSI_DRIVER = "cache.portal.gpu"
DATASETS_MANIFEST = "datasets.json"

VERSION = "v1"
JOB = "job"
ATTEMPT = "attempt"
MOUNT = "mount"
DATASETS = "datasets"
WEIGHTS = "weights"
GRANT = "grant"
# What the kubelet adds to the volume's context when the CSIDriver sets podInfoOnMount.
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_UID = "csi.storage.k8s.io/pod.uid"
EPHEMERAL = "csi.storage.k8s.io/ephemeral"


class GrantRefused(Exception):
    """The volume's attributes are not a grant the portal signed for the pod's namespace."""


@dataclass(frozen=True)
class Shard:
    sha256: str
    bytes: int


@dataclass(frozen=True)
class DatasetGrant:
    name: str
    version: int
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class Grant:
    """What one attempt's pods may read, checked: their namespace, the job and attempt, the mount path the
    manifest's paths start with, the datasets and a serving replica's weights."""

    namespace: str
    job: int
    attempt: int
    mount: str
    datasets: tuple[DatasetGrant, ...]
    weights: Shard | None = None

    def blobs(self) -> list[tuple[Shard, str]]:
        """Every blob the grant names once, with its store kind ("shards" or "models")."""
        seen, found = set(), []
        for dataset in self.datasets:
            for shard in dataset.shards:
                if shard.sha256 not in seen:
                    seen.add(shard.sha256)
                    found.append((shard, "shards"))
        if self.weights is not None and self.weights.sha256 not in seen:
            found.append((self.weights, "models"))
        return found


def grant_key(agent_token: str) -> bytes:
    """The HMAC key of the grants, derived from the cache agents' token (one secret for both uses)."""
    if not agent_token:
        raise ValueError("the cache agents' token is empty: no grant can be signed or checked without it")
    return hmac.new(agent_token.encode(), b"gpu-portal cache volume grant " + VERSION.encode(), hashlib.sha256).digest()


def _mac(key: bytes, namespace: str, attributes: dict[str, str]) -> str:
    parts = [VERSION, namespace, *(attributes.get(name, "") for name in (JOB, ATTEMPT, MOUNT, DATASETS, WEIGHTS))]
    return hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, *, namespace: str, job: int, attempt: int, mount: str,
         datasets: list[tuple[str, int, list[tuple[str, int]]]], weights: tuple[str, int] | None = None) -> dict:
    """The volume attributes of a grant: `datasets` as (name, version, [(sha256, bytes)]), `weights` as
    (sha256, bytes) or None; every value a string, as a CSI volume's attributes are."""
    attributes = {
        JOB: str(int(job)),
        ATTEMPT: str(int(attempt)),
        MOUNT: mount,
        DATASETS: json.dumps([{"name": name, "version": int(version), "shards": [[sha, int(size)] for sha, size in shards]}
                              for name, version, shards in datasets], separators=(",", ":")),
        WEIGHTS: json.dumps([weights[0], int(weights[1])], separators=(",", ":")) if weights else "",
    }
    attributes[GRANT] = _mac(key, namespace, attributes)
    return attributes


def _shard(value) -> Shard:
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str) or not SHA256.match(value[0])
            or not isinstance(value[1], int) or isinstance(value[1], bool) or value[1] < 0):
        raise GrantRefused(f"not a blob (sha256, bytes): {value!r}")
    return Shard(value[0], value[1])


def verify(key: bytes, context: dict[str, str]) -> Grant:
    """The grant in a volume's context (its attributes and the kubelet's pod information), checked against the
    pod's namespace; GrantRefused when it is missing, forged, altered or signed for another namespace."""
    namespace = context.get(POD_NAMESPACE, "")
    if not namespace:
        raise GrantRefused(f"the kubelet named no pod namespace ({POD_NAMESPACE}); the CSIDriver needs podInfoOnMount")
    signed = context.get(GRANT, "")
    if not signed:
        raise GrantRefused("the volume carries no grant: only the portal's pods may mount it")
    if not hmac.compare_digest(signed, _mac(key, namespace, context)):
        raise GrantRefused(f"the grant does not match its attributes in namespace {namespace!r}: "
                           "they were not signed by the portal for a pod of this namespace")
    try:
        job, attempt = int(context.get(JOB, "")), int(context.get(ATTEMPT, ""))
        datasets_raw = json.loads(context.get(DATASETS) or "[]")
        weights_raw = json.loads(context[WEIGHTS]) if context.get(WEIGHTS) else None
    except ValueError as exc:
        raise GrantRefused(f"the grant's attributes do not parse: {exc}") from None
    mount = context.get(MOUNT, "")
    if not mount.startswith("/"):
        raise GrantRefused(f"the grant's mount path is not absolute: {mount!r}")
    if not isinstance(datasets_raw, list):
        raise GrantRefused("the grant's datasets are not a list")
    datasets = []
    for item in datasets_raw:
        if (not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("version"), int)
                or not isinstance(item.get("shards"), list)):
            raise GrantRefused(f"not a dataset (name, version, shards): {item!r}")
        datasets.append(DatasetGrant(item["name"], item["version"], tuple(_shard(shard) for shard in item["shards"])))
    weights = _shard(weights_raw) if weights_raw is not None else None
    return Grant(namespace=namespace, job=job, attempt=attempt, mount=mount, datasets=tuple(datasets), weights=weights)

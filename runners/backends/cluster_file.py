"""Read the local backend's cluster file (YAML) or an openb trace node list (CSV).

Errors name the place in the file (``racks[1].blocks[0].nodes[2].gpus.model``)
and what to write there instead.
"""

from __future__ import annotations

import csv
from pathlib import Path

import yaml

from runners.backends.base import GpuInfo, NodeInfo, resources_of
from runners.nvidia import mig

# libyaml's safe loader where PyYAML was built with it (its wheels are): the same documents, about five times
# faster than the pure-Python one, and the file is read on every inventory sync.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ClusterFileError(ValueError):
    """The cluster file is malformed; the message says where and how to fix it."""


# GPU memory of the models in Alibaba's openb trace, which names them its own way.
OPENB_GPU_MEMORY_MIB = {"P100": 16384, "V100M16": 16384, "V100M32": 32768, "T4": 16384, "A10": 24576, "G2": 24576, "G3": 32768}


def load_cluster_file(path: str | Path) -> list[NodeInfo]:
    path = Path(path)
    if not path.exists():
        raise ClusterFileError(f"Cluster file {path} does not exist; set LOCAL_CLUSTER_FILE to a YAML cluster file.")
    if path.suffix == ".csv":
        return load_openb_nodes(path)
    try:
        document = yaml.load(path.read_text(), Loader=_SAFE_LOADER)
    except yaml.YAMLError as exc:
        raise ClusterFileError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("racks"), list):
        raise ClusterFileError(f"{path}: expected a mapping with a 'racks' list at the top.")
    nodes: list[NodeInfo] = []
    for rack_index, rack in enumerate(document["racks"]):
        for block_index, block in enumerate(_list(rack, "blocks", f"racks[{rack_index}]")):
            for node_index, node in enumerate(_list(block, "nodes", f"racks[{rack_index}].blocks[{block_index}]")):
                where = f"racks[{rack_index}].blocks[{block_index}].nodes[{node_index}]"
                nodes.append(_node(node, where, rack=str(rack.get("name", "")), block=str(block.get("name", ""))))
    names = [node.name for node in nodes]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ClusterFileError(f"{path}: node names must be unique; repeated: {', '.join(duplicates)}.")
    return nodes


def _list(parent: dict, key: str, where: str) -> list:
    value = parent.get(key) if isinstance(parent, dict) else None
    if not isinstance(value, list):
        raise ClusterFileError(f"{where}.{key}: expected a list.")
    return value


def _positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ClusterFileError(f"{where}: expected a whole number >= 0, got {value!r}.")
    return value


def _node(node: dict, where: str, *, rack: str, block: str) -> NodeInfo:
    if not isinstance(node, dict) or not node.get("name"):
        raise ClusterFileError(f"{where}.name: every node needs a name.")
    gpus_spec = node.get("gpus") or {"model": "", "count": 0}
    model = str(gpus_spec.get("model", ""))
    count = _positive_int(gpus_spec.get("count", 0), f"{where}.gpus.count")
    if count and model not in mig.GPU_MODELS:
        raise ClusterFileError(f"{where}.gpus.model: unknown GPU model {model!r}; use one of {', '.join(mig.GPU_MODELS)}.")
    gpus = tuple(
        _gpu(index, model, node.get("partition") or {"kind": "whole"}, f"{where}.partition") for index in range(count)
    )
    return NodeInfo(
        name=str(node["name"]),
        cpu_milli=_positive_int(node.get("cpu_milli", 0), f"{where}.cpu_milli"),
        memory_mib=_positive_int(node.get("memory_mib", 0), f"{where}.memory_mib"),
        pool=str(node.get("pool", "")),
        rack=rack,
        block=block,
        nvlink_domain=str(node.get("nvlink_domain", "")),
        labels={str(k): str(v) for k, v in (node.get("labels") or {}).items()},
        gpus=gpus,
        gpu_resources=resources_of(gpus),
    )


def _gpu(index: int, model: str, partition: dict, where: str) -> GpuInfo:
    memory_mib = mig.GPU_MODELS[model].memory_mib
    kind = partition.get("kind", "whole")
    if kind == "mig":
        try:
            placed = mig.fit_layout(model, list(partition.get("layout") or []))
        except mig.MigError as exc:
            raise ClusterFileError(f"{where}.layout: {exc}") from None
        return GpuInfo(index=index, model=model, memory_mib=memory_mib, partition_kind="mig", mig_layout=tuple(placed))
    if kind == "timeslice":
        replicas = _positive_int(partition.get("replicas", 0), f"{where}.replicas")
        if replicas < 2:
            raise ClusterFileError(f"{where}.replicas: time-slicing needs 2 or more replicas.")
        return GpuInfo(index=index, model=model, memory_mib=memory_mib, partition_kind="timeslice", timeslice_replicas=replicas)
    if kind != "whole":
        raise ClusterFileError(f"{where}.kind: {kind!r} is not one of whole, mig, timeslice.")
    return GpuInfo(index=index, model=model, memory_mib=memory_mib)


def load_openb_nodes(path: Path) -> list[NodeInfo]:
    """The openb node list (sn, cpu_milli, memory_mib, gpu, model) as an inventory, one pool per model."""
    nodes = []
    with open(path, newline="") as stream:
        reader = csv.DictReader(stream)
        missing = {"sn", "cpu_milli", "memory_mib", "gpu", "model"} - set(reader.fieldnames or [])
        if missing:
            raise ClusterFileError(f"{path}: missing column(s) {', '.join(sorted(missing))} of an openb node list.")
        for line, row in enumerate(reader, start=2):
            try:
                count = int(row["gpu"] or 0)
                model = row["model"] or ""
                gpus = tuple(
                    GpuInfo(index=i, model=model, memory_mib=OPENB_GPU_MEMORY_MIB.get(model, 0)) for i in range(count)
                )
                nodes.append(
                    NodeInfo(
                        name=row["sn"],
                        cpu_milli=int(row["cpu_milli"]),
                        memory_mib=int(row["memory_mib"]),
                        pool=f"openb-{model.lower()}" if model else "openb-cpu",
                        gpus=gpus,
                        gpu_resources=resources_of(gpus),
                    )
                )
            except ValueError:
                raise ClusterFileError(f"{path}:{line}: cpu_milli, memory_mib and gpu must be whole numbers.") from None
    return nodes

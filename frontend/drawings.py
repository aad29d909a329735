"""GPU drawings for the pages: where each slice of one GPU goes, as plain data for a template.

A MIG-capable GPU has 8 memory slices (positions 0..7) and 7 compute slices. A GPU
instance started at memory position `start` spans `span` memory positions and takes
compute slices `start .. start + compute_slices - 1`, which is how NVIDIA's MIG User
Guide draws them: position 7 is memory without a compute slice of its own.
"""

import re
from dataclasses import dataclass

from quotas.models import PartitionKind
from runners.nvidia import mig

# One colour per NVIDIA profile kind (its profile ID), so a 3g looks the same everywhere.
_COLOURS = {0: 1, 5: 2, 9: 3, 14: 4, 15: 5, 19: 6, 20: 7}


@dataclass(frozen=True)
class Block:
    """One part of a GPU: a MIG instance, a time-slice replica, or the whole GPU."""

    label: str
    short_label: str
    start: int
    span: int
    compute_slices: int = 0
    memory_gb: int | None = None
    colour: int = 1

    @property
    def compute_positions(self) -> range:
        return range(self.start, self.start + self.compute_slices)


@dataclass(frozen=True)
class ComputeCell:
    position: int
    owner: Block | None


@dataclass(frozen=True)
class GpuDrawing:
    gpu_model: str
    kind: str
    blocks: tuple[Block, ...]
    # Grid columns: 8 memory positions for MIG, one per replica for time-slicing, 1 for whole.
    columns: int
    replicas: int = 1
    memory_gb: int = 0

    @property
    def is_mig(self) -> bool:
        return self.kind == PartitionKind.MIG

    @property
    def positions(self) -> range:
        return range(self.columns)

    @property
    def free_positions(self) -> list[int]:
        taken = {position for block in self.blocks for position in range(block.start, block.start + block.span)}
        return [position for position in range(self.columns) if position not in taken]

    @property
    def compute_cells(self) -> list[ComputeCell]:
        owners = {position: block for block in self.blocks for position in block.compute_positions}
        return [ComputeCell(position, owners.get(position)) for position in range(mig.COMPUTE_SLICES)]

    @property
    def compute_used(self) -> int:
        return sum(block.compute_slices for block in self.blocks)

    @property
    def memory_used(self) -> int:
        return sum(block.span for block in self.blocks)


def _memory_gb(model: str) -> int:
    # A GPU NVML found may be a model the catalog does not know; draw it without a size.
    try:
        return mig.gpu_model(model).memory_mib // 1024
    except mig.UnknownGpuModelError:
        return 0


def mig_drawing(model: str, placed: list[tuple[str, int]] | list[list]) -> GpuDrawing:
    """A MIG GPU from its placed instances [(profile, start), ...]."""
    profiles = mig.profiles_for(model)
    blocks = []
    for name, start in sorted(placed, key=lambda pair: pair[1]):
        profile = profiles[name]
        blocks.append(
            Block(
                label=name,
                short_label=name.split(".")[0] + ("+me" if profile.media_extensions else ""),
                start=int(start),
                span=profile.span,
                compute_slices=profile.compute_slices,
                memory_gb=profile.memory_mib // 1024,
                colour=_COLOURS.get(profile.profile_id, 1),
            )
        )
    return GpuDrawing(
        gpu_model=model, kind=PartitionKind.MIG, blocks=tuple(blocks), columns=mig.MEMORY_SLICES,
        memory_gb=_memory_gb(model),
    )


def timeslice_drawing(model: str, replicas: int) -> GpuDrawing:
    blocks = tuple(
        Block(label=f"replica {index + 1} of {replicas}", short_label=str(index + 1), start=index, span=1, colour=(index % 7) + 1)
        for index in range(replicas)
    )
    return GpuDrawing(
        gpu_model=model, kind=PartitionKind.TIMESLICE, blocks=blocks, columns=replicas, replicas=replicas,
        memory_gb=_memory_gb(model),
    )


def whole_drawing(model: str, memory_gb: int | None = None) -> GpuDrawing:
    memory_gb = _memory_gb(model) if memory_gb is None else memory_gb
    size = f" · {memory_gb} GB" if memory_gb else ""
    block = Block(label=f"whole GPU{size}", short_label="whole", start=0, span=1, memory_gb=memory_gb, colour=1)
    return GpuDrawing(gpu_model=model, kind=PartitionKind.WHOLE, blocks=(block,), columns=1, memory_gb=memory_gb)


def profile_drawing(profile) -> GpuDrawing:
    """One GPU of a stored PartitionProfile."""
    return layout_drawing(profile.gpu_model, profile.kind, list(profile.layout), profile.replicas)


def layout_drawing(model: str, kind: str, layout: list[str], replicas: int | None) -> GpuDrawing:
    """One GPU cut as asked; raises mig.MigError (a ValueError) saying why when it cannot be."""
    if kind == PartitionKind.MIG:
        return mig_drawing(model, mig.fit_layout(model, layout))
    if kind == PartitionKind.TIMESLICE:
        return timeslice_drawing(model, replicas or 1)
    return whole_drawing(model)


def gpu_drawing(gpu) -> GpuDrawing:
    """One Gpu row of the inventory as it is partitioned now."""
    if gpu.partition_kind == PartitionKind.MIG:
        return mig_drawing(gpu.model, [tuple(pair) for pair in gpu.mig_layout])
    if gpu.partition_kind == PartitionKind.TIMESLICE:
        return timeslice_drawing(gpu.model, gpu.timeslice_replicas)
    return whole_drawing(gpu.model, gpu.memory_mib // 1024)


def parse_layout(text: str) -> list[str]:
    """MIG profile names from 'a, b c' (commas, spaces or both)."""
    return [name for name in re.split(r"[\s,]+", text.strip()) if name]

"""Defragmentation by migration: move a few running, checkpointable pods so that a waiting one fits.

Online placement never moves anything, so what it leaves behind stays: a 4-GPU gang waits while four
nodes each keep three GPUs free beside one small borrower, and a whole-GPU pod waits while shares of
a few hundred milli sit alone on GPUs that could be whole. The portal can stop a preemptible job with
a checkpoint and resume it at the exact step elsewhere, so it can undo that, at a price: every move
costs its pod's GPUs for as long as the checkpoint, the stop and the restore take.

`plan_room` is the pure decision. Given the cluster, the pods running on it and one pod that fits
nowhere, it proposes the cheapest set of at most `max_moves` moves (each a running pod, where it is,
where it goes) after which the waiting pod fits on one node, and where it then goes. "Cheapest" is,
in order: the fewest moves, the fewest milli-GPUs moved (the GPU-seconds a move costs grow with the
GPUs it stops), and the node the tie order ranks first; it is sought among the `MAX_CANDIDATES`
nodes that a vector prefilter ranks first (fewest GPUs to clear), so on a large cluster it is the
cheapest found there, not a proven optimum. The moved pods go where they fit tightest
(the GPU with the least room left that still holds them: the slivers other pods left), never onto
the node being cleared, and never where they would themselves push anything out: a plan moves each
pod once, in one step, and every target is checked against the cluster as the earlier moves of the
same plan leave it. It tries the plan on the state itself (`ClusterState.trial`) and undoes it, so
the state is as it was when it returns; `apply_plan` then makes it for real, on the state and in the
caller's `Placements` (the placed pods, indexed by node and GPU).

What may move is the caller's to say (`movable`): in the portal, running preemptible work whose
tenant allows moves and that was not moved within the window; in the trace replay, every pod
placed (the trace has no such flags). The budget (how many moves an hour, or per pod arrived) is the
caller's too: this module decides one pod at a time.

Scope: pods on the milli-GPU path (shares and whole GPUs) and CPU-only pods; MIG slices are
neither moved nor made room for here (a MIG GPU's layout is its own problem). Multi-GPU pods are
not moved (moving one costs as much as the gain of most plans), but a multi-GPU pod may be the one
waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .model import GPU_MILLI, ClusterState, PodRequest

# Nodes tried per waiting pod, cheapest first by the prefilter; trying a node costs a trial.
MAX_CANDIDATES = 24
# The replays' settings. Moves allowed per pod arrived, and the most any one waiting pod may cause.
DEFAULT_DEFRAG_BUDGET = 0.02
DEFRAG_MAX_MOVES_PER_POD = 2
# What one move costs its GPUs, in seconds: a checkpoint written, the pod stopped, restored elsewhere.
DEFAULT_MOVE_COST_S = 60.0
# A budget above one move per pod arrived is a mistake, not a setting.
DEFRAG_BUDGET_MAX = 1.0


@dataclass(frozen=True)
class Running:
    """A pod placed on the cluster: its request, its node (row) and GPU columns; `key` names it."""

    key: object
    pod: PodRequest
    row: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Move:
    """One running pod stopped where it is and started on another node."""

    running: Running
    to_row: int
    to_gpus: tuple[int, ...]

    @property
    def gpu_milli(self) -> int:
        """Milli-GPUs the move stops and restarts."""
        return self.running.pod.total_gpu_milli if self.running.pod.gpu_count else 0


@dataclass(frozen=True)
class Plan:
    """Moves that make room, and where the waiting pod then goes."""

    moves: tuple[Move, ...]
    row: int
    gpus: tuple[int, ...]

    @property
    def moved_gpu_milli(self) -> int:
        """Milli-GPUs the plan's moves stop and restart."""
        return sum(move.gpu_milli for move in self.moves)


class Placements:
    """The pods placed on a cluster, indexed as `plan_room` reads them: by key, by node (row), and how
    many pods hold each GPU slot (`pods_on`, shaped like `state.gpu_left_milli`). A replay keeps one as
    pods come, move and go; it must hold exactly the pods placed on the state it is planned against."""

    def __init__(self, state: ClusterState, running: Iterable[Running] = ()):
        self.by_key: dict[object, Running] = {}
        self.by_row: dict[int, list[Running]] = {}
        self.pods_on = np.zeros_like(state.gpu_left_milli)
        for placed in running:
            self.add(placed)

    def __len__(self) -> int:
        return len(self.by_key)

    def __contains__(self, key: object) -> bool:
        return key in self.by_key

    def __getitem__(self, key: object) -> Running:
        return self.by_key[key]

    def add(self, running: Running) -> None:
        self.by_key[running.key] = running
        self.by_row.setdefault(running.row, []).append(running)
        for col in running.gpus:
            self.pods_on[running.row, col] += 1

    def remove(self, running: Running) -> None:
        del self.by_key[running.key]
        self.by_row[running.row].remove(running)
        for col in running.gpus:
            self.pods_on[running.row, col] -= 1


def moves_allowed(budget: float, arrived: int, moves_made: int) -> int:
    """Moves a replay may still make for one waiting pod: the budget (moves per pod arrived) less those
    made, and at most `DEFRAG_MAX_MOVES_PER_POD`; below 1, none."""
    return max(min(DEFRAG_MAX_MOVES_PER_POD, int(budget * arrived + 1e-9) - moves_made), 0)


def _is_mover(running: Running) -> bool:
    """Shares, single whole GPUs and CPU-only pods; not multi-GPU pods, not MIG slices."""
    kind = running.pod.kind
    return kind in ("share", "cpu") or (kind == "whole" and running.pod.gpu_count == 1)


def _evictions(
    state: ClusterState, pod: PodRequest, row: int, on_node: Sequence[Running], max_moves: int
) -> Optional[tuple[list[Running], tuple[int, ...]]]:
    """The fewest movers to take off node `row` so `pod` fits there, and the GPUs it would then take."""
    free = state.gpu_left_milli[row]
    by_col: dict[int, list[Running]] = {}
    for running in on_node:
        for col in running.gpus:
            by_col.setdefault(col, []).append(running)
    kind = pod.kind
    chosen: list[Running] = []
    gpus: tuple[int, ...] = ()
    columns = [col for col in range(int(state.gpu_count[row])) if not state.gpu_is_mig[row, col]]
    if kind == "whole":
        # Each GPU's price: the pods on it, all of which must be movers; the k cheapest GPUs.
        priced = []
        for col in columns:
            occupants = by_col.get(col, [])
            held = sum(r.pod.gpu_milli for r in occupants)
            if free[col] + held < GPU_MILLI:
                continue  # something not listed holds part of it
            if all(_is_mover(r) for r in occupants):
                priced.append((len(occupants), held, col))
        if len(priced) < pod.gpu_count:
            return None
        priced.sort()
        taken = priced[:pod.gpu_count]
        gpus = tuple(sorted(col for _, _, col in taken))
        seen: set[int] = set()
        for col in gpus:
            for running in by_col.get(col, []):
                if id(running) not in seen:
                    seen.add(id(running))
                    chosen.append(running)
    elif kind == "share":
        best = None
        for col in columns:
            need = pod.gpu_milli - int(free[col])
            occupants = sorted(by_col.get(col, []), key=lambda r: -r.pod.gpu_milli)
            if not all(_is_mover(r) for r in occupants):
                continue
            picked, gained = [], 0
            for running in occupants:
                if gained >= need:
                    break
                picked.append(running)
                gained += running.pod.gpu_milli
            if gained < need:
                continue
            price = (len(picked), gained, col)
            if best is None or price < best[0]:
                best = (price, picked)
        if best is None:
            return None
        chosen = list(best[1])
        gpus = (best[0][2],)
    # CPU and memory: take off the largest CPU users among the rest until the pod fits.
    cpu_short = pod.cpu_milli - int(state.cpu_left_milli[row]) - sum(r.pod.cpu_milli for r in chosen)
    memory_short = pod.memory_mib - int(state.memory_left_mib[row]) - sum(r.pod.memory_mib for r in chosen)
    if cpu_short > 0 or memory_short > 0:
        taken = {id(r) for r in chosen}
        rest = [r for r in on_node if id(r) not in taken and _is_mover(r) and not (set(r.gpus) & set(gpus))]
        rest.sort(key=lambda r: (-r.pod.cpu_milli, -r.pod.memory_mib))
        for running in rest:
            if cpu_short <= 0 and memory_short <= 0:
                break
            chosen.append(running)
            cpu_short -= running.pod.cpu_milli
            memory_short -= running.pod.memory_mib
        if cpu_short > 0 or memory_short > 0:
            return None
    if not chosen or len(chosen) > max_moves:
        return None
    return chosen, gpus


def _tightest(state: ClusterState, pod: PodRequest, away_from: int) -> Optional[tuple[int, tuple[int, ...]]]:
    """Where a moved pod goes: the feasible node, other than `away_from`, whose GPU it fills tightest."""
    feasible = state.feasible(pod)
    feasible = feasible[feasible != away_from]
    if feasible.size == 0:
        return None
    kind = pod.kind
    if kind == "share":
        left = state.gpu_left_milli[feasible]
        room = np.where(left >= pod.gpu_milli, left, GPU_MILLI + 1).min(axis=1)
        order = np.lexsort((state.tie_rank[feasible], room))
    elif kind == "whole":
        # Nodes with the fewest whole GPUs free, so a move does not break up a node a gang could use.
        order = np.lexsort((state.tie_rank[feasible], state.full_free_gpus[feasible]))
    else:
        order = np.lexsort((state.tie_rank[feasible], state.cpu_left_milli[feasible]))
    row = int(feasible[order[0]])
    return row, state.default_gpus(row, pod)


def _candidates(state: ClusterState, pod: PodRequest, pods_on: np.ndarray, max_moves: int) -> np.ndarray:
    """Nodes worth a trial, cheapest first: the right model, schedulable, enough capacity once cleared.

    A GPU counts as one that moves could clear only if its occupants could land somewhere: they hold
    `GPU_MILLI - left` between them, and none can go to a GPU with less room than the most any GPU of
    the cluster has free (`room`), so more than `count x room` cannot all move. It is a bound, not the
    answer: the trial decides.
    """
    rows = state.model_rows(pod) if pod.kind in ("share", "whole") else np.arange(state.n_nodes)
    rows = rows[state.schedulable[rows]]
    rows = rows[(state.cpu_capacity_milli[rows] >= pod.cpu_milli) & (state.memory_capacity_mib[rows] >= pod.memory_mib)]
    kind = pod.kind
    if kind in ("whole", "share"):
        room = int(state.max_left_milli.max()) if state.n_nodes else 0
        count = pods_on[rows]
        held = GPU_MILLI - state.gpu_left_milli[rows]
        real = (np.arange(count.shape[1])[None, :] < state.gpu_count[rows][:, None]) & ~state.gpu_is_mig[rows]
        movable = (count >= 1) & (count <= max_moves) & (held <= count * room) & real
        if kind == "whole":
            free = (state.gpu_left_milli[rows] == GPU_MILLI) & real
            keep = (free | movable).sum(axis=1) >= pod.gpu_count
            rows, need = rows[keep], np.maximum(pod.gpu_count - state.full_free_gpus[rows][keep], 0)
        else:
            keep = movable.any(axis=1)
            rows = rows[keep]
            need = np.ones(rows.size, dtype=np.int64)
    else:
        need = np.ones(rows.size, dtype=np.int64)
    order = np.lexsort((state.tie_rank[rows], need))
    return rows[order][: MAX_CANDIDATES]


def plan_room(
    state: ClusterState,
    pod: PodRequest,
    placed: Placements,
    *,
    max_moves: int = 2,
    movable: Optional[Callable[[Running], bool]] = None,
) -> Optional[Plan]:
    """The cheapest plan found of at most `max_moves` moves after which `pod` fits, or None.

    `placed` is every pod placed on `state`; `movable` says which may move (default: all of them). The
    state is left as it was.
    """
    if max_moves < 1:
        raise ValueError(f"max_moves must be 1 or more, got {max_moves}")
    if pod.kind == "mig":
        return None
    if state._undo is not None:
        raise ValueError("plan_room needs a state with no trial open")
    best: Optional[tuple[tuple, Plan]] = None
    for row in _candidates(state, pod, placed.pods_on, max_moves):
        row = int(row)
        on_node = [r for r in placed.by_row.get(row, ()) if movable is None or movable(r)]
        found = _evictions(state, pod, row, on_node, max_moves)
        if found is None:
            continue
        evicted, gpus = found
        # Movers not listed as movable are not on_node, so _evictions never picks one; a GPU they
        # hold part of never reaches the waiting pod's free milli either.
        if best is not None and len(evicted) > len(best[1].moves):
            continue
        plan = _try(state, pod, row, gpus, evicted)
        if plan is None:
            continue
        price = (len(plan.moves), plan.moved_gpu_milli, int(state.tie_rank[row]))
        if best is None or price < best[0]:
            best = (price, plan)
            if len(plan.moves) == 1 and plan.moved_gpu_milli <= pod.gpu_milli:
                break
    return best[1] if best else None


def _try(state: ClusterState, pod: PodRequest, row: int, gpus: tuple[int, ...], evicted: list[Running]) -> Optional[Plan]:
    """Move the evicted pods off `row` on a trial, place `pod` there, and undo; the plan if all of it fits."""
    state.trial()
    try:
        for running in evicted:
            state.release(running.row, running.pod, running.gpus)
        # `_evictions` chose them so that the pod now fits; its room is taken first, so no moved pod
        # lands in it.
        state.place(row, pod, gpus)
        moves = []
        for running in evicted:
            target = _tightest(state, running.pod, away_from=row)
            if target is None:
                return None
            state.place(target[0], running.pod, target[1])
            moves.append(Move(running, target[0], target[1]))
        return Plan(tuple(moves), row, gpus)
    finally:
        state.undo()


def apply_plan(state: ClusterState, pod: PodRequest, plan: Plan, placed: Placements, key: object) -> None:
    """Make the plan on `state` and in `placed`: each move's pod released and placed on its target, then
    the waiting pod placed under `key`.

    The order is the one `plan_room` checked: every move first, so the room is free when the pod
    comes; the state refuses (ValueError) a release of what is not there.
    """
    for move in plan.moves:
        state.release(move.running.row, move.running.pod, move.running.gpus)
        placed.remove(move.running)
    for move in plan.moves:
        state.place(move.to_row, move.running.pod, move.to_gpus)
        placed.add(Running(move.running.key, move.running.pod, move.to_row, move.to_gpus))
    state.place(plan.row, pod, plan.gpus)
    placed.add(Running(key, pod, plan.row, plan.gpus))


def check_defrag_settings(budget: float, move_cost_s: float) -> None:
    """Refuse a budget or move cost that cannot be meant (ValueError naming the setting)."""
    if not (0 <= budget <= DEFRAG_BUDGET_MAX):
        raise ValueError(
            f"--defrag-budget is moves per pod arrived, from 0 to {DEFRAG_BUDGET_MAX:g}; got {budget:g}"
        )
    if not (0 <= move_cost_s <= 86_400):
        raise ValueError(f"--move-cost-s is seconds a move costs its GPUs, from 0 to 86400; got {move_cost_s:g}")

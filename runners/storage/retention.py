"""Which of a job's stored checkpoints a retention policy keeps (as Determined's checkpoint GC decides).

A policy keeps the union of three sets, each rule off when its number is None:

- ``keep_newest``: the N checkpoints of the highest steps;
- ``keep_best``: the M with the best value of the reported metric (lowest when ``smaller_is_better``,
  highest otherwise; a checkpoint with no value at its step is never among the best; among equal values
  the newer wins);
- ``keep_every``: every K-th checkpoint the job wrote, counted 1, 2, 3... in step order over its whole
  history (deleted ones included), so what the rule keeps never moves as older ones are deleted.

A policy with every rule off keeps everything. ``protected`` ids (the newest checkpoint of a job that may
still resume from it, one promoted to a model) are kept whatever the policy says.

Pure: no Django, no portal app.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

POLICY_FIELDS = ("keep_newest", "keep_best", "keep_every")


@dataclass(frozen=True)
class RetentionPolicy:
    keep_newest: int | None = None
    keep_best: int | None = None
    keep_every: int | None = None
    metric: str = "loss"
    smaller_is_better: bool = True

    @property
    def keeps_everything(self) -> bool:
        return self.keep_newest is None and self.keep_best is None and self.keep_every is None

    def to_json(self) -> dict:
        return {"keep_newest": self.keep_newest, "keep_best": self.keep_best, "keep_every": self.keep_every,
                "metric": self.metric, "smaller_is_better": self.smaller_is_better}


@dataclass(frozen=True)
class StoredCheckpoint:
    id: int
    step: int
    # The metric the job reported at this step (None when it reported none there).
    metric: float | None = None


def parse_policy(data, *, field: str = "checkpoint_retention") -> RetentionPolicy:
    """A policy from its JSON form; ValueError naming the field (``checkpoint_retention.keep_newest``)."""
    if data is None:
        return RetentionPolicy()
    if not isinstance(data, dict):
        raise ValueError(f"{field}: an object with keep_newest, keep_best, keep_every (each a count or null)")
    unknown = sorted(set(data) - {*POLICY_FIELDS, "metric", "smaller_is_better"})
    if unknown:
        raise ValueError(f"{field}.{unknown[0]}: not a retention setting (keep_newest, keep_best, keep_every, "
                         "metric, smaller_is_better)")
    values = {}
    for name in POLICY_FIELDS:
        value = data.get(name)
        minimum = 1 if name == "keep_every" else 0
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not
                                  minimum <= value <= 1_000_000):
            raise ValueError(f"{field}.{name}: a whole number from {minimum} to 1000000, or null for off")
        values[name] = value
    metric = data.get("metric", "loss")
    if metric != "loss":
        raise ValueError(f"{field}.metric: only \"loss\" is reported per step")
    smaller = data.get("smaller_is_better", True)
    if not isinstance(smaller, bool):
        raise ValueError(f"{field}.smaller_is_better: true or false")
    return RetentionPolicy(**values, metric=metric, smaller_is_better=smaller)


def kept(policy: RetentionPolicy, history: Iterable[StoredCheckpoint], *, candidates: Iterable[int] | None = None,
         protected: Iterable[int] = ()) -> set[int]:
    """The ids the policy keeps among ``candidates`` (the checkpoints still stored; all of ``history`` when
    None). ``history`` is every checkpoint the job ever recorded, in any order: ``keep_every`` counts over it."""
    ordered = sorted(history, key=lambda checkpoint: (checkpoint.step, checkpoint.id))
    alive = {checkpoint.id for checkpoint in ordered} if candidates is None else set(candidates)
    stored = [checkpoint for checkpoint in ordered if checkpoint.id in alive]
    if policy.keeps_everything:
        return {checkpoint.id for checkpoint in stored}
    keep = set(protected) & alive
    if policy.keep_newest:
        keep.update(checkpoint.id for checkpoint in stored[-policy.keep_newest:])
    if policy.keep_best:
        scored = [checkpoint for checkpoint in stored
                  if checkpoint.metric is not None and not math.isnan(checkpoint.metric)]
        sign = 1 if policy.smaller_is_better else -1
        scored.sort(key=lambda checkpoint: (sign * checkpoint.metric, -checkpoint.step, -checkpoint.id))
        keep.update(checkpoint.id for checkpoint in scored[:policy.keep_best])
    if policy.keep_every:
        keep.update(checkpoint.id for ordinal, checkpoint in enumerate(ordered, start=1)
                    if ordinal % policy.keep_every == 0 and checkpoint.id in alive)
    return keep


def freed(policy: RetentionPolicy, history: Iterable[StoredCheckpoint], *, candidates: Iterable[int] | None = None,
          protected: Iterable[int] = ()) -> set[int]:
    """The ids the policy would delete: the candidates it does not keep."""
    history = list(history)
    alive = {checkpoint.id for checkpoint in history} if candidates is None else set(candidates)
    return alive - kept(policy, history, candidates=alive, protected=protected)

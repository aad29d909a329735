"""The autoscaler's rule: how many replicas an endpoint wants, from what its replicas reported. Pure, no Django.

The load signal is requests in flight (admitted and waiting, plus in the running batch), summed
over the ready replicas, against a target per replica (Little's law ties it to latency: more in
flight at the same rate means each waits longer). Requests shed or expired count as more load
than any target, because they are work the endpoint failed to take.

- Out: when the load needs more replicas in two samples running (one when requests are being
  shed), straight to the number it needs, at most max.
- In: only when every sample of the last ``scale_in_after_s`` needed fewer, and no change was made
  in that window; to the most any of those samples needed. The gap between the two rules is the
  hysteresis: a load at the edge never flaps.
- Warm: ``warm_replicas`` more than the load needs, within [min, max].
- Zero: with ``min_replicas`` 0 and no request for ``idle_after_s``, the load needs none.
- KV cache: a foreign engine (vLLM, SGLang) also reports how full its KV cache is; at ``kv_cache_high`` or
  more (the mean over the ready replicas) the engine is about to queue or preempt sequences whatever the
  request count says, so the load needs one replica more than now (under the same two-sample rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    target_inflight: float = 8.0  # requests in flight one replica should carry
    scale_in_after_s: float = 30.0
    idle_after_s: float = 120.0
    kv_cache_high: float = 0.9  # KV-cache use (0..1) at which an engine's replicas count as full


@dataclass(frozen=True)
class Load:
    at_s: float
    inflight: int  # queued + running over the ready replicas
    shed_per_s: float = 0.0  # shed or expired since the last sample
    since_last_request_s: float = 0.0
    kv_cache_use: float | None = None  # mean over the ready replicas of a foreign engine; None: not reported


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int
    warm_replicas: int = 0


def kv_cache_full(load: Load, policy: Policy) -> bool:
    return load.kv_cache_use is not None and load.kv_cache_use >= policy.kv_cache_high


def needed(load: Load, policy: Policy, current: int) -> int:
    """Replicas this one sample's load needs (before warm and bounds)."""
    if load.since_last_request_s >= policy.idle_after_s and load.inflight == 0:
        return 0
    by_inflight = math.ceil(load.inflight / policy.target_inflight)
    if load.shed_per_s > 0 or kv_cache_full(load, policy):
        # Work is being refused, or the engines' KV caches are full: at least one more than now, whatever the
        # in-flight count says.
        by_inflight = max(by_inflight, current + 1)
    # Traffic within the idle window keeps one replica up even when nothing is in flight at the sample.
    return max(1, by_inflight)


def decide(history: list[dict], load: Load, bounds: Bounds, policy: Policy, *, current: int,
           last_change_s: float | None) -> tuple[int, str, list[dict]]:
    """(the replicas wanted now, why, the history to keep).

    ``history`` is what earlier calls returned: [{"at": s, "needed": n}, ...], newest last.
    ``current`` is the wanted number now; ``last_change_s`` when it last changed.
    """
    wants = needed(load, policy, current)
    history = [entry for entry in history if entry["at"] > load.at_s - policy.scale_in_after_s - 1]
    history.append({"at": load.at_s, "needed": wants})

    def clamp(count: int) -> int:
        return max(bounds.min_replicas, min(bounds.max_replicas, count))

    def with_warm(count: int) -> int:
        return clamp(count + bounds.warm_replicas)

    target_now = with_warm(wants)
    if target_now > current:
        previous = history[-2]["needed"] if len(history) >= 2 else None
        urgent = load.shed_per_s > 0 or current == 0
        if urgent or (previous is not None and with_warm(previous) > current):
            why = (f"{load.inflight} requests in flight need {wants} replicas at {policy.target_inflight:g} each"
                   if load.shed_per_s <= 0 else f"requests were being shed ({load.shed_per_s:.1f}/s)")
            if load.shed_per_s <= 0 and kv_cache_full(load, policy):
                why = (f"the replicas' KV caches are {load.kv_cache_use:.0%} full (at {policy.kv_cache_high:.0%} "
                       f"an engine queues or preempts sequences)")
            if current == 0 and wants > 0 and load.inflight == 0:
                why = "a request arrived while scaled to zero"
            warm = f" plus {bounds.warm_replicas} warm" if bounds.warm_replicas else ""
            return target_now, f"Scale out: {why}{warm}.", history
        return current, "", history
    if target_now < current:
        window_start = load.at_s - policy.scale_in_after_s
        covered = history and history[0]["at"] <= window_start + 1
        quiet = last_change_s is None or last_change_s <= window_start
        if covered and quiet:
            most = max(entry["needed"] for entry in history)
            target = with_warm(most)
            if target < current:
                if most == 0:
                    why = f"no request for {policy.idle_after_s:g} s"
                else:
                    why = f"the load of the last {policy.scale_in_after_s:g} s needed at most {most}"
                return target, f"Scale in: {why}.", history
    return current, "", history

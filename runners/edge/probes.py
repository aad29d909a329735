"""The edge's own look at each replica it routes to: its health route every EDGE_PROBE_INTERVAL_S.

A replica failing EDGE_PROBE_FAILURES probes in a row (no answer within EDGE_PROBE_TIMEOUT_S, or an
answer that is not 200) is out of rotation at once, without waiting for the reconcile to notice; it is
back at its first good answer. One that does not answer at all (hung: SIGSTOP, a wedged host) also
wakes the requests waiting on it, which go to the next replica with what is left of their deadline;
one that answers "not ready" (draining) still finishes what it admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import aiohttp

from runners.edge.table import Target

log = logging.getLogger("runners.edge")


# How much a replica's in-flight limit shrinks when it refuses for being full, and how often at most.
LIMIT_CUT = 0.9
LIMIT_CUT_EVERY_S = 0.05


@dataclass
class ReplicaState:
    target: Target
    outstanding: int = 0
    failures: int = 0
    out: bool = False
    task: asyncio.Task | None = None
    # Requests sent to it and not yet answered, and how many it is given before the edge refuses for it
    # (0: none learned yet, the endpoint's cap holds). See `answered` and `refused`.
    in_flight: int = 0
    limit: float = 0.0
    cut_at: float = -1e9
    # The tries waiting for its answer to begin, each with how to stop it: when the replica answers nothing
    # (hung), the probe stops them at once and they go to the next replica.
    waiting: dict = field(default_factory=dict)

    def admits(self, cap: float) -> bool:
        return self.in_flight < (self.limit or cap)

    def answered(self, cap: float) -> None:
        """It took a request (an answer that is not a refusal): its limit grows by one for each limit's worth
        of answers, up to the endpoint's cap."""
        limit = self.limit or cap
        self.limit = min(cap, limit + 1.0 / limit)

    def refused(self, now: float, cap: float) -> None:
        """It refused a request for being full (a 429 not marked as one request's deadline alone): what it held
        was too much, so it is given a tenth less than that, at most once each LIMIT_CUT_EVERY_S (the refusals
        of one burst are one signal). The edge then refuses the excess itself, at a fraction of the
        CPU the replica's own refusal costs both, and the replica keeps computing."""
        if now - self.cut_at < LIMIT_CUT_EVERY_S:
            return
        self.cut_at = now
        self.limit = max(2.0, min(self.limit or cap, LIMIT_CUT * self.in_flight))


class Prober:
    def __init__(self, client: aiohttp.ClientSession, *, interval_s: float, timeout_s: float, failures: int) -> None:
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = failures
        self.replicas: dict[str, ReplicaState] = {}
        self.on_gone = None  # called with a replica's key when it leaves the table

    def state(self, target: Target) -> ReplicaState:
        state = self.replicas.get(target.key)
        if state is None or state.target != target:
            if state is not None and state.task is not None:
                state.task.cancel()
            state = self.replicas[target.key] = ReplicaState(target)
            state.task = asyncio.create_task(self._probe_loop(state))
        return state

    def sync(self, targets: list[Target]) -> None:
        """Probe exactly these replicas (the table's ready ones); stop probing the rest."""
        keys = {target.key for target in targets}
        for target in targets:
            self.state(target)
        for key in [key for key in self.replicas if key not in keys]:
            state = self.replicas[key]
            if state.outstanding == 0:
                if state.task is not None:
                    state.task.cancel()
                del self.replicas[key]
                if self.on_gone is not None:
                    self.on_gone(key)

    async def stop(self) -> None:
        for state in self.replicas.values():
            if state.task is not None:
                state.task.cancel()
        for state in self.replicas.values():
            if state.task is not None:
                with contextlib.suppress(BaseException):
                    await state.task

    async def probe(self, state: ReplicaState) -> str:
        """"ok", "not-ready" (it answered, not 200) or "silent" (no answer)."""
        try:
            async with self.client.get(state.target.address + state.target.health_path,
                                       timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as answer:
                status = answer.status
                await answer.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return "silent"
        return "ok" if status == 200 else "not-ready"

    async def _probe_loop(self, state: ReplicaState) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            result = await self.probe(state)
            if result == "ok":
                if state.out:
                    log.info("replica %s at %s answers again: back in rotation", state.target.key, state.target.address)
                state.failures, state.out = 0, False
            else:
                state.failures += 1
                if state.failures >= self.failures:
                    if not state.out:
                        log.warning("replica %s at %s failed %d probes in a row (%s): out of rotation",
                                    state.target.key, state.target.address, state.failures, result)
                    state.out = True
                    if result == "silent":
                        for stop in list(state.waiting.values()):
                            stop("hung")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

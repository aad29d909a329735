"""Which replica a prompt goes to: the one that already holds its longest prefix, unless that one is too busy.

Pure (the standard library only): the edge asks it, a bench asks it, nothing here knows Django.

A replica's prefix cache (``runners/workloads/serve.py``, ``--prefix-block``) keeps the model's state
after each prompt prefix cut every few bytes. A request whose prompt starts with a prefix the replica
computed recently (a system prompt, a few-shot block) skips that part of its prompt. The router cannot
ask a replica what it holds on every request, so it keeps its own guess, built from what it sent where:

- a prompt is cut into blocks of ``block_chars`` characters; each whole-block prefix is known by a hash
  chained over its blocks (the hash of a prefix is the hash of (the hash of the prefix one block
  shorter, the last block)), so all the prefixes of a prompt cost one pass over it;
- per replica, the prefix hashes it was sent, oldest first; at most ``max_prefixes_per_replica`` of
  them, the oldest dropped first (as the replica's own cache drops its least recently used);
- for each prefix hash, the replicas that hold it, so a look-up is one dictionary read per block.

``order(prompt, replicas)`` ranks the replicas it is given (with their outstanding tokens, the load the
caller counts: prompt bytes plus max_tokens of what it sent and has not had answered). Replicas that
hold some of the prompt's prefix come first, longest prefix first (the less loaded first among equals),
as long as their load is within ``load_slack`` tokens of the least loaded replica's; every other replica
follows, least loaded first (ties by key). So a prefix sticks to the replica that computed it until that
replica is busier than the rest by more than the slack; the request then goes to the least loaded one,
which from then on holds the prefix too: a hot prefix spreads over as many replicas as its load needs.

``record(key, prompt)`` notes that the replica named ``key`` now holds the prompt's prefixes; ``forget(key)``
drops a replica that is gone. A prompt shorter than one block has no prefix to share: it is ranked by load
alone, and recording it notes nothing.

Costs: ``order`` and ``record`` are O(length of the prompt) plus, for ``order``, sorting the replicas
given; memory is one entry per (replica, prefix) it holds, at most ``max_prefixes_per_replica`` per
replica. Every method takes one lock, so one router may be shared by threads; on one event loop the lock
is never contended.

Why blocks of characters: the shipped server caches at multiples of ``--prefix-block`` bytes, so a
``block_chars`` that is a multiple of it makes every prefix the router counts one the replica can hold
(for ASCII prompts, where a character is a byte; other engines cache per token, and the match is then
approximate, which only costs a cache miss).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BLOCK_CHARS = 64
DEFAULT_MAX_PREFIXES_PER_REPLICA = 4096
# A prefix holder with this many more tokens of work ahead than the least loaded replica has a few decode
# steps' worth of extra wait, about what recomputing a few hundred bytes of prompt costs; more than that and
# the miss is the cheaper.
DEFAULT_LOAD_SLACK = 4096.0


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica the caller may send to, by its key, with the tokens it has sent there and not had answered."""

    key: str
    outstanding_tokens: int


class PrefixRouter:
    """Cache-aware replica order: the longest-prefix holder first, bounded by load (see the module's text)."""

    def __init__(
        self,
        *,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        max_prefixes_per_replica: int = DEFAULT_MAX_PREFIXES_PER_REPLICA,
        load_slack: float = DEFAULT_LOAD_SLACK,
    ) -> None:
        if isinstance(block_chars, bool) or not isinstance(block_chars, int) or block_chars < 1:
            raise ValueError("block_chars must be an integer >= 1")
        if isinstance(max_prefixes_per_replica, bool) or not isinstance(max_prefixes_per_replica, int) \
                or max_prefixes_per_replica < 1:
            raise ValueError("max_prefixes_per_replica must be an integer >= 1")
        if isinstance(load_slack, bool) or not isinstance(load_slack, (int, float)) or not load_slack >= 0:
            raise ValueError("load_slack must be a number of tokens >= 0")
        self.block_chars = block_chars
        self.max_prefixes_per_replica = max_prefixes_per_replica
        self.load_slack = float(load_slack)
        self._lock = threading.Lock()
        # key -> the prefix hashes it holds, least recently sent first (the values are unused).
        self._held: dict[str, OrderedDict[int, None]] = {}
        # prefix hash -> the keys that hold it.
        self._holders: dict[int, set[str]] = {}

    def _prefix_hashes(self, prompt: str) -> list[int]:
        """The chained hash of each whole-block prefix of the prompt, shortest first."""
        block = self.block_chars
        hashes, current = [], 0
        for end in range(block, len(prompt) + 1, block):
            current = hash((current, prompt[end - block:end]))
            hashes.append(current)
        return hashes

    def order(self, prompt: str, replicas: Sequence[ReplicaLoad]) -> list[str]:
        """The keys of `replicas`, most preferred first: each exactly once (a key given twice counts once)."""
        loads: dict[str, int] = {}
        for replica in replicas:
            if replica.key not in loads:
                loads[replica.key] = replica.outstanding_tokens
        if not loads:
            return []
        matched: dict[str, int] = {}  # key -> how many leading blocks of the prompt it holds
        hashes = self._prefix_hashes(prompt) if self._held else []  # outside the lock: it reads only the prompt
        with self._lock:
            for depth, prefix in enumerate(hashes, start=1):
                holders = self._holders.get(prefix)
                if not holders:
                    break  # a replica holding a longer prefix holds this one too (see record)
                for key in holders:
                    if key in loads:
                        matched[key] = depth
        bound = min(loads.values()) + self.load_slack
        preferred = sorted((key for key, depth in matched.items() if loads[key] <= bound),
                           key=lambda key: (-matched[key], loads[key], key))
        chosen = set(preferred)
        rest = sorted((key for key in loads if key not in chosen), key=lambda key: (loads[key], key))
        return preferred + rest

    def record(self, key: str, prompt: str) -> None:
        """The replica `key` now holds the prompt's prefixes (it was sent the prompt)."""
        hashes = self._prefix_hashes(prompt)
        if not hashes:
            return
        with self._lock:
            held = self._held.setdefault(key, OrderedDict())
            # Longest first, so each prefix is at least as recent as every longer one: the oldest entry,
            # the one evicted, is never the prefix of another entry held, and what a replica holds stays
            # closed under taking prefixes (order may stop at the first block nobody holds).
            for prefix in reversed(hashes):
                if prefix in held:
                    held.move_to_end(prefix)
                else:
                    held[prefix] = None
                    self._holders.setdefault(prefix, set()).add(key)
            while len(held) > self.max_prefixes_per_replica:
                prefix, _ = held.popitem(last=False)
                self._drop(prefix, key)

    def forget(self, key: str) -> None:
        """The replica `key` is gone: nothing is ranked first for a prefix it held."""
        with self._lock:
            held = self._held.pop(key, None)
            for prefix in held or ():
                self._drop(prefix, key)

    def _drop(self, prefix: int, key: str) -> None:
        holders = self._holders.get(prefix)
        if holders is not None:
            holders.discard(key)
            if not holders:
                del self._holders[prefix]

    def held(self, key: str) -> int:
        """How many prefixes the router thinks replica `key` holds (for metrics and tests)."""
        with self._lock:
            return len(self._held.get(key, ()))

    def size(self) -> int:
        """How many distinct prefixes the router keeps, over every replica."""
        with self._lock:
            return len(self._holders)

"""The inference server's settings: what the front (runners.workloads.serve) parses from its flags and hands
to its engine's process (runners.workloads.serve_engine). Apart from both, so that neither imports the other's
module for them: the engine's imports torch, the front's must not.
"""

from __future__ import annotations  # the fields' types stay names: the flags' parser reads them

from dataclasses import dataclass

# The shipped server's headers that the edge (runners.edge) speaks with it, named once for both sides.
# On a request: what is left of its deadline, counted from its arrival at the edge.
DEADLINE_HEADER = "x-portal-deadline-ms"
# On a 429 that refused one request's deadline alone ("deadline"), not a full replica: such a refusal says
# nothing of how much the replica takes, so the edge leaves its limit for the replica as it is.
REFUSED_HEADER = "x-portal-refused"


@dataclass(frozen=True)
class Settings:
    queue_limit: int = 128
    batch_token_budget: int = 65536
    max_batch_wait_ms: float = 20.0
    default_deadline_ms: float = 10_000.0
    max_deadline_ms: float = 120_000.0
    max_prompt_bytes: int = 2048
    max_tokens: int = 256
    prefix_cache_mib: float = 32.0
    prefix_block: int = 16

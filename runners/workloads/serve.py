"""The inference server: a model served over HTTP, the shipped trainer's checkpoint or a transformers model.

Run one process per replica::

    python -m runners.workloads.serve --checkpoint PATH [--port 8000] [...]

PATH is a checkpoint file the trainer wrote (`checkpoints/step-N.pt`) or a job folder, whose
newest checkpoint is taken: the model is the trainer's `CharModel`, one byte a token, restricted
to the bytes of the corpus it was trained on. Or PATH is a folder a transformers causal LM was
saved to with `save_pretrained` (it holds a `config.json`), or the .tar.gz of one (a model version
of format tar.gz, told by its content): the model is served with its own tokenizer and KV cache
(runners.workloads.serve_hf). Generation is greedy, or sampled at a request's temperature.

API::

    POST /v1/generate   {"prompt": str, "max_tokens": int, "deadline_ms": number (optional)}
        200 {"text", "tokens", "queue_ms", "compute_ms"}, header X-Time-To-First-Token-Ms
        400 {"<field>": ["why"]}       a field is missing, of the wrong type, out of range or unknown
        413 / 415                      the body is too large / not application/json
        429 {"detail"} + Retry-After   the queue is full, or the deadline can't be met behind the work ahead
        503 {"detail"} + Retry-After   draining (SIGTERM received): nothing new is admitted
        504 {"detail"}                 the deadline passed before the answer was ready
    POST /v1/completions, POST /v1/chat/completions
                   OpenAI's request and answer shapes (runners.workloads.serve_openai): max_tokens, stop,
                   temperature, seed, stream (server-sent events ending `data: [DONE]`), usage;
                   deadline_ms as an extension. Refusals as above, in OpenAI's error shape
                   {"error": {"message", "type", "param", "code"}}.
    GET /healthz   200 while the process serves; 503 once the engine's process has stopped
    GET /readyz    200 once the model is loaded and warm, 503 before and while draining
    GET /metrics   Prometheus text: requests received and refused by the front (invalid, draining),
                   callers gone, queue depth, running sequences, batch tokens, time to first token,
                   latency, outcomes (answered, shed, expired, cancelled), tokens, prefix-cache lookups,
                   hits and bytes, the step-time estimate

Every generate route honours the header `X-Portal-Deadline-Ms: <ms left>` (the edge sets it): the
deadline is the smaller of it and the body's deadline_ms (or the default); 0 or less is a 504, not
a number a 400 naming the header. A caller that closes its connection before its answer is done
(a stream dropped halfway, or a request still waiting) cancels the request in the engine: it
leaves the queue or the batch at the next step, and its budget is free.

Two processes. The replica's main process is the HTTP front (asyncio: one event loop for
every connection) and checks each request; the engine runs in a process of its own (spawned)
so that reading requests never waits for the model's interpreter, and the two talk over a
pipe. The engine ignores SIGTERM and SIGINT: the front decides when it stops.

How work flows. A request is checked, then admitted to a bounded queue ordered by deadline
(earliest first) or refused at once: never left to time out. One engine thread runs the
model. Each iteration it drops queued requests whose deadline has passed or can no longer be
met (answered 504, before they cost compute), lets waiting requests join the running batch
while the sum of their token costs (prompt tokens plus max_tokens) fits the batch token
budget, computes the joiners' prompts (each from the prefix cache's state where a prefix of it
is cached; the CharModel's in one packed call, a transformers model's one joiner at a time),
then runs one decode step for every running sequence together (a transformers model's KV
caches held as one left-padded batch). A sequence that is done (max_tokens, its end-of-sequence
token, a stop string) leaves at once and its budget goes to waiting requests, so a short
request is never held behind a long one (continuous, iteration-level batching). Prompts are
paid per position, so joiners are gathered: they join when a quarter of the budget is free,
when `--max-batch-wait-ms` has passed since the last join, or when the head of the queue could
not wait that long.
A running request still unfinished at its deadline is answered 504 then, so no caller waits
past its deadline.

What the refusals are estimated with: the time of a decode step and of a prompt token, each a
running average of what the engine computed. On a GPU that is the wall time of the work (the
device computes while the engine's thread waits for it). On a CPU it is the wall time, but never
more than the CPU time the engine's process got meanwhile (`time.process_time()`, every thread
of the process: torch's own threads compute the model): time the process sat runnable on a
contended core without running is not compute, and counting it made the server refuse requests
it had the cycles to serve.

The prefix cache keeps the model's state after prompt prefixes cut at every
`--prefix-block` tokens (bytes for the CharModel), keyed by the prefix itself, bounded in bytes and evicted least
recently used: a system prompt many requests share is computed once. The output is the
same with the cache on or off.

Drain: on SIGTERM (or SIGINT) readiness goes false, nothing new is admitted, everything
admitted is answered, then the process exits 0.

Configuration: every flag has an environment variable; a flag wins over its variable,
which wins over the default.

    flag                    variable                   default
    --checkpoint            SERVE_CHECKPOINT           (required)
    --host                  SERVE_HOST                 127.0.0.1
    --port                  SERVE_PORT                 8000    0: any free port
    --queue-limit           SERVE_QUEUE_LIMIT          64      requests waiting, beyond the running batch
    --batch-token-budget    SERVE_BATCH_TOKEN_BUDGET   16384   prompt bytes + max_tokens over the batch
    --max-batch-wait-ms     SERVE_MAX_BATCH_WAIT_MS    5       how long waiting requests are gathered to join
                                                               together (unless a quarter of the budget is
                                                               free or the head of the queue can't wait)
    --default-deadline-ms   SERVE_DEFAULT_DEADLINE_MS  10000
    --max-deadline-ms       SERVE_MAX_DEADLINE_MS      120000
    --max-prompt-bytes      SERVE_MAX_PROMPT_BYTES     2048
    --max-tokens            SERVE_MAX_TOKENS           256     the most one request may ask for
    --prefix-cache-mib      SERVE_PREFIX_CACHE_MIB     32      0: no prefix cache
    --prefix-block          SERVE_PREFIX_BLOCK         16      bytes between cached prefix states
    --device                SERVE_DEVICE               auto    cuda when available, else cpu
    --activity-file         SERVE_ACTIVITY_FILE        (none)  where the engine writes how busy it is

With --activity-file, the engine's process writes every ~2 s (and as it exits) the share of wall
time it spent running the model (prompts and decode steps; waiting for requests is idle) and its
resident memory: see `runners.workloads.activity`.

Once it listens, the server prints `PORTAL_SERVE_LISTENING {"host": ..., "port": ...}`.
Exit codes: 0 after a drain; 1 on an error (the checkpoint does not load, or the engine's
process stopped: every caller still waiting is answered 503 first); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tarfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from http import HTTPStatus
from pathlib import Path

import torch
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

from runners.workloads import serve_openai
from runners.workloads.activity import ActivityMeter
from runners.workloads.progress import checkpoint_files, tagged_line
from runners.workloads.serve_hf import plain_chat
from runners.workloads.train import CHECKPOINT_FORMAT, VOCAB, CharModel

LISTENING_TAG = "PORTAL_SERVE_LISTENING"
MAX_BODY_BYTES = 64 * 1024
REQUEST_FIELDS = {"prompt", "max_tokens", "deadline_ms"}


# --- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    queue_limit: int = 64
    batch_token_budget: int = 16384
    max_batch_wait_ms: float = 5.0
    default_deadline_ms: float = 10_000.0
    max_deadline_ms: float = 120_000.0
    max_prompt_bytes: int = 2048
    max_tokens: int = 256
    prefix_cache_mib: float = 32.0
    prefix_block: int = 16


def _at_least(minimum: float, kind=int):
    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a number >= {minimum}")
        return value
    return parse


def parse_args(argv: list[str] | None = None, environ: dict | None = None) -> argparse.Namespace:
    environ = os.environ if environ is None else environ

    def env(name: str, default):
        return environ.get(f"SERVE_{name}", default)

    parser = argparse.ArgumentParser(prog="python -m runners.workloads.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=env("CHECKPOINT", None), required=env("CHECKPOINT", None) is None)
    parser.add_argument("--host", default=env("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=_at_least(0), default=env("PORT", "8000"))
    # One flag per Settings field, named after it, its default the field's (one source of truth).
    minimum = {"queue_limit": 1, "batch_token_budget": 2, "max_batch_wait_ms": 0, "default_deadline_ms": 1,
               "max_deadline_ms": 1, "max_prompt_bytes": 1, "max_tokens": 1, "prefix_cache_mib": 0, "prefix_block": 1}
    for spec in fields(Settings):
        parser.add_argument(
            "--" + spec.name.replace("_", "-"), dest=spec.name,
            type=_at_least(minimum[spec.name], float if spec.type == "float" else int),
            default=env(spec.name.upper(), str(spec.default)),
        )
    parser.add_argument("--device", default=env("DEVICE", "auto"))
    parser.add_argument("--activity-file", type=Path, default=env("ACTIVITY_FILE", None))
    args = parser.parse_args(argv)
    # argparse applies `type` to string defaults, so variables are checked like flags.
    if args.default_deadline_ms > args.max_deadline_ms:
        parser.error("--default-deadline-ms must not exceed --max-deadline-ms")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(**{spec.name: getattr(args, spec.name) for spec in fields(Settings)})


# --- the model -----------------------------------------------------------------------------------


def checkpoint_path(path: Path) -> Path:
    """A checkpoint file as given, or the newest one of a job folder."""
    path = Path(path)
    if path.is_dir():
        files = checkpoint_files(path)
        if not files:
            raise FileNotFoundError(f"no checkpoint in {path}")
        return files[max(files)]
    return path


def load_model(path: Path, device: torch.device) -> tuple[CharModel, bytes]:
    """(the model in eval mode, the bytes it was trained on: every byte for checkpoints older than that record)."""
    state = torch.load(checkpoint_path(path), map_location=device, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT or "model" not in state:
        raise ValueError(f"{path} is not a checkpoint of the shipped trainer")
    model = CharModel().to(device)
    model.load_state_dict(state["model"])
    model.eval()
    alphabet = state.get("alphabet")
    alphabet = bytes(alphabet.tolist()) if alphabet is not None and len(alphabet) else bytes(range(VOCAB))
    return model, alphabet


def load_runner(path: Path, device: torch.device, settings: Settings):
    """(the runner serving `path`, a temporary folder to remove at exit or None).

    A folder with a config.json, or a .tar.gz (by its content: a model version's weights are named by their
    hash) of such a folder, is a transformers model (runners.workloads.serve_hf); anything else a checkpoint
    of the shipped trainer, or a job folder whose newest checkpoint is taken."""
    from runners.workloads import serve_hf

    cache = PrefixCache(int(settings.prefix_cache_mib * 1024 * 1024), settings.prefix_block)
    path = Path(path)
    temp = None
    if path.is_file() and tarfile.is_tarfile(path):
        path, temp = serve_hf.unpack_model(path)
    try:
        if serve_hf.is_hf_folder(path):
            return serve_hf.HFRunner(path, device, cache), temp
        model, alphabet = load_model(path, device)
        return CharRunner(model, alphabet, device, cache), temp
    except BaseException:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        raise


def _finite(number: int | float) -> bool:
    """Whether a JSON number is a finite float: an integer of 400 digits is neither, and must not raise."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def check_request(body, s: Settings, allowed: frozenset | None) -> tuple[bytes, int, float]:
    """(prompt bytes, max_tokens, deadline_ms) of a request body, or ValueError({field: why}).

    `allowed`: the bytes the CharModel may read (then its prompt bytes are its tokens, checked against the
    budget here); None for a transformers model, whose engine counts the prompt's tokens itself."""
    if not isinstance(body, dict):
        raise ValueError({"non_field_errors": "the body must be a JSON object"})
    unknown = sorted(set(body) - REQUEST_FIELDS)
    if unknown:
        raise ValueError({unknown[0]: f"unknown field; the fields are {', '.join(sorted(REQUEST_FIELDS))}"})
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError({"prompt": "required, a string"})
    try:
        data = prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError({"prompt": "not valid text (a lone surrogate)"}) from None
    if not data:
        raise ValueError({"prompt": "must not be empty"})
    if len(data) > s.max_prompt_bytes:
        raise ValueError({"prompt": f"{len(data)} bytes; at most {s.max_prompt_bytes}"})
    if allowed is not None and not set(data) <= allowed:
        unseen = sorted({ch for ch in prompt if not set(ch.encode("utf-8")) <= allowed})
        shown = "".join(unseen)[:20]
        raise ValueError({"prompt": f"holds characters the model never saw in training: {shown!r}"})
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ValueError({"max_tokens": "required, an integer"})
    if not 1 <= max_tokens <= s.max_tokens:
        raise ValueError({"max_tokens": f"must be between 1 and {s.max_tokens}"})
    if allowed is not None and len(data) + max_tokens > s.batch_token_budget:
        raise ValueError({"max_tokens": f"prompt bytes + max_tokens must fit the batch budget of {s.batch_token_budget}"})
    deadline_ms = body.get("deadline_ms", s.default_deadline_ms)
    if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, (int, float)) or not _finite(deadline_ms):
        raise ValueError({"deadline_ms": "a number of milliseconds"})
    if deadline_ms <= 0:
        raise ValueError({"deadline_ms": "must be positive: the deadline is that long after the request arrives"})
    if deadline_ms > s.max_deadline_ms:
        raise ValueError({"deadline_ms": f"at most {s.max_deadline_ms:g}"})
    return data, max_tokens, float(deadline_ms)


class PrefixCache:
    """The model's state after prompt prefixes cut every `block` tokens; least recently used goes first.

    Keys are prompt prefixes (bytes for the CharModel, tuples of token ids for a transformers model); a
    state is a tensor (the CharModel's hidden state) or a list of (key, value) tensors a layer (a KV cache).
    """

    ENTRY_OVERHEAD = 120  # the dict slot, the key object and the tensor's header, roughly

    def __init__(self, limit_bytes: int, block: int) -> None:
        self.limit = limit_bytes
        self.block = block
        self.entries: OrderedDict = OrderedDict()
        self.bytes = 0
        self.lookups = 0
        self.hits = 0
        self.tokens_saved = 0

    def longest(self, prompt):
        """(how many leading tokens are covered, the state after them): at least one token is always left to run."""
        if self.limit <= 0 or len(prompt) <= self.block:
            return 0, None
        self.lookups += 1
        for length in range((len(prompt) - 1) // self.block * self.block, 0, -self.block):
            state = self.entries.get(prompt[:length])
            if state is not None:
                self.entries.move_to_end(prompt[:length])
                self.hits += 1
                self.tokens_saved += length
                return length, state
        return 0, None

    def store(self, prompt, start: int, states: torch.Tensor) -> None:
        """Keep the states at block boundaries past `start`; `states[i]` is the state after token start + i."""
        if self.limit <= 0:
            return
        first = (start // self.block + 1) * self.block
        for length in range(first, len(prompt) + 1, self.block):
            if prompt[:length] in self.entries:
                self.entries.move_to_end(prompt[:length])
                continue
            self.put(prompt[:length], states[length - start - 1].clone())

    def put(self, key, state) -> None:
        """Keep `state` as the state after the prefix `key` (already owned: not copied here)."""
        if self.limit <= 0:
            return
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        self.entries[key] = state
        self.bytes += self._size(key, state)
        while self.bytes > self.limit and self.entries:
            old, dropped = self.entries.popitem(last=False)
            self.bytes -= self._size(old, dropped)

    def _size(self, key, state) -> int:
        tensors = [state] if isinstance(state, torch.Tensor) else [t for pair in state for t in pair]
        width = 1 if isinstance(key, bytes) else 8
        return len(key) * width + sum(t.numel() * t.element_size() for t in tensors) + self.ENTRY_OVERHEAD


class CharRunner:
    """The shipped trainer's CharModel behind the engine's runner interface (see serve_hf.HFRunner): one byte a
    token, restricted to the bytes of the corpus it was trained on. Its batch is one GRU state a row."""

    kind = "char"
    eos = frozenset()

    def __init__(self, model: CharModel, alphabet: bytes, device: torch.device, cache: PrefixCache) -> None:
        self.model = model
        self.alphabet = alphabet
        self.allowed = frozenset(alphabet)
        self.device = device
        self.cache = cache
        self.mask = torch.full((VOCAB,), float("-inf"), device=device)
        self.mask[list(self.allowed)] = 0.0
        hidden_size = model.rnn.hidden_size
        self.zero_state = torch.zeros(hidden_size, device=device)
        self.h = torch.zeros(0, hidden_size, device=device)

    def encode(self, text: str) -> bytes:
        return text.encode("utf-8")

    def decode(self, tokens) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")

    def chat(self, messages: list[dict]) -> bytes:
        return plain_chat(messages).encode("utf-8")

    def check(self, prompt, max_tokens: int):
        return None  # the front checked the bytes against the alphabet and the budget

    def warm_prefill(self) -> int:
        """Run one prompt (the first calls allocate); how many tokens it had."""
        self.model.rnn(self.model.embed(torch.tensor([list(self.alphabet[:1]) * 64], device=self.device)))
        return 64

    def warm_step(self) -> None:
        """Run one decode step of a 32-row batch, as `step` would."""
        hidden = torch.zeros(1, 32, self.model.rnn.hidden_size, device=self.device)
        out, _ = self.model.rnn(self.model.embed(torch.zeros(32, 1, dtype=torch.long, device=self.device)), hidden)
        (self.model.head(out[:, 0]) + self.mask).argmax(-1).tolist()

    def prefill(self, prompts: list[bytes]) -> torch.Tensor:
        """The prompts together, each from its longest cached prefix on, in one packed call: a recurrent model
        pays per position, so the call is as long as the longest prompt left to run, not the sum of them."""
        starts, states = [], []
        for prompt in prompts:
            start, state = self.cache.longest(prompt)
            starts.append(start)
            states.append(self.zero_state if state is None else state)
        suffixes = [torch.tensor(list(p[start:]), device=self.device) for p, start in zip(prompts, starts)]
        packed = pack_sequence([self.model.embed(t) for t in suffixes], enforce_sorted=False)
        out, hidden = self.model.rnn(packed, torch.stack(states).unsqueeze(0))
        out, _ = pad_packed_sequence(out, batch_first=True)
        hidden = hidden[0]  # each row's state after its own last position
        for i, prompt in enumerate(prompts):
            self.cache.store(prompt, starts[i], out[i, : len(suffixes[i])])
        self.h = torch.cat([self.h, hidden])
        return self.model.head(hidden) + self.mask

    def step(self, last: torch.Tensor) -> torch.Tensor:
        out, hidden = self.model.rnn(self.model.embed(last.view(-1, 1)), self.h.unsqueeze(0))
        self.h = hidden[0]
        return self.model.head(out[:, 0]) + self.mask

    def keep(self, rows: list[int]) -> None:
        self.h = self.h[torch.tensor(rows, dtype=torch.long, device=self.device)]


# --- the engine ----------------------------------------------------------------------------------


class Refused(Exception):
    """Answered at once with this status, a message and, for 429 and 503, a Retry-After in seconds; a 400
    names its field."""

    def __init__(self, status: int, detail: str, retry_after: int | None = None, field: str | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.retry_after, self.field = status, detail, retry_after, field


CANCELLED = 499  # the status of a request whose caller went away (nginx's "client closed request")


@dataclass(eq=False)
class Sequence:
    prompt: bytes | tuple
    max_tokens: int
    arrived: float
    deadline: float
    cost: int = 0
    joined: float | None = None
    joined_step: int = 0
    first_token: float | None = None
    finished: float | None = None
    out: list[int] = field(default_factory=list)
    status: int = 0
    detail: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    on_done: object = None  # called with the sequence from the engine thread once it is answered
    on_delta: object = None  # streaming: called with (sequence, new text) as text becomes final
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    generator: torch.Generator | None = None
    cancelled: bool = False
    finish_reason: str = "length"
    text: str | None = None
    emitted: int = 0

    @property
    def compute_s(self) -> float:
        return 0.0 if self.joined is None else (self.finished or time.monotonic()) - self.joined

    def answer(self) -> dict:
        return {
            "text": self.text or "",
            "tokens": len(self.out),
            "queue_ms": round(((self.joined or self.arrived) - self.arrived) * 1000, 3),
            "compute_ms": round(self.compute_s * 1000, 3),
        }


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("serve_queue_depth", "Requests admitted and waiting to join the batch", registry=r)
        self.running = Gauge("serve_running_sequences", "Sequences in the running batch", registry=r)
        self.batch_tokens = Histogram(
            "serve_batch_tokens", "Token cost (prompt + max_tokens) of the running batch at each decode step",
            buckets=(16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768), registry=r,
        )
        latency_buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("serve_time_to_first_token_seconds", "Arrival to first token", buckets=latency_buckets, registry=r)
        self.latency = Histogram("serve_request_seconds", "Arrival to answer, answered requests", buckets=latency_buckets, registry=r)
        self.outcomes = Counter("serve_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in ("answered", "shed", "expired", "draining", "cancelled"):
            self.outcomes.labels(outcome)
        self.tokens = Counter("serve_generated_tokens", "Tokens generated", registry=r)
        self.prefix_lookups = Counter("serve_prefix_cache_lookups", "Prompts looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("serve_prefix_cache_hits", "Prompts that reused a cached prefix", registry=r)
        self.prefix_bytes = Gauge("serve_prefix_cache_bytes", "Bytes the prefix cache holds", registry=r)
        self.step_estimate = Gauge(
            "serve_step_seconds_estimate", "The decode-step time the refusals are estimated with (computed time only)",
            registry=r,
        )


class Engine:
    """The bounded queue, the running batch and the one thread that runs the model.

    `model` is a CharModel (with `alphabet`, the bytes it may read and write) or a runner with the interface
    of `serve_hf.HFRunner`.
    """

    def __init__(self, model, alphabet: bytes | None = None, settings: Settings | None = None,
                 device: torch.device | str = "cpu") -> None:
        settings = settings or Settings()
        self.settings = settings
        self.device = torch.device(device)
        if isinstance(model, CharModel):
            cache = PrefixCache(int(settings.prefix_cache_mib * 1024 * 1024), settings.prefix_block)
            model = CharRunner(model, alphabet, self.device, cache)
        self.runner = model
        self.cache = model.cache
        self.allowed = model.allowed
        self.metrics = Metrics()
        self.activity = ActivityMeter()  # the engine thread's time in the model, for the simulated GPU's reading
        self.lock = threading.Condition()
        self.queue: list[tuple[float, int, Sequence]] = []  # a heap by deadline: earliest first
        self.queued_cost = 0
        self.active: list[Sequence] = []  # in the batch or joining it, under the lock: for the estimates
        self.running_cost = 0
        self.rows: list[Sequence] = []  # the running batch, row by row, touched by the engine thread only
        self.first_deadline = math.inf
        self.step_no = 0
        self.last_join = 0.0
        self.order = itertools.count()
        self.draining = False
        self.answered = 0
        self.cancelled = 0
        self.peak_batch_tokens = 0
        # Running estimates, for refusing at once what can't be served in time.
        self.step_s = 0.001
        self.prefill_s_per_byte = 0.00002  # a prompt token's (a byte's, for the CharModel)
        self.thread = threading.Thread(target=self._loop, name="serve-engine", daemon=True)

    # -- requests, from the thread that takes them --

    def submit(
        self, prompt: bytes | tuple, max_tokens: int, deadline_ms: float, *, arrived: float | None = None,
        on_done=None, on_delta=None, stop=(), temperature: float = 0.0, seed: int | None = None,
    ) -> Sequence:
        """Admit a checked request to the queue, or raise Refused at once. `prompt` is its tokens."""
        now = time.monotonic()
        problem = self.runner.check(prompt, max_tokens)
        if problem is None and len(prompt) + max_tokens > self.settings.batch_token_budget:
            problem = ("max_tokens", f"prompt tokens ({len(prompt)}) + max_tokens must fit the batch budget of "
                                     f"{self.settings.batch_token_budget}")
        if problem is not None:
            raise Refused(400, problem[1], field=problem[0])
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        seq = Sequence(
            prompt=prompt, max_tokens=max_tokens, arrived=arrived or now, deadline=(arrived or now) + deadline_ms / 1000,
            cost=len(prompt) + max_tokens, on_done=on_done, on_delta=on_delta, stop=tuple(stop),
            temperature=temperature, generator=generator,
        )
        with self.lock:
            if self.draining:
                self.metrics.outcomes.labels("draining").inc()
                raise Refused(503, "draining: this replica is stopping; try another or retry", retry_after=1)
            if len(self.queue) >= self.settings.queue_limit:
                self.metrics.outcomes.labels("shed").inc()
                raise Refused(429, "the queue is full", retry_after=max(1, math.ceil(self._drain_estimate())))
            wait = self._wait_estimate(seq)
            finish = now + wait + self._own_estimate(seq)
            if finish > seq.deadline:
                self.metrics.outcomes.labels("shed").inc()
                raise Refused(
                    429, f"cannot meet the deadline behind the work ahead (about {wait * 1000:.0f} ms of waiting)",
                    retry_after=max(1, math.ceil(wait)),
                )
            heapq.heappush(self.queue, (seq.deadline, next(self.order), seq))
            self.queued_cost += seq.cost
            self.metrics.queue_depth.set(len(self.queue))
            self.lock.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """The caller went away: a waiting request leaves the queue now, a running one the batch at the next step."""
        with self.lock:
            if seq.done.is_set() or seq.cancelled:
                return
            seq.cancelled = True
            waiting = seq.joined is None
            if waiting:
                self.queue = [item for item in self.queue if item[2] is not seq]
                heapq.heapify(self.queue)
                self.queued_cost -= seq.cost
                self.metrics.queue_depth.set(len(self.queue))
            self.lock.notify_all()
        if waiting:
            self._finish(seq, CANCELLED, "the caller went away while the request waited")

    def _own_estimate(self, seq: Sequence) -> float:
        return len(seq.prompt) * self.prefill_s_per_byte + seq.max_tokens * self.step_s

    def _wait_estimate(self, seq: Sequence) -> float:
        """Seconds until `seq` could join the batch, behind the running batch and what the queue puts ahead of it."""
        ahead = [s for _, _, s in self.queue if s.deadline <= seq.deadline]
        if self.running_cost + sum(s.cost for s in ahead) + seq.cost <= self.settings.batch_token_budget:
            return 0.0
        return self._backlog_s(ahead)

    def _drain_estimate(self) -> float:
        return self._backlog_s([s for _, _, s in self.queue])

    def _backlog_s(self, queued: list[Sequence]) -> float:
        """Seconds for the running batch and `queued` to go through: each holds its cost of the budget for
        as many steps as it has tokens left."""
        held = sum(s.cost * max(0, s.max_tokens - (self.step_no - s.joined_step)) for s in self.active)
        held += sum(s.cost * s.max_tokens for s in queued)
        return held / self.settings.batch_token_budget * self.step_s

    def drain(self) -> None:
        with self.lock:
            self.draining = True
            self.lock.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while self.queue or self.active:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.lock.wait(left if left is not None else 0.5)
        return True

    # -- the engine thread --

    def start(self) -> None:
        with torch.inference_mode():
            # The estimates start from real figures, counted as the engine's own compute (below).
            self.runner.warm_prefill()
            wall, cpu = time.monotonic(), time.process_time()
            tokens = sum(self.runner.warm_prefill() for _ in range(2))
            self._sync()
            self.prefill_s_per_byte = self._computed_s(wall, cpu) / tokens
            self.runner.warm_step()
            wall, cpu = time.monotonic(), time.process_time()
            for _ in range(3):
                self.runner.warm_step()
            self.step_s = self._computed_s(wall, cpu) / 3
        self.metrics.step_estimate.set(self.step_s)
        self.thread.start()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _computed_s(self, wall_started: float, cpu_started: float) -> float:
        """Seconds the engine computed since the two readings. On a GPU, the wall time (the device computes
        while the thread waits for it). On a CPU, the wall time but never more than the CPU time the engine's
        process got meanwhile: time the process sat runnable but not running (a contended core) is no compute,
        and an estimate that counted it would refuse requests the engine had the cycles to serve."""
        wall = time.monotonic() - wall_started
        if self.device.type == "cuda":
            return wall
        return min(wall, time.process_time() - cpu_started)

    def _finish(self, seq: Sequence, status: int, detail: str = "") -> None:
        seq.status, seq.detail = status, detail
        now = seq.finished = time.monotonic()
        if status == 200:
            self.answered += 1
            self.metrics.outcomes.labels("answered").inc()
            self.metrics.latency.observe(now - seq.arrived)
        elif status == CANCELLED:
            self.cancelled += 1
            self.metrics.outcomes.labels("cancelled").inc()
        else:
            self.metrics.outcomes.labels("expired").inc()
        seq.done.set()
        if seq.on_done is not None:
            seq.on_done(seq)

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                joiners = self._next_joiners()
                wall, cpu = time.monotonic(), time.process_time()
                with self.activity.busy():
                    joiners = self._drop_cancelled(joiners)
                    if joiners:
                        self._prefill(joiners)
                    if self.rows:
                        self._step()
                        # What the estimates use: the compute of a whole iteration (the joiners' prompts and
                        # the step), idle waits left out, and time the process was not running left out.
                        self.step_s = 0.95 * self.step_s + 0.05 * self._computed_s(wall, cpu)
                        self.metrics.step_estimate.set(self.step_s)

    def _drop_cancelled(self, joiners: list[Sequence]) -> list[Sequence]:
        gone = [s for s in joiners if s.cancelled]
        if any(s.cancelled for s in self.rows):
            keep = [i for i, s in enumerate(self.rows) if not s.cancelled]
            gone += [s for s in self.rows if s.cancelled]
            self.rows = [self.rows[i] for i in keep]
            self.runner.keep(keep)
        if gone:
            self._leave(gone, CANCELLED, "the caller went away; its sequence stopped computing")
        return [s for s in joiners if not s.cancelled]

    def _next_joiners(self) -> list[Sequence]:
        s = self.settings
        with self.lock:
            while not self.queue and not self.active:
                self.metrics.running.set(0)
                self.lock.notify_all()  # wait_idle
                self.lock.wait()
            if not self.active and self.queue and s.max_batch_wait_ms > 0:
                # An idle engine lets a batch form for a moment, unless it is full already.
                oldest = min(seq.arrived for _, _, seq in self.queue)
                until = oldest + s.max_batch_wait_ms / 1000
                while self.queued_cost < s.batch_token_budget and time.monotonic() < until and not self.draining:
                    self.lock.wait(max(0.0, until - time.monotonic()))
            now = time.monotonic()
            joiners: list[Sequence] = []
            if self.active and not self._join_now(now):
                self.metrics.queue_depth.set(len(self.queue))
                return joiners
            while self.queue:
                _, _, head = self.queue[0]
                if head.deadline <= now + self._own_estimate(head):
                    heapq.heappop(self.queue)
                    self.queued_cost -= head.cost
                    late = "passed" if head.deadline <= now else "can no longer be met"
                    self._finish(head, 504, f"the deadline {late} while the request waited; it cost no compute")
                    continue
                if self.running_cost + head.cost > s.batch_token_budget:
                    break  # earliest deadline first: nothing jumps the head
                heapq.heappop(self.queue)
                self.queued_cost -= head.cost
                self.running_cost += head.cost
                head.joined = now
                head.joined_step = self.step_no
                joiners.append(head)
                self.active.append(head)
                self.peak_batch_tokens = max(self.peak_batch_tokens, self.running_cost)
            if joiners:
                self.last_join = now
            self.metrics.queue_depth.set(len(self.queue))
            self.metrics.running.set(len(self.active))
            return joiners

    def _join_now(self, now: float) -> bool:
        """Whether waiting requests join the running batch at this step.

        A recurrent model pays its prompts per position, so joiners are let in together: when a
        quarter of the budget is free, when `max_batch_wait_ms` has passed since the last join, or
        when the head of the queue could not wait that long.
        """
        if not self.queue:
            return False
        s = self.settings
        wait = s.max_batch_wait_ms / 1000
        if now - self.last_join >= wait or s.batch_token_budget - self.running_cost >= s.batch_token_budget / 4:
            return True
        _, _, head = self.queue[0]
        return head.deadline - now - self._own_estimate(head) < 2 * wait

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """The next token of each row: the most likely (temperature 0), or drawn from the softmax at the
        request's temperature with the request's own generator (seeded when it gave a seed)."""
        tokens = logits.argmax(-1).tolist()  # the one wait for the device a step
        for i, seq in enumerate(seqs):
            if seq.temperature > 0:
                probs = torch.softmax(logits[i].float() / seq.temperature, -1)
                tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
        return tokens

    def _prefill(self, joiners: list[Sequence]) -> None:
        """The joiners' prompts (each from its longest cached prefix on) join the batch with their first token."""
        wall, cpu = time.monotonic(), time.process_time()
        lookups, hits, saved = self.cache.lookups, self.cache.hits, self.cache.tokens_saved
        logits = self.runner.prefill([seq.prompt for seq in joiners])
        self.rows.extend(joiners)
        self.metrics.prefix_lookups.inc(self.cache.lookups - lookups)
        self.metrics.prefix_hits.inc(self.cache.hits - hits)
        self.metrics.prefix_bytes.set(self.cache.bytes)
        tokens = self._pick(logits, joiners)
        now = time.monotonic()
        ran = max(1, sum(len(seq.prompt) for seq in joiners) - (self.cache.tokens_saved - saved))
        self.prefill_s_per_byte = 0.9 * self.prefill_s_per_byte + 0.1 * (self._computed_s(wall, cpu) / ran)
        for seq in joiners:
            seq.first_token = now
            self.metrics.ttft.observe(now - seq.arrived)
        self.metrics.tokens.inc(len(joiners))
        self._advance(len(self.rows) - len(joiners), tokens, now)

    def _step(self) -> None:
        """One decode step for every row at once; then the rows that are done, or out of time, leave."""
        last = torch.tensor([seq.out[-1] for seq in self.rows], dtype=torch.long, device=self.device)
        logits = self.runner.step(last)
        tokens = self._pick(logits, self.rows)
        self.step_no += 1
        self.metrics.batch_tokens.observe(self.running_cost)
        self.metrics.tokens.inc(len(self.rows))
        self._advance(0, tokens, time.monotonic())

    def _advance(self, first_row: int, tokens: list[int], now: float) -> None:
        """Rows from `first_row` on take their new tokens; those done (max_tokens, an end-of-sequence token, a
        stop string) or past their deadline leave the batch."""
        done, late = [], []
        for seq, token in zip(self.rows[first_row:], tokens):
            finished = False
            if token in self.runner.eos:
                seq.finish_reason, finished = "stop", True
            else:
                seq.out.append(token)
                finished = len(seq.out) >= seq.max_tokens
            if seq.stop or seq.on_delta is not None:
                finished = self._text_so_far(seq, finished)
            if finished:
                done.append(seq)
            elif seq.deadline <= now:
                late.append(seq)
        if not done and not late:
            return
        gone = set(done) | set(late)
        keep = [i for i, seq in enumerate(self.rows) if seq not in gone]
        self.rows = [self.rows[i] for i in keep]
        self.runner.keep(keep)
        self.first_deadline = min((seq.deadline for seq in self.rows), default=math.inf)
        self._leave(done, 200)
        for seq in late:
            self._leave([seq], 504, f"the deadline passed after {len(seq.out)} of {seq.max_tokens} tokens")

    def _text_so_far(self, seq: Sequence, finished: bool) -> bool:
        """Decode the sequence's text; cut it at a stop string (then it is finished); stream what is final."""
        text = self.runner.decode(seq.out)
        if seq.stop:
            found = [i for i in (text.find(stop) for stop in seq.stop) if i >= 0]
            if found:
                text, finished, seq.finish_reason = text[: min(found)], True, "stop"
        seq.text = text
        if seq.on_delta is None:
            return finished
        final = len(text)
        if not finished:
            # Held back: what could still turn out to be the start of a stop string, and a character whose
            # bytes are not all there yet.
            final -= max((len(stop) for stop in seq.stop), default=1) - 1
            while final > seq.emitted and text[final - 1] == "\ufffd":
                final -= 1
        if final > seq.emitted:
            seq.on_delta(seq, text[seq.emitted:final])
            seq.emitted = final
        return finished

    def _leave(self, seqs: list[Sequence], status: int, detail: str = "") -> None:
        with self.lock:
            for seq in seqs:
                self.active.remove(seq)
                self.running_cost -= seq.cost
            self.metrics.running.set(len(self.active))
        for seq in seqs:
            if status == 200 and seq.text is None:
                seq.text = self.runner.decode(seq.out)
            self._finish(seq, status, detail)



# --- the engine's process -------------------------------------------------------------------------


def _write_activity(meter: ActivityMeter, path: Path) -> None:
    """The engine's activity, a record a window, for as long as the process lives (a daemon thread)."""
    while True:
        time.sleep(meter.window_s)
        meter.write(path)


def engine_main(conn, checkpoint: str, device: str, settings: Settings, activity_file: Path | None) -> None:
    """The engine in a process of its own: it takes requests over `conn` and sends their answers back.

    Messages in: ("submit", id, request), ("cancel", id), ("drain",), ("metrics", id), ("exit",); a request
    is a dict: "prompt" (text) or "messages" (a chat), "max_tokens", "deadline_ms", "arrived", and optionally
    "stop", "temperature", "seed", "stream". Out: ("ready", alphabet or None, device, kind), ("delta", id,
    text) while a streamed request's text comes, ("done", id, status, body, headers), ("idle",) once
    drained, ("metrics", id, text), ("bye", answered).
    """
    # The front decides when this process stops: a signal to the process group must not cut a drain short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner, temp = load_runner(Path(checkpoint), torch.device(device), settings)
    try:
        _engine_serve(conn, runner, device, settings, activity_file)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _engine_serve(conn, runner, device: str, settings: Settings, activity_file: Path | None) -> None:
    engine = Engine(runner, None, settings, device)
    engine.start()
    if activity_file is not None:
        threading.Thread(
            target=_write_activity, args=(engine.activity, activity_file), name="serve-activity", daemon=True
        ).start()
    lock = threading.Lock()
    running: dict[int, Sequence] = {}

    def send(message) -> None:
        with lock:
            conn.send(message)

    def answered(rid: int, seq: Sequence) -> None:
        running.pop(rid, None)
        if seq.status == CANCELLED:
            return  # nobody is waiting
        if seq.status == 200:
            ttft_ms = (seq.first_token - seq.arrived) * 1000
            body = {**seq.answer(), "prompt_tokens": len(seq.prompt), "finish_reason": seq.finish_reason}
            send(("done", rid, 200, body, {"X-Time-To-First-Token-Ms": f"{ttft_ms:.3f}"}))
        else:
            send(("done", rid, seq.status, {"detail": seq.detail}, {}))

    def submit(rid: int, request: dict) -> None:
        try:
            if "messages" in request:
                prompt = runner.chat(request["messages"])
            else:
                prompt = runner.encode(request["prompt"])
            running[rid] = engine.submit(
                prompt, request["max_tokens"], request["deadline_ms"], arrived=request["arrived"],
                on_done=lambda seq: answered(rid, seq),
                on_delta=(lambda seq, text: send(("delta", rid, text))) if request.get("stream") else None,
                stop=request.get("stop", ()), temperature=request.get("temperature", 0.0), seed=request.get("seed"),
            )
        except Refused as refused:
            headers = {} if refused.retry_after is None else {"Retry-After": str(refused.retry_after)}
            send(("done", rid, refused.status, {"detail": refused.detail, "field": refused.field}, headers))

    send(("ready", None if runner.allowed is None else bytes(sorted(runner.allowed)), str(engine.device), runner.kind))
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the front is gone
            kind = message[0]
            if kind == "submit":
                submit(message[1], message[2])
            elif kind == "cancel":
                seq = running.get(message[1])
                if seq is not None:
                    engine.cancel(seq)
            elif kind == "drain":
                engine.drain()
                threading.Thread(target=lambda: (engine.wait_idle(), send(("idle",))), daemon=True).start()
            elif kind == "metrics":
                send(("metrics", message[1], generate_latest(engine.metrics.registry)))
            elif kind == "exit":
                send(("bye", engine.answered))
                return
    finally:
        if activity_file is not None:
            engine.activity.write(activity_file)  # the last window, as the engine stops


class EngineClient:
    """The front's handle on the engine's process: requests out, answers back to their awaiting callers."""

    def __init__(self, args: argparse.Namespace, settings: Settings) -> None:
        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state forked
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=engine_main, args=(child, str(args.checkpoint), device, settings, args.activity_file),
            name="serve-engine", daemon=True,
        )
        self.process.start()
        child.close()
        try:
            _, alphabet, self.device, self.kind = self.conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine did not start (exit code {self.process.exitcode}); its error is above") from None
        self.settings = settings
        self.allowed = None if alphabet is None else frozenset(alphabet)
        self.model_name = Path(args.checkpoint).name
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.waiting: dict[int, asyncio.Future] = {}
        self.streams: dict[int, asyncio.Queue] = {}
        self.draining = False
        self.dead = False
        self.answered_in_all = 0

    def send(self, message) -> None:
        with self.lock:
            self.conn.send(message)

    def cancel(self, rid: int) -> None:
        """Tell the engine no one waits for request `rid` any more (nothing to tell a stopped engine)."""
        if not self.dead:
            try:
                self.send(("cancel", rid))
            except OSError:
                pass

    def listen(self, loop: asyncio.AbstractEventLoop, on_idle, on_dead) -> None:
        """Read the engine's messages on a thread of their own and hand each to the event loop."""

        def run() -> None:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    loop.call_soon_threadsafe(self._dead, on_dead)
                    return
                loop.call_soon_threadsafe(self._dispatch, message, on_idle)
                if message[0] == "bye":
                    return

        threading.Thread(target=run, name="serve-engine-answers", daemon=True).start()

    def _dispatch(self, message, on_idle) -> None:
        kind = message[0]
        if kind in ("done", "metrics", "delta"):
            stream = self.streams.get(message[1])
            if stream is not None:
                stream.put_nowait(message)
                return
            future = self.waiting.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message)
        elif kind == "idle":
            on_idle()
        elif kind == "bye":
            self.answered_in_all = message[1]
            on_idle()

    def _dead(self, on_dead) -> None:
        self.dead = True
        stopped = ("done", -1, 503, {"detail": "the engine stopped"}, {"Retry-After": "1"})
        for future in self.waiting.values():
            if not future.done():
                future.set_result(stopped)
        for stream in self.streams.values():
            stream.put_nowait(stopped)
        self.waiting.clear()
        on_dead()

    async def ask(self, kind: str, *payload, timeout: float):
        rid = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.waiting[rid] = future
        self.send((kind, rid, *payload))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self.waiting.pop(rid, None)


# --- HTTP ----------------------------------------------------------------------------------------


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.received = Counter(
            "serve_requests_received", "Generate requests received, before any check", registry=self.registry
        )
        self.refused = Counter(
            "serve_front_refused", "Generate requests the front answered itself", ["reason"], registry=self.registry
        )
        for reason in ("invalid", "draining"):
            self.refused.labels(reason)
        self.gone = Counter(
            "serve_callers_gone", "Requests whose caller closed the connection before the answer was done",
            registry=self.registry,
        )


DEADLINE_HEADER = "x-portal-deadline-ms"
GENERATE_ROUTES = {"/v1/generate": "native", "/v1/completions": "completion", "/v1/chat/completions": "chat"}
GONE = ("gone",)  # what a waiting request gets when its caller closed the connection


class Answer(Exception):
    """An answer decided while checking a request: (status, body, headers)."""


class Front:
    """HTTP/1.1 on asyncio: one event loop takes every connection; the model runs in the engine's process."""

    MAX_HEADERS = 100
    WATCH_S = 0.05  # how often the connections awaiting an answer are checked for a caller that went away

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.metrics = FrontMetrics()
        self.connections: dict[asyncio.StreamWriter, bool] = {}  # writer -> busy with a request
        self.watched: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}  # request id -> its caller

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections[writer] = False
        try:
            while True:
                request = await self._read(reader)
                if request is None:
                    return
                self.connections[writer] = True
                method, path, version, headers, body = request
                if isinstance(body, tuple):  # refused while reading: (status, answer)
                    status, answer, extra = *body, {}
                    self.metrics.refused.labels("invalid").inc()
                else:
                    routed = await self.route(method, path, headers, body, reader, writer)
                    if routed is None:
                        return  # streamed, or the caller went away: the connection closes
                    status, answer, extra = routed
                keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
                keep = keep and not self.engine.draining and not isinstance(body, tuple)
                self._write(writer, status, answer, extra, keep)
                await writer.drain()
                self.connections[writer] = False
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            return
        finally:
            self.connections.pop(writer, None)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader):
        line = await reader.readline()
        if not line.strip():
            return None
        parts = line.decode("latin-1").split()
        if len(parts) != 3:
            return "GET", "", "HTTP/1.0", {}, (400, {"detail": "not an HTTP request line"})
        method, path, version = parts
        headers: dict[str, str] = {}
        for _ in range(self.MAX_HEADERS):
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        else:
            return method, path, version, headers, (431, {"detail": "too many headers"})
        body = b""
        if method == "POST":
            if "transfer-encoding" in headers:
                return method, path, version, headers, (411, {"Content-Length": ["required; chunked bodies are not taken"]})
            try:
                length = int(headers.get("content-length", ""))
            except ValueError:
                length = -1
            if length < 0:
                return method, path, version, headers, (411, {"Content-Length": ["required, a byte count"]})
            if length > MAX_BODY_BYTES:
                if length <= 16 * MAX_BODY_BYTES:  # read it away, so the client sees the answer, not a reset
                    await reader.readexactly(length)
                return method, path, version, headers, (413, {"detail": f"the body is {length} bytes; at most {MAX_BODY_BYTES}"})
            body = await reader.readexactly(length)
        return method, path, version, headers, body

    def _write(self, writer, status: int, answer, extra: dict, keep: bool) -> None:
        if isinstance(answer, bytes):
            data, content_type = answer, CONTENT_TYPE_LATEST
        else:
            data, content_type = json.dumps(answer).encode(), "application/json"
        head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Content-Type: {content_type}",
                f"Content-Length: {len(data)}", "Server: portal-serve"]
        head += [f"{name}: {value}" for name, value in extra.items()]
        head.append("Connection: keep-alive" if keep else "Connection: close")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)

    async def route(self, method: str, path: str, headers: dict, body: bytes, reader, writer):
        engine = self.engine
        if method == "GET" and path == "/healthz":
            return (503 if engine.dead else 200), {"status": "engine stopped" if engine.dead else "ok"}, {}
        if method == "GET" and path == "/readyz":
            ready = not engine.dead and not engine.draining
            return (200 if ready else 503), {"ready": ready, "draining": engine.draining}, {}
        if method == "GET" and path == "/metrics":
            text = generate_latest(self.metrics.registry)
            if not engine.dead:
                text += (await engine.ask("metrics", timeout=10))[2]
            return 200, text, {}
        route = GENERATE_ROUTES.get(path)
        if route is None:
            return 404, {"detail": "not found"}, {}
        native = route == "native"
        if method != "POST":
            return 405, ({"detail": "POST only"} if native else serve_openai.error(405, "POST only")), {"Allow": "POST"}
        arrived = time.monotonic()  # CLOCK_MONOTONIC: the engine's process reads the same clock
        self.metrics.received.inc()
        try:
            request, completion = self._check(route, headers, body)
        except Answer as answer:
            status, problem, extra = answer.args
            self.metrics.refused.labels("invalid").inc()
            return self._refusal(native, status, problem, extra)
        if engine.draining or engine.dead:
            self.metrics.refused.labels("draining").inc()
            return self._refusal(native, 503, {"detail": "draining: this replica is stopping; try another or retry"},
                                 {"Retry-After": "1"})
        request["arrived"] = arrived
        request["stream"] = completion is not None and completion.stream
        # The engine answers every admitted request by its deadline; the margin covers a stalled engine.
        timeout = request["deadline_ms"] / 1000 + 5
        if request["stream"]:
            return await self._stream(request, completion, reader, writer, timeout)
        message = await self._submit(request, reader, writer, timeout)
        if message is GONE:
            return None
        if message is None:
            return self._refusal(native, 504, {"detail": "no answer by the deadline"}, {})
        _, _, status, answer, extra = message
        if status != 200:
            return self._refusal(native, status, answer, extra)
        if native:
            return 200, {name: answer[name] for name in ("text", "tokens", "queue_ms", "compute_ms")}, extra
        return 200, serve_openai.answer(completion, serve_openai.new_id(completion.chat), answer), extra

    def _refusal(self, native: bool, status: int, problem: dict, extra: dict):
        """A refusal in the route's own shape: the native route's {field: [why]} / {"detail"}, or OpenAI's error."""
        field, detail = problem.get("field"), problem.get("detail")
        if native:
            if field is not None:
                return status, {field: [detail]}, extra
            if detail is None:  # the native check's own {field: [why]}
                return status, problem, extra
            return status, {"detail": detail}, extra
        if detail is None:
            field, (detail,) = next(iter(problem.items()))
        return status, serve_openai.error(status, detail, field), extra

    def _check(self, route: str, headers: dict, body: bytes):
        """(the engine's request, the OpenAI request or None); Answer(status, problem, headers) if refused."""
        s, engine = self.engine.settings, self.engine
        if headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise Answer(415, {"field": "Content-Type", "detail": "must be application/json"}, {})
        header_ms = None
        if DEADLINE_HEADER in headers:
            try:
                header_ms = float(headers[DEADLINE_HEADER])
            except ValueError:
                header_ms = math.nan
            if not math.isfinite(header_ms):
                raise Answer(400, {"field": "X-Portal-Deadline-Ms", "detail": "a number of milliseconds left"}, {})
            if header_ms <= 0:
                raise Answer(504, {"detail": "the deadline passed before the request reached this replica"}, {})
        try:
            data = json.loads(body)
        except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors too
            raise Answer(400, {"field": "body", "detail": "not valid JSON"}, {}) from None
        if route == "native":
            try:
                prompt, max_tokens, deadline_ms = check_request(data, s, engine.allowed)
            except ValueError as error:
                (field, why), = error.args[0].items()
                raise Answer(400, {"field": field, "detail": why}, {}) from None
            request = {"prompt": prompt.decode("utf-8"), "max_tokens": max_tokens}
            completion = None
        else:
            try:
                completion = serve_openai.check(data, chat=route == "chat", max_tokens_limit=s.max_tokens,
                                                served_model=engine.model_name)
                if completion.deadline_ms is not None and completion.deadline_ms > s.max_deadline_ms:
                    raise serve_openai.Invalid("deadline_ms", f"at most {s.max_deadline_ms:g}")
                request = self._prompt_of(completion)
            except serve_openai.Invalid as invalid:
                raise Answer(400, {"field": invalid.param, "detail": invalid.message}, {}) from None
            deadline_ms = completion.deadline_ms or s.default_deadline_ms
            request.update(max_tokens=completion.max_tokens, stop=completion.stop, temperature=completion.temperature,
                           seed=completion.seed)
        request["deadline_ms"] = deadline_ms if header_ms is None else min(deadline_ms, header_ms)
        return request, completion

    def _prompt_of(self, completion: serve_openai.Completion) -> dict:
        """What the engine gets as the prompt; the CharModel's prompt (a chat rendered as plain lines) is
        checked here, against its bytes: its tokens."""
        engine, s = self.engine, self.engine.settings
        if completion.chat and engine.allowed is None:
            return {"messages": completion.messages}
        text = plain_chat(completion.messages) if completion.chat else completion.prompt
        field = "messages" if completion.chat else "prompt"
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise serve_openai.Invalid(field, "not valid text (a lone surrogate)") from None
        if len(data) > s.max_prompt_bytes:
            raise serve_openai.Invalid(field, f"{len(data)} bytes; at most {s.max_prompt_bytes}")
        if engine.allowed is not None:
            if not set(data) <= engine.allowed:
                unseen = "".join(sorted({ch for ch in text if not set(ch.encode("utf-8")) <= engine.allowed}))[:20]
                raise serve_openai.Invalid(field, f"holds characters the model never saw in training: {unseen!r}")
            if len(data) + completion.max_tokens > s.batch_token_budget:
                raise serve_openai.Invalid("max_tokens", f"prompt bytes + max_tokens must fit the batch budget of {s.batch_token_budget}")
        return {"prompt": text}

    # -- waiting for the engine, and noticing a caller that went away --

    def _watch(self, rid: int, reader, writer) -> None:
        self.watched[rid] = (reader, writer)

    async def watch_callers(self) -> None:
        """Every WATCH_S, the connections awaiting an answer: one whose caller closed it (the reader at its end,
        the transport closing) has its request cancelled in the engine, which stops computing it."""
        while True:
            await asyncio.sleep(self.WATCH_S)
            for rid, (reader, writer) in list(self.watched.items()):
                if reader.at_eof() or reader.exception() is not None or writer.is_closing():
                    del self.watched[rid]
                    self.metrics.gone.inc()
                    self.engine.cancel(rid)
                    future = self.engine.waiting.pop(rid, None)
                    if future is not None and not future.done():
                        future.set_result(GONE)
                    stream = self.engine.streams.get(rid)
                    if stream is not None:
                        stream.put_nowait(GONE)

    async def _submit(self, request: dict, reader, writer, timeout: float):
        """The engine's ("done", ...) message, GONE if the caller went away first, None at the timeout."""
        engine = self.engine
        rid = next(engine.ids)
        future = asyncio.get_running_loop().create_future()
        engine.waiting[rid] = future
        self._watch(rid, reader, writer)
        engine.send(("submit", rid, request))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return None
        finally:
            if not future.done() or future.result() is GONE:
                engine.cancel(rid)  # no one will take the answer: it stops computing
            engine.waiting.pop(rid, None)
            self.watched.pop(rid, None)

    async def _stream(self, request: dict, completion, reader, writer, timeout: float):
        """Server-sent events: a chunk for each piece of text the engine sends, the last with its finish_reason
        (then the usage when asked), then `data: [DONE]`. A refusal before the first token is an ordinary
        answer; one after it (the deadline passed) an error event, and the stream ends."""
        engine = self.engine
        rid = next(engine.ids)
        queue: asyncio.Queue = asyncio.Queue()
        engine.streams[rid] = queue
        self._watch(rid, reader, writer)
        engine.send(("submit", rid, request))
        ident, created, started, finished = serve_openai.new_id(completion.chat), int(time.time()), False, False
        end = time.monotonic() + timeout
        try:
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), max(0.0, end - time.monotonic()))
                except TimeoutError:
                    message = ("done", rid, 504, {"detail": "no answer by the deadline"}, {})
                if message is GONE:
                    return None
                kind, status = message[0], message[2] if message[0] == "done" else 200
                finished = finished or (kind == "done" and message[1] == rid)
                if not started:
                    if status != 200:
                        return self._refusal(False, status, message[3], message[4])
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                                 b"Server: portal-serve\r\nConnection: close\r\n\r\n")
                    started = True
                    if completion.chat:
                        self._event(writer, serve_openai.chunk(completion, ident, created, text="", first=True))
                if kind == "delta":
                    self._event(writer, serve_openai.chunk(completion, ident, created, text=message[2]))
                elif status == 200:
                    result = message[3]
                    self._event(writer, serve_openai.chunk(completion, ident, created, finish_reason=result["finish_reason"]))
                    if completion.include_usage:
                        self._event(writer, serve_openai.usage_chunk(completion, ident, created, result))
                    writer.write(b"data: [DONE]\n\n")
                    await writer.drain()
                    return None
                else:
                    self._event(writer, serve_openai.error(status, message[3].get("detail", ""), message[3].get("field")))
                    await writer.drain()
                    return None
                await writer.drain()
        finally:
            if not finished:  # the caller went away: seen by the watcher, or a write to it failed
                if self.watched.pop(rid, None) is not None and not engine.dead:
                    self.metrics.gone.inc()
                engine.cancel(rid)
            engine.streams.pop(rid, None)
            self.watched.pop(rid, None)

    @staticmethod
    def _event(writer, payload: dict) -> None:
        writer.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    async def close_idle(self) -> None:
        """Close the connections waiting for a next request; those answering one finish first."""
        while True:
            for writer, busy in list(self.connections.items()):
                if not busy:
                    writer.close()
            if not self.connections:
                return
            await asyncio.sleep(0.05)


async def serve_async(args: argparse.Namespace, engine: EngineClient) -> int:
    front = Front(engine)
    loop = asyncio.get_running_loop()
    stop, idle = asyncio.Event(), asyncio.Event()
    engine.listen(loop, on_idle=idle.set, on_dead=stop.set)
    watcher = asyncio.create_task(front.watch_callers())

    def on_signal() -> None:
        if not engine.draining:
            engine.draining = True  # readiness false and nothing new admitted, at once
            engine.send(("drain",))
            stop.set()
        # Asked again (a stop is repeated until the replica is gone) it must not die mid-drain or mid-exit:
        # from now on the signals are ignored, also once the loop closes (which would restore the default).
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
            signal.signal(signum, signal.SIG_IGN)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    server = await asyncio.start_server(front.handle, args.host, args.port, backlog=1024, limit=MAX_BODY_BYTES)
    host, port = server.sockets[0].getsockname()[:2]
    print(tagged_line(LISTENING_TAG, {"host": host, "port": port, "device": engine.device, "model": engine.kind}), flush=True)
    await stop.wait()
    if engine.dead:
        server.close()
        watcher.cancel()
        print("serve: the engine's process stopped", file=sys.stderr, flush=True)
        return 1
    # Draining: new requests get 503 while everything admitted is answered; then no more connections.
    await idle.wait()
    server.close()
    await asyncio.wait_for(front.close_idle(), 30)
    watcher.cancel()
    idle.clear()
    engine.send(("exit",))
    await asyncio.wait_for(idle.wait(), 30)
    return 0


def serve(args: argparse.Namespace) -> int:
    engine = EngineClient(args, settings_from(args))
    try:
        code = asyncio.run(serve_async(args, engine))
    finally:
        engine.process.join(30)
        if engine.process.is_alive():
            engine.process.kill()
    if code == 0:
        print(f"drained: {engine.answered_in_all} answered in all", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return serve(args)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"serve: {error}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())

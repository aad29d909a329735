"""The inference server's engine: the model, the bounded queue, continuous batching and generation.

Only the engine's process imports this module (and with it torch): the replica's front,
`runners.workloads.serve` (whose docstring tells how work flows), spawns it with `engine_main` and talks
to it over a pipe, so the front's interpreter never pays torch's import.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import shutil
import signal
import tarfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

from runners.workloads.activity import ActivityMeter
from runners.workloads.progress import checkpoint_files
from runners.workloads.serve_openai import plain_chat
from runners.workloads.serve_settings import REFUSED_HEADER, Settings
from runners.workloads.train import CHECKPOINT_FORMAT, VOCAB, CharModel

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

    def __init__(self, status: int, detail: str, retry_after: int | None = None, field: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.retry_after, self.field = status, detail, retry_after, field
        # "deadline": refused for this request's deadline alone (the answer's X-Portal-Refused), not for being
        # full; the edge learns its limit for the replica from the other refusals only (docs/edge.md).
        self.reason = reason


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
            buckets=(16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072), registry=r,
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
                    retry_after=max(1, math.ceil(wait)), reason="deadline",
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
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
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
            if refused.reason is not None:
                headers[REFUSED_HEADER] = refused.reason
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

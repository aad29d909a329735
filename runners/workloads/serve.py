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
pipe. The engine ignores SIGTERM and SIGINT: the front decides when it stops. The front (this
module) never imports torch: the model, the batching and generation live in
`runners.workloads.serve_engine`, which only the engine's process imports (it resolves
`--device auto` too, and tells the front the device it took).

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
    --queue-limit           SERVE_QUEUE_LIMIT          128     requests waiting, beyond the running batch
    --batch-token-budget    SERVE_BATCH_TOKEN_BUDGET   65536   prompt bytes + max_tokens over the batch
    --max-batch-wait-ms     SERVE_MAX_BATCH_WAIT_MS    20      how long waiting requests are gathered to join
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
import itertools
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import fields
from http import HTTPStatus
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from runners.workloads import serve_openai
from runners.workloads.progress import tagged_line
from runners.workloads.serve_openai import plain_chat
from runners.workloads.serve_settings import DEADLINE_HEADER, Settings

LISTENING_TAG = "PORTAL_SERVE_LISTENING"
MAX_BODY_BYTES = 64 * 1024
REQUEST_FIELDS = {"prompt", "max_tokens", "deadline_ms"}

# --- settings ------------------------------------------------------------------------------------


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



# --- requests ------------------------------------------------------------------------------------


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


# --- the engine's process, from the front --------------------------------------------------------


def _engine_process(*args) -> None:
    """The spawned engine's entry point: only that process imports the engine's module, and torch with it."""
    # The front decides when the engine stops, from its first moment (engine_main says so again).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from runners.workloads.serve_engine import engine_main

    engine_main(*args)


class EngineClient:
    """The front's handle on the engine's process: requests out, answers back to their awaiting callers."""

    def __init__(self, args: argparse.Namespace, settings: Settings) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state forked
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_engine_process, args=(child, str(args.checkpoint), args.device, settings, args.activity_file),
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


def _runner() -> asyncio.Runner:
    """The front's event loop: uvloop's where it is installed (the portal's image has it, with uvicorn), asyncio's
    otherwise. The front shares its core with the engine, so its CPU per request is the engine's loss: on uvloop
    the replica alone answered 683 requests/s in a closed loop, against 642 on asyncio's (bench/serve_load.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def serve(args: argparse.Namespace) -> int:
    engine = EngineClient(args, settings_from(args))
    try:
        with _runner() as runner:
            code = runner.run(serve_async(args, engine))
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

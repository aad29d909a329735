"""Open-loop load against the portal's inference server and LitServe, fairly: each tuned, each measured.

    python bench/serve_load.py [--seconds 10] [--repeats 5] [--levels 0.5,1,2,3,5] [--own-levels 0.5,1,2]
                               [--search | --litserve-config '{"max_batch_size": 64, ...}'] [--plot bench/serve_load.png]

Both systems serve the same checkpoint of the trainer's model (`CharModel`, written here with the
shipped corpus's alphabet) on one CPU thread, greedy decoding one byte a token:

- `portal`: `runners/workloads/serve.py` exactly as an endpoint's replica runs it: the flags the
  backends pass (`ServingSettings().flags()`, the deployed defaults), nothing bench-only; measured
  through the edge (`python -m runners.edge`, `bench/serve_edge.py`: a scratch database with one
  endpoint whose one replica is that server; needs DATABASE_URL and CELERY_BROKER_URL) when the edge
  is on main, else at the replica (`--portal-via edge|direct` to choose);
- `litserve`: LitServe (`litserve==0.2.19`, installed by this bench into the running environment
  when missing, never a dependency of the portal) with its batched loop, `bench/serve_litserve.py`,
  given its documented admission knobs (`max_batch_size`, `batch_timeout`, `timeout`,
  `workers_per_device`, `fast_queue`, `num_api_servers`, uvicorn's `limit_concurrency`), tuned by
  `--search`: coordinate descent over each knob's values for goodput at 2x LitServe's own capacity.

How it is fair:

- cores: every server process (the edge, the replica's front and engine; LitServe's HTTP server and
  workers) is pinned to `--server-core` (0), the load generator (this process) to `--client-core` (1);
- capacity: each system's own, measured as answered requests per second of a closed loop
  (`--capacity-clients` clients, each sending its next request when answered; the best of them),
  with generous deadlines; the levels are multiples of the portal's capacity (both systems get the
  same request stream: paired) and, for `--own-levels`, of LitServe's own capacity too;
- the same per-request deadline to both: `deadline_ms` in every body. The portal honours it per
  request; LitServe has no per-request deadline, its `timeout` knob (one figure for the server,
  searched) is what it has. The client waits for an answer no longer than the deadline + 100 ms,
  then counts the request unanswered and closes that connection;
- keep-alive: one client with one pool of keep-alive connections per run (`KeepAliveClient`, or
  aiohttp's with `--client aiohttp`); a request given up on closes its connection;
- alternated: each repeat runs the systems in turn at each level, the order swapped from one
  (repeat, level) to the next (ABBA), `--repeats` paired repeats with a fresh seed each (the same
  requests for both within a repeat); a fresh server process for every run.

Load: Poisson arrivals for `--seconds`. Half the prompts start with the same 200-byte system
prompt; prompts are 20-260 bytes, outputs 8-32 tokens (70 %) or 128-256 (30 %); a request's
deadline is 300 ms + 12 ms per token asked.

Every request ends as exactly one of: answered in time (2xx by its deadline, as the client saw it),
answered late (2xx after its deadline, before it + 100 ms), refused with Retry-After (429/503 with
the header), refused without it, expired (504 from the server), unanswered (no answer by the
deadline + 100 ms, or a connection error), other (any other status). Goodput is answered in time
per second of the run. The server's CPU (user + system seconds of its processes, read from /proc)
and the load generator's are per second of the run (arrivals and the last answers): 1.0 is a whole core.

Output: a line of JSON per run in `--out`; the tables in Markdown at the end (medians over the
repeats; goodput's min / max; the portal / LitServe ratios of each repeat, min / median / max).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serve_litserve import LITSERVE, LITSERVE_KNOBS  # noqa: E402

# The plot's one library, as pinned in the bench extra (pyproject.toml).
MATPLOTLIB = "matplotlib==3.11.2"

SYSTEM = (
    "You are the GPU portal's assistant for the ml-research team. Answer briefly, name the job and the "
    "flavor you mean, and never guess a quota: read it. Be kind to people who wait for their GPUs today.\n"
)[:200]
GRACE_S = 0.1  # the client waits for an answer until the deadline + this, then counts it unanswered
CLOSED_LOOP_DEADLINE_MS = 20_000  # under the deployed --max-deadline-ms
# The search: each knob's values, tried one knob at a time from LITSERVE_KNOBS, the best kept.
SEARCH = {
    "max_batch_size": [16, 32, 64, 128, 256],
    "batch_timeout": [0.001, 0.005, 0.02, 0.05],
    "timeout": [0.25, 0.5, 1.0, 2.0, 3.5, False],
    "limit_concurrency": [None, 32, 64, 128, 256, 512],
    "workers_per_device": [1, 2],
    "num_api_servers": [None, 1, 2],
    "fast_queue": [False, True],
}
SEARCH_PASSES = 3  # passes over every knob, until one changes nothing
OUTCOMES = ("in_time", "late", "refused_retry_after", "refused_bare", "expired", "unanswered", "other")


# --- the servers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def portal_flags() -> list[str]:
    """The flags a replica runs with: the backends' ServingSettings at their defaults."""
    from runners.backends.base import ServingSettings

    return ServingSettings(endpoint_id=0, checkpoint="").flags()


def group_cpu_seconds(group: int) -> float:
    """User + system CPU seconds of every live process of a process group (threads included)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:
            total += int(fields[11]) + int(fields[12])
    return total / tick


EDGE = None  # bench.serve_edge.EdgeSetup while the portal is measured through the edge


class Under:
    """What a run sends to: the server, and for the portal through the edge the edge in front of it."""

    def __init__(self, kind: str, checkpoint: Path, core: int, knobs: dict | None = None) -> None:
        self.server = Started(kind, checkpoint, core, knobs)
        self.edge = None
        self.url, self.token = self.server.url, None
        if kind == "portal" and EDGE is not None:
            try:
                self.edge = EDGE.start(f"http://127.0.0.1:{self.server.port}", core)
                self.edge.wait_route(EDGE.path, EDGE.token)
            except BaseException:
                self.stop()
                raise
            self.url, self.token = f"http://127.0.0.1:{self.edge.port}{EDGE.path}", EDGE.token
        self.warm()

    def warm(self) -> None:
        """A few requests one after the other before the run, the same for every system: first calls allocate."""
        import http.client
        from urllib.parse import urlsplit

        parts = urlsplit(self.url)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Token {self.token}"} if self.token else {})}
        for n in (4, 16, 4):
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
            conn.request("POST", parts.path, body=json.dumps({"prompt": "warm up", "max_tokens": n}), headers=headers)
            conn.getresponse().read()
            conn.close()

    def cpu_seconds(self) -> float:
        return self.server.cpu_seconds() + self.edge_cpu_seconds()

    def edge_cpu_seconds(self) -> float:
        return group_cpu_seconds(self.edge.proc.pid) if self.edge else 0.0

    def stop(self) -> None:
        if self.edge is not None:
            self.edge.stop()
        self.server.stop()


class Started:
    """One server under test, its own process group, pinned to one core; stopped whole."""

    def __init__(self, kind: str, checkpoint: Path, core: int, knobs: dict | None = None) -> None:
        self.kind = kind
        self.port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        if kind in ("portal", "portal-direct"):
            command = [sys.executable, "-m", "runners.workloads.serve", "--checkpoint", str(checkpoint),
                       "--port", str(self.port), *portal_flags()]
            ready = "/readyz"
        elif kind == "litserve":
            command = [sys.executable, str(REPO / "bench" / "serve_litserve.py"), "--checkpoint", str(checkpoint),
                       "--port", str(self.port), "--config", json.dumps(knobs or {})]
            ready = "/health"
        else:
            raise ValueError(kind)
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {core}),
        )
        until = time.monotonic() + 180
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} exited with {self.proc.returncode} before it was ready")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(f"GET {ready} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
                    if b" 200 " in sock.recv(64):
                        break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            self.stop()
            raise RuntimeError(f"{kind} did not become ready")
        self.url = f"http://127.0.0.1:{self.port}/v1/generate"

    def cpu_seconds(self) -> float:
        return group_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        # LitServe's workers may outlive its parent for a moment: wait until the group is gone.
        until = time.monotonic() + 10
        while time.monotonic() < until and self._kill_leftovers():
            time.sleep(0.1)

    def _kill_leftovers(self) -> bool:
        """SIGKILL to every live process left in the group; whether there was one."""
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(entry), signal.SIGKILL)
                    return True
        return False


def write_checkpoint(folder: Path) -> Path:
    import torch

    from runners.workloads.train import DEFAULT_CORPUS, CharModel, save_checkpoint

    torch.manual_seed(0)
    model = CharModel()
    alphabet = DEFAULT_CORPUS.read_bytes() + SYSTEM.encode() + b"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,?"
    save_checkpoint(folder, 1, model, torch.optim.Adam(model.parameters()), keep=1, world_size=1, attempt=0, alphabet=alphabet)
    return folder


# --- the load ------------------------------------------------------------------------------------


def make_requests(rate: float, seconds: float, seed: int) -> list[dict]:
    """Arrival time, prompt, max_tokens and deadline of every request of one run (open loop)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,?"
    at, out = 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            return out
        user = "".join(rng.choice(alphabet) for _ in range(rng.randint(20, 60)))
        prompt = SYSTEM + user if rng.random() < 0.5 else "".join(rng.choice(alphabet) for _ in range(rng.randint(20, 260)))
        max_tokens = rng.randint(8, 32) if rng.random() < 0.7 else rng.randint(128, 256)
        out.append({"at": at, "prompt": prompt, "max_tokens": max_tokens, "deadline_ms": 300 + 12 * max_tokens})


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of `KeepAliveClient`: one request at a time, its answer to a future."""

    def __init__(self) -> None:
        self.transport = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionResetError("the server closed the connection before its answer"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.waiter is None or self.waiter.done():
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            last = self.buffer.find(b"\r\n0\r\n\r\n", end)
            if last < 0:
                return
            size = last + 7
        else:
            size = end + 4 + int(headers.get("content-length", "0"))
            if len(self.buffer) < size:
                return
        del self.buffer[:size]
        self.waiter.set_result((int(head[0].split()[1]), headers, headers.get("connection", "").lower() != "close"))

    async def request(self, data: bytes):
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter


class KeepAliveClient:
    """The load generator's HTTP/1.1 client: a pool of keep-alive connections, one request on each at a time.

    Hand-written on asyncio's protocols because the generator must not be what saturates: on this
    machine aiohttp's client took 170-260 us of CPU a request (at 3,000 requests/s most of the
    client's core), this one 30-50 us. `--client aiohttp` runs the bench with aiohttp's instead.
    A request not answered in time closes its connection (the server sees the client leave).
    """

    def __init__(self) -> None:
        self.idle: dict[tuple[str, int], list[_Connection]] = {}

    async def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.transport.close()
        self.idle.clear()

    async def post(self, url: str, body: dict, timeout_s: float, token: str | None = None) -> tuple[int | str, dict]:
        """(status or why there is none, the answer's headers, names in lower case) within `timeout_s`."""
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        where = (parts.hostname, parts.port)
        data = json.dumps(body).encode()
        auth = f"Authorization: Token {token}\r\n" if token else ""
        data = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n{auth}"
                f"Content-Length: {len(data)}\r\n\r\n").encode() + data
        idle = self.idle.setdefault(where, [])
        conn = None
        try:
            async with asyncio.timeout(timeout_s):
                while idle and conn is None:
                    conn = idle.pop()
                    conn = None if conn.closed else conn
                if conn is None:
                    _, conn = await asyncio.get_running_loop().create_connection(_Connection, *where)
                status, headers, keep = await conn.request(data)
        except TimeoutError:
            if conn is not None:
                conn.transport.close()
            return "unanswered", {}
        except OSError as error:
            if conn is not None:
                conn.transport.close()
            return f"error {error.__class__.__name__}", {}
        if keep and not conn.closed:
            idle.append(conn)
        else:
            conn.transport.close()
        return status, headers


class AiohttpClient:
    """The same, with one aiohttp session (one pool of keep-alive connections): `--client aiohttp`."""

    def __init__(self) -> None:
        import aiohttp

        self.aiohttp = aiohttp
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=8192, keepalive_timeout=60), skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        await self.session.close()

    async def post(self, url: str, body: dict, timeout_s: float, token: str | None = None) -> tuple[int | str, dict]:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Token {token}"} if token else {})}
        try:
            async with asyncio.timeout(timeout_s):
                async with self.session.post(url, data=data, headers=headers) as response:
                    await response.read()
                    return response.status, {k.lower(): v for k, v in response.headers.items()}
        except TimeoutError:
            return "unanswered", {}
        except (self.aiohttp.ClientError, OSError) as error:
            return f"error {error.__class__.__name__}", {}


CLIENTS = {"keepalive": KeepAliveClient, "aiohttp": AiohttpClient}


def outcome(status, headers: dict, latency_s: float, deadline_ms: float) -> str:
    if isinstance(status, str):
        return "unanswered"
    if 200 <= status < 300:
        return "in_time" if latency_s * 1000 <= deadline_ms else "late"
    if status in (429, 503):
        return "refused_retry_after" if "retry-after" in headers else "refused_bare"
    if status == 504:
        return "expired"
    return "other"


async def drive(client, url: str, requests: list[dict], token: str | None = None) -> list[dict]:
    """Send each request at its arrival time (open loop), every one with its deadline in the body."""
    loop = asyncio.get_running_loop()
    results: list[dict] = []
    tasks = []

    async def one(req, scheduled):
        sent = loop.time()
        body = {"prompt": req["prompt"], "max_tokens": req["max_tokens"], "deadline_ms": req["deadline_ms"]}
        status, headers = await client.post(url, body, req["deadline_ms"] / 1000 + GRACE_S, token)
        latency = loop.time() - sent
        results.append({
            "status": status, "latency_ms": latency * 1000, "deadline_ms": req["deadline_ms"],
            "lag_ms": (sent - scheduled) * 1000, "outcome": outcome(status, headers, latency, req["deadline_ms"]),
        })

    start = loop.time() + 0.05
    for req in requests:
        delay = start + req["at"] - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, start + req["at"])))
    await asyncio.gather(*tasks)
    return results


async def closed_loop(client, url: str, token: str | None, clients: int, seconds: float, seed: int) -> float:
    """Answered requests per second with `clients` each waiting on one answer at a time (1 s of warm-up left out)."""
    pool = make_requests(200, 60, seed)
    loop = asyncio.get_running_loop()
    begin = loop.time() + 1.0
    end = begin + seconds
    done = 0

    async def worker(i):
        nonlocal done
        k = i
        while loop.time() < end:
            req = pool[k % len(pool)]
            k += clients
            body = {"prompt": req["prompt"], "max_tokens": req["max_tokens"], "deadline_ms": CLOSED_LOOP_DEADLINE_MS}
            status, _ = await client.post(url, body, CLOSED_LOOP_DEADLINE_MS / 1000 + 5, token)
            if status == 200 and begin <= loop.time() <= end:
                done += 1
            elif not isinstance(status, int) or status >= 500:
                await asyncio.sleep(0.01)  # a refusal: no busy loop of refusals
    await asyncio.gather(*(worker(i) for i in range(clients)))
    return done / seconds


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(results: list[dict], seconds: float) -> dict:
    answered = [r for r in results if r["outcome"] in ("in_time", "late")]
    counts = {name: sum(r["outcome"] == name for r in results) for name in OUTCOMES}
    n = len(results)
    return {
        "requests": n, **counts,
        "goodput_per_s": counts["in_time"] / seconds,
        "p50_ms": percentile([r["latency_ms"] for r in answered], 0.5),
        "p99_ms": percentile([r["latency_ms"] for r in answered], 0.99),
        # The share of the answered that came past their own deadline: the p99 is within the deadline when <= 1 %.
        "answered_late_share": counts["late"] / len(answered) if answered else 0.0,
        "lag_p99_ms": percentile([r["lag_ms"] for r in results], 0.99),
        "errors": sorted({r["status"] for r in results if isinstance(r["status"], str) and r["status"] != "unanswered"}),
    }


# --- one run, the capacity, the search -------------------------------------------------------------


def one_run(kind: str, checkpoint: Path, args, knobs: dict | None, requests: list[dict], seconds: float) -> dict:
    server = Under(kind, checkpoint, args.server_core, knobs)
    try:
        async def go():
            client = CLIENTS[args.client]()
            try:
                cpu, edge, mine, wall = server.cpu_seconds(), server.edge_cpu_seconds(), time.process_time(), time.monotonic()
                results = await drive(client, server.url, requests, server.token)
                wall = time.monotonic() - wall
                return (results, (server.cpu_seconds() - cpu) / wall, (server.edge_cpu_seconds() - edge) / wall,
                        (time.process_time() - mine) / wall)
            finally:
                await client.close()
        results, cpu, edge, mine = asyncio.run(go())
    finally:
        server.stop()
    return {**summarize(results, seconds), "server_cpu": cpu, "edge_cpu": edge, "client_cpu": mine}


def capacity(kind: str, checkpoint: Path, args, knobs: dict | None) -> tuple[float, dict]:
    """The best answered/s over closed loops of each of `--capacity-clients` clients; a fresh server each."""
    found = {}
    for clients in [int(c) for c in args.capacity_clients.split(",")]:
        server = Under(kind, checkpoint, args.server_core, knobs)
        try:
            async def go():
                client = CLIENTS[args.client]()
                try:
                    return await closed_loop(client, server.url, server.token, clients, args.capacity_seconds, args.seed)
                finally:
                    await client.close()
            found[clients] = asyncio.run(go())
        finally:
            server.stop()
    return max(found.values()), found


def search(checkpoint: Path, args, start: dict) -> dict:
    """Coordinate descent: each knob in turn over its values, the others held, the best goodput at 2x LitServe's
    own capacity kept; passes over all the knobs again until one changes nothing (at most SEARCH_PASSES). The
    capacity is measured first with the starting knobs.

    One pass was not enough: from knobs with no admission control every candidate drowned at 2x (about 60/s
    answered in time whatever the batch), so the batch size was chosen among equals before
    `limit_concurrency` made the runs comparable; the next pass chooses it again with the limit in place."""
    knobs = dict(start)
    cap, by_clients = capacity("litserve", checkpoint, args, knobs)
    rate = 2 * cap
    print(f"search: LitServe's capacity with {knobs}: {cap:.1f}/s {by_clients}; searching at {rate:.0f}/s", flush=True)
    requests = make_requests(rate, args.search_seconds, args.seed + 7919)
    tried: dict[str, float] = {}

    def score(candidate: dict) -> float:
        key = json.dumps(candidate, sort_keys=True)
        if key not in tried:
            row = one_run("litserve", checkpoint, args, candidate, requests, args.search_seconds)
            tried[key] = row["goodput_per_s"]
            print(f"search: {candidate} goodput {row['goodput_per_s']:.1f}/s p50 {row['p50_ms']:.0f} ms "
                  f"in time {row['in_time']} late {row['late']} refused {row['refused_bare']} "
                  f"expired {row['expired']} unanswered {row['unanswered']}", flush=True)
            with open(args.out, "a") as out:
                out.write(json.dumps({"search": candidate, "rate": rate, **row}) + "\n")
        return tried[key]

    best = score(knobs)
    for _ in range(SEARCH_PASSES):
        before = knobs
        for name, values in SEARCH.items():
            for value in values:
                candidate = {**knobs, name: value}
                if candidate["batch_timeout"] and candidate["timeout"] and candidate["batch_timeout"] >= candidate["timeout"]:
                    continue  # LitServe refuses a batch_timeout past the request timeout
                got = score(candidate)
                if got > best:
                    best, knobs = got, candidate
        if knobs == before:
            break
    print(f"search: best {knobs} goodput {best:.1f}/s at {rate:.0f}/s", flush=True)
    return knobs


# --- the report ----------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 2) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    return f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f} / {max(values):.{digits}f}"


def checks(rows: list[dict], caps: dict) -> list[str]:
    """The issue's marks, each said met or not, from the runs."""
    out = []

    def at(system, level, basis="portal"):
        return sorted((r for r in rows if r["system"] == system and r["level"] == level and r["basis"] == basis),
                      key=lambda r: r["repeat"])

    portal2, lit2 = at("portal", 2.0), at("litserve", 2.0)
    if portal2:
        late = [r["answered_late_share"] for r in portal2]
        out.append(f"- 2x: answered past their deadline, share of the answered, each repeat: "
                   f"{', '.join(f'{100 * x:.2f} %' for x in late)} (the p99 is within the deadline when <= 1 %): "
                   f"{'met in every repeat' if max(late) <= 0.01 else 'NOT met in every repeat'}.")
        share = statistics.median(r["goodput_per_s"] for r in portal2) / caps["portal"]
        out.append(f"- 2x: the portal's goodput, median, is {100 * share:.1f} % of its own capacity "
                   f"(mark: >= 95 %): {'met' if share >= 0.95 else 'NOT met'}.")
    if portal2 and lit2:
        ratios = [p["goodput_per_s"] / max(lit["goodput_per_s"], 1e-9) for p, lit in zip(portal2, lit2)]
        out.append(f"- 2x: goodput portal / LitServe (tuned), min / median / max of the paired repeats: {spread(ratios)} "
                   f"(mark: median >= 1, never below): {'met' if min(ratios) >= 1 else 'NOT met'}.")
    for level in (3.0, 5.0):
        mine = at("portal", level)
        if mine:
            bad = sum(r["unanswered"] + r["other"] + r["refused_bare"] for r in mine)
            total = sum(r["requests"] for r in mine)
            out.append(f"- {level:g}x: of {total} requests, {bad} neither answered, refused with Retry-After nor expired "
                       f"before the deadline + {GRACE_S * 1000:.0f} ms: {'met' if bad == 0 else 'NOT met'}.")
    for level in (0.5, 1.0):
        p, lit = at("portal", level), at("litserve", level)
        if p and lit:
            ratios = [a["p50_ms"] / b["p50_ms"] for a, b in zip(p, lit)]
            out.append(f"- {level:g}x: p50 portal / LitServe, min / median / max: {spread(ratios)} "
                       f"(mark: <= 1): {'met' if statistics.median(ratios) <= 1 else 'NOT met'} on the median.")
    return out


def report(rows: list[dict], caps: dict, knobs: dict, via: str) -> str:
    lines = [
        f"Capacities (closed loop, answered/s): portal ({via}) {caps['portal']:.1f}, LitServe {caps['litserve']:.1f}"
        + (f", portal-direct {caps['portal-direct']:.1f}" if caps.get("portal-direct") == caps.get("portal-direct") else "")
        + ". "
        f"LitServe's knobs: {json.dumps(knobs)}. Load generator: lag p99 at most "
        f"{max((r['lag_p99_ms'] for r in rows), default=float('nan')):.1f} ms, CPU at most "
        f"{max((r['client_cpu'] for r in rows), default=float('nan')):.2f} of its core.",
        "",
        "| system | load | rate/s | goodput/s median (min-max) | p50 ms | p99 ms | answered late % | in time "
        "| late | refused (Retry-After) | refused (bare) | expired | unanswered | other | server CPU (edge) | repeats |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["basis"], row["level"]), []).append(row)
    for (system, basis, level), mine in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1] != "portal", kv[0][0])):
        def med(key):
            return statistics.median(r[key] for r in mine)
        good = [r["goodput_per_s"] for r in mine]
        label = f"{level:g}x {'portal' if basis == 'portal' else 'own'}"
        lines.append(
            f"| {system} | {label} | {mine[0]['rate']:.0f} | {statistics.median(good):.1f} ({min(good):.1f}-{max(good):.1f}) "
            f"| {med('p50_ms'):.0f} | {med('p99_ms'):.0f} | {100 * med('answered_late_share'):.2f} "
            + " ".join(f"| {med(k):.0f}" for k in OUTCOMES)
            + f" | {med('server_cpu'):.2f}" + (f" ({med('edge_cpu'):.2f})" if med("edge_cpu") else "") + f" | {len(mine)} |"
        )
    lines += ["", "Paired ratios, portal / LitServe, each repeat at the same offered load (min / median / max):", "",
              "| load | goodput ratio | p50 ratio (lower: portal faster) | p99 ratio |", "|---|---|---|---|"]
    for level in sorted({r["level"] for r in rows}):
        pairs = []
        for repeat in sorted({r["repeat"] for r in rows}):
            a = [r for r in rows if r["level"] == level and r["repeat"] == repeat and r["basis"] == "portal"]
            p = next((r for r in a if r["system"] == "portal"), None)
            lit = next((r for r in a if r["system"] == "litserve"), None)
            if p and lit:
                pairs.append((p, lit))
        if not pairs:
            continue

        def ratio(key, pairs=pairs):
            return [p[key] / lit[key] if lit[key] else float("inf") for p, lit in pairs]
        lines.append(f"| {level:g}x | {spread(ratio('goodput_per_s'))} | {spread(ratio('p50_ms'))} | {spread(ratio('p99_ms'))} |")
    own = [r for r in rows if r["basis"] == "own"]
    if own:
        names = [k for k in ("portal", "portal-direct", "litserve") if any(r["system"] == k for r in rows)]
        lines += ["", "Each at multiples of its own capacity: goodput / own capacity, and p50 ms "
                  "(min / median / max over the repeats; the portal's own capacity is its levels' basis):", "",
                  "| load | " + " | ".join(f"{n} goodput / capacity | {n} p50 ms" for n in names) + " |",
                  "|---|" + "---|---|" * len(names)]
        for level in sorted({r["level"] for r in own}):
            cells = []
            for name in names:
                mine = [r for r in rows if r["level"] == level and r["system"] == name
                        and r["basis"] == ("portal" if name == "portal" else "own")]
                cells += [spread([r["goodput_per_s"] / caps[name] for r in mine]), spread([r["p50_ms"] for r in mine], 0)]
            lines.append(f"| {level:g}x | " + " | ".join(cells) + " |")
    lines += ["", "The marks:", "", *checks(rows, caps)]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    styles = {("portal", "portal"): "o-", ("portal-direct", "own"): "o:", ("litserve", "portal"): "s-",
              ("litserve", "own"): "s--"}
    for (system, basis), style in styles.items():
        mine = [r for r in rows if r["system"] == system and r["basis"] == basis]
        levels = sorted({r["level"] for r in mine})
        if not levels:
            continue
        label = {"portal": "portal, through the edge", "portal-direct": "portal's replica alone (x own capacity)"}.get(
            system, f"LitServe ({'x portal' if basis == 'portal' else 'x own'} capacity)")
        for axis, key in ((left, "goodput_per_s"), (right, "p99_ms")):
            meds = [statistics.median(r[key] for r in mine if r["level"] == lv) for lv in levels]
            lows = [min(r[key] for r in mine if r["level"] == lv) for lv in levels]
            highs = [max(r[key] for r in mine if r["level"] == lv) for lv in levels]
            axis.errorbar(levels, meds, yerr=[[m - lo for m, lo in zip(meds, lows)], [hi - m for m, hi in zip(meds, highs)]],
                          fmt=style, capsize=3, label=label)
    left.set(xlabel="load (x capacity)", ylabel="goodput (answered in time / s)")
    right.set(xlabel="load (x capacity)", ylabel="p99 of answered (ms)", yscale="log")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10, help="each run's arrivals last this long")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--levels", default="0.5,1,2,3,5", help="multiples of the portal's capacity, both systems")
    parser.add_argument("--own-levels", default="0.5,1,2",
                        help="multiples of each one's own capacity, for LitServe and portal-direct")
    parser.add_argument("--systems", default="portal,litserve",
                        help="portal, litserve, and portal-direct: the portal's replica without the edge in front "
                             "(at --own-levels only)")
    parser.add_argument("--capacity", type=float, help="the portal's answered/s; measured when not given")
    parser.add_argument("--litserve-capacity", type=float, help="LitServe's answered/s; measured when not given")
    parser.add_argument("--capacity-clients", default="64,128", help="closed loops of these many clients; the best")
    parser.add_argument("--capacity-seconds", type=float, default=8)
    parser.add_argument("--search", action="store_true", help="tune LitServe's knobs first (at 2x its own capacity)")
    parser.add_argument("--search-seconds", type=float, default=6, help="each search run's arrivals last this long")
    parser.add_argument("--litserve-config", default="{}", help="LitServe's knobs, JSON (over the starting ones)")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--portal-via", choices=("auto", "edge", "direct"), default="auto",
                        help="the portal through the edge (runners/edge) or at its replica; auto: the edge when on main")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--client", choices=sorted(CLIENTS), default="keepalive", help="the load generator's HTTP client")
    parser.add_argument("--out", type=Path, default=Path("/tmp/serve_load.jsonl"))
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    os.sched_setaffinity(0, {args.client_core})
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    systems = args.systems.split(",")
    if "litserve" in systems and importlib.util.find_spec("litserve") is None:
        print(f"installing {LITSERVE} for this bench (never a dependency of the portal)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", LITSERVE], check=True)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Checked before the runs, not after them: the plot is drawn at the end of a 20-minute bench.
        print(f"installing {MATPLOTLIB} for --plot (the bench extra in pyproject.toml)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", MATPLOTLIB], check=True)
    checkpoint = write_checkpoint(Path(f"/tmp/serve-load-{os.getpid()}"))
    global EDGE
    if "portal" in systems and args.portal_via != "direct":
        from bench import serve_edge

        if args.portal_via == "edge" or serve_edge.available():
            EDGE = serve_edge.EdgeSetup()
    print(f"the portal measured {'through the edge' if EDGE else 'at its replica directly (no edge)'}", flush=True)
    try:
        run_all(args, systems, checkpoint)
    finally:
        if EDGE is not None:
            EDGE.close()


def run_all(args, systems: list[str], checkpoint: Path) -> None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--short", "runners/workloads/serve.py", "runners/edge"], cwd=REPO,
                             capture_output=True, text=True).stdout.split()
    print(f"commit {head}; changed in the work tree: {' '.join(changed[1::2]) or 'nothing'}", flush=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; load average {os.getloadavg()}; "
          f"servers on core {args.server_core}, load generator on core {args.client_core}; portal flags {portal_flags()}",
          flush=True)

    knobs = {**LITSERVE_KNOBS, **json.loads(args.litserve_config)}
    if "litserve" in systems and args.search:
        knobs = search(checkpoint, args, knobs)
    caps = {"portal": args.capacity, "litserve": args.litserve_capacity, "portal-direct": None}
    for kind in systems:
        if caps[kind] is None:
            caps[kind], found = capacity(kind, checkpoint, args, knobs if kind == "litserve" else None)
            print(f"capacity of {kind}: {caps[kind]:.1f} answered/s (closed loop; by clients {found})", flush=True)
    caps = {kind: float("nan") if cap is None else cap for kind, cap in caps.items()}

    levels = [float(x) for x in args.levels.split(",") if x]
    own_levels = [float(x) for x in args.own_levels.split(",") if x]
    rows = []
    turn = 0
    for repeat in range(args.repeats):
        for level in sorted(set(levels) | set(own_levels)):
            seed = args.seed + 1000 * repeat + int(level * 100)
            runs = []
            if level in levels:
                runs += [(kind, "portal") for kind in systems if kind != "portal-direct"]
            if level in own_levels:
                runs += [(kind, "own") for kind in systems if kind in ("litserve", "portal-direct")]
            if turn % 2:
                runs.reverse()
            turn += 1
            for kind, basis in runs:
                rate = (caps["portal"] if basis == "portal" else caps[kind]) * level
                requests = make_requests(rate, args.seconds, seed if basis == "portal" else seed + 500)
                row = {"system": kind, "basis": basis, "level": level, "rate": rate, "repeat": repeat,
                       **one_run(kind, checkpoint, args, knobs if kind == "litserve" else None, requests, args.seconds)}
                rows.append(row)
                with open(args.out, "a") as out:
                    out.write(json.dumps(row) + "\n")
                print(f"repeat {repeat} {kind} {level:g}x {basis} ({rate:.0f}/s): goodput {row['goodput_per_s']:.1f}/s "
                      f"p50 {row['p50_ms']:.0f} p99 {row['p99_ms']:.0f} ms; "
                      + ", ".join(f"{k} {row[k]}" for k in OUTCOMES)
                      + f"; cpu server {row['server_cpu']:.2f} (edge {row['edge_cpu']:.2f}) client {row['client_cpu']:.2f}; lag p99 {row['lag_p99_ms']:.1f} ms {row['errors'] or ''}", flush=True)
    print()
    print(report(rows, caps, knobs, "through the edge" if EDGE else "at its replica, no edge"))
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; load average {os.getloadavg()}", flush=True)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

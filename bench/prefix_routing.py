"""Cache-aware routing against least outstanding tokens, on 4 real replicas of the shipped server.

    python bench/prefix_routing.py [--replicas 4] [--seconds 20] [--repeats 5] [--level 1.0] [--capacity R]
                                   [--prefix-cache-mib 0.0625] [--load-slack 4096] [--block-chars 64]
                                   [--zipf 0] [--policies least-tokens,prefix,prefix-unbounded]
                                   [--server-cores 0] [--client-core 1]

Each replica is `runners.workloads.serve` as `bench/serve_load.py` starts its `portal` server: the flags a
deployed replica gets (the backends' `ServingSettings` at their defaults), one CPU thread for the model,
its own process group, pinned to `--server-cores`; here with a prefix cache of `--prefix-cache-mib` and
`--prefix-block` bytes. Every replica serves the same `CharModel` checkpoint, written by serve_load's
`write_checkpoint`. This process (the load and the dispatcher) is pinned to `--client-core`.

The dispatcher sends each request to one replica and counts, per replica, the tokens it has sent there and
not had answered (prompt bytes plus max_tokens, as the portal's router does). The two policies share it;
only the order of the replicas differs:

- `least-tokens`: the fewest outstanding tokens first (ties by replica), as `runners/inference/router.py`
  picks today;
- `prefix`: `runners.edge.prefix.PrefixRouter` (the edge's): the replica that was sent the longest prefix
  of the prompt first, unless it has more than `--load-slack` tokens outstanding over the least loaded
  one; each prompt is recorded against the replica it is sent to as it is sent (`--record-at answer`:
  once answered 2xx, as the edge does);
- `prefix-unbounded` (only when asked): the same with no load bound, to show what the bound is for.

The request goes to the first replica of the order; that replica's answer (2xx, 429, 503, 504) is the
request's outcome. One aiohttp session (keep-alive connections) carries every request.

Workload: 60 % of the prompts begin with one of 8 system prompts (280-420 bytes, cut from the trainer's
corpus; each as likely, or the k-th in proportion to 1/k**zipf with `--zipf`) and a newline, then 20-60
bytes of the user's own; the rest are unique, 20-260 bytes. Outputs 8-32 tokens (70 %) or 128-256 (30 %); a request's deadline is 300 ms + 12 ms per
token asked, in its body, as in serve_load.py; the client waits until the deadline + 100 ms. Poisson
arrivals for `--seconds` at `--level` times the replicas' capacity, measured first unless given: the
answered requests per second of a closed loop of 64 clients per replica through the dispatcher with
least-tokens, generous deadlines (1 s of warm-up left out).

`--prefix-cache-mib` is each replica's prefix cache. At the server's default (32 MiB) every replica keeps
all 8 system prompts whatever the routing; the default here, 64 KiB, holds about two of them beside the
unique prompts' churn, as a GPU's KV cache holds a few long prefixes beside the running batch: where the
routing decides what stays cached.

The policies run in turn on the same requests, the order reversed every other repeat, each run on fresh replicas
(empty caches); each repeat draws new requests. Reported per policy over the repeats (min / median / max):
prefix-cache hit rate (the replicas' `serve_prefix_cache_hits_total` over
`serve_prefix_cache_lookups_total`, summed), goodput (answered within the deadline as the client saw it,
per second), p50 / p99 latency of the answered, shed (429/503), expired (504), late (answered past the
deadline), the busiest replica's share of the requests (25 % is even) and how many replicas each system
prompt was sent to (1: it stayed on one). A line of JSON per run goes to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
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

from bench.serve_load import free_port, write_checkpoint  # noqa: E402
from runners.backends.base import ServingSettings  # noqa: E402
from runners.edge.prefix import PrefixRouter, ReplicaLoad  # noqa: E402
from runners.workloads.train import DEFAULT_CORPUS  # noqa: E402

GRACE_S = 0.1  # the client waits for an answer until the deadline + this, then counts it unanswered
CLOSED_LOOP_DEADLINE_MS = 20_000  # under the deployed --max-deadline-ms
SYSTEM_PROMPTS = 8
SHARED_SHARE = 0.6
USER_ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,?"


# --- the workload ----------------------------------------------------------------------------------


def system_prompts(count: int = SYSTEM_PROMPTS) -> list[str]:
    """`count` different system prompts of 280-420 bytes: stretches of the corpus the model was trained on."""
    text = " ".join(DEFAULT_CORPUS.read_text().split())
    rng = random.Random(36)
    out = []
    for i in range(count):
        length = rng.randint(280, 420)
        start = (i * len(text)) // count
        out.append(f"System {chr(ord('A') + i)}. " + text[start:start + length])
    return out


def make_requests(rate: float, seconds: float, seed: int, systems: list[str], zipf: float = 0.0) -> list[dict]:
    """Arrival time, prompt, max_tokens, deadline and which system prompt (or none) of every request.

    The k-th system prompt is chosen in proportion to 1 / k ** zipf: each as likely at 0."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** zipf for k in range(len(systems))]
    at, out = 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            return out
        if rng.random() < SHARED_SHARE:
            system = rng.choices(range(len(systems)), weights)[0]
            prompt = systems[system] + "\n" + "".join(rng.choice(USER_ALPHABET) for _ in range(rng.randint(20, 60)))
        else:
            system = None
            prompt = "".join(rng.choice(USER_ALPHABET) for _ in range(rng.randint(20, 260)))
        max_tokens = rng.randint(8, 32) if rng.random() < 0.7 else rng.randint(128, 256)
        out.append({"at": at, "prompt": prompt, "max_tokens": max_tokens, "deadline_ms": 300 + 12 * max_tokens,
                    "system": system})


# --- the replicas ----------------------------------------------------------------------------------


class Replica:
    """One `runners.workloads.serve` process with the flags a deployed replica gets (the backends'
    ServingSettings at their defaults) and this bench's prefix cache, its own process group, pinned to
    `--server-cores`, as bench/serve_load.py starts its `portal` server."""

    def __init__(self, checkpoint: Path, args) -> None:
        self.port = free_port()
        command = [
            sys.executable, "-m", "runners.workloads.serve", "--checkpoint", str(checkpoint), "--port", str(self.port),
            *ServingSettings(endpoint_id=0, checkpoint="").flags(),
            "--prefix-cache-mib", str(args.prefix_cache_mib), "--prefix-block", str(args.prefix_block),
        ]
        cores = args.server_cores
        self.proc = subprocess.Popen(
            command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )

    def wait_ready(self, until: float) -> None:
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the replica on port {self.port} exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")
                    if b" 200 " in sock.recv(64):
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the replica on port {self.port} did not become ready")

    def metrics(self) -> dict[str, float]:
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            text = b"".join(iter(lambda: sock.recv(65536), b"")).decode()
        body = text.partition("\r\n\r\n")[2]
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                if line and line[0] != "#"}

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class Replicas:
    """`count` replicas started together, stopped together."""

    def __init__(self, count: int, checkpoint: Path, args) -> None:
        self.all: list[Replica] = []
        try:
            for _ in range(count):
                self.all.append(Replica(checkpoint, args))
            until = time.monotonic() + 180
            for replica in self.all:
                replica.wait_ready(until)
        except BaseException:
            self.stop()
            raise

    def urls(self) -> dict[str, str]:
        return {f"r{i}": f"http://127.0.0.1:{replica.port}/v1/generate" for i, replica in enumerate(self.all)}

    def prefix_hit_rate(self) -> float | None:
        hits = lookups = 0.0
        for replica in self.all:
            values = replica.metrics()
            hits += values.get("serve_prefix_cache_hits_total", 0.0)
            lookups += values.get("serve_prefix_cache_lookups_total", 0.0)
        return hits / lookups if lookups else None

    def stop(self) -> None:
        for replica in self.all:
            replica.stop()


# --- the dispatcher --------------------------------------------------------------------------------


class LeastTokens:
    """Today's order, in the PrefixRouter's shape: fewest outstanding tokens first, ties by key."""

    def order(self, prompt: str, replicas: list[ReplicaLoad]) -> list[str]:
        return [r.key for r in sorted(replicas, key=lambda r: (r.outstanding_tokens, r.key))]

    def record(self, key: str, prompt: str) -> None:
        pass


class Dispatcher:
    """Sends each request to the first replica of the policy's order, counting outstanding tokens per replica.

    One aiohttp session (a pool of keep-alive connections) for every request."""

    def __init__(self, urls: dict[str, str], policy, record_at: str = "send") -> None:
        import aiohttp

        self.aiohttp = aiohttp
        self.urls = urls
        self.policy = policy
        self.record_at = record_at
        self.outstanding = dict.fromkeys(urls, 0)
        self.sent = dict.fromkeys(urls, 0)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=8192, keepalive_timeout=60), skip_auto_headers=("User-Agent",))

    async def close(self) -> None:
        await self.session.close()

    async def send(self, body: dict, timeout_s: float) -> tuple[str, int | str]:
        """(the replica it went to, its status or why there is none)."""
        prompt = body["prompt"]
        loads = [ReplicaLoad(key, tokens) for key, tokens in self.outstanding.items()]
        key = self.policy.order(prompt, loads)[0]
        if self.record_at == "send":
            self.policy.record(key, prompt)
        cost = len(prompt.encode()) + body["max_tokens"]
        self.outstanding[key] += cost
        self.sent[key] += 1
        data = json.dumps(body).encode()
        try:
            async with asyncio.timeout(timeout_s):
                async with self.session.post(self.urls[key], data=data,
                                             headers={"Content-Type": "application/json"}) as response:
                    await response.read()
                    if self.record_at == "answer" and response.status < 400:
                        self.policy.record(key, prompt)
                    return key, response.status
        except TimeoutError:
            return key, "unanswered"
        except (self.aiohttp.ClientError, OSError) as error:
            return key, f"error {error.__class__.__name__}"
        finally:
            self.outstanding[key] -= cost


async def drive(dispatcher: Dispatcher, requests: list[dict]) -> list[dict]:
    """Send each request at its arrival time (open loop), every one with its deadline in the body."""
    loop = asyncio.get_running_loop()
    results: list[dict] = []
    tasks = []

    async def one(req):
        sent = loop.time()
        body = {"prompt": req["prompt"], "max_tokens": req["max_tokens"], "deadline_ms": req["deadline_ms"]}
        key, status = await dispatcher.send(body, req["deadline_ms"] / 1000 + GRACE_S)
        latency_ms = (loop.time() - sent) * 1000
        results.append({"system": req["system"], "replica": key, "status": status, "latency_ms": latency_ms,
                        "deadline_ms": req["deadline_ms"]})

    start = loop.time() + 0.05
    for req in requests:
        delay = start + req["at"] - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    await asyncio.gather(*tasks)
    return results


async def closed_loop(dispatcher: Dispatcher, clients: int, seconds: float, pool: list[dict]) -> float:
    """Answered requests per second with `clients` each waiting on one answer at a time (1 s of warm-up left out)."""
    loop = asyncio.get_running_loop()
    begin = loop.time() + 1.0
    end = begin + seconds
    done = 0

    async def client(i):
        nonlocal done
        k = i
        while loop.time() < end:
            req = pool[k % len(pool)]
            k += clients
            body = {"prompt": req["prompt"], "max_tokens": req["max_tokens"], "deadline_ms": CLOSED_LOOP_DEADLINE_MS}
            _, status = await dispatcher.send(body, CLOSED_LOOP_DEADLINE_MS / 1000 + 5)
            if status == 200 and begin <= loop.time() <= end:
                done += 1
            elif status != 200:
                await asyncio.sleep(0.01)  # a refusal: no busy loop of refusals

    await asyncio.gather(*(client(i) for i in range(clients)))
    return done / seconds


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(results: list[dict], seconds: float) -> dict:
    n = len(results) or 1
    answered = [r for r in results if r["status"] == 200]
    in_time = [r for r in answered if r["latency_ms"] <= r["deadline_ms"]]
    return {
        "requests": len(results),
        "answered": len(answered),
        "goodput_per_s": len(in_time) / seconds,
        "p50_ms": percentile([r["latency_ms"] for r in answered], 0.5),
        "p99_ms": percentile([r["latency_ms"] for r in answered], 0.99),
        "shed": sum(r["status"] in (429, 503) for r in results) / n,
        "expired": sum(r["status"] == 504 for r in results) / n,
        "late": (len(answered) - len(in_time)) / n,
        "unanswered": sum(isinstance(r["status"], str) for r in results) / n,
        "other": sum(isinstance(r["status"], int) and r["status"] not in (200, 429, 503, 504) for r in results) / n,
    }


POLICIES = ("least-tokens", "prefix", "prefix-unbounded")


def make_policy(name: str, args):
    """least-tokens; prefix (PrefixRouter with --load-slack); prefix-unbounded (no load bound: it never spills)."""
    if name == "least-tokens":
        return LeastTokens()
    slack = {"prefix": args.load_slack, "prefix-unbounded": float("inf")}[name]
    return PrefixRouter(block_chars=args.block_chars, max_prefixes_per_replica=args.max_prefixes, load_slack=slack)


async def dispatched(urls: dict[str, str], policy, work, record_at: str = "send") -> tuple[object, Dispatcher]:
    """(what `work(dispatcher)` returns, the dispatcher): its aiohttp session made and closed on this loop."""
    dispatcher = Dispatcher(urls, policy, record_at)
    try:
        return await work(dispatcher), dispatcher
    finally:
        await dispatcher.close()


def run_once(policy_name: str, requests: list[dict], checkpoint: Path, args) -> dict:
    replicas = Replicas(args.replicas, checkpoint, args)
    try:
        results, dispatcher = asyncio.run(
            dispatched(replicas.urls(), make_policy(policy_name, args), lambda d: drive(d, requests), args.record_at))
        hits = replicas.prefix_hit_rate()
    finally:
        replicas.stop()
    total = sum(dispatcher.sent.values()) or 1
    shares = sorted((n / total for n in dispatcher.sent.values()), reverse=True)
    shared = [r for r in results if r["system"] is not None]
    systems = {r["system"] for r in shared}
    return {**summarize(results, args.seconds), "policy": policy_name, "prefix_hit_rate": hits,
            "busiest_share": shares[0], "shares": shares,
            # How many replicas each system prompt was sent to: 1 = it stuck to one, 4 = spread over all.
            "replicas_per_system": statistics.mean(
                len({r["replica"] for r in shared if r["system"] == system}) for system in systems
            ) if systems else None}


def spread(values: list[float], fmt: str) -> str:
    values = sorted(v for v in values if v is not None)
    if not values:
        return ""
    return " / ".join(format(v, fmt) for v in (values[0], statistics.median(values), values[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--level", type=float, default=1.0, help="the arrival rate, times the replicas' capacity")
    parser.add_argument("--capacity", type=float, help="requests/s of the replicas together; measured when not given")
    parser.add_argument("--policies", default="least-tokens,prefix", help=f"some of {', '.join(POLICIES)}")
    parser.add_argument("--record-at", choices=("send", "answer"), default="send",
                        help="when a prompt is recorded against its replica: as it is sent, or once answered 2xx")
    parser.add_argument("--zipf", type=float, default=0.0,
                        help="system prompt k is chosen in proportion to 1/k**zipf (0: each as likely)")
    parser.add_argument("--prefix-cache-mib", type=float, default=0.0625)
    parser.add_argument("--prefix-block", type=int, default=16, help="the replicas' --prefix-block (bytes)")
    parser.add_argument("--block-chars", type=int, default=64, help="the router's block (a multiple of the replicas')")
    parser.add_argument("--max-prefixes", type=int, default=4096, help="the router's prefixes per replica")
    parser.add_argument("--load-slack", type=float, default=4096, help="the router's load slack, in tokens")
    parser.add_argument("--server-cores", default="0", help="the cores the replicas are pinned to, comma-separated")
    parser.add_argument("--client-core", type=int, default=1, help="the core this process (the load) is pinned to")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("/tmp/prefix_routing.jsonl"))
    args = parser.parse_args()
    args.server_cores = {int(core) for core in args.server_cores.split(",")}
    policies = args.policies.split(",")
    if not set(policies) <= set(POLICIES):
        parser.error(f"--policies: some of {', '.join(POLICIES)}")
    os.sched_setaffinity(0, {args.client_core})

    checkpoint = write_checkpoint(Path(f"/tmp/prefix-routing-{os.getpid()}"))
    systems = system_prompts()
    capacity = args.capacity
    if capacity is None:
        replicas = Replicas(args.replicas, checkpoint, args)
        pool = make_requests(200, 60, args.seed, systems)
        try:
            capacity, _ = asyncio.run(dispatched(
                replicas.urls(), LeastTokens(),
                lambda d: closed_loop(d, 64 * args.replicas, max(10.0, args.seconds / 2), pool)))
        finally:
            replicas.stop()
        print(f"capacity of {args.replicas} replicas: {capacity:.1f} requests/s "
              f"(closed loop, {64 * args.replicas} clients, least-tokens)", flush=True)
    rate = capacity * args.level
    rows: list[dict] = []
    for repeat in range(args.repeats):
        requests = make_requests(rate, args.seconds, args.seed + 1000 * (repeat + 1), systems, args.zipf)
        pair = policies if repeat % 2 == 0 else policies[::-1]
        for name in pair:
            row = {**run_once(name, requests, checkpoint, args), "repeat": repeat, "rate": rate,
                   "prefix_cache_mib": args.prefix_cache_mib, "load_slack": args.load_slack, "zipf": args.zipf,
                   "record_at": args.record_at}
            rows.append(row)
            with open(args.out, "a") as out:
                out.write(json.dumps(row) + "\n")
            print(f"repeat {repeat} {name}: hits {row['prefix_hit_rate'] or 0:.1%}, goodput {row['goodput_per_s']:.1f}/s, "
                  f"p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms, shed {row['shed']:.1%}, "
                  f"expired {row['expired']:.1%}, late {row['late']:.1%}, shares "
                  f"{'/'.join(f'{s:.0%}' for s in row['shares'])}, replicas per system prompt "
                  f"{row['replicas_per_system'] or 0:.1f}", flush=True)

    print(f"\n{args.replicas} replicas, {rate:.0f} requests/s ({args.level:g}x capacity), {args.seconds:g} s runs, "
          f"{args.repeats} paired repeats, prefix cache {args.prefix_cache_mib:g} MiB per replica, load slack "
          f"{args.load_slack:g} tokens, system prompts' zipf {args.zipf:g}, recorded at {args.record_at}; "
          "min / median / max")
    print("| policy | prefix-cache hits | goodput/s | p50 ms | p99 ms | shed | expired | late | busiest replica "
          "| replicas per system prompt |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in policies:
        mine = [r for r in rows if r["policy"] == name]

        def col(field, fmt, scale=1.0, mine=mine):
            return spread([r[field] * scale if r[field] is not None else None for r in mine], fmt)

        print(f"| {name} | {col('prefix_hit_rate', '.0f', 100)} % | {col('goodput_per_s', '.0f')} | {col('p50_ms', '.0f')} "
              f"| {col('p99_ms', '.0f')} | {col('shed', '.1f', 100)} % | {col('expired', '.1f', 100)} % "
              f"| {col('late', '.1f', 100)} % | {col('busiest_share', '.0f', 100)} % "
              f"| {col('replicas_per_system', '.1f')} |")


if __name__ == "__main__":
    main()

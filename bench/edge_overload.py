"""The edge under overload: one real replica (the shipped server) behind the edge, offered 2x, 3x and 5x
what it answers per second, every request with the same deadline.

    .venv/bin/python bench/edge_overload.py [--deadline-ms 2000] [--seconds 8] [--max-tokens 32]

What it prints, per load: the share of requests answered (200), refused (429 / 503, each with
Retry-After) and expired (504); the p50 and p99 of answered requests' latency; and how many requests of
any outcome took longer than their deadline plus 100 ms (the done-point: none). Latency is counted at
the client, from sending to the last byte.

The replica runs as a process of its own (``python -m runners.workloads.serve`` with a seeded CharModel
checkpoint); the edge runs as a process of its own with a fixed routing table (one endpoint, one replica,
one caller: the database plays no part in what is measured). Capacity is measured first: a closed loop
of clients for a few seconds, answered requests per second. Loads are open (Poisson arrivals): a request
is sent at its time whatever came of the ones before, as independent callers do.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
ROUTE = "/serve/bench/chat/v1/generate"
TOKEN = "bench-token"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer")


def _checkpoint(folder: Path) -> Path:
    import torch

    from runners.workloads.train import CharModel, save_checkpoint

    torch.manual_seed(0)
    model = CharModel()
    return save_checkpoint(folder, 10, model, torch.optim.Adam(model.parameters()), keep=1, world_size=1,
                           attempt=0, alphabet=bytes(range(32, 127)) + b"\n")


def run_edge(port: int, replica: str, queue_limit: int) -> None:
    """``--as-edge``: the edge with a fixed table (one endpoint, one replica, one caller)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    import uvicorn

    from runners.edge.app import EdgeConfig, build
    from runners.edge.table import Caller, Route, Table, Target

    class FixedTable(Table):
        async def start(self) -> None:
            self.routes = {("bench", "chat"): Route(
                id=1, tenant_id=1, tenant_slug="bench", name="chat", default_deadline_ms=10_000,
                queue_limit=queue_limit, stopping=False, desired_replicas=1, starting=False, engine="shipped",
                targets=[Target("1", replica, "/readyz")])}
            self.refreshed_at = asyncio.get_running_loop().time()
            self.loaded.set()

        async def caller(self, *, token, session_key):
            return Caller(1, "bench", False, {1: "member"}, False) if token == TOKEN else None

        def note_request(self, route) -> None:
            pass

    table = FixedTable(refresh_s=3600, auth_cache_s=5)
    uvicorn.run(build(config=EdgeConfig(), table=table), host="127.0.0.1", port=port, log_level="warning",
                access_log=False)


async def _one(client, url: str, body: dict) -> tuple[int, float, bool]:
    import httpx

    started = time.monotonic()
    try:
        answer = await client.post(url, json=body, headers={"Authorization": f"Token {TOKEN}"})
        status, retry_after = answer.status_code, "retry-after" in answer.headers
    except httpx.HTTPError:
        status, retry_after = 0, False
    return status, (time.monotonic() - started) * 1000.0, retry_after


async def _capacity(url: str, body: dict, seconds: float, clients: int) -> float:
    import httpx

    answered = 0
    stop_at = time.monotonic() + seconds

    async def loop(client):
        nonlocal answered
        while time.monotonic() < stop_at:
            status, _, _ = await _one(client, url, body)
            answered += status == 200

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        await asyncio.gather(*(loop(client) for _ in range(clients)))
    return answered / seconds


async def _open_load(url: str, body: dict, rate: float, seconds: float, seed: int) -> list[tuple[int, float, bool]]:
    import httpx

    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
        start = time.monotonic()
        at = 0.0
        while at < seconds:
            at += rng.expovariate(rate)
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, url, body)))
        return await asyncio.gather(*tasks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--as-edge", nargs=3, metavar=("PORT", "REPLICA", "QUEUE_LIMIT"), help=argparse.SUPPRESS)
    parser.add_argument("--deadline-ms", type=float, default=2000)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--queue-limit", type=int, default=64)
    parser.add_argument("--loads", default="2,3,5")
    args = parser.parse_args()
    if args.as_edge:
        run_edge(int(args.as_edge[0]), args.as_edge[1], int(args.as_edge[2]))
        return 0

    folder = Path(tempfile.mkdtemp(prefix="edge-overload-"))
    checkpoint = _checkpoint(folder)
    replica_port, edge_port = _free_port(), _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", SERVE_QUEUE_LIMIT=str(args.queue_limit))
    processes = []
    try:
        replica = subprocess.Popen([sys.executable, "-m", "runners.workloads.serve", "--checkpoint", str(checkpoint),
                                    "--port", str(replica_port)], cwd=REPO, env=env,
                                   stdout=open(folder / "replica.log", "wb"), stderr=subprocess.STDOUT)
        processes.append(replica)
        _wait(f"http://127.0.0.1:{replica_port}/readyz", replica)
        edge = subprocess.Popen([sys.executable, __file__, "--as-edge", str(edge_port),
                                 f"http://127.0.0.1:{replica_port}", str(args.queue_limit)], cwd=REPO, env=env,
                                stdout=open(folder / "edge.log", "wb"), stderr=subprocess.STDOUT)
        processes.append(edge)
        _wait(f"http://127.0.0.1:{edge_port}/healthz", edge)
        url = f"http://127.0.0.1:{edge_port}{ROUTE}"
        body = {"prompt": "the quick brown fox ", "max_tokens": args.max_tokens, "deadline_ms": args.deadline_ms}
        capacity = asyncio.run(_capacity(url, body, 5.0, 16))
        print(f"one replica answers {capacity:.1f} requests/s (closed loop, 16 clients, max_tokens "
              f"{args.max_tokens}); deadline {args.deadline_ms:g} ms")
        print(f"{'load':>5} {'sent':>6} {'answered':>9} {'refused':>8} {'expired':>8} {'other':>6} "
              f"{'p50 ms':>8} {'p99 ms':>8} {'late>+100ms':>12}")
        for seed, factor in enumerate(float(x) for x in args.loads.split(",")):
            results = asyncio.run(_open_load(url, body, capacity * factor, args.seconds, seed))
            answered = sorted(ms for status, ms, _ in results if status == 200)
            refused = [r for r in results if r[0] in (429, 503)]
            expired = [r for r in results if r[0] == 504]
            other = len(results) - len(answered) - len(refused) - len(expired)
            late = sum(1 for _, ms, _ in results if ms > args.deadline_ms + 100)
            missing_retry = sum(1 for r in refused if not r[2])
            p50 = statistics.median(answered) if answered else float("nan")
            p99 = answered[min(len(answered) - 1, int(0.99 * len(answered)))] if answered else float("nan")
            n = len(results)
            print(f"{factor:>4g}x {n:>6} {len(answered) / n:>9.1%} {len(refused) / n:>8.1%} {len(expired) / n:>8.1%} "
                  f"{other:>6} {p50:>8.0f} {p99:>8.0f} {late:>12}"
                  + (f"  ({missing_retry} refusals without Retry-After)" if missing_retry else ""))
            time.sleep(2)  # the replica's queue drains between loads
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

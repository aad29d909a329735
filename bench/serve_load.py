"""Open-loop load against the inference server, side by side with LitServe and a one-at-a-time server.

    python bench/serve_load.py [--seconds 20] [--levels 0.5,1,2] [--servers portal,portal-nocache,litserve,one-at-a-time]
                               [--litserve-batch 8] [--litserve-timeout-ms 10] [--plot bench/serve_load.png]

Every server serves the same checkpoint of the trainer's model (`CharModel`, written here with the
shipped corpus's alphabet) on one CPU thread, greedy decoding one byte a token, each as its own
process on loopback:

- `portal`: `runners/workloads/serve.py` as a replica runs it (continuous batching under a token
  budget, deadline-ordered bounded queue, prefix cache);
- `portal-nocache`: the same with `--prefix-cache-mib 0`;
- `litserve`: LitServe (`litserve==0.2.19`, installed by this script into the running environment
  when missing: it is never a dependency of the portal) with its dynamic batching: up to
  `--litserve-batch` requests gathered for at most `--litserve-timeout-ms`, each batch decoded
  together for as many steps as its longest request asks;
- `one-at-a-time`: a plain HTTP server that answers one request after the other.

Load: Poisson arrivals for `--seconds` at each level, a level being a multiple of one portal
replica's capacity, measured first (the answered requests per second of a closed loop of 64
clients with no deadline pressure). Half the prompts start with the same 200-byte system prompt;
prompts are 20-260 bytes, outputs 8-32 tokens (70 %) or 128-256 (30 %); a request's deadline is
300 ms + 12 ms per token asked. Each (server, level) gets a fresh server process. A client waits
for an answer up to 30 s past its deadline.

Reported per (server, level): answered (2xx), p50 / p99 latency of answered requests, time to
first token (portal: the server's header; the others answer all at once, so it is their latency),
goodput (answered within the deadline, per second of the run), shed (429/503), expired (504 from
the server), late (answered past the deadline), unanswered (the client gave up), prefix-cache hit
rate (portal, from /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SYSTEM = (
    "You are the GPU portal's assistant for the ml-research team. Answer briefly, name the job and the "
    "flavor you mean, and never guess a quota: read it. Be kind to people who wait for their GPUs today.\n"
)[:200]
LITSERVE = "litserve==0.2.19"
GIVE_UP_AFTER_DEADLINE_S = 30.0


# --- the servers this bench compares (run as `python bench/serve_load.py --as-server KIND ...`) -------


def _generate_one(model, mask, prompt: bytes, max_tokens: int) -> bytes:
    import torch

    out, hidden = model.rnn(model.embed(torch.tensor([list(prompt)])))
    token = int((model.head(out[0, -1]) + mask).argmax())
    generated = [token]
    while len(generated) < max_tokens:
        out, hidden = model.rnn(model.embed(torch.tensor([[token]])), hidden)
        token = int((model.head(out[0, 0]) + mask).argmax())
        generated.append(token)
    return bytes(generated)


def _generate_batch(model, mask, prompts: list[bytes], max_tokens: list[int]) -> list[bytes]:
    """A static batch: the prompts in one packed call (as the portal's server runs its joiners), then
    every sequence decoded together for as many steps as the longest ask."""
    import torch
    from torch.nn.utils.rnn import pack_sequence

    packed = pack_sequence([model.embed(torch.tensor(list(p))) for p in prompts], enforce_sorted=False)
    _, hidden = model.rnn(packed)
    tokens = (model.head(hidden[0]) + mask).argmax(-1)
    generated = [tokens]
    for _ in range(max(max_tokens) - 1):
        out, hidden = model.rnn(model.embed(tokens.view(-1, 1)), hidden)
        tokens = (model.head(out[:, 0]) + mask).argmax(-1)
        generated.append(tokens)
    rows = torch.stack(generated, dim=1).tolist()
    return [bytes(row[:n]) for row, n in zip(rows, max_tokens)]


def _load(checkpoint: str):
    import torch

    from runners.workloads.serve import load_model
    from runners.workloads.train import VOCAB

    torch.set_num_threads(1)
    model, alphabet = load_model(Path(checkpoint), torch.device("cpu"))
    mask = torch.full((VOCAB,), float("-inf"))
    mask[list(alphabet)] = 0.0
    return model, mask


def run_one_at_a_time(checkpoint: str, port: int) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import torch

    model, mask = _load(checkpoint)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock, torch.inference_mode():
                text = _generate_one(model, mask, body["prompt"].encode(), body["max_tokens"])
            data = json.dumps({"text": text.decode(errors="replace"), "tokens": len(text)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.request_queue_size = 1024
    server.daemon_threads = True
    server.serve_forever()


try:  # only for `--as-server litserve`; the bench installs it when asked to compare with it
    import litserve as ls
except ImportError:
    ls = None

if ls is not None:

    class CharModelAPI(ls.LitAPI):
        """The same model behind LitServe's dynamic batching (module level: its workers are spawned)."""

        def __init__(self, checkpoint: str, **kwargs) -> None:
            super().__init__(**kwargs)
            self.checkpoint = checkpoint

        def setup(self, device):
            self.model, self.mask = _load(self.checkpoint)

        def decode_request(self, request):
            return request["prompt"].encode(), int(request["max_tokens"])

        def batch(self, inputs):
            return inputs

        def predict(self, inputs):
            import torch

            with torch.inference_mode():
                return _generate_batch(self.model, self.mask, [p for p, _ in inputs], [n for _, n in inputs])

        def unbatch(self, output):
            return output

        def encode_response(self, output):
            return {"text": output.decode(errors="replace"), "tokens": len(output)}


def run_litserve(checkpoint: str, port: int, batch: int, timeout_ms: float) -> None:
    api = CharModelAPI(checkpoint, max_batch_size=batch, batch_timeout=timeout_ms / 1000, api_path="/v1/generate")
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=600)
    server.run(port=port, host="127.0.0.1", log_level="warning", generate_client_file=False)


# --- the load ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


async def post(port: int, body: dict, timeout: float) -> tuple[int | str, dict, float]:
    data = json.dumps(body).encode()
    request = (
        f"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode() + data
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            await writer.drain()
            raw = await reader.read()
            writer.close()
    except TimeoutError:
        return "gave up", {}, 0.0
    except OSError as error:
        return f"error {error.__class__.__name__}", {}, 0.0
    head, _, _ = raw.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else "bad answer"
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    ttft = float(headers.get("x-time-to-first-token-ms", "nan"))
    return status, headers, ttft


async def drive(port: int, requests: list[dict], send_deadline: bool) -> list[dict]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    results = []

    async def one(req):
        await asyncio.sleep(max(0.0, start + req["at"] - loop.time()))
        sent = loop.time()
        body = {"prompt": req["prompt"], "max_tokens": req["max_tokens"]}
        if send_deadline:
            body["deadline_ms"] = req["deadline_ms"]
        status, _headers, ttft = await post(port, body, req["deadline_ms"] / 1000 + GIVE_UP_AFTER_DEADLINE_S)
        latency = loop.time() - sent
        results.append({**req, "status": status, "latency": latency, "ttft": ttft if ttft == ttft else latency * 1000})

    await asyncio.gather(*(one(r) for r in requests))
    return results


async def closed_loop(port: int, clients: int, seconds: float, seed: int) -> float:
    """Answered requests per second with `clients` always waiting on one answer each, generous deadlines."""
    pool = make_requests(200, 60, seed)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    done = 0

    async def client(i):
        nonlocal done
        k = i
        while loop.time() < end:
            req = pool[k % len(pool)]
            k += clients
            status, _, _ = await post(port, {"prompt": req["prompt"], "max_tokens": req["max_tokens"], "deadline_ms": 60_000}, 90)
            done += status == 200
    await asyncio.gather(*(client(i) for i in range(clients)))
    return done / seconds


def summarize(results: list[dict], seconds: float) -> dict:
    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    answered = [r for r in results if r["status"] == 200]
    in_time = [r for r in answered if r["latency"] * 1000 <= r["deadline_ms"]]
    n = len(results)
    return {
        "requests": n,
        "answered": len(answered),
        "p50_ms": pct([r["latency"] * 1000 for r in answered], 0.5),
        "p99_ms": pct([r["latency"] * 1000 for r in answered], 0.99),
        "ttft_p50_ms": pct([r["ttft"] for r in answered], 0.5),
        "ttft_p99_ms": pct([r["ttft"] for r in answered], 0.99),
        "goodput_per_s": len(in_time) / seconds,
        "shed": sum(r["status"] in (429, 503) for r in results) / n,
        "expired": sum(r["status"] == 504 for r in results) / n,
        "late": (len(answered) - len(in_time)) / n,
        "unanswered": sum(not isinstance(r["status"], int) for r in results) / n,
        "other": sum(isinstance(r["status"], int) and r["status"] not in (200, 429, 503, 504) for r in results) / n,
    }


class Started:
    def __init__(self, kind: str, checkpoint: Path, args) -> None:
        self.port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if kind in ("portal", "portal-nocache"):
            command = [
                sys.executable, "-m", "runners.workloads.serve", "--checkpoint", str(checkpoint), "--port", str(self.port),
                "--queue-limit", str(args.queue_limit), "--max-tokens", "256",
            ]
            if kind == "portal-nocache":
                command += ["--prefix-cache-mib", "0"]
        else:
            command = [sys.executable, __file__, "--as-server", kind, "--checkpoint", str(checkpoint), "--port", str(self.port),
                       "--litserve-batch", str(args.litserve_batch), "--litserve-timeout-ms", str(args.litserve_timeout_ms)]
        # Its own process group: LitServe's workers are children that a signal to the parent alone leaves behind.
        # --server-nice: the server under test runs at a lower priority than the load generator, so on
        # shared cores the clock that judges deadlines (the generator's) is not the one starved.
        niceness = args.server_nice
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=(lambda: os.nice(niceness)) if niceness else None,
        )
        ready = "/readyz" if kind.startswith("portal") else ("/health" if kind == "litserve" else "/")
        until = time.monotonic() + 120
        while time.monotonic() < until:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(f"GET {ready} HTTP/1.0\r\n\r\n".encode())
                    if b" 200 " in sock.recv(64):
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{kind} did not become ready")

    def prefix_hit_rate(self) -> float | None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            text = b"".join(iter(lambda: sock.recv(65536), b"")).decode()
        body = text.partition("\r\n\r\n")[2]
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line and line[0] != "#"}
        lookups = values.get("serve_prefix_cache_lookups_total", 0)
        return values.get("serve_prefix_cache_hits_total", 0) / lookups if lookups else None

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def write_checkpoint(folder: Path) -> Path:
    import torch

    from runners.workloads.train import DEFAULT_CORPUS, CharModel, save_checkpoint

    torch.manual_seed(0)
    model = CharModel()
    alphabet = DEFAULT_CORPUS.read_bytes() + SYSTEM.encode() + b"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,?"
    save_checkpoint(folder, 1, model, torch.optim.Adam(model.parameters()), keep=1, world_size=1, attempt=0, alphabet=alphabet)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--levels", default="0.5,1,2")
    parser.add_argument("--servers", default="portal,portal-nocache,litserve,one-at-a-time")
    parser.add_argument("--capacity", type=float, help="requests/s of one portal replica; measured when not given")
    parser.add_argument("--queue-limit", type=int, default=256)
    parser.add_argument("--litserve-batch", type=int, default=8)
    parser.add_argument("--litserve-timeout-ms", type=float, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--server-nice", type=int, default=0,
                        help="run every server under test at this niceness (the generator stays at 0)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/serve_load.jsonl"))
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--as-server", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.as_server == "one-at-a-time":
        return run_one_at_a_time(str(args.checkpoint), args.port)
    if args.as_server == "litserve":
        return run_litserve(str(args.checkpoint), args.port, args.litserve_batch, args.litserve_timeout_ms)

    servers = args.servers.split(",")
    if "litserve" in servers and importlib.util.find_spec("litserve") is None:
        print(f"installing {LITSERVE} for this bench (never a dependency of the portal)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", LITSERVE], check=True)
    checkpoint = write_checkpoint(Path(f"/tmp/serve-load-{os.getpid()}"))

    capacity = args.capacity
    if capacity is None:
        server = Started("portal", checkpoint, args)
        try:
            capacity = asyncio.run(closed_loop(server.port, 64, max(10.0, args.seconds / 2), args.seed))
        finally:
            server.stop()
        print(f"capacity of one portal replica: {capacity:.1f} requests/s (closed loop, 64 clients)", flush=True)

    rows = []
    print("| server | load | requests | answered | p50 ms | p99 ms | TTFT p50 / p99 ms | goodput/s | shed | expired "
          "| late | unanswered | prefix hits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for level in [float(x) for x in args.levels.split(",")]:
        requests = make_requests(capacity * level, args.seconds, args.seed + int(level * 100))
        for kind in servers:
            server = Started(kind, checkpoint, args)
            try:
                results = asyncio.run(drive(server.port, requests, send_deadline=kind.startswith("portal")))
                hits = server.prefix_hit_rate() if kind == "portal" else None
            finally:
                server.stop()
            row = {"server": kind, "level": level, "rate": capacity * level, **summarize(results, args.seconds),
                   "prefix_hit_rate": hits}
            rows.append(row)
            with open(args.out, "a") as out:
                out.write(json.dumps(row) + "\n")
            print(
                f"| {kind} | {level:g}x ({row['rate']:.0f}/s) | {row['requests']} | {row['answered']} | {row['p50_ms']:.0f} "
                f"| {row['p99_ms']:.0f} | {row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} | {row['goodput_per_s']:.1f} "
                f"| {row['shed']:.1%} | {row['expired']:.1%} | {row['late']:.1%} | {row['unanswered']:.1%} "
                f"| {'' if hits is None else f'{hits:.0%}'} |",
                flush=True,
            )
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == kind]
        left.plot([r["level"] for r in mine], [r["goodput_per_s"] for r in mine], marker="o", label=kind)
        right.plot([r["level"] for r in mine], [r["p99_ms"] for r in mine], marker="o", label=kind)
    left.set(xlabel="load (x one portal replica's capacity)", ylabel="goodput (answered in time / s)")
    right.set(xlabel="load (x one portal replica's capacity)", ylabel="p99 latency of answered (ms)", yscale="log")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

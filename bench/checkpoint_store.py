"""Checkpoint saves: the step time of a job that checkpoints every step, with the store written in the
background against written synchronously, and the deduplicated bytes of a fine-tune with a frozen base.

The workload is a LoRA fine-tune in torch: a frozen base of ``--layers`` square ``--width`` layers, rank
``--rank`` adapters trained with Adam, a forward and backward pass per step, and ``torch.save`` of the whole
state dict (model and optimizer) to the job's folder at every step, named by its step as the SDK names it.
Three ways to save, each run ``--repeats`` times, alternating their order (paired repeats):

- ``local``: the file written to local disk only (what the SDK does; the floor);
- ``async``: the same, and a separate process stores each new file in the chunk store while training goes on,
  as the first agent did: niced 10, ``chunks.store_file`` (a sha256 of the whole file and of each chunk);
- ``lean``: the same, with the portal's agent as it is now (``runners.jobs.checkpoint_store``): the file read
  once, in 32 MiB windows, each byte hashed once for its chunk and once for the whole file in that read, the
  chunks the store lacks stored as they are cut (``chunks.store_open``), under SCHED_IDLE and nice 19; and,
  with ``--coalesce``, when more than one checkpoint waits only the newest is stored (what the portal does
  under a retention policy that keeps the newest only);
- ``sync``: the step stores its checkpoint in the chunk store (``runners.storage.chunks.store_file``) before
  the next step starts.

Each figure is the median step time of a run (the first step, which warms up, left out); the report gives
the median over repeats and the spread (min to max). Also reported: how long after training ended the agent
had the last checkpoint stored, and the store's bytes after deduplication over the checkpoints of one run
against one checkpoint.

    .venv/bin/python bench/checkpoint_store.py --steps 10 --repeats 5
    .venv/bin/python bench/checkpoint_store.py --steps 10 --repeats 5 --agent-cpu
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from runners.storage import chunks  # noqa: E402
from runners.storage.blobs import BlobStore  # noqa: E402


def agent(folder: str, store_url: str, expected: int, done) -> None:
    """Store each checkpoint file as it appears (oldest first), until ``expected`` are stored. It runs niced,
    as the portal's worker should beside training on a node: it gives way to the step."""
    os.nice(10)
    store = BlobStore(store_url, chunks.KIND)
    stored: set[str] = set()
    while len(stored) < expected:
        ready = sorted(name for name in os.listdir(folder) if name.endswith(".pt") and name not in stored)
        if not ready:
            time.sleep(0.005)
            continue
        for name in ready:
            chunks.store_file(store, Path(folder) / name)
            stored.add(name)
    done.value = time.monotonic()


def lean_agent(folder: str, store_url: str, expected: int, done, coalesce: bool, stored_count) -> None:
    """The portal's agent's work on each checkpoint (runners.jobs.checkpoint_store.checkpoint_store_run, without
    its database): idle priority, one read of the file that cuts it, hashes each byte once for its chunk and
    once for the whole file, and stores the chunks the store lacks (``chunks.store_open``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass
    os.nice(19)
    store = BlobStore(store_url, chunks.KIND)
    seen: set[str] = set()
    while len(seen) < expected:
        ready = sorted(name for name in os.listdir(folder) if name.endswith(".pt") and name not in seen)
        if not ready:
            time.sleep(0.005)
            continue
        if coalesce:  # the older ones are superseded, and a keep-newest policy would not keep them
            seen.update(ready[:-1])
            ready = ready[-1:]
        for name in ready:
            with open(Path(folder) / name, "rb") as handle:
                chunks.store_open(store, handle)
            seen.add(name)
            stored_count.value += 1
    done.value = time.monotonic()


def run(mode: str, args, scratch: Path) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    folder = scratch / f"{mode}-checkpoints"
    store_url = f"file://{scratch}/{mode}-store"
    folder.mkdir()
    base = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    for parameter in base.parameters():
        parameter.requires_grad_(False)
    adapters = torch.nn.ParameterList()
    for _ in range(args.layers):
        adapters.append(torch.nn.Parameter(torch.randn(args.width, args.rank) * 0.01))
        adapters.append(torch.nn.Parameter(torch.zeros(args.rank, args.width)))
    optimizer = torch.optim.Adam(adapters.parameters(), lr=1e-3)
    batch = torch.randn(args.batch, args.width)
    context = multiprocessing.get_context("spawn")
    done = context.Value("d", 0.0)
    worker = None
    stored_count = context.Value("i", 0)
    if mode == "async":
        worker = context.Process(
            target=agent, args=(str(folder), store_url, args.steps, done), daemon=True)
        worker.start()
    elif mode == "lean":
        worker = context.Process(target=lean_agent, args=(
            str(folder), store_url, args.steps, done, args.coalesce, stored_count), daemon=True)
        worker.start()
    store = BlobStore(store_url, chunks.KIND)
    steps = []
    for step in range(args.steps):
        started = time.perf_counter()
        hidden = batch
        for index, layer in enumerate(base):
            hidden = torch.tanh(layer(hidden) + hidden @ adapters[2 * index] @ adapters[2 * index + 1])
        loss = hidden.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        path = folder / f"step-{step:08d}.pt"
        temporary = folder / f".step-{step:08d}.tmp"
        torch.save({"model": {**base.state_dict(), **{f"adapter.{i}": p for i, p in enumerate(adapters)}},
                    "optimizer": optimizer.state_dict(), "step": step}, temporary)
        os.replace(temporary, path)  # whole or absent, as the SDK writes it
        if mode == "sync":
            chunks.store_file(store, path)
        steps.append(time.perf_counter() - started)
    ended = time.monotonic()
    lag = None
    if worker is not None:
        worker.join(timeout=600)
        lag = done.value - ended
    one = (folder / "step-00000000.pt").stat().st_size
    stored = sum(store.size(key) for key in store.keys()) if mode != "local" else None
    return {"step_s": statistics.median(steps[1:]), "lag_s": lag, "one_bytes": one, "stored_bytes": stored,
            "stored": stored_count.value if mode == "lean" else (args.steps if mode != "local" else 0)}


def agent_cpu(args) -> None:
    """The agent's own CPU time per checkpoint, on a quiet core: the portal's agent before (the file spooled with
    1 MiB copies, the spool cut with its whole hash, every chunk hashed again as it is stored) against now
    (``chunks.store_open``: one read, each byte hashed once for its chunk and once for the whole file), over the
    same ``--steps`` checkpoints of one run, each into a fresh store, ``--repeats`` times alternating."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-agent-cpu-"))
    try:
        run("local", args, scratch)
        files = sorted((scratch / "local-checkpoints").glob("*.pt"))
        figures: dict[str, list[float]] = {"before": [], "now": []}
        for repeat in range(args.repeats):
            for variant in (("before", "now") if repeat % 2 == 0 else ("now", "before")):
                store = BlobStore(f"file://{scratch}/{variant}-{repeat}", chunks.KIND)
                started = time.process_time()
                for path in files:
                    if variant == "before":
                        spool = scratch / "spool"
                        with open(path, "rb") as source, open(spool, "wb") as target:
                            shutil.copyfileobj(source, target, 1 << 20)
                        manifest = chunks.split(spool)
                        chunks.store_chunks(store, spool, manifest)
                    else:
                        with open(path, "rb") as handle:
                            chunks.store_open(store, handle)
                figures[variant].append((time.process_time() - started) / len(files))
                shutil.rmtree(f"{scratch}/{variant}-{repeat}", ignore_errors=True)
        size = files[0].stat().st_size
        print(f"agent CPU per checkpoint of {size / 1e6:.1f} MB ({len(files)} checkpoints, {args.repeats} repeats):")
        for variant, values in figures.items():
            print(f"  {variant:6s}: {statistics.median(values) * 1000:6.1f} ms (min {min(values) * 1000:.1f}, "
                  f"max {max(values) * 1000:.1f})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--coalesce", action="store_true", help="the lean agent stores only the newest waiting")
    parser.add_argument("--modes", default="local,async,lean,sync")
    parser.add_argument("--agent-cpu", action="store_true", help="the agent's own CPU time per checkpoint only")
    args = parser.parse_args()
    if args.agent_cpu:
        agent_cpu(args)
        return
    modes = args.modes.split(",")
    results = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        order = modes if repeat % 2 == 0 else modes[::-1]
        for mode in order:
            scratch = Path(tempfile.mkdtemp(prefix="bench-checkpoints-"))
            try:
                results[mode].append(run(mode, args, scratch))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        print(f"repeat {repeat + 1}: " + ", ".join(
            f"{mode} {results[mode][-1]['step_s'] * 1000:.0f} ms" for mode in modes), flush=True)
    trainable = args.layers * 2 * args.width * args.rank
    frozen = args.layers * args.width * args.width
    print(f"\n{args.layers} frozen {args.width}x{args.width} layers, rank-{args.rank} adapters "
          f"({100 * trainable / frozen:.2f}% of the base trainable), {args.steps} steps, a checkpoint every step, "
          f"{args.repeats} paired repeats, {args.threads} torch thread(s)")
    for mode in modes:
        figures = [result["step_s"] * 1000 for result in results[mode]]
        print(f"  {mode:5s}: step {statistics.median(figures):7.1f} ms (min {min(figures):.1f}, max {max(figures):.1f})")
    for mode in ("async", "lean"):
        if mode not in modes:
            continue
        lags = [result["lag_s"] for result in results[mode]]
        print(f"  {mode:5s}: last checkpoint stored {statistics.median(lags):.2f} s after training ended "
              f"(min {min(lags):.2f}, max {max(lags):.2f}); {statistics.median(r['stored'] for r in results[mode])} "
              f"of {args.steps} checkpoints stored (median)")
    for mode in ("async", "lean", "sync"):
        if mode not in modes:
            continue
        ratios = [result["stored_bytes"] / result["one_bytes"] for result in results[mode]]
        print(f"  {mode:5s}: the store holds {statistics.median(ratios):.3f}x one checkpoint for {args.steps} "
              f"checkpoints (one is {results[mode][0]['one_bytes'] / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()

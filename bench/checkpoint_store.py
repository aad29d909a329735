"""Checkpoint saves: the step time of a job that checkpoints every step, with the checkpoint store written in
the background by the portal's agent on a core of its own, against written synchronously on the trainer's core.

The workload is a LoRA fine-tune in torch: a frozen base of ``--layers`` square ``--width`` layers, rank
``--rank`` adapters trained with Adam, a forward and backward pass per step, and ``torch.save`` of the whole
state dict (model and optimizer) to the job's folder at every step, named by its step as the SDK names it
(written under a temporary name, then renamed).

The node it models: on a GPU node the step runs on the GPU and the node keeps cores the job is not given
(system-reserved), where the portal's agent belongs. So the trainer runs in a process of its own pinned to
core 0 (``taskset -c 0``, one torch thread), and the agent in a process pinned to core 1 (``taskset -c 1``),
in every mode that has one:

- ``local``: the file written to local disk only (what the SDK does; the floor); no agent;
- ``background``: the same, and the agent stores each new file while training goes on, with the portal's own
  storing code as the Celery worker runs it (``runners.jobs.checkpoint_store.at_low_priority`` over
  ``chunks.store_open`` on the opened file: a thread under ``CHECKPOINT_STORE_PRIORITY``, one read in
  windows, the chunks the store lacks stored as they are cut), without the database rows around it; with
  ``--coalesce``, when more than one checkpoint waits only the newest is stored (what the portal does under a
  retention policy that keeps the newest only);
- ``sync``: the trainer stores its checkpoint (``chunks.store_open``, the same code) on its own core before
  the next step starts, as a synchronous save would.

``--agent-work`` swaps what the agent does with each file, to find what in it slows the step: ``store`` (the
portal's code, the default), ``read`` (the same windows read, nothing hashed or stored), ``spin``
(``--spin-s`` of CPU in a loop that touches no memory) and ``stream`` (``--spin-s`` of CPU copying 64 MiB
buffers: the most memory traffic one core makes, the control that shows whether the other core can slow the
step at all). All run as the portal's agent does, in a thread at ``CHECKPOINT_STORE_PRIORITY``.

Each run's figure is the median step time (the first step, which warms up, left out), and its parts: the
forward and backward pass and optimizer step (``compute``), the ``torch.save`` and rename (``save``) and the
synchronous store (``store``). ``--repeats`` paired repeats, the modes' order alternated; the report gives
the median over repeats and the spread (min to max), how long after training ended the agent had the last
checkpoint stored, the store's bytes after deduplication, and what the machine did during the trainer's
steps: the trainer's own run-queue wait (``/proc/self/schedstat``: time it was runnable but another task had
its core), its involuntary context switches and major faults, each core's busy and steal time
(``/proc/stat``), pages read and written (``/proc/vmstat``) and CPU, memory and IO pressure
(``/proc/pressure``). ``uptime`` is printed before and after.

    .venv/bin/python bench/checkpoint_store.py --steps 10 --repeats 5
    .venv/bin/python bench/checkpoint_store.py --steps 10 --repeats 5 --coalesce --modes local,background
    .venv/bin/python bench/checkpoint_store.py --steps 10 --repeats 5 --modes local,background --agent-work read
    CHECKPOINT_STORE_PRIORITY=normal .venv/bin/python bench/checkpoint_store.py --modes local,background \
        --agent-work stream
    .venv/bin/python bench/checkpoint_store.py --steps 10 --repeats 5 --agent-cpu

The agent imports the portal's settings to run its code, so ``DATABASE_URL`` and ``CELERY_BROKER_URL`` must
name a PostgreSQL and a Redis server (nothing connects to either); the bench names local ones when unset.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRAINER_CORE = 0
AGENT_CORE = 1
WINDOW_BYTES = 32 << 20  # chunks.WINDOW_BYTES, for the read-only agent


# --- What the machine did ------------------------------------------------------------------------------


def _cpu_ticks() -> dict[str, list[int]]:
    """Per core: user, nice, system, idle, iowait, irq, softirq, steal (``/proc/stat``, in clock ticks)."""
    ticks = {}
    with open("/proc/stat") as handle:
        for line in handle:
            name, *values = line.split()
            if name.startswith("cpu") and name != "cpu":
                ticks[name] = [int(value) for value in values[:8]]
    return ticks


def _vmstat(names=("pgpgin", "pgpgout", "pgmajfault", "pgsteal_kswapd", "pgsteal_direct")) -> dict[str, int]:
    found = {}
    with open("/proc/vmstat") as handle:
        for line in handle:
            name, value = line.split()
            if name in names:
                found[name] = int(value)
    return found


def _pressure() -> dict[str, int]:
    """Each resource's ``some`` total stall (microseconds), where the kernel exposes it."""
    found = {}
    for resource_name in ("cpu", "memory", "io"):
        try:
            with open(f"/proc/pressure/{resource_name}") as handle:
                found[resource_name] = int(handle.readline().split("total=")[1])
        except (OSError, IndexError, ValueError):
            pass
    return found


def _schedstat() -> tuple[int, int]:
    """The calling process's time on a core and time runnable but waiting for one (nanoseconds)."""
    with open("/proc/self/schedstat") as handle:
        running, waiting, _slices = (int(value) for value in handle.read().split())
    return running, waiting


def _snapshot() -> dict:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    running, waiting = _schedstat()
    return {"cpu": _cpu_ticks(), "vm": _vmstat(), "pressure": _pressure(), "running_ns": running,
            "waiting_ns": waiting, "nivcsw": usage.ru_nivcsw, "majflt": usage.ru_majflt}


def _machine_delta(before: dict, after: dict, seconds: float) -> dict:
    hertz = os.sysconf("SC_CLK_TCK")
    cores = {}
    for core, start in before["cpu"].items():
        end = after["cpu"].get(core, start)
        spent = [(b - a) / hertz for a, b in zip(start, end)]
        user, nice, system, idle, iowait, irq, softirq, steal = spent
        cores[core] = {"busy": (user + nice + system + irq + softirq) / seconds, "steal": steal / seconds,
                       "iowait": iowait / seconds}
    return {
        "cores": cores,
        "vm": {name: after["vm"].get(name, 0) - value for name, value in before["vm"].items()},
        "pressure_ms": {name: (after["pressure"].get(name, 0) - value) / 1000
                        for name, value in before["pressure"].items()},
        "run_s": (after["running_ns"] - before["running_ns"]) / 1e9,
        "wait_s": (after["waiting_ns"] - before["waiting_ns"]) / 1e9,
        "nivcsw": after["nivcsw"] - before["nivcsw"],
        "majflt": after["majflt"] - before["majflt"],
    }


# --- The trainer (core 0) -----------------------------------------------------------------------------


def trainer(args) -> None:
    import torch

    from runners.storage import chunks
    from runners.storage.blobs import BlobStore

    torch.manual_seed(0)
    torch.set_num_threads(1)
    folder = Path(args.folder)
    base = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    for parameter in base.parameters():
        parameter.requires_grad_(False)
    adapters = torch.nn.ParameterList()
    for _ in range(args.layers):
        adapters.append(torch.nn.Parameter(torch.randn(args.width, args.rank) * 0.01))
        adapters.append(torch.nn.Parameter(torch.zeros(args.rank, args.width)))
    optimizer = torch.optim.Adam(adapters.parameters(), lr=1e-3)
    batch = torch.randn(args.batch, args.width)
    store = BlobStore(args.store, chunks.KIND)
    steps = []
    before = started_at = None
    for step in range(args.steps):
        if step == 1:  # the first step warms up: what the machine did is counted from the second
            before, started_at = _snapshot(), time.monotonic()
        on_core, queued = _schedstat()
        started = time.perf_counter()
        hidden = batch
        for index, layer in enumerate(base):
            hidden = torch.tanh(layer(hidden) + hidden @ adapters[2 * index] @ adapters[2 * index + 1])
        loss = hidden.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        computed = time.perf_counter()
        path = folder / f"step-{step:08d}.pt"
        temporary = folder / f".step-{step:08d}.tmp"
        torch.save({"model": {**base.state_dict(), **{f"adapter.{i}": p for i, p in enumerate(adapters)}},
                    "optimizer": optimizer.state_dict(), "step": step}, temporary)
        os.replace(temporary, path)  # whole or absent, as the SDK writes it
        saved = time.perf_counter()
        if args.mode == "sync":
            with open(path, "rb") as handle:
                chunks.store_open(store, handle)
        stored = time.perf_counter()
        on_core_after, queued_after = _schedstat()
        # The step's wall time is its time on the core, its time runnable while another task had the core, and
        # the rest blocked (in the kernel's IO waits, mostly).
        on_core_s, queued_s = (on_core_after - on_core) / 1e9, (queued_after - queued) / 1e9
        steps.append({"step_s": stored - started, "compute_s": computed - started, "save_s": saved - computed,
                      "store_s": stored - saved, "on_core_s": on_core_s, "queued_s": queued_s,
                      "blocked_s": max(0.0, stored - started - on_core_s - queued_s)})
    ended = time.monotonic()
    machine = _machine_delta(before, _snapshot(), ended - started_at) if before else None
    Path(args.result).write_text(json.dumps({"steps": steps, "ended": ended, "machine": machine}))


# --- The agent (core 1) -------------------------------------------------------------------------------


def _read_only(handle) -> None:
    """The agent's reads alone: the file front to back in the windows ``chunks.split_open`` uses."""
    buffer = memoryview(bytearray(WINDOW_BYTES))
    fd, position = handle.fileno(), 0
    while count := os.preadv(fd, [buffer], position):
        position += count


def _spin(seconds: float) -> None:
    """CPU time spent in a loop that touches no memory to speak of."""
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        sum(range(1000))


def _stream(seconds: float) -> None:
    """CPU time spent copying 64 MiB buffers over and over: as much memory traffic as one core makes (the
    control that shows whether the trainer's step can be slowed from the other core at all)."""
    source, target = bytearray(64 << 20), bytearray(64 << 20)
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        target[:] = source


def agent(args) -> None:
    """Store each checkpoint file as it appears (oldest first), as the portal's worker does on the node, until
    the last step's is done; then record when."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/portal")
    os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/2")
    import django

    django.setup()
    from runners.jobs.checkpoint_store import at_low_priority
    from runners.storage import chunks
    from runners.storage.blobs import BlobStore

    store = BlobStore(args.store, chunks.KIND)
    folder = Path(args.folder)
    last = f"step-{args.steps - 1:08d}.pt"
    seen: set[str] = set()
    stored = 0
    cpu_at_ready = time.process_time()  # its imports and settings are not the agent's work per checkpoint
    Path(args.result).with_suffix(".ready").touch()
    while last not in seen:
        ready = sorted(name for name in os.listdir(folder) if name.endswith(".pt") and name not in seen)
        if not ready:
            time.sleep(0.005)
            continue
        if args.coalesce:  # the older ones are superseded, and a keep-newest policy would not keep them
            seen.update(ready[:-1])
            ready = ready[-1:]
        for name in ready:
            with open(folder / name, "rb") as handle:
                if args.agent_work == "store":
                    at_low_priority(chunks.store_open, store, handle)
                elif args.agent_work == "read":
                    at_low_priority(_read_only, handle)
                elif args.agent_work == "stream":
                    at_low_priority(_stream, args.spin_s)
                else:
                    at_low_priority(_spin, args.spin_s)
            seen.add(name)
            stored += 1
    done = time.monotonic()
    cpu_s = time.process_time() - cpu_at_ready
    Path(args.result).write_text(json.dumps({"done": done, "stored": stored, "cpu_s": cpu_s}))


# --- One run of one mode -------------------------------------------------------------------------------


def _pinned(core: int, role: str, args, **extra) -> list[str]:
    command = ["taskset", "-c", str(core), sys.executable, str(Path(__file__).resolve()), "--role", role,
               "--steps", str(args.steps), "--layers", str(args.layers), "--width", str(args.width),
               "--rank", str(args.rank), "--batch", str(args.batch), "--agent-work", args.agent_work,
               "--spin-s", str(args.spin_s)]
    if args.coalesce:
        command.append("--coalesce")
    for name, value in extra.items():
        command += [f"--{name}", str(value)]
    return command


def _wait_for(path: Path, process: subprocess.Popen, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        if process.poll() is not None:
            raise RuntimeError(f"the agent exited ({process.returncode}) before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agent was not ready within {deadline_s} s")
        time.sleep(0.02)


def run(mode: str, args, scratch: Path) -> dict:
    folder = scratch / "checkpoints"
    folder.mkdir()
    store_url = f"file://{scratch}/store"
    common = {"folder": folder, "store": store_url, "mode": mode}
    worker = None
    if mode == "background":
        worker = subprocess.Popen(_pinned(AGENT_CORE, "agent", args, **common, result=scratch / "agent.json"))
        _wait_for(scratch / "agent.ready", worker, 60)
    try:
        subprocess.run(_pinned(TRAINER_CORE, "trainer", args, **common, result=scratch / "trainer.json"),
                       check=True, timeout=600)
        if worker is not None:
            worker.wait(timeout=600)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()
    trained = json.loads((scratch / "trainer.json").read_text())
    steps = trained["steps"][1:]
    result = {part: statistics.median(step[part] for step in steps)
              for part in ("step_s", "compute_s", "save_s", "store_s", "on_core_s", "queued_s", "blocked_s")}
    result["machine"] = trained["machine"]
    result["steps"] = trained["steps"]
    result["one_bytes"] = (folder / "step-00000000.pt").stat().st_size
    result["stored_bytes"] = None
    result["lag_s"] = None
    result["stored"] = 0
    if mode == "sync":
        result["stored"] = args.steps
    if worker is not None:
        agent_result = json.loads((scratch / "agent.json").read_text())
        result["lag_s"] = agent_result["done"] - trained["ended"]
        result["stored"] = agent_result["stored"]
        result["agent_cpu_s"] = agent_result["cpu_s"]
    store_root = scratch / "store"
    if store_root.exists():
        result["stored_bytes"] = sum(path.stat().st_size for path in store_root.rglob("*") if path.is_file())
    return result


# --- The agent's own CPU, before and now ---------------------------------------------------------------


def agent_cpu(args) -> None:
    """The agent's own CPU time per checkpoint, on a quiet core: the portal's agent before (the file spooled with
    1 MiB copies, the spool cut with its whole hash, every chunk hashed again as it is stored) against now
    (``chunks.store_open``: one read, each byte hashed once for its chunk and once for the whole file), over the
    same ``--steps`` checkpoints of one run, each into a fresh store, ``--repeats`` times alternating."""
    from runners.storage import chunks
    from runners.storage.blobs import BlobStore

    os.sched_setaffinity(0, {AGENT_CORE})
    scratch = Path(tempfile.mkdtemp(prefix="bench-agent-cpu-"))
    try:
        run("local", args, scratch)
        files = sorted((scratch / "checkpoints").glob("*.pt"))
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


# --- The report ----------------------------------------------------------------------------------------


def _spread(values: list[float], scale: float = 1000, digits: int = 1) -> str:
    return (f"{statistics.median(values) * scale:.{digits}f} ({min(values) * scale:.{digits}f}-"
            f"{max(values) * scale:.{digits}f})")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def report(args, modes: list[str], results: dict[str, list[dict]]) -> None:
    trainable = args.layers * 2 * args.width * args.rank
    frozen = args.layers * args.width * args.width
    print(f"\n{args.layers} frozen {args.width}x{args.width} layers, rank-{args.rank} adapters "
          f"({100 * trainable / frozen:.2f}% of the base trainable), {args.steps} steps, a checkpoint of "
          f"{results[modes[0]][0]['one_bytes'] / 1e6:.1f} MB every step, {args.repeats} paired repeats; trainer "
          f"on core {TRAINER_CORE} (1 torch thread), agent on core {AGENT_CORE} ({args.agent_work}, priority "
          f"{os.environ.get('CHECKPOINT_STORE_PRIORITY', 'idle')}{', coalescing' if args.coalesce else ''})")
    print("ms, median over repeats of each run's median step (min-max):")
    for mode in modes:
        runs = results[mode]
        line = f"  {mode:10s}: step {_spread([r['step_s'] for r in runs])}  compute {_spread([r['compute_s'] for r in runs])}" \
               f"  save {_spread([r['save_s'] for r in runs])}"
        if mode == "sync":
            line += f"  store {_spread([r['store_s'] for r in runs])}"
        print(line)
    print("the step's wall time split: on its core, runnable but another task on its core (queued), blocked; and "
          "the step as on a core of its own (on core + blocked, what a node's reserved cores give it):")
    for mode in modes:
        runs = results[mode]
        print(f"  {mode:10s}: on core {_spread([r['on_core_s'] for r in runs])}  queued "
              f"{_spread([r['queued_s'] for r in runs])}  blocked {_spread([r['blocked_s'] for r in runs])}  "
              f"own core {_spread([r['on_core_s'] + r['blocked_s'] for r in runs])}")
    print("during the trainer's steps (median over repeats): trainer's run-queue wait per step, involuntary "
          "switches, major faults; each core busy and steal (share of the time); pages in/out; pressure "
          "(ms stalled, some)")
    for mode in modes:
        machines = [r["machine"] for r in results[mode]]
        counted = args.steps - 1

        def median(getter):
            return statistics.median(getter(machine) for machine in machines)

        cores = sorted(machines[0]["cores"])
        core_text = " ".join(
            f"{core} {median(lambda m, c=core: m['cores'][c]['busy']):.2f}/{median(lambda m, c=core: m['cores'][c]['steal']):.2f}"
            for core in cores)
        pressure = " ".join(f"{name} {median(lambda m, n=name: m['pressure_ms'].get(n, 0)):.0f}"
                            for name in machines[0]["pressure_ms"])
        print(f"  {mode:10s}: wait {median(lambda m: m['wait_s']) / counted * 1000:.2f} ms/step, "
              f"nivcsw {median(lambda m: m['nivcsw']):.0f}, majflt {median(lambda m: m['majflt']):.0f}; {core_text}; "
              f"pgpgin {median(lambda m: m['vm'].get('pgpgin', 0)):.0f} pgpgout "
              f"{median(lambda m: m['vm'].get('pgpgout', 0)):.0f} pgsteal "
              f"{median(lambda m: m['vm'].get('pgsteal_kswapd', 0) + m['vm'].get('pgsteal_direct', 0)):.0f}; "
              f"{pressure}")
    if "background" in modes:
        runs = results["background"]
        print(f"  background: last checkpoint stored {_spread([r['lag_s'] for r in runs], 1, 2)} s after training "
              f"ended; {statistics.median(r['stored'] for r in runs)} of {args.steps} checkpoints handled (median); "
              f"agent CPU {_spread([r['agent_cpu_s'] / max(r['stored'], 1) for r in runs])} ms per checkpoint")
    for mode in modes:
        if args.agent_work != "store" and mode == "background":
            continue
        ratios = [r["stored_bytes"] / r["one_bytes"] for r in results[mode] if r["stored_bytes"]]
        if ratios:
            print(f"  {mode:10s}: the store holds {statistics.median(ratios):.3f}x one checkpoint for "
                  f"{statistics.median(r['stored'] for r in results[mode])} checkpoints stored")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--coalesce", action="store_true", help="the agent stores only the newest waiting")
    parser.add_argument("--modes", default="local,background,sync")
    parser.add_argument("--agent-work", choices=("store", "read", "spin", "stream"), default="store",
                        help="what the agent does with each checkpoint (see the module's docstring)")
    parser.add_argument("--spin-s", type=float, default=0.145,
                        help="CPU seconds per checkpoint for --agent-work spin and stream")
    parser.add_argument("--agent-cpu", action="store_true", help="the agent's own CPU time per checkpoint only")
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--role", choices=("trainer", "agent"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "trainer":
        trainer(args)
        return
    if args.role == "agent":
        agent(args)
        return
    if len(os.sched_getaffinity(0)) < 2 or not {TRAINER_CORE, AGENT_CORE} <= os.sched_getaffinity(0):
        raise SystemExit(f"the bench pins the trainer to core {TRAINER_CORE} and the agent to core {AGENT_CORE}: "
                         "run it where both are allowed")
    if args.agent_cpu:
        agent_cpu(args)
        return
    print(f"before: {_uptime()}", flush=True)
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            scratch = Path(tempfile.mkdtemp(prefix="bench-checkpoints-"))
            try:
                results[mode].append(run(mode, args, scratch))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        print(f"repeat {repeat + 1}: " + ", ".join(
            f"{mode} {results[mode][-1]['step_s'] * 1000:.0f} ms" for mode in modes), flush=True)
    print(f"after: {_uptime()}", flush=True)
    report(args, modes, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()

"""A small character-level language model, trained data-parallel: the job the local backend launches.

Run one process per replica::

    python -m runners.workloads.train --job-dir DIR --steps N --checkpoint-every K [--batch-size B] [--lr LR]

Configuration. Every flag has an environment variable; a flag given on the
command line wins over its variable, which wins over the default.

    flag                  variable               default
    --job-dir             TRAIN_JOB_DIR          (required)
    --steps               TRAIN_STEPS            200     total steps of the run, counted across resumes
    --checkpoint-every    TRAIN_CHECKPOINT_EVERY 50      0: only on stopping and at the end
    --batch-size          TRAIN_BATCH_SIZE       32      sequences per replica per step
    --seq-len             TRAIN_SEQ_LEN          64      characters per sequence
    --lr                  TRAIN_LR               0.003   Adam's learning rate
    --keep-checkpoints    TRAIN_KEEP_CHECKPOINTS 3       older checkpoint files are deleted
    --max-runtime-s       TRAIN_MAX_RUNTIME_S    0       0: no limit; else stop as on SIGTERM once this
                                                         long has passed since this process's first
                                                         training step (torch's import, the rendezvous
                                                         and loading the checkpoint do not count)
    --seed                TRAIN_SEED             0
    --corpus              TRAIN_CORPUS           corpus.txt beside this file
    --dist-timeout-s      TRAIN_DIST_TIMEOUT_S   300     how long a rank waits for the others

The portal's launchers pass every setting as a flag, from the job's spec (a tenant may set
no TRAIN_* variable: `runners.workloads.env_policy`); the variables are for running the
trainer by hand.

Set by the launcher, as torchrun would: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (the last two only when WORLD_SIZE > 1;
unset WORLD_SIZE means 1), and PORTAL_ATTEMPT (default 0), copied into every
metric and checkpoint record.

Memory: under a data-segment limit (RLIMIT_DATA, which the local backend sets to the
job's memory_mib_per_replica) smaller than env_policy.TRAINER_MIN_MEMORY_MIB the trainer
exits 1 at once, since torch.distributed's start-up can hang rather than fail that short
of memory. Above it, a step that needs more than the limit fails its allocation: exit 1.

The backend is NCCL when torch.cuda.is_available() and CUDA_VISIBLE_DEVICES is set
(each rank takes GPU LOCAL_RANK), gloo otherwise. Without OMP_NUM_THREADS, each rank
uses its share of this machine's cores.

Exit codes (constants in `runners.workloads.progress`, re-exported here):
0 EXIT_OK, every step done; 75 EXIT_CHECKPOINTED_ON_SIGNAL, stopped early on
SIGTERM, SIGINT or --max-runtime-s after saving a checkpoint of the step
reached, so relaunching resumes; 1 EXIT_FAILED, any error, traceback on stderr;
2, bad arguments. A signal to any one rank stops every rank after the current
step, since each step all-reduces a stop flag. A repeated SIGTERM changes
nothing (escalate with SIGKILL); a second SIGINT kills at once. A signal in
the first second, while torch is still importing, kills the default way
(nothing has been trained by then).

The trainer is the first user of the portal's SDK (`gpuportal`, in sdk/): its metrics,
checkpoints, stop handling (signals and --max-runtime-s) and activity go through the same
calls a team's own script makes. Files written by rank 0, and how to read them without
torch: see `runners.workloads.progress`. Every rank logs human lines to stdout. Under the
local backend every rank also writes how busy it keeps its device (the share of wall time in
forward, backward and optimizer step) to its attempt's folder every ~2 s: see
`runners.workloads.activity`.

Batches are drawn from a generator seeded by (seed, rank, step), so ranks see
different data, and a resumed run sees exactly what an uninterrupted one would
have; the checkpoint keeps torch's RNG state besides model and optimizer.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import gpuportal
import numpy as np
import torch
import torch.distributed as dist
from gpuportal._protocol import now_iso
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from runners.workloads.env_policy import TRAINER_MIN_MEMORY_MIB
from runners.workloads.progress import EXIT_CHECKPOINTED_ON_SIGNAL, EXIT_FAILED, EXIT_OK

__all__ = ["EXIT_CHECKPOINTED_ON_SIGNAL", "EXIT_FAILED", "EXIT_OK", "CharModel", "main"]

DEFAULT_CORPUS = Path(__file__).with_name("corpus.txt")
VOCAB = 256  # bytes: any corpus works and the model's shape never depends on it
CHECKPOINT_FORMAT = 1


# --- configuration -------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def parse_args(argv: list[str] | None = None, environ: dict | None = None) -> argparse.Namespace:
    environ = os.environ if environ is None else environ

    def env(name: str, default: str | None) -> str | None:
        # argparse runs a string default through `type` only when the flag is absent,
        # which is exactly "the flag wins, then the variable", with the same validation.
        return environ.get(f"TRAIN_{name}", default)

    parser = argparse.ArgumentParser(
        prog="python -m runners.workloads.train",
        description="Train a small character-level language model; resumes from the newest checkpoint in --job-dir.",
    )
    parser.add_argument("--job-dir", type=Path, default=env("JOB_DIR", None))
    parser.add_argument("--steps", type=_positive_int, default=env("STEPS", "200"))
    parser.add_argument("--checkpoint-every", type=_non_negative_int, default=env("CHECKPOINT_EVERY", "50"))
    parser.add_argument("--batch-size", type=_positive_int, default=env("BATCH_SIZE", "32"))
    parser.add_argument("--seq-len", type=_positive_int, default=env("SEQ_LEN", "64"))
    parser.add_argument("--lr", type=_positive_float, default=env("LR", "0.003"))
    parser.add_argument("--keep-checkpoints", type=_positive_int, default=env("KEEP_CHECKPOINTS", "3"))
    parser.add_argument("--max-runtime-s", type=_non_negative_float, default=env("MAX_RUNTIME_S", "0"))
    parser.add_argument("--seed", type=int, default=env("SEED", "0"))
    parser.add_argument("--corpus", type=Path, default=env("CORPUS", str(DEFAULT_CORPUS)))
    parser.add_argument("--dist-timeout-s", type=_positive_float, default=env("DIST_TIMEOUT_S", "300"))
    args = parser.parse_args(argv)
    if args.job_dir is None:
        parser.error("--job-dir (or TRAIN_JOB_DIR) is required")
    try:
        args.attempt = int(environ.get("PORTAL_ATTEMPT", "0"))
        args.rank = int(environ.get("RANK", "0"))
        args.world_size = int(environ.get("WORLD_SIZE", "1"))
        args.local_rank = int(environ.get("LOCAL_RANK", str(args.rank)))
        args.local_world_size = int(environ.get("LOCAL_WORLD_SIZE", str(args.world_size)))
    except ValueError as exc:
        parser.error(f"PORTAL_ATTEMPT, RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers: {exc}")
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        parser.error(f"RANK={args.rank} does not fit WORLD_SIZE={args.world_size}")
    return args


# --- model and data ------------------------------------------------------------------------------


class CharModel(nn.Module):
    """Byte embedding, one GRU layer, a linear head: about 44k parameters, ~10-30 ms a step on a CPU core."""

    def __init__(self, embed: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.rnn = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)


def load_corpus(path: Path, seq_len: int) -> np.ndarray:
    data = np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)
    if len(data) < seq_len + 2:
        raise ValueError(f"corpus {path} has {len(data)} bytes; --seq-len {seq_len} needs at least {seq_len + 2}")
    return data


def batch_for(data: np.ndarray, *, seed: int, rank: int, step: int, batch_size: int, seq_len: int):
    """Inputs and next-byte targets for one rank's share of one step."""
    # A generator per (seed, rank, step) rather than one long stream: nothing to carry
    # in the checkpoint, and a resumed step draws the same batch as the first time.
    rng = np.random.default_rng([seed, rank, step])
    starts = rng.integers(0, len(data) - seq_len, size=batch_size)
    window = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)
    return torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, 1:])


# --- checkpoints ---------------------------------------------------------------------------------


def checkpoint_state(step: int, model: nn.Module, optimizer, *, world_size: int, alphabet: bytes = b"") -> dict:
    """What a checkpoint of this trainer holds: enough to resume exactly, and for the server to serve the model."""
    state = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
        "world_size": world_size,
        "saved_at": now_iso(),
        # The bytes the corpus holds: the server refuses a prompt with any other (the model never saw it).
        "alphabet": torch.tensor(sorted(set(alphabet)), dtype=torch.uint8),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng"]["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(
    job_dir: Path, step: int, model: nn.Module, optimizer, *, keep: int, world_size: int, attempt: int,
    alphabet: bytes = b"",
) -> Path:
    """A checkpoint written and recorded as the trainer's rank 0 does it, without a running job (the SDK's write)."""
    state = checkpoint_state(step, model, optimizer, world_size=world_size, alphabet=alphabet)
    return gpuportal.write_checkpoint(job_dir, step, state, attempt=attempt, keep=keep)


def read_checkpoint(path: Path, step: int, model: nn.Module, device: torch.device) -> dict:
    """The checkpoint's state, checked against the model; raises if it is unreadable or does not fit."""
    state = torch.load(path, map_location=device, weights_only=True)  # no pickled code from a writable folder
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT or state.get("step") != step:
        raise ValueError("not a checkpoint of this trainer, or not of the step its name says")
    expected = model.state_dict()
    got = state["model"]
    if set(got) != set(expected) or any(got[k].shape != expected[k].shape for k in expected):
        raise ValueError("model parameters do not match this model")
    if not {"state", "param_groups"} <= set(state["optimizer"]):
        raise ValueError("no optimizer state")
    return state


def newest_loadable(ctx: gpuportal.Context, model: nn.Module, device: torch.device, log) -> tuple[int, dict | None, list]:
    """(step, state, the newer files that failed to load): the newest checkpoint that loads, else (0, None, ...)."""
    failed = []
    for step, path in ctx.checkpoints_on_disk():
        try:
            return step, read_checkpoint(path, step, model, device), failed
        except Exception as exc:  # any damage at all: fall back to the one before
            first_line = (str(exc).strip().splitlines() or [""])[0][:200]  # torch's messages run to paragraphs
            log(f"skipping checkpoint {path.name}: {type(exc).__name__}: {first_line}")
            failed.append(path)
    return 0, None, failed


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Placement:
    device: torch.device
    backend: str


def start_process_group(args) -> Placement:
    if torch.cuda.is_available() and "CUDA_VISIBLE_DEVICES" in os.environ:
        device = torch.device("cuda", args.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        if "OMP_NUM_THREADS" not in os.environ:
            # Replicas on one machine would otherwise each start a thread per core and fight over them.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.local_world_size)))
    timeout = timedelta(seconds=args.dist_timeout_s)
    if args.world_size == 1:
        # A one-member group on an in-process store: DDP and the collectives work as in the
        # multi-replica case, without needing MASTER_ADDR or a free port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", rank=args.rank, world_size=args.world_size, timeout=timeout)
    return Placement(device, backend)


def run(args, ctx: gpuportal.Context) -> int:
    """Train until --steps or a stop. `ctx` measures activity from its init(): the rendezvous and the
    loading count as idle, as on a GPU."""
    rank, world = args.rank, args.world_size

    def log(message: str) -> None:
        print(f"{now_iso()} [rank {rank}/{world}] {message}", flush=True)

    placement = start_process_group(args)
    device = placement.device
    data = load_corpus(args.corpus, args.seq_len)
    alphabet = np.unique(data).tobytes()
    torch.manual_seed(args.seed)
    model = CharModel().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    log(
        f"{placement.backend} on {device}, threads={torch.get_num_threads()}; "
        f"{sum(p.numel() for p in model.parameters()):,} parameters; corpus {args.corpus} ({len(data):,} bytes)"
    )

    start_step, state, failed = newest_loadable(ctx, model, device, log)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
        if "cuda" in state["rng"] and device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu())
        log(f"resumed from step {start_step}")
    else:
        log("no checkpoint to resume from; starting at step 0")

    # Every rank read the folder on its own; if they disagree (a folder not shared by every
    # replica), training on would silently mix two runs. One MAX over (step, -step) checks it.
    agree = torch.tensor([start_step, -start_step], dtype=torch.int64, device=device)
    dist.all_reduce(agree, op=dist.ReduceOp.MAX)
    if agree[0].item() != -agree[1].item():
        raise RuntimeError(
            f"ranks resumed from different steps ({-agree[1].item()} to {agree[0].item()}): "
            "every replica must see the same job folder"
        )

    if rank == 0:
        # Set damaged files aside, so the portal's latest_checkpoint_step stops counting them
        # and the next start doesn't trip over them again; renamed, not deleted, for inspection.
        # (Temporary files a writer killed mid-save left are removed by gpuportal.init on rank 0.)
        for path in failed:
            path.rename(path.with_name(path.name + ".corrupt"))

    if start_step >= args.steps:
        log(f"already at step {start_step} of {args.steps}; nothing to do")
        return EXIT_OK

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    step = start_step
    stopping = False
    ctx.start_clock()  # --max-runtime-s counts from here: the first step of this process
    if args.max_runtime_s:
        log(f"first step; --max-runtime-s {args.max_runtime_s:g} counts from now")
    while step < args.steps:
        began = time.perf_counter()
        inputs, targets = batch_for(
            data, seed=args.seed, rank=rank, step=step + 1, batch_size=args.batch_size, seq_len=args.seq_len
        )
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with ctx.busy():
            logits = ddp(inputs)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        step += 1

        reason = None
        if ctx.should_stop():  # a signal, or --max-runtime-s since the first step
            reason = f"{ctx.stop_signal} received" if ctx.stop_signal else f"--max-runtime-s {args.max_runtime_s:g} reached"
        # One collective for two things: the loss averaged over replicas, and whether any
        # replica wants to stop, so that a signal to one rank stops all of them at this step.
        shared = torch.stack([loss.detach().float(), torch.tensor(1.0 if reason else 0.0, device=device)])
        dist.all_reduce(shared, op=dist.ReduceOp.SUM)
        mean_loss, stop_votes = shared.tolist()
        mean_loss /= world
        stopping = stop_votes > 0
        if stopping and not reason:
            ctx.request_stop("another rank asked to stop")
            ctx.should_stop()  # records the stop (rank 0 writes the stop line)
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"loss is {mean_loss} at step {step}; try a lower --lr")

        elapsed = time.perf_counter() - began
        samples_per_s = args.batch_size * world / elapsed
        ctx.report(step, loss=round(mean_loss, 6), samples_per_s=round(samples_per_s, 1))
        ctx.flush()  # every step's line now (the trainer's init asks for no rate limit)
        log(f"step {step}/{args.steps} loss {mean_loss:.4f} {elapsed * 1000:.1f} ms {samples_per_s:.0f} samples/s")

        due = args.checkpoint_every and step % args.checkpoint_every == 0
        if stopping or due or step == args.steps:
            if rank == 0:
                path = ctx.checkpoint(step, checkpoint_state(step, model, optimizer, world_size=world, alphabet=alphabet))
                log(f"saved checkpoint {path.name}")
        if stopping:
            log(f"stopping after step {step}: {reason or 'another rank asked to stop'}")
            break

    # Nobody leaves before rank 0's last save is durable: a replica's exit code then
    # speaks for the whole job. A tiny all_reduce serves as a barrier on every backend.
    dist.all_reduce(torch.zeros(1, device=device))
    if stopping:
        log(f"exiting with {EXIT_CHECKPOINTED_ON_SIGNAL}: checkpointed at step {step}, relaunch to resume")
        return EXIT_CHECKPOINTED_ON_SIGNAL
    log(f"finished all {args.steps} steps")
    return EXIT_OK


def memory_limit_mib() -> int | None:
    """This process's data-segment limit (RLIMIT_DATA) in MiB, or None when there is none."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_DATA)
    return None if soft == resource.RLIM_INFINITY else soft // (1024 * 1024)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The SDK's SIGTERM/SIGINT handlers only note the signal; the loop stops between steps, at a point where
    # a checkpoint is consistent.
    ctx = gpuportal.init(
        job_dir=args.job_dir, max_runtime_s=args.max_runtime_s, keep_checkpoints=args.keep_checkpoints,
        metrics_interval_s=0,
    )
    limit = memory_limit_mib()
    if limit is not None and limit < TRAINER_MIN_MEMORY_MIB:
        print(
            f"memory limit {limit} MiB is below the {TRAINER_MIN_MEMORY_MIB} MiB this trainer needs to start; "
            "raise memory_mib_per_replica",
            file=sys.stderr, flush=True,
        )
        ctx.close()
        return EXIT_FAILED
    try:
        return run(args, ctx)
    except Exception:
        traceback.print_exc()
        return EXIT_FAILED
    finally:
        sys.stdout.flush()
        if dist.is_initialized():
            # DDP and finished collectives hold the group in reference cycles; unless they are
            # collected and the group destroyed now, gloo's worker threads may free tensors
            # during interpreter shutdown, which aborts the process (rc 134) after a clean run.
            gc.collect()
            dist.destroy_process_group()
        # The last activity window; once stopped, a repeated SIGTERM is ignored from here on, so it cannot
        # turn the documented exit code into a death by signal (interpreter shutdown puts the default back).
        ctx.close()


if __name__ == "__main__":
    sys.exit(main())

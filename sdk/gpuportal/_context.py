"""`init()` and the `Context` it returns: what a training script calls to work with the portal."""

from __future__ import annotations

import atexit
import json
import math
import numbers
import os
import shutil
import signal
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from gpuportal import _protocol as protocol
from gpuportal._activity import ActivityMeter, ActivityWriter

RESERVED_METRIC_NAMES = frozenset({"step", "time", "attempt"})
DEFAULT_METRICS_INTERVAL_S = 1.0
DEFAULT_KEEP_CHECKPOINTS = 3


class ResumePoint(NamedTuple):
    """A checkpoint to resume from: its step and where it is (a file, or a folder)."""

    step: int
    path: Path


def _env_int(environ, name: str, default: int | None) -> int | None:
    text = environ.get(name, "")
    if text.strip() == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, not {text!r}") from None


def _step(step: Any) -> int:
    """The step as an int, or a TypeError."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise TypeError(f"step must be an integer of 0 or more, not {step!r}")
    return int(step)


def _metric_value(name: str, value: Any) -> float | int:
    """The value as a plain finite number, or a TypeError/ValueError that names the metric."""
    if hasattr(value, "item") and not isinstance(value, numbers.Number):  # a one-element tensor or array
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            raise TypeError(f"metric {name!r} must be a number, not {type(value).__name__} of several values") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"metric {name!r} must be a number, not {type(value).__name__}")
    if isinstance(value, numbers.Integral):
        return int(value)
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"metric {name!r} must be finite, not {value}")
    return value


def _loadable(path: Path) -> bool:
    """Whether a checkpoint looks whole without loading it: a torch.save file is a zip (its index comes last,
    so a cut file fails), a folder has a file in it."""
    try:
        if path.is_dir():
            return any(entry.is_file() for entry in path.rglob("*"))
        if path.suffix in (".pt", ".ckpt"):
            return zipfile.is_zipfile(path)
        return path.stat().st_size > 0
    except OSError:
        return False


class _StopSignals:
    """SIGTERM/SIGINT handlers that only remember the signal (and call a handler that was there before).

    One per process, installed once. A repeated SIGTERM changes nothing (a launcher may signal both the group
    and each pid, and that must not lose the checkpoint); a second SIGINT kills at once (a person pressing
    Ctrl-C twice wants out now).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self.listeners: list[Callable[[str], None]] = []  # told of the first signal (Context._notify)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            print("gpuportal: init() outside the main thread cannot handle SIGTERM/SIGINT; "
                  "call it from the main thread", file=sys.stderr, flush=True)
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            current = signal.getsignal(signum)
            if current != self._on_signal:
                if signum not in self._previous:
                    self._previous[signum] = current
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        # No printing here: a handler that writes to stdout mid-write of the main code can raise.
        if self.signal_name is not None and signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        first = self.signal_name is None
        self.signal_name = self.signal_name or signal.Signals(signum).name
        if first:
            for listener in list(self.listeners):
                listener(f"{self.signal_name} received")
        previous = self._previous.get(signum)
        # Python's own SIGINT handler raises KeyboardInterrupt: exactly what this handler is here to prevent.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)


def checkpoint_path(job_dir: str | Path, step: int, what: Any) -> Path:
    """Where `write_checkpoint` puts this checkpoint."""
    step = _step(step)
    source = Path(what) if isinstance(what, (str, os.PathLike)) else None
    if source is None:
        suffix = ".pt"
    elif source.is_dir():
        suffix = ""
    elif source.is_file():
        suffix = ".ckpt" if source.suffix == ".ckpt" else ".pt"
    else:
        raise FileNotFoundError(f"no checkpoint file or folder at {source}")
    return Path(job_dir) / protocol.CHECKPOINT_DIR / protocol.checkpoint_name(step, suffix)


def write_checkpoint(job_dir: str | Path, step: int, what: Any, *, attempt: int = 0,
                     keep: int = DEFAULT_KEEP_CHECKPOINTS) -> Path:
    """Save a checkpoint into the job's folder and record it (what Context.checkpoint does on rank 0).

    `what` is the state to torch.save (saved as checkpoints/step-N.pt), or the path of a file or folder
    written already (a .ckpt file keeps its suffix, any other file becomes .pt, a folder step-N): it is moved
    into the checkpoint folder (renamed, or copied where it is on another file system). Either way the
    checkpoint gets its name only once every byte is on disk, and its line in checkpoints.jsonl (and the
    PORTAL_CHECKPOINT line on stdout) comes after that. Then all but the newest `keep` are deleted (0: none).
    """
    job_dir = Path(job_dir)
    final = checkpoint_path(job_dir, step, what)
    final.parent.mkdir(parents=True, exist_ok=True)
    if not isinstance(what, (str, os.PathLike)):
        import torch

        protocol.write_atomically(final, lambda stream: torch.save(what, stream))
    elif Path(what).resolve() != final.resolve():
        _move_in(Path(what), final)
    else:  # written under its final name already: it can at least be made durable before it is recorded
        protocol.fsync_tree(final) if final.is_dir() else protocol.fsync_file(final)
        protocol.fsync_dir(final.parent)
    record = {
        "step": int(step), "path": f"{protocol.CHECKPOINT_DIR}/{final.name}", "bytes": protocol.size_of(final),
        "created_at": protocol.now_iso(), "attempt": attempt,
    }
    protocol.append_jsonl(job_dir / protocol.CHECKPOINTS_FILE, record, durable=True)
    print(protocol.tagged_line(protocol.CHECKPOINT_TAG, record), flush=True)
    if keep:
        for old in list(protocol.checkpoint_entries(job_dir).values())[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return final


def _move_in(source: Path, final: Path) -> None:
    temp = protocol.temp_name(final)
    try:
        if source.stat().st_dev == final.parent.stat().st_dev:
            protocol.fsync_tree(source) if source.is_dir() else protocol.fsync_file(source)
            os.replace(source, temp)  # first into a temp name: a folder cannot replace a folder that has files
        elif source.is_dir():
            shutil.copytree(source, temp)
            protocol.fsync_tree(temp)
        else:
            shutil.copyfile(source, temp)
            protocol.fsync_file(temp)
        if final.is_dir():
            shutil.rmtree(final)  # the same step saved again
        os.replace(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True) if temp.is_dir() else temp.unlink(missing_ok=True)
        raise
    protocol.fsync_dir(final.parent)
    if source.exists():  # copied from another file system: the original goes, as after a rename
        shutil.rmtree(source) if source.is_dir() else source.unlink()


_signals = _StopSignals()
_active: Context | None = None


def init(
    job_dir: str | Path | None = None,
    *,
    max_runtime_s: float | None = None,
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS,
    metrics_interval_s: float = DEFAULT_METRICS_INTERVAL_S,
    metrics_every: int = 1,
    handle_signals: bool = True,
    environ: dict[str, str] | None = None,
) -> Context:
    """The job as the portal launched this process; see `Context` and docs/sdk.md.

    job_dir: the job folder (default: $TRAIN_JOB_DIR). max_runtime_s: should_stop() turns true this many
    seconds after the first report() or start_clock(), as the portal counts a job's runtime from its first
    step (default: $TRAIN_MAX_RUNTIME_S; 0: no limit). keep_checkpoints: older checkpoints are
    deleted (0: keep all). metrics_interval_s, metrics_every: at most one metrics line per this many seconds
    and steps (the steps between are dropped). handle_signals: install the SIGTERM/SIGINT handlers.
    """
    global _active
    if _active is not None:
        _active.close()
    _active = Context(
        job_dir=job_dir, max_runtime_s=max_runtime_s, keep_checkpoints=keep_checkpoints,
        metrics_interval_s=metrics_interval_s, metrics_every=metrics_every, handle_signals=handle_signals,
        environ=os.environ if environ is None else environ,
    )
    return _active


class Context:
    """One process of a training job: its rank, its folders, and the calls that talk to the portal."""

    def __init__(self, *, job_dir, max_runtime_s, keep_checkpoints, metrics_interval_s, metrics_every,
                 handle_signals, environ) -> None:
        job_dir = job_dir if job_dir is not None else environ.get(protocol.ENV_JOB_DIR)
        if not job_dir:
            raise ValueError(f"no job folder: pass init(job_dir=...) or set {protocol.ENV_JOB_DIR}")
        self.job_dir = Path(job_dir)
        self.checkpoint_dir = self.job_dir / protocol.CHECKPOINT_DIR
        self.rank = _env_int(environ, "RANK", 0)
        self.world_size = _env_int(environ, "WORLD_SIZE", 1)
        self.local_rank = _env_int(environ, "LOCAL_RANK", self.rank)
        self.local_world_size = _env_int(environ, "LOCAL_WORLD_SIZE", self.world_size)
        self.attempt = _env_int(environ, protocol.ENV_ATTEMPT, 0)
        self.job_id = _env_int(environ, protocol.ENV_JOB, None)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} does not fit WORLD_SIZE={self.world_size}")
        self.hyperparameters = self._hyperparameters(environ)
        if max_runtime_s is None:
            text = environ.get(protocol.ENV_MAX_RUNTIME_S, "").strip() or "0"
            try:
                max_runtime_s = float(text)
            except ValueError:
                raise ValueError(f"{protocol.ENV_MAX_RUNTIME_S} must be a number of seconds, not {text!r}") from None
        if not max_runtime_s >= 0:  # also refuses nan
            raise ValueError(f"max_runtime_s must be 0 or more, not {max_runtime_s}")
        if keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints must be 0 or more, not {keep_checkpoints}")
        if not metrics_interval_s >= 0 or metrics_every < 1:
            raise ValueError("metrics_interval_s must be 0 or more and metrics_every at least 1")
        self.max_runtime_s = float(max_runtime_s)
        self.keep_checkpoints = keep_checkpoints
        self.metrics_interval_s = metrics_interval_s
        self.metrics_every = metrics_every
        self._resume_step = _env_int(environ, protocol.ENV_RESUME_FROM_STEP, None)
        self._resume_path = environ.get(protocol.ENV_RESUME_FROM_PATH, "").strip()
        self._datasets_manifest = environ.get(protocol.ENV_DATASETS, "")
        # When max_runtime_s started to count: the first report() or start_clock(); None before either.
        self._started: float | None = None
        self._handle_signals = handle_signals
        self._requested: str | None = None
        self.stop_reason: str | None = None
        self._last_checkpoint_step: int | None = None
        self._pending: dict | None = None
        self._pending_time = ""  # when the pending step was reported (ISO 8601)
        self._last_emitted: tuple[int, float] | None = None  # (step, monotonic time) of the last metrics line
        self._metrics_handle = None
        self._closed = False
        self._stop_callbacks: list[Callable[[str], None]] = []
        self._notified = False
        # Held while the stop callbacks run, so that they run once and are done before anyone who asked goes on:
        # the timer thread, should_stop() in the loop and a signal handler (the main thread again: reentrant).
        self._notify_lock = threading.RLock()
        self._timer: threading.Timer | None = None
        if handle_signals:
            _signals.install()
            _signals.listeners.append(self._notify)
        self.meter = ActivityMeter()
        path = protocol.attempt_activity_file(self.job_dir, self.attempt, self.rank)
        self._activity = ActivityWriter(self.meter, path) if path is not None else None
        if self.is_main:
            for temp in self.checkpoint_dir.glob(".step-*.tmp-*"):  # left by a writer killed mid-save
                shutil.rmtree(temp) if temp.is_dir() else temp.unlink(missing_ok=True)
        atexit.register(self.close)

    @staticmethod
    def _hyperparameters(environ) -> dict:
        text = environ.get(protocol.ENV_HYPERPARAMETERS, "").strip()
        if not text:
            return {}
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{protocol.ENV_HYPERPARAMETERS} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{protocol.ENV_HYPERPARAMETERS} must be a JSON object, not {type(value).__name__}")
        return value

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes the job's files."""
        return self.rank == 0

    # --- resuming ---------------------------------------------------------------------------------

    def checkpoints_on_disk(self) -> list[ResumePoint]:
        """Every checkpoint in the job's folder now, newest first (damaged ones included)."""
        return [ResumePoint(step, path) for step, path in reversed(protocol.checkpoint_entries(self.job_dir).items())]

    @cached_property
    def resume_from(self) -> ResumePoint | None:
        """The checkpoint to resume from: the one the portal named (PORTAL_RESUME_FROM_STEP and _PATH) if it is
        there and whole, else the newest whole one in the job's folder; None to start afresh."""
        step = self._resume_step
        if step is not None:
            path = self.job_dir / self._resume_path if self._resume_path else protocol.checkpoint_entries(self.job_dir).get(step)
            if path is not None and _loadable(path):
                return ResumePoint(step, path)
            print(f"gpuportal: the checkpoint of step {step} the portal named is missing or damaged; "
                  "resuming from the newest whole one", file=sys.stderr, flush=True)
        for point in self.checkpoints_on_disk():
            if _loadable(point.path):
                return point
        return None

    def load(self, map_location: Any = "cpu", **kwargs) -> Any:
        """torch.load of resume_from (weights only, onto the CPU, unless told otherwise); None with nothing to resume."""
        point = self.resume_from
        if point is None:
            return None
        if point.path.is_dir():
            raise IsADirectoryError(f"{point.path} is a folder: load it with the library that wrote it")
        import torch

        kwargs.setdefault("weights_only", True)  # no pickled code from a writable folder
        return torch.load(point.path, map_location=map_location, **kwargs)

    # --- metrics -----------------------------------------------------------------------------------

    def dataset(self, name: str, **options):
        """A dataset the job's spec names (gpuportal.datasets.JobDataset): ``.path``, a folder of its shards, and
        iteration over its samples with prefetch. Records which version was read (datasets.jsonl)."""
        from gpuportal import datasets

        return datasets.dataset_for_context(self, name, **options)

    def report(self, step: int, /, **metrics) -> None:
        """Record the metrics of a step (finite numbers; rank 0 writes, other ranks only validate).

        At most one line per step: a second report of the same step adds to it, until its line is written. A
        step's line is written when a later step is reported, if metrics_interval_s and metrics_every have passed
        since the last line written (the others are dropped), or at flush(), a checkpoint, a stop and the end.
        """
        step = _step(step)
        values = {}
        for name, value in metrics.items():
            if name in RESERVED_METRIC_NAMES:
                raise ValueError(f"metric {name!r} is a name the record uses itself; pick another")
            values[name] = _metric_value(name, value)
        self.meter.mark()
        if self._started is None:
            self._start_counting()
        if not self.is_main:
            return
        pending = self._pending
        last = pending["step"] if pending is not None else self._last_emitted and self._last_emitted[0]
        if last is not None and step < last:
            raise ValueError(f"step {step} comes after step {last}: steps must not go back")
        if pending is not None and step == pending["step"]:
            pending.update(values)
            return
        if pending is None and step == last:
            return  # its line is written already (by a checkpoint or a stop): one line a step
        if pending is not None and self._due(pending["step"]):
            self._emit(pending)
        # The line's time is when its step was first reported, not when the line is written: the portal counts
        # an attempt's runtime from its first line's time, which is then the instant this clock started.
        self._pending = {"step": step, **values}
        self._pending_time = protocol.now_iso()

    def _due(self, step: int) -> bool:
        if self._last_emitted is None:
            return True
        last_step, last_time = self._last_emitted
        return step - last_step >= self.metrics_every and time.monotonic() - last_time >= self.metrics_interval_s

    def _emit(self, pending: dict) -> None:
        record = {**pending, "time": self._pending_time, "attempt": self.attempt}
        if self._metrics_handle is None:
            self._metrics_handle = protocol.open_jsonl(self.job_dir / protocol.METRICS_FILE)
        protocol.write_jsonl(self._metrics_handle, record)
        print(protocol.tagged_line(protocol.METRIC_TAG, record), flush=True)
        self._last_emitted = (pending["step"], time.monotonic())
        self._pending = None

    def flush(self) -> None:
        """Write the step reported last, if not written yet."""
        if self._pending is not None:
            self._emit(self._pending)

    def _flush_if_due(self) -> None:
        # For a caller that knows no more metrics of the pending step will come (a framework's step end), so
        # that a step reported every N steps is not written only N steps late; the rate limits still hold.
        if self._pending is not None and self._due(self._pending["step"]):
            self._emit(self._pending)

    # --- checkpoints -------------------------------------------------------------------------------

    def checkpoint(self, step: int, what: Any) -> Path:
        """Save a checkpoint of `step` and record it; returns where it is (rank 0 writes; other ranks write nothing).

        `what` is the state to torch.save, or the path of a file or folder the script wrote itself: see
        `write_checkpoint`. Any metrics line still pending is written first.
        """
        step = _step(step)
        self.meter.mark()
        if not self.is_main:
            # Rank 0 alone writes: a file named here may exist only on its machine.
            source = Path(what) if isinstance(what, (str, os.PathLike)) else None
            if source is None or source.exists():
                return checkpoint_path(self.job_dir, step, what)
            suffix = ".ckpt" if source.suffix == ".ckpt" else ".pt" if source.suffix else ""
            return self.checkpoint_dir / protocol.checkpoint_name(step, suffix)
        final = checkpoint_path(self.job_dir, step, what)
        self.flush()
        write_checkpoint(self.job_dir, step, what, attempt=self.attempt, keep=self.keep_checkpoints)
        self._last_checkpoint_step = step
        if self.stop_reason is not None:
            self._record_stop()  # the newest stop line names the checkpoint this attempt leaves
        return final

    # --- stopping ----------------------------------------------------------------------------------

    def start_clock(self) -> None:
        """Count max_runtime_s from now rather than from the first report() (say, from the start of a first step
        that is long). Called again, the count starts again."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._start_counting()

    def _start_counting(self) -> None:
        self._started = time.monotonic()
        if self.max_runtime_s and self._stop_callbacks and not self._notified:
            self._start_timer()

    def request_stop(self, reason: str) -> None:
        """Stop as if the portal had asked: should_stop() is true from now on, with this reason."""
        self._requested = self._requested or reason
        self._notify(self._requested)

    def on_stop(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once, as soon as the portal asks the job to stop, for a loop that cannot poll
        should_stop(): from the signal handler (a signal: in the main thread, between two instructions of the
        script), from a timer thread (max_runtime_s), from request_stop(), or from should_stop() when the loop
        sees the stop first. Keep it short (set a flag); no printing in it, which can fail inside a signal
        handler. Called at once if the stop came already."""
        self._stop_callbacks.append(callback)
        if self._notified:
            self._call(callback, self._requested or self.stop_reason or self._local_reason() or "stopped")
        elif (reason := self._local_reason()) is not None:
            self._notify(reason)
        elif self.max_runtime_s and self._timer is None and self._started is not None:
            self._start_timer()  # else it starts with the clock

    def _start_timer(self) -> None:
        left = max(0.0, self.max_runtime_s - (time.monotonic() - self._started))
        reason = f"max runtime {self.max_runtime_s:g} s reached"
        self._timer = threading.Timer(left, lambda: self._notify(reason))
        self._timer.daemon = True
        self._timer.start()

    def _notify(self, reason: str) -> None:
        with self._notify_lock:
            if self._notified or not self._stop_callbacks:
                return
            self._notified = True
            for callback in list(self._stop_callbacks):
                self._call(callback, reason)

    @staticmethod
    def _call(callback: Callable[[str], None], reason: str) -> None:
        try:
            callback(reason)
        except Exception as exc:  # a callback's failure must not end the training it was to stop
            os.write(2, f"gpuportal: the on_stop callback failed: {exc!r}\n".encode())

    @property
    def stop_signal(self) -> str | None:
        """The name of the signal that asked this process to stop (SIGTERM, SIGINT), or None."""
        return _signals.signal_name if self._handle_signals else None

    def should_stop(self, *, sync: bool = False) -> bool:
        """True once the portal asked the job to stop: SIGTERM/SIGINT, max_runtime_s passed, or request_stop().

        The script should then checkpoint and exit 0 (or exit_stopped()). The first time it is true, the stop
        is recorded (stops.jsonl and a PORTAL_STOPPED line, by rank 0). With `sync`, every rank of an
        initialized torch.distributed group learns it together (one all-reduce; every rank must call it).
        """
        reason = self.stop_reason or self._local_reason()
        if sync and self.world_size > 1:
            reason = self._agree(reason)
        if reason:
            # The loop may see max_runtime_s pass before the timer thread does (a busy machine): the callbacks
            # are called here then, or waited for if the timer is calling them, before the script can exit.
            self._notify(reason)
        if reason and self.stop_reason is None:
            self.stop_reason = reason
            self._record_stop()
        return reason is not None

    def _local_reason(self) -> str | None:
        if self.stop_signal:
            return f"{self.stop_signal} received"
        if self._requested:
            return self._requested
        if self.max_runtime_s and self._started is not None and time.monotonic() - self._started >= self.max_runtime_s:
            return f"max runtime {self.max_runtime_s:g} s reached"
        return None

    def _agree(self, reason: str | None) -> str | None:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return reason
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        vote = torch.tensor([1 if reason else 0], device=device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        return reason or ("another rank asked to stop" if vote.item() else None)

    def _record_stop(self) -> None:
        self.flush()
        if not self.is_main:
            return
        record = {
            "attempt": self.attempt, "rank": self.rank, "reason": self.stop_reason,
            "checkpoint_step": self._last_checkpoint_step if self._last_checkpoint_step is not None
            else next((p.step for p in self.checkpoints_on_disk()), None),
            "time": protocol.now_iso(),
        }
        protocol.append_jsonl(self.job_dir / protocol.STOPS_FILE, record, durable=True)
        print(protocol.tagged_line(protocol.STOPPED_TAG, record), flush=True)

    def exit_stopped(self) -> None:
        """Leave with exit code 75 (checkpointed on a stop), for scripts that prefer it to exiting 0."""
        self.close()
        sys.exit(protocol.EXIT_CHECKPOINTED_ON_SIGNAL)

    # --- activity ----------------------------------------------------------------------------------

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Around the compute (forward, backward, optimizer step): the idle detector sees the time outside as idle."""
        with self.meter.busy():
            yield

    # --- the end -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Write what is pending (the last metrics line, the last activity window); run at exit by itself."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._timer is not None:
            self._timer.cancel()
        if self._notify in _signals.listeners:
            _signals.listeners.remove(self._notify)
        try:
            self.flush()
        finally:
            if self._metrics_handle is not None:
                self._metrics_handle.close()
                self._metrics_handle = None
            if self._activity is not None:
                self._activity.close()
            if self.stop_reason is not None and self._handle_signals \
                    and threading.current_thread() is threading.main_thread():
                # Checkpointed and on the way out: a repeated SIGTERM must not turn the exit into a death by
                # signal (interpreter shutdown puts the default handler back).
                signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

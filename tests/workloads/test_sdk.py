"""The SDK's calls in one process, on a temporary job folder: what they write, what they refuse, what they read."""

import json
import math
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import gpuportal
import pytest
from gpuportal._activity import ActivityMeter

from runners.workloads import progress
from runners.workloads.activity import read_activity

pytestmark = pytest.mark.unit


def make(tmp_path, env=None, **options):
    """A context on tmp_path/job, from these variables alone (none of this process's), without signal handlers."""
    environ = {"TRAIN_JOB_DIR": str(tmp_path / "job"), **(env or {})}
    options.setdefault("metrics_interval_s", 0)
    return gpuportal.init(handle_signals=False, environ=environ, **options)


@pytest.fixture(autouse=True)
def _close_the_last_context():
    yield
    if gpuportal._context._active is not None:
        gpuportal._context._active.close()


# --- init ---------------------------------------------------------------------------------------------


def test_init_reads_what_the_launcher_set(tmp_path):
    ctx = make(tmp_path, {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "PORTAL_ATTEMPT": "3", "PORTAL_JOB": "42",
        "PORTAL_HYPERPARAMETERS": json.dumps({"lr": 0.01, "layers": [2, 3]}),
    })

    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.attempt, ctx.job_id) == (1, 2, 1, 3, 42)
    assert not ctx.is_main
    assert ctx.job_dir == tmp_path / "job" and ctx.checkpoint_dir == tmp_path / "job" / "checkpoints"
    assert ctx.hyperparameters == {"lr": 0.01, "layers": [2, 3]}
    assert ctx.resume_from is None and ctx.load() is None


def test_init_defaults_to_one_process_and_no_hyperparameters(tmp_path):
    ctx = make(tmp_path)
    assert (ctx.rank, ctx.world_size, ctx.attempt, ctx.job_id, ctx.hyperparameters) == (0, 1, 0, None, {})
    assert ctx.is_main and ctx.max_runtime_s == 0


@pytest.mark.parametrize(("env", "named"), [
    ({"TRAIN_JOB_DIR": ""}, "TRAIN_JOB_DIR"),
    ({"PORTAL_HYPERPARAMETERS": "{lr: 1}"}, "PORTAL_HYPERPARAMETERS"),
    ({"PORTAL_HYPERPARAMETERS": "[1, 2]"}, "PORTAL_HYPERPARAMETERS"),
    ({"RANK": "two"}, "RANK"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2"),
    ({"TRAIN_MAX_RUNTIME_S": "soon"}, "TRAIN_MAX_RUNTIME_S"),
    ({"PORTAL_RESUME_FROM_STEP": "last"}, "PORTAL_RESUME_FROM_STEP"),
])
def test_bad_variables_are_refused_by_name(tmp_path, env, named):
    with pytest.raises(ValueError, match=named):
        make(tmp_path, env)


# --- report ---------------------------------------------------------------------------------------------


def test_report_writes_one_line_a_step_with_time_and_attempt_and_a_tagged_stdout_line(tmp_path, capsys):
    ctx = make(tmp_path, {"PORTAL_ATTEMPT": "2"})
    ctx.report(1, loss=2.5, samples_per_s=100)
    ctx.report(2, loss=2.0)
    ctx.report(2, eval_loss=2.25)  # the same step again: added to its line
    ctx.report(3, loss=1.5)
    ctx.close()

    metrics = progress.read_metrics(ctx.job_dir)
    assert [(r["step"], r.get("loss"), r.get("eval_loss")) for r in metrics] == [
        (1, 2.5, None), (2, 2.0, 2.25), (3, 1.5, None)]
    assert all(r["attempt"] == 2 and r["time"].endswith("+00:00") for r in metrics)
    assert metrics[0]["samples_per_s"] == 100 and isinstance(metrics[0]["samples_per_s"], int)
    logged, _ = progress.parse_log(capsys.readouterr().out)
    assert logged == metrics


def test_report_every_n_steps_keeps_a_bounded_share_and_the_last_step(tmp_path):
    ctx = make(tmp_path, metrics_every=10)
    for step in range(1, 96):
        ctx.report(step, loss=1.0 / step)
    ctx.flush()

    assert [r["step"] for r in progress.read_metrics(ctx.job_dir)] == [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 95]


def test_report_at_most_one_line_an_interval(tmp_path):
    ctx = make(tmp_path, metrics_interval_s=3600)
    for step in range(1, 10_001):
        ctx.report(step, loss=1.0)
    ctx.close()

    assert [r["step"] for r in progress.read_metrics(ctx.job_dir)] == [1, 10_000], "the first, and the last at the end"


@pytest.mark.parametrize(("metrics", "error", "named"), [
    ({"loss": "low"}, TypeError, "'loss'"),
    ({"loss": None}, TypeError, "'loss'"),
    ({"ok": 1.0, "acc": True}, TypeError, "'acc'"),
    ({"loss": math.nan}, ValueError, "'loss'"),
    ({"grad": -math.inf}, ValueError, "'grad'"),
    ({"time": 3.0}, ValueError, "'time'"),
    ({"step": 3}, ValueError, "'step'"),
])
def test_report_refuses_what_is_not_a_finite_number_naming_the_metric(tmp_path, metrics, error, named):
    ctx = make(tmp_path)
    with pytest.raises(error, match=named):
        ctx.report(1, **metrics)
    ctx.close()
    assert progress.read_metrics(ctx.job_dir) == []


def test_report_refuses_a_bad_step_and_a_step_going_back(tmp_path):
    ctx = make(tmp_path)
    for bad in ("1", 1.5, -1, True):
        with pytest.raises(TypeError, match="step"):
            ctx.report(bad, loss=1.0)
    ctx.report(5, loss=1.0)
    with pytest.raises(ValueError, match="step 4"):
        ctx.report(4, loss=1.0)


def test_report_takes_one_element_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    ctx = make(tmp_path)
    ctx.report(1, loss=torch.tensor(0.5), tokens=torch.tensor(7))
    with pytest.raises(TypeError, match="'batch'"):
        ctx.report(1, batch=torch.ones(3))
    ctx.close()

    assert [(r["loss"], r["tokens"]) for r in progress.read_metrics(ctx.job_dir)] == [(0.5, 7)]


def test_only_rank_0_writes(tmp_path, capsys):
    ctx = make(tmp_path, {"RANK": "1", "WORLD_SIZE": "2"})
    ctx.report(1, loss=1.0)
    path = ctx.checkpoint(1, {"w": 1})
    ctx.request_stop("test")
    assert ctx.should_stop()
    ctx.close()

    assert path == ctx.checkpoint_dir / "step-00000001.pt"
    assert ctx.checkpoint(2, tmp_path / "on-rank-0-only.ckpt") == ctx.checkpoint_dir / "step-00000002.ckpt"
    with pytest.raises(TypeError, match="step"):
        ctx.checkpoint("3", {"w": 1})
    assert not ctx.job_dir.exists() and capsys.readouterr().out == ""


# --- checkpoints and resuming -----------------------------------------------------------------------


def test_a_state_checkpoint_is_saved_recorded_and_resumed_from(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    ctx = make(tmp_path, {"PORTAL_ATTEMPT": "1"})
    path = ctx.checkpoint(10, {"weights": torch.arange(4.0), "step": 10})

    assert path == ctx.checkpoint_dir / "step-00000010.pt"
    [record] = progress.read_checkpoints(ctx.job_dir)
    assert set(record) == {"step", "path", "bytes", "created_at", "attempt"}
    assert (record["step"], record["path"], record["bytes"], record["attempt"]) == (
        10, "checkpoints/step-00000010.pt", path.stat().st_size, 1)
    _, logged = progress.parse_log(capsys.readouterr().out)
    assert logged == [record]
    assert [p.name for p in ctx.checkpoint_dir.iterdir()] == ["step-00000010.pt"], "no temporary file left"

    again = make(tmp_path, {"PORTAL_ATTEMPT": "2"})
    assert again.resume_from == gpuportal.ResumePoint(10, path)
    assert again.load()["weights"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_file_or_folder_the_script_wrote_is_moved_in_under_its_step(tmp_path):
    ctx = make(tmp_path)
    lightning_file = tmp_path / "last.ckpt"
    lightning_file.write_bytes(b"lightning")
    folder = tmp_path / "checkpoint-30"
    (folder / "sub").mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    (folder / "sub" / "optimizer.pt").write_bytes(b"12345")

    assert ctx.checkpoint(20, lightning_file) == ctx.checkpoint_dir / "step-00000020.ckpt"
    assert ctx.checkpoint(30, str(folder)) == ctx.checkpoint_dir / "step-00000030"

    assert not lightning_file.exists() and not folder.exists()
    assert (ctx.checkpoint_dir / "step-00000030" / "sub" / "optimizer.pt").read_bytes() == b"12345"
    assert [(r["step"], r["path"], r["bytes"]) for r in progress.read_checkpoints(ctx.job_dir)] == [
        (20, "checkpoints/step-00000020.ckpt", 9), (30, "checkpoints/step-00000030", 7)]
    assert progress.latest_checkpoint_step(ctx.job_dir) == 30
    assert make(tmp_path).resume_from == gpuportal.ResumePoint(30, ctx.checkpoint_dir / "step-00000030")
    with pytest.raises(FileNotFoundError, match="missing"):
        ctx.checkpoint(40, tmp_path / "missing")


def test_a_file_written_under_its_final_name_is_recorded_where_it_is(tmp_path):
    ctx = make(tmp_path)
    ctx.checkpoint_dir.mkdir(parents=True)
    (ctx.checkpoint_dir / "step-00000040.pt").write_bytes(b"state")

    assert ctx.checkpoint(40, ctx.checkpoint_dir / "step-00000040.pt") == ctx.checkpoint_dir / "step-00000040.pt"
    assert (ctx.checkpoint_dir / "step-00000040.pt").read_bytes() == b"state"
    assert [(r["step"], r["bytes"]) for r in progress.read_checkpoints(ctx.job_dir)] == [(40, 5)]


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    ctx = make(tmp_path, keep_checkpoints=2)
    for step in (1, 2, 3, 4):
        ctx.checkpoint(step, {"step": step})

    assert list(progress.checkpoint_files(ctx.job_dir)) == [3, 4]
    assert [r["step"] for r in progress.read_checkpoints(ctx.job_dir)] == [1, 2, 3, 4]


def test_resume_from_passes_over_a_damaged_newest_checkpoint_and_a_temporary_file(tmp_path):
    ctx = make(tmp_path, keep_checkpoints=0)
    ctx.checkpoint(10, {"step": 10})
    newest = ctx.checkpoint(20, {"step": 20})
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # cut, as by a full disk afterwards
    stale = ctx.checkpoint_dir / ".step-00000030.pt.tmp-999999"
    stale.write_bytes(b"half a checkpoint")
    ctx.close()

    again = make(tmp_path)
    assert again.resume_from.step == 10
    assert again.load()["step"] == 10
    assert [p.step for p in again.checkpoints_on_disk()] == [20, 10], "every candidate, damaged ones too"
    assert not stale.exists(), "rank 0's init removes what a killed writer left"


def test_resume_from_is_the_checkpoint_the_portal_named(tmp_path, capsys):
    ctx = make(tmp_path, keep_checkpoints=0)
    for step in (10, 20, 30):
        ctx.checkpoint(step, {"step": step})
    ctx.close()

    assert make(tmp_path, {"PORTAL_RESUME_FROM_STEP": "20"}).resume_from.step == 20
    named = make(tmp_path, {"PORTAL_RESUME_FROM_STEP": "10", "PORTAL_RESUME_FROM_PATH": "checkpoints/step-00000010.pt"})
    assert named.resume_from == (10, ctx.checkpoint_dir / "step-00000010.pt")
    capsys.readouterr()
    gone = make(tmp_path, {"PORTAL_RESUME_FROM_STEP": "40"})
    assert gone.resume_from.step == 30, "not there: the newest whole one"
    assert "step 40" in capsys.readouterr().err


# --- stopping ---------------------------------------------------------------------------------------


def test_max_runtime_stops_and_the_stop_is_recorded_once_then_after_each_checkpoint(tmp_path, capsys):
    ctx = make(tmp_path, {"TRAIN_MAX_RUNTIME_S": "0.05", "PORTAL_ATTEMPT": "4"})
    ctx.checkpoint(5, {"step": 5})
    assert ctx.max_runtime_s == 0.05 and not ctx.should_stop()
    ctx.report(6, loss=1.0)
    time.sleep(0.1)

    assert ctx.should_stop() and ctx.should_stop()
    assert ctx.stop_reason == "max runtime 0.05 s reached" and ctx.stop_signal is None
    assert [r["step"] for r in progress.read_metrics(ctx.job_dir)] == [6], "the pending line is written at the stop"
    [stop] = progress.read_stops(ctx.job_dir)
    assert (stop["attempt"], stop["rank"], stop["reason"], stop["checkpoint_step"]) == (4, 0, ctx.stop_reason, 5)

    ctx.checkpoint(6, {"step": 6})
    assert [s["checkpoint_step"] for s in progress.read_stops(ctx.job_dir)] == [5, 6]
    assert progress.stop_of_attempt(ctx.job_dir, 4)["checkpoint_step"] == 6
    assert progress.stop_of_attempt(ctx.job_dir, 3) is None
    records = progress.parse_log_records(capsys.readouterr().out)
    assert records.stops == progress.read_stops(ctx.job_dir) and len(records.checkpoints) == 2


def test_the_clock_can_start_later_than_init(tmp_path):
    ctx = make(tmp_path, max_runtime_s=0.05)
    time.sleep(0.1)
    ctx.start_clock()
    assert not ctx.should_stop()


def test_the_max_runtime_counts_from_the_first_report_as_the_portal_does_not_from_init(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(gpuportal._context, "time", SimpleNamespace(monotonic=clock))
    ctx = make(tmp_path, {"TRAIN_MAX_RUNTIME_S": "10"})
    clock.now += 60  # imports, the rendezvous, loading data: the portal counts none of it
    assert not ctx.should_stop()

    ctx.report(1, loss=1.0)  # the clock starts here
    clock.now += 6
    ctx.report(2, loss=1.0)  # a later report does not start it again
    clock.now += 3.9
    assert not ctx.should_stop()
    clock.now += 0.1
    assert ctx.should_stop() and ctx.stop_reason == "max runtime 10 s reached"


def test_on_other_ranks_too_the_clock_starts_at_the_first_report(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(gpuportal._context, "time", SimpleNamespace(monotonic=clock))
    ctx = make(tmp_path, {"RANK": "1", "WORLD_SIZE": "2"}, max_runtime_s=10)
    clock.now += 60
    ctx.report(1, loss=1.0)
    clock.now += 9
    assert not ctx.should_stop()
    clock.now += 1
    assert ctx.should_stop()


def test_start_clock_before_the_first_report_is_where_the_count_starts(tmp_path, monkeypatch):
    # What the shipped trainer does: start_clock() before its first step, then report after it.
    clock = Clock()
    monkeypatch.setattr(gpuportal._context, "time", SimpleNamespace(monotonic=clock))
    ctx = make(tmp_path, max_runtime_s=10)
    clock.now += 60
    ctx.start_clock()
    clock.now += 5
    ctx.report(1, loss=1.0)
    clock.now += 5
    assert ctx.should_stop(), "counted from start_clock(), not from the report after it"


def test_a_lines_time_is_when_its_step_was_reported_not_when_the_line_is_written(tmp_path):
    # The portal counts an attempt's runtime from its first line's time: that must be when the SDK's clock started.
    ctx = make(tmp_path, metrics_interval_s=0)
    before = datetime.now(UTC)
    ctx.report(1, loss=1.0)
    after = datetime.now(UTC)
    time.sleep(0.05)
    ctx.report(2, loss=0.5)  # writes step 1's line
    assert progress.read_metrics(ctx.job_dir)[0]["step"] == 1
    written = datetime.fromisoformat(progress.read_metrics(ctx.job_dir)[0]["time"])
    assert before.replace(microsecond=before.microsecond // 1000 * 1000) <= written <= after


def test_a_max_runtime_timer_waits_for_the_first_report(tmp_path):
    ctx = make(tmp_path, max_runtime_s=0.2)
    heard = threading.Event()
    ctx.on_stop(lambda reason: heard.set())
    assert not heard.wait(timeout=0.5), "no step reported yet: nothing counts"
    ctx.report(1, loss=1.0)
    assert heard.wait(timeout=30)
    assert ctx.should_stop() and ctx.stop_reason == "max runtime 0.2 s reached"


def test_request_stop_and_exit_stopped(tmp_path):
    ctx = make(tmp_path)
    ctx.request_stop("the data ran out")
    assert ctx.should_stop() and ctx.stop_reason == "the data ran out"
    with pytest.raises(SystemExit) as exited:
        ctx.exit_stopped()
    assert exited.value.code == gpuportal.EXIT_CHECKPOINTED_ON_SIGNAL == 75


def test_on_stop_calls_back_once_at_the_stop_or_at_once_if_it_came_already(tmp_path, capfd):
    ctx = make(tmp_path)
    heard = []
    ctx.on_stop(lambda reason: 1 / 0)  # a failing callback is reported, and the others still called
    ctx.on_stop(heard.append)
    assert heard == []
    ctx.request_stop("the data ran out")
    ctx.request_stop("again")
    assert heard == ["the data ran out"]
    assert "the on_stop callback failed: ZeroDivisionError" in capfd.readouterr().err
    ctx.on_stop(heard.append)
    assert heard == ["the data ran out"] * 2


def test_on_stop_is_called_from_a_timer_when_the_max_runtime_passes(tmp_path):
    ctx = make(tmp_path, max_runtime_s=0.2)
    heard = threading.Event()
    reasons = []
    ctx.on_stop(lambda reason: (reasons.append(reason), heard.set()))
    ctx.start_clock()  # the timer starts again with the clock
    assert heard.wait(timeout=30)
    assert reasons == ["max runtime 0.2 s reached"] and ctx.should_stop()


def test_a_loop_that_sees_the_max_runtime_before_the_timer_calls_back_itself(tmp_path):
    """On a busy machine the loop's should_stop() may find the max runtime passed before the timer thread runs;
    the callbacks are called then, from the loop, before the script can exit (the timer's late call is none)."""
    ctx = make(tmp_path, max_runtime_s=0.2)
    reasons = []
    ctx.on_stop(reasons.append)
    ctx.start_clock()
    ctx._timer.cancel()  # the timer thread has not had the CPU yet
    time.sleep(0.3)
    assert ctx.should_stop()
    assert reasons == ["max runtime 0.2 s reached"], "called from the loop, at once"
    ctx._notify("late")  # what the timer thread would do now
    assert reasons == ["max runtime 0.2 s reached"], "still once"


def test_a_loop_that_stops_while_the_timer_is_calling_back_waits_for_the_callback(tmp_path):
    ctx = make(tmp_path, max_runtime_s=0.1)
    calling, done = threading.Event(), threading.Event()

    def slow(reason):
        calling.set()
        time.sleep(0.3)
        done.set()

    ctx.on_stop(slow)
    ctx.start_clock()
    assert calling.wait(timeout=30)
    assert ctx.should_stop()
    assert done.is_set(), "should_stop() returned while the callback still ran: the script could exit under it"


def test_a_stop_line_without_a_checkpoint_names_none(tmp_path):
    ctx = make(tmp_path)
    ctx.request_stop("x")
    ctx.should_stop()
    assert progress.read_stops(ctx.job_dir)[0]["checkpoint_step"] is None


# --- activity ---------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_marks_count_the_time_between_them_as_busy_and_a_hang_as_idle_after_the_hold():
    clock = Clock()
    meter = ActivityMeter(window_s=2.0, clock=clock, min_hold_s=3.0)
    meter.mark()
    for _ in range(4):
        clock.now += 0.5
        meter.mark()
    assert meter.roll() == (2.0, 1.0), "reports every half second: busy throughout"
    clock.now += 2.0
    assert meter.roll() == (2.0, 1.0), "within the hold after the last report"
    clock.now += 2.0
    assert meter.roll() == (2.0, 0.5), "the hold (3 s after the last report) ends halfway through this window"
    clock.now += 2.0
    assert meter.roll() == (2.0, 0.0), "no report for longer than the hold: idle"


def test_once_busy_is_used_marks_count_for_nothing():
    clock = Clock()
    meter = ActivityMeter(window_s=2.0, clock=clock)
    with meter.busy():
        clock.now += 0.5
    meter.mark()
    clock.now += 1.5
    meter.mark()
    assert meter.roll() == (2.0, 0.25)


def test_activity_is_written_into_the_attempts_folder_where_the_local_backend_made_one(tmp_path):
    (tmp_path / "job" / "attempts" / "0").mkdir(parents=True)
    ctx = make(tmp_path)
    with ctx.busy():
        time.sleep(0.05)
    ctx.close()

    found = read_activity(tmp_path / "job" / "attempts" / "0" / "rank-0.activity.json", now=time.time())
    assert found is not None and 0 < found["busy_fraction"] <= 1

    elsewhere = make(tmp_path / "other")
    elsewhere.close()
    assert not (tmp_path / "other" / "job").exists(), "no attempt folder (Kubernetes): no activity file"


# --- the portal's readers ---------------------------------------------------------------------------


def test_parse_log_keeps_its_two_lists_and_parse_log_records_adds_the_stops():
    text = "\n".join([
        'PORTAL_METRIC {"step": 1, "loss": 1.0}', "hello", 'PORTAL_STOPPED {"attempt": 0, "rank": 0}',
        'PORTAL_STOPPED {"rank": 0}', 'PORTAL_STOPPED {"attempt": true}', "PORTAL_STOPPED {",
        'PORTAL_CHECKPOINT {"step": 1, "path": "checkpoints/step-00000001.pt"}',
    ])
    metrics, checkpoints = progress.parse_log(text)
    records = progress.parse_log_records(text)

    assert (records.metrics, records.checkpoints) == (metrics, checkpoints) and len(metrics) == len(checkpoints) == 1
    assert records.stops == [{"attempt": 0, "rank": 0}]


def test_read_stops_skips_what_is_not_a_stop(tmp_path):
    (tmp_path / progress.STOPS_FILE).write_text('{"attempt": 1}\ngarbage\n{"attempt": "1"}\n{"attempt": 2}\n{"att')
    assert progress.read_stops(tmp_path) == [{"attempt": 1}, {"attempt": 2}]
    assert progress.read_stops(tmp_path / "none") == []


def test_the_docs_page_shows_the_ddp_example_as_it_is():
    repo = Path(__file__).resolve().parents[2]
    assert (repo / "sdk" / "examples" / "ddp" / "train.py").read_text() in (repo / "docs" / "sdk.md").read_text()


def test_the_transformers_callback_writes_a_logged_step_at_the_next_step_end_and_stops_the_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from gpuportal.transformers import PortalCallback

    ctx = make(tmp_path)
    callback = PortalCallback(ctx)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    state, control = transformers.TrainerState(global_step=10), transformers.TrainerControl()
    callback.on_log(args, state, control, logs={"loss": 1.5, "epoch": 0.1, "note": "text", "bad": float("nan")})
    callback.on_log(args, state, control, logs={"eval_loss": 1.75})  # evaluation comes after, at the same step
    assert progress.read_metrics(ctx.job_dir) == []
    state.global_step = 11
    callback.on_step_end(args, state, control)

    [line] = progress.read_metrics(ctx.job_dir)
    assert {k: v for k, v in line.items() if k not in ("time", "attempt")} == {
        "step": 10, "loss": 1.5, "epoch": 0.1, "eval_loss": 1.75}
    assert not control.should_save and not control.should_training_stop
    ctx.request_stop("test")
    callback.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop

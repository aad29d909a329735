"""The activity meter: the busy share of each window, computes that span a window's end, the file and its staleness."""

import json
import os
import threading
import time

import pytest

from runners.workloads.activity import (
    STALE_AFTER_S,
    ActivityMeter,
    activity_file,
    read_activity,
    trainer_activity_file,
)

pytestmark = pytest.mark.unit


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_busy_share_of_a_window_counts_only_the_time_inside_busy():
    clock = Clock()
    meter = ActivityMeter(window_s=2.0, clock=clock)
    with meter.busy():
        clock.now += 1.5
    clock.now += 0.5  # idle
    assert meter.roll() == (2.0, 0.75)
    clock.now += 4.0
    assert meter.roll() == (4.0, 0.0), "a new window starts at each roll"


def test_a_compute_running_across_a_window_end_is_split_between_the_windows():
    clock = Clock()
    meter = ActivityMeter(window_s=2.0, clock=clock)
    clock.now += 1.0
    with meter.busy():
        clock.now += 1.0
        assert meter.roll() == (2.0, 0.5), "counted up to the window's end while it still runs"
        clock.now += 3.0
    clock.now += 1.0
    assert meter.roll() == (4.0, 0.75), "and only its rest in the next one"


def test_maybe_write_waits_for_a_whole_window_and_writes_atomically(tmp_path):
    clock = Clock()
    meter = ActivityMeter(window_s=2.0, clock=clock)
    path = activity_file(tmp_path, 3)
    assert path.name == "rank-3.activity.json"
    with meter.busy():
        clock.now += 1.0
    assert not meter.maybe_write(path) and not path.exists()
    clock.now += 1.0
    before = time.time()
    assert meter.maybe_write(path)
    record = json.loads(path.read_text())
    assert set(record) == {"at", "window_s", "busy_fraction", "memory_used_mib"}
    assert record["window_s"] == 2.0 and record["busy_fraction"] == 0.5
    assert before - 0.01 <= record["at"] <= time.time() + 0.01
    assert 1 < record["memory_used_mib"] < 64 * 1024, "this process's resident memory"
    assert os.listdir(tmp_path) == [path.name], "no temporary file left behind"
    assert read_activity(path, now=time.time()) == {
        "at": record["at"], "busy_fraction": 0.5, "memory_used_mib": record["memory_used_mib"]}


def test_a_stale_or_broken_file_reads_as_nothing(tmp_path):
    path = activity_file(tmp_path, 0)
    assert read_activity(path, now=time.time()) is None, "no file yet"
    path.write_text(json.dumps({"at": 1000.0, "window_s": 2.0, "busy_fraction": 0.9, "memory_used_mib": 10}))
    assert read_activity(path, now=1000.0 + STALE_AFTER_S - 0.1)["busy_fraction"] == 0.9
    assert read_activity(path, now=1000.0 + STALE_AFTER_S + 0.1) is None, "a rank that stopped writing"
    for broken in ("{", "[]", json.dumps({"at": "soon", "busy_fraction": 0.5}), json.dumps({"at": 1000.0})):
        path.write_text(broken)
        assert read_activity(path, now=1000.0) is None, broken


def test_a_write_that_fails_never_raises(tmp_path):
    meter = ActivityMeter()
    assert not meter.write(tmp_path / "gone" / "rank-0.activity.json")


def test_the_trainer_writes_only_into_an_attempt_folder_the_local_backend_made(tmp_path):
    assert trainer_activity_file(tmp_path, 2, 1) is None
    (tmp_path / "attempts" / "2").mkdir(parents=True)
    assert trainer_activity_file(tmp_path, 2, 1) == tmp_path / "attempts" / "2" / "rank-1.activity.json"


def test_busy_from_one_thread_and_writes_from_another_add_up():
    """The server's engine thread computes while a writer thread rolls the windows: no time is lost or counted twice."""
    meter = ActivityMeter(window_s=0.05)
    fractions = []
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            time.sleep(0.01)
            fractions.append(meter.roll())

    thread = threading.Thread(target=writer)
    thread.start()
    started = time.perf_counter()
    while time.perf_counter() - started < 0.3:
        with meter.busy():
            time.sleep(0.001)
    stop.set()
    thread.join()
    fractions.append(meter.roll())
    total = sum(length for length, _ in fractions)
    busy = sum(length * fraction for length, fraction in fractions)
    assert all(0.0 <= fraction <= 1.0 for _, fraction in fractions)
    assert busy / total > 0.7, "the thread spent nearly all its time inside busy()"

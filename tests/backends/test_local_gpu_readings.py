"""GPU readings on the local backend: the simulated GPUs' measured activity, and NVML's readings.

Real supervisors, trainers and servers, started through LocalBackend as the portal's launch does: a
training attempt keeps its GPUs busy, an inference replica with no requests keeps its GPU idle, a
rank that stops writing gives no reading. NVML is exercised with a hand-written stand-in of the pynvml
functions used, since this machine has no GPU.
"""

import json
import logging
import os
import signal
import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from runners.backends.base import ReplicaPlacement, ServingSettings
from runners.backends.local import LocalBackend
from runners.backends.local_jobs import LocalJobs, nvml_readings, simulated_device
from runners.nvidia import names
from runners.workloads import activity, progress, supervise
from tests.backends.test_local_jobs import exited, make_launch, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture
def backend(tmp_path) -> LocalBackend:
    return LocalBackend(workspace_dir=tmp_path / "workspaces", use_nvml=False, jobs_dir=tmp_path / "jobs")


def log_of(backend, launch, rank=0) -> str:
    return backend.job_logs(launch.job_id, launch.attempt, rank, tail=40)


def readings_of(backend, launch) -> list:
    key = (launch.job_id, launch.attempt)
    return backend.gpu_readings({key}).get(key, [])


def group_of(backend, launch) -> int:
    return backend.jobs._supervisor(launch.job_id, launch.attempt)[1]


def recorded_attempt(jobs: LocalJobs, job_id: int, attempt: int, placement: ReplicaPlacement, *,
                     busy_fraction: float = 0.25, memory_used_mib: float = 300.0) -> None:
    """An attempt's folder as a launch leaves it, with one rank's fresh activity record, and no process."""
    attempt_dir = jobs.attempt_dir(job_id, attempt)
    attempt_dir.mkdir(parents=True)
    (attempt_dir / supervise.LAUNCH_FILE).write_text(json.dumps({
        "job_id": job_id, "attempt": attempt, "gpu_resource": names.GPU_RESOURCE,
        "replicas": [{"rank": placement.rank, "placement": asdict(placement)}],
    }))
    activity.activity_file(attempt_dir, placement.rank).write_text(json.dumps({
        "at": time.time(), "window_s": 2.0, "busy_fraction": busy_fraction, "memory_used_mib": memory_used_mib}))


# --- simulated GPUs: the workloads' own measured activity -------------------------------------------


def test_a_training_attempt_that_computes_reads_busy_on_each_gpu_it_was_placed_on(backend):
    launch = make_launch(replicas=(ReplicaPlacement(0, "sim-1", (0,)), ReplicaPlacement(1, "sim-1", (1,))))
    assert backend.gpu_readings({(5, 1)}) == {}, "nothing launched, nothing to read"
    backend.launch_job(launch)

    def busy():
        # The first window holds the rendezvous and the model's loading (idle, as on a GPU); the steps come after.
        readings = readings_of(backend, launch)
        return readings if len(readings) == 2 and all(r.gpu_util_pct > 50 for r in readings) else None

    readings = wait_until(busy, what=f"busy readings on both GPUs\n{log_of(backend, launch)}")
    assert {(r.rank, r.device) for r in readings} == {(0, "sim-1/gpu0"), (1, "sim-1/gpu1")}
    for reading in readings:
        assert reading.source == "simulated" and reading.power_w is None
        assert reading.gpu_util_pct <= 100
        assert 50 < reading.memory_used_mib < 2048, "the rank's resident memory, within its limit"
        assert time.time() - activity.STALE_AFTER_S <= reading.at <= time.time()
    assert progress.read_metrics(backend.jobs.job_dir(5)), "it ran steps"

    # Only what is asked for: an attempt never launched is left out, and another with readings not asked for too.
    recorded_attempt(backend.jobs, 6, 0, ReplicaPlacement(0, "sim-2", (3,)))
    assert set(backend.gpu_readings({(5, 1), (7, 0)})) == {(5, 1)}
    assert [r.device for r in backend.gpu_readings({(6, 0)})[(6, 0)]] == ["sim-2/gpu3"]
    assert backend.gpu_readings(set()) == {}


def test_a_rank_that_stops_writing_gives_no_reading_not_a_stale_one(backend):
    launch = make_launch(job_id=8)
    backend.launch_job(launch)

    def busy_on_file() -> bool:
        # The first file can come before the first step (start-up reads as idle), on a loaded machine most of all.
        files = list(backend.jobs.attempt_dir(8, 1).glob("rank-0.activity.json"))
        return bool(files) and json.loads(files[0].read_text()).get("busy_fraction", 0) > 0

    wait_until(lambda: readings_of(backend, launch) and busy_on_file(), what=f"a busy reading\n{log_of(backend, launch)}")

    os.killpg(group_of(backend, launch), signal.SIGSTOP)  # hung: alive, writing nothing
    try:
        wait_until(lambda: not readings_of(backend, launch), timeout=activity.STALE_AFTER_S + 10,
                   what="the reading going stale")
        (path,) = backend.jobs.attempt_dir(8, 1).glob("rank-0.activity.json")
        assert json.loads(path.read_text())["busy_fraction"] > 0, "the file is still there, only old"
        assert backend.job_status(8, 1).phase == "running"
    finally:
        os.killpg(group_of(backend, launch), signal.SIGCONT)
    backend.kill_job(8, 1)


def test_an_inference_replica_with_no_requests_reads_idle_on_its_time_slice(backend):
    # A checkpoint of the shipped trainer, trained here: three steps, then the job ends.
    training = make_launch(job_id=20, attempt=0, steps=3, checkpoint_every_steps=3)
    backend.launch_job(training)
    assert wait_until(lambda: exited(backend, training), what="the training's end") == {0: 0}, log_of(backend, training)
    (checkpoint,) = progress.read_checkpoints(backend.jobs.job_dir(20))

    serving = make_launch(
        job_id=21, attempt=0, template="serve", replicas=(ReplicaPlacement(0, "sim-3", (1,)),),
        gpu_resource=names.TIMESLICE_RESOURCE, steps=1, checkpoint_every_steps=0,
        serving=ServingSettings(endpoint_id=4, checkpoint=checkpoint["path"], source_job_id=20),
    )
    backend.launch_job(serving)
    (replica,) = json.loads((backend.jobs.attempt_dir(21, 0) / supervise.LAUNCH_FILE).read_text())["replicas"]
    assert replica["argv"][-2:] == ["--activity-file", str(activity.activity_file(backend.jobs.attempt_dir(21, 0), 0))]

    seen = {}

    def two_windows():
        for reading in readings_of(backend, serving):
            seen[reading.at] = reading
        return len(seen) >= 2

    wait_until(two_windows, timeout=120, what=f"two readings of the server\n{log_of(backend, serving)}")
    for reading in seen.values():
        assert (reading.rank, reading.device, reading.source) == (0, "sim-3/gpu1/ts", "simulated")
        assert reading.gpu_util_pct < 10, "waiting for requests is idle"
        assert reading.memory_used_mib > 50, "the engine's process holds the model"

    backend.stop_job(21, 0, grace_period_s=30)  # drains (nothing to answer) and exits 0
    assert wait_until(lambda: exited(backend, serving), what="the drain") == {0: 0}, log_of(backend, serving)


def test_simulated_devices_follow_the_placement():
    whole = ReplicaPlacement(0, "a100-1", (2,))
    mig = ReplicaPlacement(1, "a100-1", (3,), mig_profile="3g.40gb", mig_start=4)
    assert simulated_device(whole, 2, timeslice=False) == "a100-1/gpu2"
    assert simulated_device(whole, 2, timeslice=True) == "a100-1/gpu2/ts"
    assert simulated_device(mig, 3, timeslice=False) == "a100-1/gpu3/mig-3g.40gb@4"


def test_memory_is_shared_out_over_the_ranks_devices(backend):
    """A rank on two GPUs: one reading per GPU, its memory halved so that the two add up to the rank's."""
    recorded_attempt(backend.jobs, 9, 0, ReplicaPlacement(0, "h100-1", (4, 5)), busy_fraction=0.25, memory_used_mib=300)
    readings = backend.gpu_readings({(9, 0)})[(9, 0)]
    assert [(r.device, r.gpu_util_pct, r.memory_used_mib) for r in readings] == [
        ("h100-1/gpu4", 25.0, 150.0), ("h100-1/gpu5", 25.0, 150.0)]


# --- real GPUs: NVML ----------------------------------------------------------------------------------


class FakeNvml:
    """The pynvml functions nvml_readings uses, over two whole GPUs (0, 1) and one MIG-partitioned GPU (2).

    A stand-in of the third-party library, written from its documented behaviour: the real path is
    exercised only on a GPU host. GPU 1 reports no power; GPU 9 does not exist; GPU 2's MIG slot 0 is
    empty and slots 1 and 2 hold the GPU instances starting at memory slices 0 and 4.
    """

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):
        pass

    MIB = 2**20

    def nvmlDeviceGetHandleByIndex(self, index):
        if index not in (0, 1, 2):
            raise self.NVMLError("Invalid Argument")
        return ("gpu", index)

    def nvmlDeviceGetUUID(self, handle):
        if handle[0] == "mig":
            return f"MIG-{handle[1]}-{handle[2]}"
        return f"GPU-{handle[1]}".encode()  # older pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, handle):
        if handle[0] == "mig":
            raise self.NVMLError("Not Supported")
        return SimpleNamespace(gpu=40 + handle[1], memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle):
        used = 1000 * (handle[2] + 1) if handle[0] == "mig" else 2000 + handle[1]
        return SimpleNamespace(used=used * self.MIB, total=80_000 * self.MIB, free=0)

    def nvmlDeviceGetPowerUsage(self, handle):
        if handle[1] == 1:
            raise self.NVMLError("Not Supported")
        return 312_500  # milliwatts

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return 7 if handle[1] == 2 else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, slot):
        if slot not in (1, 2):
            raise self.NVMLError_NotFound("Not Found")
        return ("mig", handle[1], slot)

    def nvmlDeviceGetGpuInstanceId(self, mig):
        return {1: 3, 2: 5}[mig[2]]

    def nvmlDeviceGetGpuInstanceById(self, handle, instance_id):
        return ("gi", handle[1], instance_id)

    def nvmlGpuInstanceGetInfo(self, instance):
        start = {3: 0, 5: 4}[instance[2]]
        return SimpleNamespace(id=instance[2], profileId=0, placement=SimpleNamespace(start=start, size=4))


def test_nvml_reads_utilization_memory_and_power_of_each_whole_gpu():
    readings = nvml_readings(FakeNvml(), ReplicaPlacement(3, "gpu-host", (0, 1)))
    assert [(r.rank, r.device, r.source, r.gpu_util_pct, r.memory_used_mib, r.power_w) for r in readings] == [
        (3, "GPU-0", "nvml", 40.0, 2000.0, 312.5),
        (3, "GPU-1", "nvml", 41.0, 2001.0, None),  # a GPU that reports no power still reads
    ]
    assert all(abs(r.at - time.time()) < 5 for r in readings)


def test_nvml_reads_the_memory_of_the_mig_instance_at_the_placement_start():
    (reading,) = nvml_readings(FakeNvml(), ReplicaPlacement(0, "gpu-host", (2,), mig_profile="3g.40gb", mig_start=4))
    assert (reading.device, reading.gpu_util_pct, reading.memory_used_mib, reading.power_w) == (
        "MIG-2-2", None, 3000.0, None)
    with_none_there = ReplicaPlacement(0, "gpu-host", (2,), mig_profile="1g.10gb", mig_start=6)
    assert nvml_readings(FakeNvml(), with_none_there) == []


def test_a_gpu_nvml_fails_on_gives_no_reading_and_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="runners.backends.local_jobs"):
        readings = nvml_readings(FakeNvml(), ReplicaPlacement(1, "gpu-host", (9, 0)))
    assert [r.device for r in readings] == ["GPU-0"]
    assert "NVML could not read GPU 9 for rank 1" in caplog.text


def test_where_nvml_cannot_start_a_rank_on_a_real_node_gives_no_reading_and_is_logged(backend, caplog):
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: the case looked at here
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML starts on this machine: the no-driver case cannot be seen here")
    claimed_real = LocalJobs(jobs_dir=backend.jobs.jobs_dir, state=backend._state, real_gpu_nodes=lambda: {"gpu-host"})
    recorded_attempt(claimed_real, 3, 0, ReplicaPlacement(0, "gpu-host", (0,)))
    with caplog.at_level(logging.WARNING, logger="runners.backends.local_jobs"):
        assert claimed_real.gpu_readings({(3, 0)}) == {}, "no activity figure stands in for NVML's"
    assert "No NVML readings for rank 0 on gpu-host" in caplog.text


def test_the_trainer_looks_for_its_activity_file_in_the_local_backends_attempt_folder(backend):
    attempt_dir = backend.jobs.attempt_dir(3, 2)
    attempt_dir.mkdir(parents=True)
    assert activity.trainer_activity_file(backend.jobs.job_dir(3), 2, 1) == activity.activity_file(attempt_dir, 1)

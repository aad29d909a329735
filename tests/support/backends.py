"""Cluster backends for tests that need a cluster to misbehave, chosen through CLUSTER_BACKEND_FACTORY.

Each is the real local backend with one behaviour changed, so everything else it does is
what production does. A test picks one with ``use_backend(settings, "name")``; the class
attributes carry what the test wants to happen and what happened.
"""

from runners.backends.base import PermanentBackendError, TransientBackendError
from runners.backends.local import LocalBackend
from runners.clusters.registry import get_backend, local_backend_options
from runners.environments.models import Environment


def use_backend(settings, factory: str) -> None:
    """Make get_backend() build the named factory of this module (the settings fixture undoes it)."""
    settings.CLUSTER_BACKEND_FACTORY = f"{__name__}.{factory}"
    get_backend.cache_clear()


def _local(cls: type[LocalBackend]) -> LocalBackend:
    return cls(**local_backend_options())


class FailingBackend(LocalBackend):
    """Every provision and teardown fails with ``error``; ``calls`` counts the provisions."""

    error: Exception = TransientBackendError("connection refused")
    calls = 0

    def ensure_environment(self, spec):
        FailingBackend.calls += 1
        raise FailingBackend.error

    def delete_environment(self, spec):
        raise FailingBackend.error


def refusing_for_good() -> LocalBackend:
    FailingBackend.error = PermanentBackendError("namespace quota admission webhook denied the request")
    FailingBackend.calls = 0
    return _local(FailingBackend)


def unreachable() -> LocalBackend:
    FailingBackend.error = TransientBackendError("connection refused")
    FailingBackend.calls = 0
    return _local(FailingBackend)


class DeletedWhileBuilding(LocalBackend):
    """A user deletes the environment (and its teardown runs) while the workspace is being built."""

    def ensure_environment(self, spec):
        super().ensure_environment(spec)
        Environment.objects.filter(id=spec.environment_id).update(state="deleted")


def deleted_while_building() -> LocalBackend:
    return _local(DeletedWhileBuilding)


class SomethingHappensWhileBuilding(LocalBackend):
    """Runs ``during`` (once) right after the first apply, as if another request committed meanwhile."""

    during = None

    def ensure_environment(self, spec):
        super().ensure_environment(spec)
        during, SomethingHappensWhileBuilding.during = SomethingHappensWhileBuilding.during, None
        if during is not None:
            during()


def something_happens_while_building() -> LocalBackend:
    return _local(SomethingHappensWhileBuilding)


class QuickJobs(LocalBackend):
    """The local backend whose jobs are timers instead of trainers, for load tests of the scheduling path.

    A replica "runs" for ``steps`` x QUICK_STEP_S seconds, then exits 0; stop makes it exit 75
    and kill leaves it lost, as real processes would. Everything else (environments, inventory,
    the cluster state file) is the real local backend's, and the record lives on disk so every
    worker process sees the same jobs.
    """

    QUICK_STEP_S = 0.01

    def _record_path(self, job_id, attempt):
        return self.jobs.attempt_dir(job_id, attempt) / "quick.json"

    def _read(self, job_id, attempt):
        import json

        try:
            return json.loads(self._record_path(job_id, attempt).read_text())
        except FileNotFoundError:
            return None

    def _write(self, job_id, attempt, record):
        import json
        import os

        path = self._record_path(job_id, attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(f".{os.getpid()}.tmp")
        temp.write_text(json.dumps(record))
        os.replace(temp, path)

    def launch_job(self, launch):
        import time

        if self._read(launch.job_id, launch.attempt) is None:
            self._write(launch.job_id, launch.attempt, {
                "started": time.time(), "duration": launch.steps * self.QUICK_STEP_S,
                "ranks": [replica.rank for replica in launch.replicas], "end": None,
            })
        return None

    def job_status(self, job_id, attempt):
        import time

        from runners.backends.base import AttemptStatus

        record = self._read(job_id, attempt)
        if record is None:
            return AttemptStatus("lost", reason="never launched")
        if record["end"] == "killed":
            return AttemptStatus("lost", reason="killed")
        if record["end"] == "stopped":
            return AttemptStatus("exited", {rank: 75 for rank in record["ranks"]})
        if time.time() - record["started"] >= record["duration"]:
            return AttemptStatus("exited", {rank: 0 for rank in record["ranks"]})
        return AttemptStatus("running")

    def _end(self, job_id, attempt, how):
        record = self._read(job_id, attempt)
        if record is not None and record["end"] is None:
            record["end"] = how
            self._write(job_id, attempt, record)

    def stop_job(self, job_id, attempt, *, grace_period_s):
        self._end(job_id, attempt, "stopped")

    def kill_job(self, job_id, attempt):
        self._end(job_id, attempt, "killed")

    def forget_job(self, job_id, attempt):
        pass

    def job_logs(self, job_id, attempt, rank, *, tail):
        return ""

    def jobs_open(self, attempts):
        pass

    def job_progress(self, job_id, attempt, cursor):
        from runners.backends.base import ProgressRead

        return ProgressRead(cursor=dict(cursor))


def quick_jobs() -> LocalBackend:
    return _local(QuickJobs)


class Gated(LocalBackend):
    """The real local backend, except that a call named in ``gates`` stops until the test opens its gate.

    ``gates[name]`` is a Gate: the call sets ``reached`` and waits for ``opened``, so a test can
    hold a worker inside launch_job (say) while it runs the cycle or a cancel, then let it go on.
    Within one process only (tests that drive the services from threads).
    """

    gates: dict = {}

    def _pass(self, name):
        gate = Gated.gates.get(name)
        if gate is not None:
            gate.reached.set()
            if not gate.opened.wait(60):
                raise AssertionError(f"the test never opened the gate at {name}")

    def launch_job(self, launch):
        self._pass("launch_job")
        return super().launch_job(launch)

    def job_status(self, job_id, attempt):
        self._pass("job_status")
        return super().job_status(job_id, attempt)

    def discover_inventory(self):
        self._pass("discover_inventory")
        return super().discover_inventory()


class Gate:
    def __init__(self):
        import threading

        self.reached, self.opened = threading.Event(), threading.Event()


def gated() -> LocalBackend:
    return _local(Gated)


class Faulty(LocalBackend):
    """The real local backend, except that every call named in ``failing`` raises the error given for it."""

    failing: dict = {}

    def __getattribute__(self, name):
        error = Faulty.failing.get(name)
        if error is not None:
            def fail(*args, **kwargs):
                raise error
            return fail
        return super().__getattribute__(name)


def faulty() -> LocalBackend:
    return _local(Faulty)

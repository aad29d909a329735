"""Cluster backends for tests that need a cluster to misbehave, chosen through CLUSTER_BACKEND_FACTORY.

Each is the real local backend with one behaviour changed, so everything else it does is
what production does. A test picks one with ``use_backend(settings, "name")``; the class
attributes carry what the test wants to happen and what happened.
"""

from runners.backends.base import PermanentBackendError, TransientBackendError
from runners.backends.local import LocalBackend
from runners.models import Environment
from runners.registry import get_backend, local_backend_options


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

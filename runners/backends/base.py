"""The contract between the portal and whatever runs the work.

Backends receive plain, frozen specs built by the portal (never Django model
instances), so they can be tested without a database and can never be handed
anything a tenant typed in directly. Every method reconciles toward the desired
state: calling it twice has the same effect as calling it once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# Roles a member can hold in a tenant, from least to most privileged.
ROLES = ("viewer", "member", "admin", "owner")


class BackendError(Exception):
    """Base class for errors a backend reports to the portal."""


class TransientBackendError(BackendError):
    """The call may succeed if retried later (timeouts, 5xx, conflicts in flight)."""


class PermanentBackendError(BackendError):
    """Retrying will not help; the message says what an operator must fix."""


@dataclass(frozen=True)
class MemberBinding:
    """One portal user's access to an environment."""

    username: str
    role: str  # one of ROLES


@dataclass(frozen=True)
class EnvironmentSpec:
    """Everything a backend needs to build one tenant environment.

    ``quota_hard`` maps Kubernetes ResourceQuota keys (for example
    ``requests.nvidia.com/gpu`` or ``requests.nvidia.com/mig-1g.10gb``) to whole
    counts; a resource that is absent is not granted at all.
    """

    environment_id: int
    tenant_slug: str
    name: str
    namespace: str
    members: tuple[MemberBinding, ...] = ()
    quota_hard: dict[str, int] = field(default_factory=dict)

    def __hash__(self) -> int:  # dict fields are not hashable by default
        return hash((self.environment_id, self.namespace))


@runtime_checkable
class ClusterBackend(Protocol):
    """What the portal asks of a cluster. Later issues add jobs and inventory."""

    name: str

    def ensure_environment(self, spec: EnvironmentSpec) -> None:
        """Create or converge the environment; a no-op when it already matches."""

    def delete_environment(self, spec: EnvironmentSpec) -> None:
        """Delete the environment and return once nothing of it remains."""

    def environment_exists(self, spec: EnvironmentSpec) -> bool:
        """Whether any part of the environment still exists."""

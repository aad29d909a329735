"""Who: tenants, their members, and the environments they provision."""

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q

# A DNS-1123 label (what Kubernetes accepts as a namespace name) without "--": tenant slugs and
# environment names never hold two hyphens in a row, so "--" can join them into a namespace.
DNS_LABEL_RE = r"^[a-z0-9]+(-[a-z0-9]+)*$"
DNS_LABEL_MESSAGE = (
    "Must be a DNS-1123 label without '--': lowercase letters and digits, with single '-' between them."
)
dns_label_validator = RegexValidator(DNS_LABEL_RE, DNS_LABEL_MESSAGE)
TENANT_SLUG_MAX = 30
ENVIRONMENT_NAME_MAX = 32
NAMESPACE_MAX = 63
NAMESPACE_SEPARATOR = "--"


def environment_namespace(tenant_slug: str, name: str) -> str:
    """The namespace of a tenant's environment: unique by construction.

    Neither part may hold "--" nor start or end with "-", so the one "--" in the
    result says where the slug ends: no two (tenant, name) pairs share a
    namespace, whatever either tenant names things.
    """
    return f"{tenant_slug}{NAMESPACE_SEPARATOR}{name}"


class Tenant(models.Model):
    slug = models.CharField(max_length=TENANT_SLUG_MAX, unique=True, validators=[dns_label_validator])
    name = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    VIEWER = "viewer"
    MEMBER = "member"
    ADMIN = "admin"
    OWNER = "owner"


# Roles from least to most privileged: each holds every right of those before it.
ROLE_RANK = {role: rank for rank, role in enumerate(Role.values)}


def role_at_least(role: str | None, at_least: str) -> bool:
    """Whether a role (None for no membership) holds the rights of `at_least`: the one rank rule."""
    return role is not None and ROLE_RANK[role] >= ROLE_RANK[at_least]


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="one_membership_per_user_and_tenant")]
        ordering = ["tenant__slug", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} as {self.role}"

    def has_role(self, at_least: str) -> bool:
        return role_at_least(self.role, at_least)


class EnvironmentState(models.TextChoices):
    REQUESTED = "requested"
    PROVISIONING = "provisioning"
    READY = "ready"
    DELETING = "deleting"
    DELETED = "deleted"
    FAILED = "failed"


LIVE_STATES = [s for s in EnvironmentState.values if s != EnvironmentState.DELETED]


class Environment(models.Model):
    """A tenant's isolated slice of the cluster: a namespace (or workspace) with its quota."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="environments")
    name = models.CharField(max_length=ENVIRONMENT_NAME_MAX, validators=[dns_label_validator])
    namespace = models.CharField(max_length=63)
    backend = models.CharField(max_length=20)
    state = models.CharField(max_length=20, choices=EnvironmentState.choices, default=EnvironmentState.REQUESTED)
    status_message = models.CharField(max_length=500, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="environments_created"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    # Touched by every state change; the sweep uses it to find lost messages.
    state_changed_at = models.DateTimeField(auto_now_add=True)
    # How many times a worker started provisioning or teardown; redeliveries show here.
    task_runs = models.PositiveIntegerField(default=0)
    # Re-syncs (members or quota changed) coalesce: each change bumps sync_generation, at most
    # one sync message is pending (sync_pending), and the sync that holds the lease applies the
    # newest state until synced_generation catches up. See tenants.services.environments_resync.
    sync_generation = models.PositiveBigIntegerField(default=0)
    synced_generation = models.PositiveBigIntegerField(default=0)
    sync_pending = models.BooleanField(default=False)
    sync_requested_at = models.DateTimeField(null=True, blank=True)
    sync_lease_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["tenant__slug", "name"]
        constraints = [
            # Deleted environments keep their row for history; a live name is unique per tenant.
            models.UniqueConstraint(
                fields=["tenant", "name"], condition=~Q(state="deleted"), name="unique_live_environment_name"
            ),
            models.UniqueConstraint(
                fields=["namespace"], condition=~Q(state="deleted"), name="unique_live_environment_namespace"
            ),
        ]
        indexes = [models.Index(fields=["state", "state_changed_at"], name="environment_state_age")]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"

    @property
    def is_transitional(self) -> bool:
        return self.state in (EnvironmentState.REQUESTED, EnvironmentState.PROVISIONING, EnvironmentState.DELETING)

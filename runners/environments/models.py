"""Environments: a tenant's isolated slice of the cluster (a namespace, or a workspace locally)."""

from django.conf import settings
from django.db import models
from django.db.models import Q

from tenants.models import ENVIRONMENT_NAME_MAX, dns_label_validator


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

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="environments")
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
    # newest state until synced_generation catches up. See runners.environments.services.environments_resync.
    sync_generation = models.PositiveBigIntegerField(default=0)
    synced_generation = models.PositiveBigIntegerField(default=0)
    sync_pending = models.BooleanField(default=False)
    sync_requested_at = models.DateTimeField(null=True, blank=True)
    sync_lease_until = models.DateTimeField(null=True, blank=True)
    # When teardown was first asked for; a namespace Terminating much longer than
    # KUBERNETES_NAMESPACE_DELETE_TIMEOUT_S is reported on the environment as stuck.
    delete_requested_at = models.DateTimeField(null=True, blank=True)
    # The image a workspace of this environment runs on Kubernetes (from ALLOWED_IMAGE_REGISTRIES, holding
    # JupyterLab and the portal's runners/workloads/workspace.py); "": the portal's own (KUBERNETES_TRAINER_IMAGE).
    # The local backend always runs the portal's own JupyterLab in its sandbox.
    workspace_image = models.CharField(max_length=255, blank=True)

    class Meta:
        db_table = "runners_environment"  # the table kept its name when the model moved here
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

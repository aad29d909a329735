"""Interactive workspaces: a member's JupyterLab in one of the tenant's environments, on a flavor.

A workspace is the fourth kind of work beside training jobs, endpoints' replicas and trials: each start
queues a job of kind "workspace" (``Workspace.job``), so the scheduler cycle admits, places, counts and
preempts it like any other, and the ledger meters it. Its home folder outlives every start; its server
answers only through the portal's edge (runners/edge/), which adds ``key`` after its own sign-in check.
"""

import secrets

from django.conf import settings
from django.db import models

from runners.environments.models import Environment
from runners.jobs.models import Job
from tenants.models import dns_label_validator


class WorkspaceState(models.TextChoices):
    STOPPED = "stopped"  # no job: its home folder waits for the next start
    QUEUED = "queued"  # its job waits for the cycle (quota, capacity)
    STARTING = "starting"  # its job runs; JupyterLab has not answered yet
    READY = "ready"  # JupyterLab answers through the edge
    STOPPING = "stopping"  # told to stop (by its owner, the idle cull or a preemption): the job ends
    FAILED = "failed"  # its last job failed; a start tries again


def new_key() -> str:
    return secrets.token_hex(32)


class Workspace(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="workspaces")
    environment = models.ForeignKey(Environment, on_delete=models.PROTECT, related_name="workspaces")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="workspaces")
    name = models.CharField(max_length=40, validators=[dns_label_validator])
    flavor = models.ForeignKey("quotas.ResourceFlavor", on_delete=models.PROTECT, related_name="workspaces")
    gpus = models.PositiveSmallIntegerField(default=1)
    cpu_milli = models.PositiveIntegerField(default=2000)
    memory_mib = models.PositiveIntegerField(default=8192)
    # Members of the tenant may open it too (the owner's choice); everyone else gets a 404.
    shared = models.BooleanField(default=False)
    # Stopped after this many minutes with no activity; null: WORKSPACE_IDLE_MINUTES.
    idle_minutes = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=20, choices=WorkspaceState.choices, default=WorkspaceState.STOPPED)
    reason = models.CharField(max_length=1000, blank=True)
    # The job of the current (or last) start; a start queues a new one.
    job = models.OneToOneField(Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="workspace")
    # What the edge adds to every request it passes (JupyterLab answers nothing else); new at every start.
    key = models.CharField(max_length=64, default=new_key)
    # Where its server answers while ready: unix:/path (local backend) or http://host:port (Kubernetes).
    address = models.CharField(max_length=300, blank=True)
    # The latest activity JupyterLab reported (requests, kernels' and terminals' traffic), and the latest
    # time a kernel was seen busy: the idle clock runs from the later of the two.
    last_activity_at = models.DateTimeField(null=True, blank=True)
    busy_seen_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    # The last time its JupyterLab answered the pass: a ready workspace is taken out of the edge's table only once
    # it has not answered for WORKSPACE_UNANSWERED_S (a server busy a moment is not a server gone).
    answered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="workspace_unique_name")]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}#{self.id}"

    @property
    def base_url(self) -> str:
        return f"/workspaces/{self.id}/"

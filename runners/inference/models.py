"""Inference endpoints: what a team serves, its replicas (each one a job of kind "serving"), scale events and samples."""

from django.conf import settings
from django.db import models

from runners.environments.models import Environment
from runners.jobs.models import Job
from tenants.models import dns_label_validator


class EndpointState(models.TextChoices):
    DEPLOYING = "deploying"  # no replica has been ready yet
    READY = "ready"  # as many replicas ready as wanted (zero, when scaled to zero)
    SCALING = "scaling"  # replicas starting or draining on the way to the wanted number, or a rollout
    DRAINING = "draining"  # stopped by its owner: replicas answer what they admitted, then end
    STOPPED = "stopped"
    FAILED = "failed"  # its replicas cannot start (their jobs failed past their retries)


ENDPOINT_LIVE_STATES = [EndpointState.DEPLOYING, EndpointState.READY, EndpointState.SCALING, EndpointState.FAILED]


class InferenceEndpoint(models.Model):
    """A served model: the spec as validated, how many replicas the autoscaler wants, and where it stands.

    Its replicas are jobs of kind "serving" (``Replica``), so the scheduler cycle admits, places,
    preempts and counts them in fair share exactly as it does training gangs. The reconcile
    (``runners.inference.reconcile``) reads the replicas' metrics, scales, rolls out and drains.
    """

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="endpoints")
    environment = models.ForeignKey(Environment, on_delete=models.PROTECT, related_name="endpoints")
    name = models.CharField(max_length=40, validators=[dns_label_validator])
    # The request as validated: {"job": id, "step": n} (a checkpoint of one of the tenant's own jobs)
    # or {"image": "..."} (Kubernetes only), and the serving settings; with a foreign engine ("engine": "vllm",
    # "tgi", "sglang"; Kubernetes only), its "image", "max_model_len", "dtype" and {"path": ...} as its source.
    spec = models.JSONField()
    # Where the checkpoint being served lies (its record's uri) and its step; a rollout changes both
    # and bumps the generation, and replicas of an older generation are replaced one at a time.
    # The model version it serves (its weights are the version's own copy in the store), null for an image or a
    # checkpoint the portal cannot copy (Kubernetes). The job and step it came from are kept while the job exists.
    model_version = models.ForeignKey("registry.ModelVersion", null=True, blank=True, on_delete=models.PROTECT,
                                      related_name="endpoints")
    source_job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    checkpoint_uri = models.CharField(max_length=1000, blank=True)
    checkpoint_step = models.PositiveIntegerField(null=True, blank=True)
    generation = models.PositiveIntegerField(default=1)
    flavor = models.ForeignKey("quotas.ResourceFlavor", on_delete=models.PROTECT, related_name="endpoints")
    gpus_per_replica = models.PositiveSmallIntegerField()
    min_replicas = models.PositiveSmallIntegerField()
    max_replicas = models.PositiveSmallIntegerField()
    warm_replicas = models.PositiveSmallIntegerField(default=0)
    # What the autoscaler wants now, between min_replicas and max_replicas (0 once stopped).
    desired_replicas = models.PositiveSmallIntegerField(default=0)
    state = models.CharField(max_length=20, choices=EndpointState.choices, default=EndpointState.DEPLOYING)
    reason = models.CharField(max_length=1000, blank=True)
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    # Written by the router (at most every few seconds): when the last request came, for scale-to-zero.
    last_request_at = models.DateTimeField(null=True, blank=True)
    # The autoscaler's memory between passes: since when the load has been high or low, the last change.
    autoscale_state = models.JSONField(default=dict, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name"], condition=~models.Q(state="stopped"), name="unique_live_endpoint_name"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"


class Replica(models.Model):
    """One replica of an endpoint: its slot (below min_replicas it is not preemptible), generation and job."""

    endpoint = models.ForeignKey(InferenceEndpoint, on_delete=models.CASCADE, related_name="replicas")
    job = models.OneToOneField(Job, on_delete=models.CASCADE, related_name="serving_replica")
    slot = models.PositiveSmallIntegerField()
    generation = models.PositiveIntegerField()
    # The model version this replica serves (its endpoint's when it started): a rollout moves between versions.
    model_version = models.ForeignKey("registry.ModelVersion", null=True, blank=True, on_delete=models.PROTECT,
                                      related_name="replicas")
    # Where its server answers, and whether /readyz said so at the reconcile's last look.
    address = models.CharField(max_length=200, blank=True)
    ready = models.BooleanField(default=False)
    ready_since = models.DateTimeField(null=True, blank=True)
    # Told to drain and stop (scale-in, rollout, stop); never counted as wanted again.
    retiring = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["endpoint_id", "slot", "id"]


class ScaleEvent(models.Model):
    """One change of an endpoint's wanted replicas (or a rollout step), with its reason: nothing scales unrecorded."""

    endpoint = models.ForeignKey(InferenceEndpoint, on_delete=models.CASCADE, related_name="scale_events")
    at = models.DateTimeField(auto_now_add=True)
    from_replicas = models.PositiveSmallIntegerField()
    to_replicas = models.PositiveSmallIntegerField()
    reason = models.CharField(max_length=1000)

    class Meta:
        ordering = ["endpoint_id", "-at", "-id"]


class EndpointSample(models.Model):
    """What the endpoint's ready replicas reported at one reconcile pass, summed: the page's charts."""

    endpoint = models.ForeignKey(InferenceEndpoint, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField()
    ready_replicas = models.PositiveSmallIntegerField()
    queue_depth = models.PositiveIntegerField()
    running = models.PositiveIntegerField()
    # Over the interval since the previous sample.
    requests_per_s = models.FloatField()
    shed_per_s = models.FloatField()
    expired_per_s = models.FloatField()
    p50_ms = models.FloatField(null=True)
    p99_ms = models.FloatField(null=True)
    # A foreign engine's KV-cache use (0..1), the mean over the ready replicas; null for the shipped server.
    kv_cache_use = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["endpoint_id", "at"]
        indexes = [models.Index(fields=["endpoint", "at"], name="endpoint_sample_at")]

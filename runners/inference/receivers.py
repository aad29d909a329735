"""Inference's answers to what the apps below ask (connected in InferenceConfig.ready()).

- the registry, before a model version is deleted: which endpoints still serve it (the version they serve now,
  or a replica of theirs not yet ended that runs it, as an old generation does during a rollout);
- the jobs app, while an inference replica's launch is built: the URL its pod fetches the model version's
  weights from, signed for that attempt (``runners.registry.fetch_view``).
"""

from django.dispatch import receiver

from runners.inference.models import ENDPOINT_LIVE_STATES, InferenceEndpoint, Replica
from runners.jobs.models import JOB_FINAL_STATES
from runners.jobs.signals import serving_weights_url
from runners.registry.fetch_view import signed_weights_url
from runners.registry.signals import version_in_use


@receiver(version_in_use, dispatch_uid="inference-version-in-use")
def _version_in_use(sender, *, version, **kwargs) -> list[str]:
    serving = set(InferenceEndpoint.objects.filter(model_version=version, state__in=ENDPOINT_LIVE_STATES)
                  .values_list("name", flat=True))
    running = set(Replica.objects.filter(model_version=version).exclude(job__state__in=JOB_FINAL_STATES)
                  .values_list("endpoint__name", flat=True))
    return [f"endpoint {name}" for name in sorted(serving | running)]


@receiver(serving_weights_url, dispatch_uid="inference-serving-weights-url")
def _serving_weights_url(sender, *, job, attempt, **kwargs) -> str:
    replica = Replica.objects.select_related("model_version").filter(job_id=job.id).first()
    if replica is None or replica.model_version is None:
        return ""
    return signed_weights_url(replica.model_version, job_id=job.id, attempt=attempt.number, since=attempt.admitted_at)

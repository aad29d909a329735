"""Jobs' answers to what the apps below ask (connected in JobsConfig.ready()).

The inventory, environments and bundles never import jobs: a partition change asks which work sits
on its nodes and has it stopped there; an environment being deleted has its jobs cancelled, and its
teardown asks whether any attempt still runs; a bundle's delete asks which jobs still run it.
"""

from django.dispatch import receiver

from runners.bundles.signals import bundle_in_use
from runners.clusters.signals import nodes_draining, placed_on_nodes
from runners.environments.signals import environment_deleting, environment_work_left
from runners.jobs.attempts import jobs_preempt_on_nodes
from runners.jobs.models import JobAttempt
from runners.jobs.selectors import jobs_placed_on_nodes
from runners.jobs.services import jobs_cancel_in_environment, jobs_using_bundle


@receiver(placed_on_nodes, dispatch_uid="jobs-placed-on-nodes")
def _placed_on_nodes(sender, *, nodes, **kwargs) -> dict[str, list[str]]:
    return jobs_placed_on_nodes(nodes)


@receiver(nodes_draining, dispatch_uid="jobs-preempted-on-drained-nodes")
def _nodes_draining(sender, *, nodes, reason, **kwargs) -> set[str]:
    return jobs_preempt_on_nodes(nodes, reason=reason)


@receiver(environment_deleting, dispatch_uid="jobs-cancelled-with-their-environment")
def _environment_deleting(sender, *, environment, reason, actor=None, **kwargs) -> None:
    jobs_cancel_in_environment(environment, reason, actor=actor)


@receiver(environment_work_left, dispatch_uid="jobs-attempts-left-in-environment")
def _environment_work_left(sender, *, environment_id, **kwargs) -> str | None:
    running = JobAttempt.objects.open().filter(job__environment_id=environment_id).count()
    return f"{running} job attempt(s)" if running else None


@receiver(bundle_in_use, dispatch_uid="jobs-running-a-bundle")
def _bundle_in_use(sender, *, bundle, **kwargs) -> list[str]:
    return [f"job {job.name} #{job.id} ({job.state})" for job in jobs_using_bundle(bundle)]

"""Celery task of the model registry: the weights sweep."""

from celery import shared_task

from runners.registry import services


@shared_task(name="runners.registry.tasks.model_weights_sweep")
def model_weights_sweep(*_args) -> dict:
    return services.weights_sweep()

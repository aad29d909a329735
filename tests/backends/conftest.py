"""A Kubernetes API stand-in per test, and a backend pointed at it."""

import pytest

from runners.backends.base import EnvironmentSpec
from runners.backends.kubernetes import KubernetesBackend
from runners.clusters.registry import kubernetes_backend_options
from tests.support.k8s import client_for, make_spec
from tests.support.k8s_standin import KubernetesStandIn


@pytest.fixture
def spec() -> EnvironmentSpec:
    return make_spec()


@pytest.fixture
def standin():
    with KubernetesStandIn(termination_delay_s=0.2) as api:
        yield api




@pytest.fixture
def make_backend(standin):
    """A backend for the stand-in (or the API at `url`); keyword arguments override the constructor's."""

    def make(url: str | None = None, **overrides) -> KubernetesBackend:
        options = kubernetes_backend_options() | dict(
            field_manager="gpu-portal",
            username_template="oidc:{username}",
            request_timeout_s=5,
        )
        options.update(overrides)
        return KubernetesBackend(client_for(url or standin.url), **options)

    return make


@pytest.fixture
def backend(make_backend) -> KubernetesBackend:
    return make_backend()

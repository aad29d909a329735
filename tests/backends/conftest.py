"""A Kubernetes API stand-in per test, and a backend pointed at it."""

import pytest
from kubernetes import client

from runners.backends.base import EnvironmentSpec, MemberBinding
from runners.backends.kubernetes import KubernetesBackend
from tests.backends.k8s_standin import KubernetesStandIn


def make_spec(**overrides) -> EnvironmentSpec:
    """An environment with an owner, a member and a viewer, and two GPUs."""
    values = dict(
        environment_id=7,
        tenant_slug="acme",
        name="Vision research",
        namespace="acme-vision",
        members=(MemberBinding("olivia", "owner"), MemberBinding("tom", "member"), MemberBinding("vera", "viewer")),
        quota_hard={"requests.nvidia.com/gpu": 2},
    )
    values.update(overrides)
    return EnvironmentSpec(**values)


@pytest.fixture
def spec() -> EnvironmentSpec:
    return make_spec()


@pytest.fixture
def standin():
    with KubernetesStandIn(termination_delay_s=0.2) as api:
        yield api


def client_for(url: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = url
    return client.ApiClient(configuration)


@pytest.fixture
def make_backend(standin):
    """A backend for the stand-in; keyword arguments override the constructor's."""

    def make(**overrides) -> KubernetesBackend:
        options = dict(
            field_manager="gpu-portal",
            username_template="oidc:{username}",
            delete_timeout_s=5,
            poll_interval_s=0.02,
            request_timeout_s=5,
        )
        options.update(overrides)
        return KubernetesBackend(client_for(standin.url), **options)

    return make


@pytest.fixture
def backend(make_backend) -> KubernetesBackend:
    return make_backend()

"""A Kubernetes API stand-in per test, and a backend pointed at it; or a real cluster, for `real_cluster` tests.

Tests marked `real_cluster` run against the cluster the KUBECONFIG environment variable names
(its current context), a kind or k3s cluster the tests may create and delete namespaces on; they
are skipped, saying why, when KUBECONFIG is unset or its cluster does not answer.
"""

import functools
import os

import pytest

from runners.backends.base import EnvironmentSpec
from runners.backends.kubernetes import KubernetesBackend
from runners.clusters.registry import kubernetes_backend_options
from tests.support.k8s import client_for, deploy_rbac, make_spec
from tests.support.k8s_standin import KubernetesStandIn

# The portal's own tokens: the one make_backend sends, and the one of test_from_settings_reads_the_kubeconfig.
PORTAL_TOKENS = {"standin-token", "not-a-secret"}


@pytest.fixture
def spec() -> EnvironmentSpec:
    return make_spec()


@pytest.fixture
def standin():
    # The portal's token may do only what deploy/'s RBAC grants it, so a verb missing there fails here.
    # Watches held 0.1 s, not the second the backend asks for, to keep these tests quick. Every answer
    # the backend gets is checked against the Kubernetes schema.
    with KubernetesStandIn(termination_delay_s=0.2, admin_tokens=PORTAL_TOKENS, portal_rbac=deploy_rbac(),
                           watch_hold_s=0.1, check_answers=True) as api:
        yield api
        assert api.invalid_answers == []




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
        return KubernetesBackend(client_for(url or standin.url, token="standin-token"), **options)

    return make


@pytest.fixture
def backend(make_backend) -> KubernetesBackend:
    return make_backend()


@functools.cache
def _real_cluster_unavailable() -> str | None:
    """Why there is no real cluster to run against (None: KUBECONFIG names one that answers)."""
    path = os.environ.get("KUBECONFIG")
    if not path:
        return "KUBECONFIG is not set: point it at a kind or k3s cluster to run the real_cluster tests"
    from kubernetes import client, config

    try:
        api_client = config.new_client_from_config(config_file=path)
        version = client.VersionApi(api_client).get_code(_request_timeout=5)
    except Exception as exc:  # noqa: BLE001 - any failure means: no cluster to test against
        return f"the cluster in KUBECONFIG={path} does not answer: {exc.__class__.__name__}: {exc}"[:300]
    if "standin" in (version.git_version or ""):
        return f"KUBECONFIG={path} points at the API stand-in, not a real cluster"
    return None


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("real_cluster") is not None:
        why = _real_cluster_unavailable()
        if why:
            pytest.skip(f"real_cluster: {why}")


@pytest.fixture
def real_backend() -> KubernetesBackend:
    """A backend for the real cluster KUBECONFIG names (the real_cluster tests only)."""
    options = kubernetes_backend_options() | dict(field_manager="gpu-portal-tests", request_timeout_s=15)
    return KubernetesBackend.from_kubeconfig(in_cluster=False, kubeconfig=os.environ["KUBECONFIG"], **options)

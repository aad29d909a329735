"""Connecting to an environment in the browser: a member downloads the kubeconfig, and the real kubectl uses it."""

import pytest
import yaml

from tests.frontend.conftest import log_in, snap
from tests.support.jobs import ready_environment
from tests.support.k8s import kubectl, portal_on_standin, portal_pod

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def cluster(settings, tmp_path):
    with portal_on_standin(settings, tmp_path) as api:
        yield api


def test_a_member_downloads_a_kubeconfig_and_kubectl_lists_the_namespace(
    page, live_server, cluster, owner, teammate, tenant, outsider, other_tenant, tmp_path, screenshot_dir
):
    environment = ready_environment(actor=owner, tenant=tenant)
    elsewhere = ready_environment(actor=outsider, tenant=other_tenant, name="vision")
    cluster.put(portal_pod("trainer-0", "gpu-1", namespace=environment.namespace))
    cluster.put(portal_pod("not-yours", "gpu-1", namespace=elsewhere.namespace))

    log_in(page, live_server, "tom")
    page.goto(f"{live_server.url}/environments/{environment.id}/")
    connect = page.get_by_test_id("environment-connect")
    expect(connect).to_contain_text("Its token lives 60 minutes")
    expect(connect.get_by_test_id("kubectl-snippet")).to_contain_text(
        f"kubectl --kubeconfig kubeconfig-{environment.namespace}.yaml get pods")
    expect(connect.get_by_test_id("api-snippet")).to_contain_text(f'"environment":{environment.id}')
    snap(page, screenshot_dir / "environment-connect.png")

    with page.expect_download() as download_info:
        connect.get_by_role("link", name="Download kubeconfig").click()
    download = download_info.value
    assert download.suggested_filename == f"kubeconfig-{environment.namespace}.yaml"
    kubeconfig = tmp_path / download.suggested_filename
    download.save_as(kubeconfig)
    assert yaml.safe_load(kubeconfig.read_text())["contexts"][0]["context"]["namespace"] == environment.namespace

    listed = kubectl(kubeconfig, "get", "pods", home=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "trainer-0" in listed.stdout and "not-yours" not in listed.stdout
    refused = kubectl(kubeconfig, "get", "pods", "-n", elsewhere.namespace, home=tmp_path)
    assert refused.returncode != 0 and "Forbidden" in refused.stderr

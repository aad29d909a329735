"""The environment page: how to connect when it is ready, its jobs, the tenant's quota, its history, and gone once deleted."""

import pytest
from django.utils import timezone

from runners.environments import services as environments
from runners.environments.models import Environment
from tests.support.jobs import give_quota, job_data
from tests.support.k8s import portal_on_standin

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]


def page_of(client, user, environment):
    client.force_login(user)
    return client.get(f"/environments/{environment.id}/")


def test_a_ready_local_environment_shows_its_workspace_jobs_quota_and_history(
    client, client_for, owner, tenant, acme_env, flavors, settings
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    job = client_for(owner).post("/api/v1/jobs/", job_data(acme_env, name="tiny-lm"), format="json")
    assert job.status_code == 201, job.content
    response = page_of(client, owner, acme_env)
    assert response.status_code == 200
    html = response.content.decode()
    assert f'data-testid="workspace-path">{settings.LOCAL_WORKSPACE_DIR / acme_env.namespace}<' in html
    assert 'data-testid="kubeconfig-download"' not in html
    assert f'"environment":{acme_env.id}' in html and '"flavor":"h100-80gb"' in html  # a submit that works here
    assert f'href="/jobs/{job.json()["id"]}/">tiny-lm</a>' in html
    assert "<td>h100-80gb</td><td>2</td><td>4</td>" in html
    assert "<strong>Created</strong> — by olivia" in html and "<strong>Ready</strong>" in html


def test_a_failed_environment_says_why_and_offers_no_connection(client, owner, tenant):
    environment = Environment.objects.create(tenant=tenant, name="broken", namespace="acme--broken", backend="kubernetes",
                                             state="failed", status_message="Namespace acme--broken already exists.")
    html = page_of(client, owner, environment).content.decode()
    assert "<strong>Failed</strong> — Namespace acme--broken already exists." in html
    assert 'data-testid="environment-connect"' not in html


def test_a_deleted_environment_page_says_it_is_gone(client, owner, tenant):
    environment = environments.environment_request(actor=owner, tenant=tenant, name="old")
    Environment.objects.filter(id=environment.id).update(state="deleted", delete_requested_at=timezone.now(),
                                                         status_message="Deleted.")
    response = page_of(client, owner, environment)
    assert response.status_code == 410
    html = response.content.decode()
    assert 'data-testid="environment-gone"' in html and "This environment is gone" in html
    assert "<strong>Delete requested</strong>" in html and "<strong>Deleted</strong>" in html
    assert 'data-testid="environment-connect"' not in html


def test_another_tenants_environment_page_is_404(client, outsider, owner, tenant):
    environment = environments.environment_request(actor=owner, tenant=tenant, name="train")
    assert page_of(client, outsider, environment).status_code == 404


def test_on_kubernetes_members_get_the_download_and_staff_outside_do_not(
    client, owner, viewer, staff, tenant, settings, tmp_path
):
    with portal_on_standin(settings, tmp_path):
        environment = environments.environment_request(actor=owner, tenant=tenant, name="train")
        assert environments.environment_provision_run(environment_id=environment.id) == "ready"
        html = page_of(client, viewer, environment).content.decode()
        assert f'href="/api/v1/environments/{environment.id}/kubeconfig/"' in html
        assert "with your viewer rights there (read-only)" in html
        assert f"kubectl --kubeconfig kubeconfig-{environment.namespace}.yaml get pods" in html
        html = page_of(client, staff, environment).content.decode()
        assert 'data-testid="kubeconfig-download"' not in html
        assert "Kubeconfigs are for members of Acme ML" in html


def test_a_staff_member_reads_their_memberships_real_role(client, owner, staff, tenant, settings, tmp_path):
    """Staff count as owners for what the page offers, but a kubeconfig carries their membership's role."""
    from tenants.models import Membership

    Membership.objects.create(tenant=tenant, user=staff, role="viewer")
    with portal_on_standin(settings, tmp_path):
        environment = environments.environment_request(actor=owner, tenant=tenant, name="train")
        assert environments.environment_provision_run(environment_id=environment.id) == "ready"
        html = page_of(client, staff, environment).content.decode()
        assert "with your viewer rights there (read-only)" in html
        assert "with your owner rights" not in html

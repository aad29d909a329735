"""GET /api/v1/environments/{id}/kubeconfig/: a member's own kubeconfig, used with the real kubectl, and revoked."""

import base64
import time
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from django.db import connection, transaction
from django.utils import timezone

from runners.backends import k8s_access
from runners.clusters.registry import get_backend
from runners.environments import services as environments
from runners.environments.models import Environment
from tenants.models import Membership, Tenant
from tenants.services import membership_remove
from tests.support.jobs import ready_environment
from tests.support.k8s import kubectl, portal_kubeconfig, portal_on_standin, portal_pod
from tests.support.races import InThread
from tests.support.worker import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]

UNAUTHORIZED = "You must be logged in to the server"


@pytest.fixture
def cluster(settings, tmp_path):
    with portal_on_standin(settings, tmp_path) as api:
        yield api


@pytest.fixture
def environment(cluster, owner, tenant):
    environment = ready_environment(actor=owner, tenant=tenant)
    cluster.put(portal_pod("trainer-0", "gpu-1", namespace=environment.namespace))
    return environment


@pytest.fixture
def elsewhere(cluster, outsider, other_tenant):
    """Another tenant's environment on the same cluster, with a pod of its own."""
    environment = ready_environment(actor=outsider, tenant=other_tenant, name="vision")
    cluster.put(portal_pod("secret-work", "gpu-1", namespace=environment.namespace))
    return environment


def save_kubeconfig(response, tmp_path, name="kubeconfig.yaml"):
    path = tmp_path / name
    path.write_bytes(response.content)
    return path


def test_a_member_gets_a_kubeconfig_that_opens_their_namespace_only(
    client_for, teammate, environment, elsewhere, cluster, tmp_path, settings
):
    before = datetime.now(UTC)
    response = client_for(teammate).get(f"/api/v1/environments/{environment.id}/kubeconfig/")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("application/yaml")
    assert response["Content-Disposition"] == f'attachment; filename="kubeconfig-{environment.namespace}.yaml"'
    assert response["Cache-Control"] == "no-store"
    expires = datetime.fromisoformat(response["X-Token-Expires-At"])
    ttl = timedelta(seconds=settings.KUBECONFIG_TOKEN_TTL_S)
    assert before + ttl - timedelta(seconds=5) <= expires <= datetime.now(UTC) + ttl + timedelta(seconds=1)
    config = yaml.safe_load(response.content)
    assert config["contexts"][0]["context"]["namespace"] == environment.namespace
    assert config["clusters"][0]["cluster"]["server"] == cluster.url

    kubeconfig = save_kubeconfig(response, tmp_path)
    listed = kubectl(kubeconfig, "get", "pods", home=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "trainer-0" in listed.stdout and "secret-work" not in listed.stdout
    refused = kubectl(kubeconfig, "get", "pods", "-n", elsewhere.namespace, home=tmp_path)
    assert refused.returncode != 0 and "Forbidden" in refused.stderr


def test_asking_for_yaml_gets_the_kubeconfig_and_errors_stay_json(client_for, teammate, environment, tenant):
    client = client_for(teammate)
    response = client.get(f"/api/v1/environments/{environment.id}/kubeconfig/", HTTP_ACCEPT="application/yaml")
    assert response.status_code == 200 and yaml.safe_load(response.content)["kind"] == "Config"
    local = Environment.objects.create(tenant=tenant, name="laptop", namespace="acme--laptop", backend="local",
                                       state="ready")
    response = client.get(f"/api/v1/environments/{local.id}/kubeconfig/", HTTP_ACCEPT="application/yaml")
    assert response.status_code == 409 and response["Content-Type"] == "application/json"


def test_a_viewer_gets_read_only_rights(client_for, viewer, environment, cluster, tmp_path):
    response = client_for(viewer).get(f"/api/v1/environments/{environment.id}/kubeconfig/")
    assert response.status_code == 200
    binding = cluster.get("rolebindings", k8s_access.role_binding_name("vera", environment.namespace, "viewer"),
                          environment.namespace)
    assert binding["roleRef"]["name"] == "portal-viewer"
    kubeconfig = save_kubeconfig(response, tmp_path)
    assert kubectl(kubeconfig, "get", "pods", home=tmp_path).returncode == 0
    deleting = kubectl(kubeconfig, "delete", "pod", "trainer-0", "--wait=false", home=tmp_path)
    assert deleting.returncode != 0 and "Forbidden" in deleting.stderr


def test_another_tenants_environment_is_404_and_staff_outside_the_tenant_403(
    client_for, outsider, staff, environment, cluster
):
    cluster.clear_log()
    assert client_for(outsider).get(f"/api/v1/environments/{environment.id}/kubeconfig/").status_code == 404
    response = client_for(staff).get(f"/api/v1/environments/{environment.id}/kubeconfig/")
    assert response.status_code == 403
    assert response.json()["detail"] == "A kubeconfig is for members of acme; you are not one."
    assert cluster.writes() == []  # nothing was made for either


def test_a_local_environment_has_no_kubeconfig(client_for, owner, tenant):
    local = ready_environment(actor=owner, tenant=tenant, name="laptop")
    assert local.backend == "local"
    response = client_for(owner).get(f"/api/v1/environments/{local.id}/kubeconfig/")
    assert response.status_code == 409
    assert response.json()["detail"].startswith(
        f"Environment {local.id} runs on the local backend; it has no kubeconfig")


@pytest.mark.parametrize("state", ["requested", "provisioning", "failed", "deleting"])
def test_an_environment_not_ready_says_its_state(client_for, owner, tenant, cluster, state):
    environment = Environment.objects.create(tenant=tenant, name="soon", namespace="acme--soon", backend="kubernetes",
                                             state=state)
    response = client_for(owner).get(f"/api/v1/environments/{environment.id}/kubeconfig/")
    assert response.status_code == 409
    assert response.json()["detail"] == (f"Environment {environment.id} is {state}; a kubeconfig is available once it "
                                         "is ready.")


def test_a_deleted_environment_is_gone(client_for, owner, tenant):
    environment = Environment.objects.create(tenant=tenant, name="old", namespace="acme--old", backend="kubernetes",
                                             state="deleted", state_changed_at=timezone.now())
    client = client_for(owner)
    for method, url in (("get", f"/api/v1/environments/{environment.id}/kubeconfig/"),
                        ("get", f"/api/v1/environments/{environment.id}/"),
                        ("delete", f"/api/v1/environments/{environment.id}/")):
        response = getattr(client, method)(url)
        assert response.status_code == 410, (method, url)
        assert response.json()["detail"].startswith(f"Environment {environment.id} (old) was deleted on ")
    assert client.get("/api/v1/environments/?state=deleted").json()["count"] == 1  # still listed when asked for


def test_an_unreachable_cluster_is_a_quick_503_naming_it(client_for, teammate, environment, cluster, settings):
    settings.KUBECONFIG_REQUEST_TIMEOUT_S = 2
    url = cluster.url
    cluster.stop()
    get_backend.cache_clear()  # a fresh process: no pooled connection to the stopped server
    started = time.monotonic()
    response = client_for(teammate).get(f"/api/v1/environments/{environment.id}/kubeconfig/")
    assert response.status_code == 503
    assert f"The Kubernetes cluster at {url} cannot be reached now" in response.json()["detail"]
    assert time.monotonic() - started < 15


@pytest.mark.django_db(transaction=True)
def test_the_cluster_is_asked_outside_any_transaction(client_for, teammate, environment, tenant, cluster):
    """While the TokenRequest hangs, no transaction of the request is open and its rows are free to lock."""
    cluster.inject(201, method="POST", path_contains="/token", delay_s=2)  # a slow but successful answer
    asking = InThread(client_for(teammate).get, path=f"/api/v1/environments/{environment.id}/kubeconfig/")
    wait_for(lambda: any(r.path.endswith("/token") for r in cluster.requests), message="the TokenRequest")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND state LIKE 'idle in transaction%%' AND pid <> pg_backend_pid()")
        assert cursor.fetchone()[0] == 0
    with transaction.atomic():
        Tenant.objects.select_for_update(nowait=True).get(id=tenant.id)
        Environment.objects.select_for_update(nowait=True).get(id=environment.id)
        Membership.objects.select_for_update(nowait=True).get(tenant=tenant, user=teammate)
    assert asking.outcome().status_code == 200


def test_a_role_change_rebinds_at_the_next_resync(client_for, teammate, environment, tenant, cluster, tmp_path):
    kubeconfig = save_kubeconfig(client_for(teammate).get(f"/api/v1/environments/{environment.id}/kubeconfig/"),
                                 tmp_path)
    assert kubectl(kubeconfig, "delete", "pod", "trainer-0", "--wait=false", home=tmp_path).returncode == 0
    cluster.put(portal_pod("trainer-1", "gpu-1", namespace=environment.namespace))
    Membership.objects.filter(tenant=tenant, user=teammate).update(role="viewer")
    environments.environments_resync(tenant)
    assert environments.environment_sync_run(environment_id=environment.id)

    names = {name for plural, ns, name in cluster.objects() if plural == "rolebindings" and ns == environment.namespace}
    assert k8s_access.role_binding_name("tom", environment.namespace, "viewer") in names
    assert k8s_access.role_binding_name("tom", environment.namespace, "member") not in names
    assert kubectl(kubeconfig, "get", "pods", home=tmp_path).returncode == 0  # the same token, now read-only
    refused = kubectl(kubeconfig, "delete", "pod", "trainer-1", "--wait=false", home=tmp_path)
    assert refused.returncode != 0 and "Forbidden" in refused.stderr


def test_removing_a_member_revokes_in_every_environment_of_the_tenant(
    client_for, owner, teammate, viewer, environment, tenant, cluster, tmp_path, django_capture_on_commit_callbacks
):
    second = ready_environment(actor=owner, tenant=tenant, name="eval")
    toms = [save_kubeconfig(client_for(teammate).get(f"/api/v1/environments/{env.id}/kubeconfig/"), tmp_path,
                            f"tom-{env.id}.yaml") for env in (environment, second)]
    veras = save_kubeconfig(client_for(viewer).get(f"/api/v1/environments/{environment.id}/kubeconfig/"), tmp_path)

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        membership_remove(actor=owner, tenant=tenant, username="tom")
    assert callbacks, "the revoke (and the re-sync) wait for the commit"
    assert environments.environment_access_revoke_run(tenant_id=tenant.id, username="tom") == sorted(
        [environment.id, second.id])

    for kubeconfig in toms:
        refused = kubectl(kubeconfig, "get", "pods", home=tmp_path)
        assert refused.returncode != 0 and UNAUTHORIZED in refused.stderr
    assert kubectl(veras, "get", "pods", home=tmp_path).returncode == 0
    toms_accounts = {k8s_access.service_account_name("tom", env.namespace) for env in (environment, second)}
    assert not any(name.startswith(tuple(toms_accounts)) for _p, _ns, name in cluster.objects())


def test_a_revoke_for_someone_still_a_member_does_nothing(owner, teammate, environment, tenant):
    assert environments.environment_access_revoke_run(tenant_id=tenant.id, username="tom") == []


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_revokes_after_the_member_is_removed(
    cluster, celery_worker, client_for, owner, teammate, tenant, tmp_path, settings
):
    client = client_for(owner)
    environment_id = client.post("/api/v1/environments/", {"tenant": "acme", "name": "train"}).json()["id"]
    wait_for(lambda: Environment.objects.get(id=environment_id).state == "ready", message="the environment to be ready")
    namespace = Environment.objects.get(id=environment_id).namespace
    cluster.put(portal_pod("trainer-0", "gpu-1", namespace=namespace))
    kubeconfig = save_kubeconfig(client_for(teammate).get(f"/api/v1/environments/{environment_id}/kubeconfig/"),
                                 tmp_path)
    assert kubectl(kubeconfig, "get", "pods", home=tmp_path).returncode == 0

    assert client.delete("/api/v1/tenants/acme/members/tom/").status_code == 204
    account = k8s_access.service_account_name("tom", namespace)
    accounts_namespace = settings.KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE
    assert cluster.get("serviceaccounts", account, accounts_namespace) is not None
    wait_for(lambda: cluster.get("serviceaccounts", account, accounts_namespace) is None, message="the revoke to run")
    refused = kubectl(kubeconfig, "get", "pods", home=tmp_path)
    assert refused.returncode != 0 and UNAUTHORIZED in refused.stderr
    assert "runners.tasks.environment_access_revoke" in celery_worker.output()


# --- Fixes: removal mid-download, deleted or deactivated users, the server and CA, refusals --------


@pytest.mark.django_db(transaction=True)
def test_a_member_removed_while_the_token_is_minted_gets_404_and_no_access(
    client_for, owner, teammate, environment, tenant, cluster, settings
):
    cluster.inject(201, method="POST", path_contains="/token", delay_s=2)  # a slow but successful answer
    asking = InThread(client_for(teammate).get, path=f"/api/v1/environments/{environment.id}/kubeconfig/")
    wait_for(lambda: any(r.path.endswith("/token") for r in cluster.requests), message="the TokenRequest")
    Membership.objects.filter(tenant=tenant, user=teammate).delete()  # the revoke it queues may run before the mint
    assert asking.outcome().status_code == 404
    account = k8s_access.service_account_name("tom", environment.namespace)
    assert cluster.get("serviceaccounts", account, settings.KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE) is None


@pytest.mark.parametrize("how", ["deactivated", "deleted"])
def test_a_user_deactivated_or_deleted_loses_their_kubeconfig(
    client_for, teammate, environment, tenant, cluster, tmp_path, django_capture_on_commit_callbacks, how
):
    kubeconfig = save_kubeconfig(client_for(teammate).get(f"/api/v1/environments/{environment.id}/kubeconfig/"),
                                 tmp_path)
    assert kubectl(kubeconfig, "get", "pods", home=tmp_path).returncode == 0
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        with transaction.atomic():
            if how == "deleted":
                teammate.delete()
            else:
                teammate.is_active = False
                teammate.save()
    assert callbacks, "the revoke (and the re-sync) wait for the commit"
    assert environments.environment_access_revoke_run(tenant_id=tenant.id, username="tom") == [environment.id]
    refused = kubectl(kubeconfig, "get", "pods", home=tmp_path)
    assert refused.returncode != 0 and UNAUTHORIZED in refused.stderr
    assert "tom" not in {m.username for m in environments.environment_spec(environment).members}


def test_a_login_does_not_resync(teammate, environment, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        teammate.last_login = timezone.now()
        teammate.save(update_fields=["last_login"])
        teammate.save()  # a save that leaves is_active as it was
    assert callbacks == []


def test_the_kubeconfig_names_the_configured_server_and_ca(client_for, teammate, environment, settings, tmp_path):
    ca = tmp_path / "public-ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    settings.KUBECONFIG_SERVER_URL, settings.KUBECONFIG_CA_FILE = "https://k8s.example.com:6443", str(ca)
    get_backend.cache_clear()
    response = client_for(teammate).get(f"/api/v1/environments/{environment.id}/kubeconfig/")
    assert response.status_code == 200, response.content
    entry = yaml.safe_load(response.content)["clusters"][0]["cluster"]
    assert entry["server"] == "https://k8s.example.com:6443"
    assert base64.b64decode(entry["certificate-authority-data"]) == ca.read_bytes()


def test_no_kubeconfig_is_handed_out_without_tls_verification(client_for, teammate, environment, cluster, settings,
                                                               tmp_path):
    insecure = yaml.safe_load(portal_kubeconfig(cluster))
    insecure["clusters"][0]["cluster"] = {"server": cluster.url, "insecure-skip-tls-verify": True}
    path = tmp_path / "insecure-kubeconfig"
    path.write_text(yaml.safe_dump(insecure))
    settings.KUBECONFIG = str(path)
    get_backend.cache_clear()
    response = client_for(teammate).get(f"/api/v1/environments/{environment.id}/kubeconfig/")
    assert response.status_code == 409
    assert "KUBECONFIG_CA_FILE" in response.json()["detail"]
    assert cluster.tokens == {}


def test_a_service_account_held_by_another_user_is_a_409(client_for, teammate, environment, cluster, settings):
    namespace = settings.KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE
    cluster.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    cluster.put({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
        "name": k8s_access.service_account_name("tom", environment.namespace), "namespace": namespace,
        "annotations": {k8s_access.USERNAME_ANNOTATION: "eve"}}})
    response = client_for(teammate).get(f"/api/v1/environments/{environment.id}/kubeconfig/")
    assert response.status_code == 409
    assert "already exists for eve, not tom" in response.json()["detail"]
    assert cluster.tokens == {}


def test_a_refused_token_request_is_a_502_naming_the_cluster_and_logged(
    client_for, teammate, environment, cluster, caplog
):
    cluster.inject(403, method="POST", path_contains="/token")
    response = client_for(teammate).get(f"/api/v1/environments/{environment.id}/kubeconfig/")
    assert response.status_code == 502
    assert f"The Kubernetes cluster at {cluster.url} refused" in response.json()["detail"]
    assert any("refused by the cluster" in record.getMessage() for record in caplog.records)

"""A model version's life after promotion: its weights fetched by a replica's pod through a URL signed for its
attempt and version (checked bytes only; forged, expired or deleted is refused), promotion from the checkpoint
store (a checkpoint on a Kubernetes claim not yet durable is a 409), a delete refused while an endpoint serves the
version, and the sweep of weights no kept version names."""

import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.core import signing
from django.test import Client
from django.utils import timezone

from runners.clusters.registry import get_backend
from runners.inference import reconcile as endpoint_reconcile
from runners.inference.models import InferenceEndpoint
from runners.jobs import attempts, checkpoint_store
from runners.jobs.models import Job, JobAttempt
from runners.registry import services
from runners.registry.fetch_view import SALT, signed_weights_url
from runners.registry.models import ModelVersion
from runners.registry.services import weights_store
from runners.scheduling import services as scheduling
from tests.support.endpoints import trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment
from tests.support.k8s import portal_kubeconfig
from tests.support.k8s_standin import KubernetesStandIn

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]


@pytest.fixture
def world(settings, tmp_path, tenant, other_tenant, owner):
    settings.DATA_STORAGE_URL = f"file://{tmp_path / 'store'}"
    settings.PORTAL_PUBLIC_URL = "https://portal.example.com"
    get_backend.cache_clear()
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = trained_job(actor=owner, environment=environment, step=10)
    yield {"environment": environment, "job": job}
    get_backend.cache_clear()


@contextmanager
def on_kubernetes(settings, folder):
    """CLUSTER_BACKEND=kubernetes against the API server stand-in (in this process, plain HTTP)."""
    with KubernetesStandIn(admin_tokens={"standin-token"}) as api:
        kubeconfig = folder / "kubeconfig"
        kubeconfig.write_text(portal_kubeconfig(api))
        settings.CLUSTER_BACKEND = "kubernetes"
        settings.KUBECONFIG = str(kubeconfig)
        get_backend.cache_clear()
        try:
            yield api
        finally:
            settings.CLUSTER_BACKEND = "local"
            get_backend.cache_clear()


def promote(client, **body):
    answer = client.post("/api/v1/tenants/acme/models/", body, format="json")
    return answer.status_code, answer.json()


def deploy(client, environment, name="chat", source=None):
    answer = client.post("/api/v1/endpoints/", {
        "tenant": "acme", "environment": environment.id, "name": name, "source": source or {"model": "chars"},
        "flavor": "h100-80gb", "min_replicas": 1, "max_replicas": 1}, format="json")
    assert answer.status_code == 201, answer.json()
    return InferenceEndpoint.objects.get(id=answer.json()["id"])


def fetch_path(url: str) -> str:
    return url.removeprefix("https://portal.example.com")


# --- The signed weights URL ---------------------------------------------------------------------


def test_a_replicas_launch_carries_a_url_signed_for_its_attempt_that_serves_the_checked_weights(
        world, client_for, owner):
    client = client_for(owner)
    assert promote(client, name="chars", job=world["job"].id)[0] == 201
    endpoint = deploy(client, world["environment"])
    endpoint_reconcile.endpoints_reconcile_run()
    scheduling.cycle_run()
    attempt = JobAttempt.objects.open().get(job__kind=Job.Kind.SERVING)
    launch = attempts.job_launch_spec(Job.objects.get(id=attempt.job_id), attempt)
    weights = launch.serving.weights
    version = endpoint.model_version
    assert (weights.sha256, weights.bytes) == (version.weights_sha256, version.weights_bytes)
    assert weights.fetch_url.startswith("https://portal.example.com/models/fetch/")
    # The same attempt gets the same URL, so a launch applied again leaves the pod's spec as it was.
    assert attempts.job_launch_spec(Job.objects.get(id=attempt.job_id), attempt).serving.weights.fetch_url == \
        weights.fetch_url
    answer = Client().get(fetch_path(weights.fetch_url))  # the pod holds no credentials of the portal's
    assert answer.status_code == 200
    assert b"".join(answer.streaming_content) == weights_store().read(version.weights_sha256)


def test_a_forged_expired_or_deleted_versions_url_is_refused_and_bad_stored_bytes_are_never_served(
        world, client_for, owner):
    anonymous = Client()
    status, body = promote(client_for(owner), name="chars", job=world["job"].id)
    version = ModelVersion.objects.get(id=body["id"])
    url = fetch_path(signed_weights_url(version, job_id=7, attempt=1, since=timezone.now()))
    assert anonymous.get(url).status_code == 200
    # Forged: a token naming another version's weights, signed with another key, or edited.
    forged = signing.Signer(key="not-the-portals", salt=SALT).sign_object(
        {"version": version.id, "sha256": version.weights_sha256, "job": 7, "attempt": 1,
         "until": int(time.time()) + 600})
    assert anonymous.get(f"/models/fetch/{forged}/").status_code == 404
    assert anonymous.get(url.replace("/fetch/", "/fetch/x")).status_code == 404
    other = signing.Signer(salt=SALT).sign_object(
        {"version": version.id, "sha256": "0" * 64, "job": 7, "attempt": 1, "until": int(time.time()) + 600})
    assert anonymous.get(f"/models/fetch/{other}/").status_code == 404
    # Expired: signed for an attempt admitted long ago.
    old = fetch_path(signed_weights_url(version, job_id=7, attempt=1, since=timezone.now() - timezone.timedelta(days=2)))
    expired = anonymous.get(old)
    assert expired.status_code == 410 and b"expired" in expired.content
    # Bytes in the store that are not the version's are never sent.
    path = Path(weights_store().path(version.weights_sha256))
    original = path.read_bytes()
    path.write_bytes(b"not the weights")
    assert anonymous.get(url).status_code == 404
    path.write_bytes(original)
    # Deleted: the version's URL reads as not found.
    services.model_version_delete(actor=owner, tenant=version.tenant, name="chars", version=1)
    assert anonymous.get(url).status_code == 404


# --- Promotion through the checkpoint store -----------------------------------------------------


def test_a_durable_checkpoint_is_promoted_from_the_store_once_its_file_is_gone(world, client_for, owner):
    job = world["job"]
    checkpoint = job.checkpoints.get()
    original = (get_backend().jobs.job_dir(job.id) / checkpoint.uri).read_bytes()
    job.checkpoints.update(store_state="pending")
    checkpoint_store.checkpoint_store_run(checkpoint.id)
    checkpoint.refresh_from_db()
    assert checkpoint.store_state == "durable", checkpoint.store_reason
    (get_backend().jobs.job_dir(job.id) / checkpoint.uri).unlink()
    job.checkpoints.update(deleted_at=timezone.now())
    status, body = promote(client_for(owner), name="chars", job=job.id, step=10)
    assert status == 201, body
    assert body["weights"]["format"] == "file"
    assert weights_store().read(body["weights"]["sha256"]) == original


def test_on_kubernetes_a_checkpoint_is_promoted_once_durable_and_a_409_says_it_is_not_yet(
        world, client_for, owner, settings, tmp_path):
    job = world["job"]
    checkpoint = job.checkpoints.get()
    job.checkpoints.update(store_state="pending")
    checkpoint_store.checkpoint_store_run(checkpoint.id)  # stored while the file was readable here
    other = trained_job(actor=owner, environment=world["environment"], name="later", seed=1, step=20)
    other.checkpoints.update(store_state="storing")
    client = client_for(owner)
    with on_kubernetes(settings, tmp_path):  # the claim's files are the cluster's: the portal reads none
        status, body = promote(client, name="chars", job=other.id, step=20)
        assert status == 409, body
        assert "not yet durable in the checkpoint store" in body["detail"] and "storing" in body["detail"]
        status, body = promote(client, name="chars", job=job.id, step=10)
    assert status == 201, body
    assert body["weights"]["sha256"] == checkpoint_store.chunks.Manifest.from_json(
        job.checkpoints.get().manifest).sha256


def test_on_kubernetes_an_endpoint_serves_a_model_version(world, client_for, owner, settings):
    assert promote(client_for(owner), name="chars", job=world["job"].id)[0] == 201
    settings.CLUSTER_BACKEND = "kubernetes"
    get_backend.cache_clear()
    endpoint = deploy(client_for(owner), world["environment"])
    assert endpoint.model_version.version == 1


# --- Delete and sweep ---------------------------------------------------------------------------


def test_a_version_an_endpoint_serves_cannot_be_deleted_and_one_no_endpoint_serves_can(
        world, client_for, owner, teammate, outsider):
    client = client_for(owner)
    job = world["job"]
    assert promote(client, name="chars", job=job.id)[0] == 201
    other = trained_job(actor=owner, environment=world["environment"], name="other", seed=1, step=20)
    assert promote(client, name="chars", job=other.id)[0] == 201
    deploy(client, world["environment"], source={"model": "chars", "version": 1})
    refused = client.delete("/api/v1/tenants/acme/models/chars/versions/1/")
    assert refused.status_code == 409 and "endpoint chat" in refused.json()["detail"]
    assert client_for(teammate).delete("/api/v1/tenants/acme/models/chars/versions/2/").status_code == 403
    assert client_for(outsider).delete("/api/v1/tenants/acme/models/chars/versions/2/").status_code == 404
    assert client.delete("/api/v1/tenants/acme/models/chars/versions/2/").status_code == 204
    gone = client.get("/api/v1/tenants/acme/models/chars/versions/2/")
    assert gone.status_code == 404 and "was deleted" in gone.json()["detail"]
    assert [v["version"] for v in client.get("/api/v1/tenants/acme/models/chars/").json()["versions"]] == [1]
    # Its number is never given again.
    status, again = promote(client, name="chars", job=other.id)
    assert status == 201 and again["version"] == 3


def test_the_sweep_removes_weights_only_no_kept_version_names(world, client_for, owner):
    client = client_for(owner)
    job = world["job"]
    _, first = promote(client, name="chars", job=job.id)
    _, twin = promote(client, name="twin", job=job.id)  # the same bytes, another model: one blob
    other = trained_job(actor=owner, environment=world["environment"], name="other", seed=1, step=20)
    _, second = promote(client, name="chars", job=other.id)
    shared, alone = first["weights"]["sha256"], second["weights"]["sha256"]
    assert twin["weights"]["sha256"] == shared
    store = weights_store()
    store.put_bytes(b"left by a promotion that never wrote its row")
    assert services.weights_sweep()["deleted"] == 1  # the orphan only
    services.model_version_delete(actor=owner, tenant=job.tenant, name="chars", version=1)
    services.model_version_delete(actor=owner, tenant=job.tenant, name="chars", version=2)
    swept = services.weights_sweep()
    assert swept["deleted"] == 1 and swept["deleted_bytes"] == second["weights"]["bytes"]
    assert store.exists(shared) and not store.exists(alone)  # twin v1 still names the shared blob
    assert client.get("/api/v1/tenants/acme/models/twin/versions/1/").status_code == 200

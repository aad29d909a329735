"""The model registry's API: a checkpoint promoted to an immutable version with its weights copied into the store
and its lineage; versions numbered per model; tenants apart (404); a name or version that does not exist is a 404
naming the field, in the registry and in an endpoint's source."""

import pytest
from django.utils import timezone

from runners.clusters.registry import get_backend
from runners.inference.models import InferenceEndpoint
from runners.jobs.models import JobMetric
from runners.registry.models import ModelVersion
from runners.registry.services import weights_store
from runners.storage.blobs import sha256_file
from tests.support.endpoints import trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def world(settings, tmp_path, tenant, other_tenant, owner, outsider):
    settings.DATA_STORAGE_URL = f"file://{tmp_path / 'store'}"
    get_backend.cache_clear()
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = trained_job(actor=owner, environment=environment, step=10)
    JobMetric.objects.create(job=job, attempt=1, step=9, loss=2.5, samples_per_s=100.0, at="t")
    JobMetric.objects.create(job=job, attempt=1, step=10, loss=2.25, samples_per_s=120.0, at="t")
    return {"environment": environment, "job": job}


def promote(client, slug="acme", **body):
    answer = client.post(f"/api/v1/tenants/{slug}/models/", body, format="json")
    return answer.status_code, answer.json()


def test_a_checkpoint_is_promoted_with_its_weights_copied_and_its_lineage(world, client_for, owner):
    job = world["job"]
    status, body = promote(client_for(owner), name="chars", job=job.id, step=10)
    assert status == 201, body
    assert (body["name"], body["version"], body["step"], body["template"]) == ("chars", 1, 10, "pytorch-ddp")
    checkpoint = get_backend().jobs.job_dir(job.id) / job.checkpoints.get().uri
    sha256, size = sha256_file(checkpoint)
    assert body["weights"] == {"sha256": sha256, "bytes": size, "format": "file"}
    assert weights_store().read(sha256) == checkpoint.read_bytes()  # the version's own copy, checked
    lineage = body["lineage"]
    assert lineage["job"] == {"id": job.id, "name": job.name, "template": "pytorch-ddp", "environment": "train"}
    assert lineage["metrics"] == {"step": 10, "loss": 2.25, "samples_per_s": 120.0}
    assert lineage["hyperparameters"] == job.spec.get("hyperparameters", {}) and lineage["bundle"] is None
    assert lineage["datasets"] == [] and body["job"] == {"id": job.id, "name": job.name, "exists": True}


def test_the_same_checkpoint_again_is_the_same_version_and_another_is_the_next(world, client_for, owner):
    client, job = client_for(owner), world["job"]
    assert promote(client, name="chars", job=job.id)[0] == 201  # its newest checkpoint
    status, again = promote(client, name="chars", job=job.id, step=10)
    assert status == 200 and again["version"] == 1
    other = trained_job(actor=owner, environment=world["environment"], name="other", seed=1, step=20)
    status, second = promote(client, name="chars", job=other.id)
    assert status == 201 and (second["version"], second["step"]) == (2, 20)
    listed = client.get("/api/v1/tenants/acme/models/").json()["results"]
    assert [(m["name"], m["versions"], m["newest"]) for m in listed] == [("chars", 2, 2)]
    model = client.get("/api/v1/tenants/acme/models/chars/").json()
    assert [v["version"] for v in model["versions"]] == [2, 1]


def test_a_version_is_immutable_and_outlives_its_jobs_checkpoints_and_the_job(world, client_for, owner):
    client, job = client_for(owner), world["job"]
    status, body = promote(client, name="chars", job=job.id)
    version = ModelVersion.objects.get(id=body["id"])
    version.step = 99
    with pytest.raises(ValueError, match="immutable"):
        version.save()
    # The checkpoints collected (file gone, marked deleted), then the job deleted.
    checkpoint = job.checkpoints.get()
    (get_backend().jobs.job_dir(job.id) / checkpoint.uri).unlink()
    job.checkpoints.update(deleted_at=timezone.now())
    job.delete()
    kept = client.get("/api/v1/tenants/acme/models/chars/versions/1/").json()
    assert kept["job"] == {"id": body["job"]["id"], "name": job.name, "exists": False}
    assert kept["lineage"] == body["lineage"] and kept["weights"] == body["weights"]
    assert weights_store().exists(body["weights"]["sha256"])


def test_bad_input_names_the_field(world, client_for, owner):
    client, job = client_for(owner), world["job"]
    assert promote(client, name="Not A Name", job=job.id)[1].keys() == {"name"}
    assert promote(client, name="chars", job=job.id, step=11)[1].keys() == {"step"}
    assert promote(client, name="chars", job=999999)[1].keys() == {"job"}
    assert promote(client, name="chars", job=job.id, extra=1)[1].keys() == {"extra"}
    assert not ModelVersion.objects.exists()
    promote(client, name="chars", job=job.id)
    answer = client.get("/api/v1/tenants/acme/models/nope/")
    assert answer.status_code == 404 and answer.json()["detail"].startswith("model:")
    answer = client.get("/api/v1/tenants/acme/models/chars/versions/7/")
    assert answer.status_code == 404 and answer.json()["detail"].startswith("version:")


def test_an_endpoint_source_naming_a_model_or_version_that_does_not_exist_is_a_404_naming_it(
        world, client_for, owner):
    client = client_for(owner)
    promote(client, name="chars", job=world["job"].id)
    body = {"tenant": "acme", "environment": world["environment"].id, "name": "chat", "flavor": "h100-80gb",
            "min_replicas": 1, "max_replicas": 1}
    for source, field in (({"model": "nope"}, "source.model:"), ({"model": "chars", "version": 3}, "source.version:")):
        answer = client.post("/api/v1/endpoints/", {**body, "source": source}, format="json")
        assert answer.status_code == 404 and answer.json()["detail"].startswith(field), answer.json()
    assert not InferenceEndpoint.objects.exists()
    answer = client.post("/api/v1/endpoints/", {**body, "source": {"model": "chars"}}, format="json")
    assert answer.status_code == 201, answer.json()
    assert answer.json()["model"] == {"name": "chars", "version": 1}


def test_viewers_read_members_promote_and_other_tenants_get_404(world, client_for, owner, viewer, outsider):
    job = world["job"]
    assert promote(client_for(viewer), name="chars", job=job.id)[0] == 403
    assert promote(client_for(owner), name="chars", job=job.id)[0] == 201
    assert client_for(viewer).get("/api/v1/tenants/acme/models/chars/versions/1/").status_code == 200
    for path in ("/api/v1/tenants/acme/models/", "/api/v1/tenants/acme/models/chars/",
                 "/api/v1/tenants/acme/models/chars/versions/1/"):
        assert client_for(outsider).get(path).status_code == 404, path
    assert promote(client_for(outsider), name="chars", job=job.id)[0] == 404
    # Another tenant's job is no job of this tenant's: named, nothing promoted.
    assert promote(client_for(outsider), slug="globex", name="chars", job=job.id)[1].keys() == {"job"}


def test_the_pages_list_models_and_show_a_versions_lineage_to_members_only(world, client_for, owner, outsider):
    job = world["job"]
    promote(client_for(owner), name="chars", job=job.id)
    client = client_for(owner)
    client.force_login(owner)
    listed = client.get("/tenants/acme/models/")
    assert listed.status_code == 200 and b'data-model="chars"' in listed.content
    page = client.get("/tenants/acme/models/chars/v1/")
    assert page.status_code == 200
    assert job.name.encode() in page.content and b"loss 2.2500" in page.content
    assert client.get("/tenants/acme/models/chars/v2/").status_code == 404
    stranger = client_for(outsider)
    stranger.force_login(outsider)
    assert stranger.get("/tenants/acme/models/").status_code == 404
    assert stranger.get("/tenants/acme/models/chars/v1/").status_code == 404

"""An endpoint that runs a foreign engine (vLLM, TGI, SGLang) through the API: what is recorded, what its replicas'
jobs get, the rollout to another image, and every bad field a 400 naming it."""

import pytest

from runners.backends.base import ServingSettings
from runners.inference.models import InferenceEndpoint
from runners.inference.services import replica_job_spec
from runners.jobs.attempts import _serving_settings
from runners.jobs.models import Job
from runners.registry.models import ModelVersion, WeightsFormat
from tests.support.endpoints import trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

VLLM_IMAGE = "nvcr.io/nvidia/vllm-openai:v0.8.5"


@pytest.fixture
def world(settings, tenant, other_tenant, owner, outsider):
    settings.PREEMPTION_GRACE_PERIOD_S = 30
    settings.ALLOWED_IMAGE_REGISTRIES = ["nvcr.io/nvidia"]
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    settings.CLUSTER_BACKEND = "kubernetes"  # foreign engines run there only (a deploy calls no cluster)
    return {"environment": environment}


def data(world, **overrides) -> dict:
    body = {"tenant": "acme", "environment": world["environment"].id, "name": "llama", "engine": "vllm",
            "image": VLLM_IMAGE, "source": {"path": "/models/llama-3-8b"}, "max_model_len": 8192,
            "dtype": "bfloat16", "flavor": "h100-80gb", "gpus_per_replica": 2, "min_replicas": 1, "max_replicas": 2}
    body.update(overrides)
    return {key: value for key, value in body.items() if value is not ...}


def post(client, body):
    answer = client.post("/api/v1/endpoints/", body, format="json")
    return answer.status_code, answer.json()


def test_a_vllm_endpoint_is_recorded_and_its_replicas_run_the_engine_with_its_settings(world, client_for, owner,
                                                                                        outsider):
    status, body = post(client_for(owner), data(world))
    assert status == 201, body
    spec = body["spec"]
    assert (spec["engine"], spec["image"], spec["max_model_len"], spec["dtype"]) == ("vllm", VLLM_IMAGE, 8192,
                                                                                   "bfloat16")
    assert body["source"] == {"path": "/models/llama-3-8b"} and body["model"] is None
    # The shipped server's own settings are none of the engine's.
    assert not {"queue_limit", "batch_token_budget", "max_batch_wait_ms"} & set(spec)
    endpoint = InferenceEndpoint.objects.get(id=body["id"])
    job = replica_job_spec(endpoint, 0)
    assert job["image"] == VLLM_IMAGE and job["command"] is None
    assert (job["cpu_milli_per_replica"], job["memory_mib_per_replica"]) == (8000, 65536)  # two GPUs' worth
    serving = ServingSettings(**job["serving"])
    assert (serving.engine, serving.model, serving.served_name, serving.image) == (
        "vllm", "/models/llama-3-8b", "llama", VLLM_IMAGE)
    assert (serving.max_model_len, serving.dtype, serving.weights, serving.source_job_id) == (8192, "bfloat16", None,
                                                                                              None)
    assert client_for(outsider).get(f"/api/v1/endpoints/{endpoint.id}/").status_code == 404


def test_the_launch_of_a_replica_carries_the_engine(world, client_for, owner):
    """What the backend is handed: the job's spec read back as the attempt's ServingSettings."""
    status, body = post(client_for(owner), data(world, engine="sglang", image="nvcr.io/nvidia/sglang:v0.4.6",
                                                dtype="auto", max_model_len=...))
    assert status == 201, body
    endpoint = InferenceEndpoint.objects.get(id=body["id"])
    job = Job(spec=replica_job_spec(endpoint, 0))
    serving = _serving_settings(job, attempt=None)
    assert (serving.engine, serving.max_model_len, serving.dtype) == ("sglang", None, "auto")


@pytest.mark.parametrize("overrides, field", [
    ({"engine": "triton"}, "engine"),
    ({"image": ...}, "image"),
    ({"image": "docker.io/vllm/vllm-openai:latest"}, "image"),  # not an allowed registry
    ({"image": "nvcr.io/nvidia/vllm openai"}, "image"),
    ({"engine": "tgi", "image": "nvcr.io/nvidia/tgi:3", "dtype": "float32"}, "dtype"),  # TGI has no float32
    ({"dtype": "int3"}, "dtype"),
    ({"max_model_len": 5}, "max_model_len"),
    ({"max_model_len": "long"}, "max_model_len"),
    ({"source": {"path": "../../etc/passwd"}}, "source.path"),
    ({"source": {"path": "/models/llama; rm -rf /"}}, "source.path"),
    ({"source": {"job": 3}}, "source"),  # a job's checkpoint: the shipped server's
    ({"source": {"path": "/models/x", "job": 3}}, "source"),
    ({"queue_limit": 64}, "queue_limit"),  # the shipped server's setting
    ({"engine": "shipped", "dtype": "float16", "image": ..., "max_model_len": ...}, "dtype"),
    ({"engine": "shipped", "source": {"path": "/models/x"}, "image": ..., "dtype": ..., "max_model_len": ...},
     "source.path"),
])
def test_bad_engine_fields_are_a_400_naming_the_field(world, client_for, owner, overrides, field):
    status, body = post(client_for(owner), data(world, **overrides))
    assert status == 400 and field in body, body
    assert not InferenceEndpoint.objects.exists()


def test_a_foreign_engine_on_the_local_backend_is_a_400_naming_engine(world, client_for, owner, settings):
    settings.CLUSTER_BACKEND = "local"
    status, body = post(client_for(owner), data(world))
    assert status == 400 and "engine" in body and "Kubernetes" in body["engine"][0], body


def test_a_rollout_moves_to_another_image_and_model_and_checks_both(world, client_for, owner, outsider):
    client = client_for(owner)
    status, body = post(client, data(world))
    assert status == 201, body
    url = f"/api/v1/endpoints/{body['id']}/rollout/"
    bad = client.post(url, {"source": {"path": "/models/x"}, "image": "evil.example/vllm:1"}, format="json")
    assert bad.status_code == 400 and "image" in bad.json()
    bad = client.post(url, {"source": {"job": 3}}, format="json")
    assert bad.status_code == 400 and "source" in bad.json()
    assert client_for(outsider).post(url, {"source": {"path": "/models/x"}}, format="json").status_code == 404
    answer = client.post(url, {"source": {"path": "/models/llama-3.1-8b"}, "image": "nvcr.io/nvidia/vllm-openai:v0.9"},
                         format="json")
    assert answer.status_code == 202, answer.json()
    endpoint = InferenceEndpoint.objects.get(id=body["id"])
    assert endpoint.generation == 2
    assert (endpoint.spec["image"], endpoint.spec["source"]) == ("nvcr.io/nvidia/vllm-openai:v0.9",
                                                                 {"path": "/models/llama-3.1-8b"})
    assert "/models/llama-3.1-8b on vllm" in endpoint.scale_events.first().reason
    job = replica_job_spec(endpoint, 0)
    assert job["name"] == "llama-g2-r0" and job["serving"]["model"] == "/models/llama-3.1-8b"


def test_a_shipped_endpoints_rollout_takes_no_image(world, client_for, owner, settings):
    settings.CLUSTER_BACKEND = "local"
    trained = trained_job(actor=owner, environment=world["environment"])
    client = client_for(owner)
    status, body = post(client, data(world, engine=..., image=..., max_model_len=..., dtype=..., gpus_per_replica=1,
                                     source={"job": trained.id}))
    assert status == 201, body
    assert body["spec"]["engine"] == "shipped" and body["spec"]["queue_limit"] == ServingSettings.queue_limit
    answer = client.post(f"/api/v1/endpoints/{body['id']}/rollout/",
                         {"source": {"job": trained.id}, "image": VLLM_IMAGE}, format="json")
    assert answer.status_code == 400 and "image" in answer.json()


def _version(tenant, name, fmt, version=1):
    return ModelVersion.objects.create(tenant=tenant, name=name, version=version, weights_sha256="cd" * 32,
                                       weights_bytes=5 << 30, weights_format=fmt, step=100, template="script")


def test_an_engine_serves_a_model_versions_folder_and_refuses_a_single_checkpoint_file(world, client_for, owner,
                                                                                       tenant, other_tenant):
    folder = _version(tenant, "llama", WeightsFormat.TAR_GZ)
    _version(tenant, "chars", WeightsFormat.FILE)
    _version(other_tenant, "theirs", WeightsFormat.TAR_GZ)
    client = client_for(owner)
    status, body = post(client, data(world, source={"model": "chars"}))
    assert status == 400 and "source" in body and "one checkpoint file" in body["source"][0], body
    status, body = post(client, data(world, source={"model": "theirs"}))
    assert status == 404 and "source.model" in body["detail"], body  # another tenant's model is none of its own
    status, body = post(client, data(world, source={"version": 1}))
    assert status == 400 and "source.model" in body, body
    status, body = post(client, data(world, source={"model": "llama"}))
    assert status == 201, body
    assert body["model"] == {"name": "llama", "version": 1} and body["source"] == {"model": "llama", "version": 1}
    endpoint = InferenceEndpoint.objects.get(id=body["id"])
    serving = ServingSettings(**replica_job_spec(endpoint, 0)["serving"])
    # The pod fetches (or reads from its node's cache) the version's archive and unpacks it; the engine serves that.
    assert serving.weights.sha256 == folder.weights_sha256 and serving.weights.bytes == folder.weights_bytes
    assert (serving.engine, serving.model) == ("vllm", "")

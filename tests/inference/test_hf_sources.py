"""A transformers model's folder as a shipped-engine endpoint's source: a script job's folder checkpoint, or a model
version whose weights are that folder's .tar.gz, is taken when its config.json (at the folder's root) is a model's
config; anything else is a 400 naming `source` that says why, and nothing is stored. The portal reads config.json
only (no torch, no transformers): the weights and the tokenizer are the replica's to load when it starts."""

import io
import json
import tarfile

import pytest

from runners.bundles.models import Bundle
from runners.inference.models import InferenceEndpoint
from runners.inference.services import SERVER_LOADS, replica_job_spec
from runners.registry import services as registry
from runners.registry.models import ModelVersion, WeightsFormat
from tests.support.jobs import (
    demo_cluster_with_flavors,
    give_quota,
    ready_environment,
    script_job_with_checkpoint,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

SHA = "ab" * 32
CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "vocab_size": 300}


@pytest.fixture
def environment(tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    Bundle.objects.create(tenant=tenant, sha256=SHA, size_bytes=2048, unpacked_bytes=8192, files=3)
    return ready_environment(actor=owner, tenant=tenant)


def folder(tmp_path, files: dict, name="save"):
    """A folder of the given files (name: bytes or str; a name with '/' makes its folder)."""
    root = tmp_path / name
    root.mkdir()
    for relative, data in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
    return root


def hf_files(config=CONFIG) -> dict:
    """What save_pretrained writes, as far as the portal reads it: the config, then files it does not read."""
    return {"config.json": json.dumps(config) if isinstance(config, dict) else config,
            "model.safetensors": b"\0" * 4096, "tokenizer.json": "{}", "tokenizer_config.json": "{}"}


def script_job(owner, environment, what, *, step=10):
    return script_job_with_checkpoint(owner, environment, what, bundle=SHA, step=step)


def post(client, environment, source, name="chat"):
    answer = client.post("/api/v1/endpoints/", {
        "tenant": "acme", "environment": environment.id, "name": name, "source": source,
        "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 1, "warm_replicas": 0,
    }, format="json")
    return answer.status_code, answer.json()


def test_a_script_jobs_transformers_folder_is_served_as_a_version_of_its_folders_archive(
        client_for, owner, environment, tmp_path):
    job = script_job(owner, environment, folder(tmp_path, hf_files()))
    status, body = post(client_for(owner), environment, {"job": job.id})
    assert status == 201, body
    assert body["source"] == {"job": job.id, "step": 10} and body["model"] == {"name": "chat", "version": 1}
    version = ModelVersion.objects.get(name="chat", version=1)
    assert version.weights_format == WeightsFormat.TAR_GZ
    # The replica serves the version's .tar.gz (the node cache's copy on the local backend); the server unpacks it.
    endpoint = InferenceEndpoint.objects.get(id=body["id"])
    serving = replica_job_spec(endpoint, 0)["serving"]
    assert serving["weights"] == {"sha256": version.weights_sha256, "bytes": version.weights_bytes}
    assert serving["checkpoint"] == ""
    with tarfile.open(fileobj=io.BytesIO(registry.weights_store().read(version.weights_sha256)), mode="r:gz") as tar:
        assert json.load(tar.extractfile("step-00000010/config.json")) == CONFIG

    # The same version is then a source by name, at a deploy and at a rollout.
    status, body = post(client_for(owner), environment, {"model": "chat"}, name="again")
    assert status == 201, body
    assert body["model"] == {"name": "chat", "version": 1}
    answer = client_for(owner).post(f"/api/v1/endpoints/{body['id']}/rollout/", {"source": {"model": "chat"}},
                                    format="json")
    assert answer.status_code == 202, answer.json()


@pytest.mark.parametrize("files, words", [
    ({"weights.bin": b"\0" * 64}, "a folder with no config.json at its root or in its one top folder"),
    ({"inner/config.json": json.dumps(CONFIG)}, "a folder with no config.json"),  # too deep: the server would not find it
    (hf_files("{not json"), "config.json is not JSON"),
    (hf_files({"n_layer": 2}), "names no model_type"),
    (hf_files("[1, 2]"), "names no model_type"),
    ({"config.json/x": "{}"}, "config.json is not a file"),
])
def test_any_other_folder_is_a_400_naming_source_saying_why_and_nothing_is_stored(
        client_for, owner, environment, tmp_path, files, words):
    job = script_job(owner, environment, folder(tmp_path, files))
    status, body = post(client_for(owner), environment, {"job": job.id})
    assert status == 400, body
    assert "is a folder" in body["source"][0] and words in body["source"][0], body
    assert SERVER_LOADS in body["source"][0]
    assert not InferenceEndpoint.objects.exists() and not ModelVersion.objects.exists()


def test_a_config_past_the_bound_is_refused_unread(client_for, owner, environment, tmp_path, monkeypatch):
    from runners.inference import services

    monkeypatch.setattr(services, "TRANSFORMERS_CONFIG_MAX_BYTES", 16)
    job = script_job(owner, environment, folder(tmp_path, hf_files()))
    status, body = post(client_for(owner), environment, {"job": job.id})
    assert status == 400 and "is over 16 bytes" in body["source"][0], body


def test_a_version_of_a_folder_that_is_not_a_transformers_model_is_a_400_naming_source(
        client_for, owner, environment, tmp_path):
    # A promotion takes any folder; serving it is what is checked.
    job = script_job(owner, environment, folder(tmp_path, {"weights.bin": b"\0" * 64}))
    client = client_for(owner)
    promoted = client.post("/api/v1/tenants/acme/models/", {"name": "lightning", "job": job.id}, format="json")
    assert promoted.status_code == 201, promoted.json()
    assert ModelVersion.objects.get().weights_format == WeightsFormat.TAR_GZ
    status, body = post(client, environment, {"model": "lightning"})
    assert status == 400, body
    assert body["source"][0].startswith("Model lightning version 1 is a folder with no config.json"), body
    assert not InferenceEndpoint.objects.exists()


def test_a_version_whose_archive_is_not_a_tar_gz_or_whose_weights_are_gone_is_a_400_naming_source(
        client_for, owner, environment, tenant):
    sha, size = registry.weights_store().put_bytes(b"\x1f\x8b not really gzip")
    ModelVersion.objects.create(tenant=tenant, name="broken", version=1, weights_sha256=sha, weights_bytes=size,
                                weights_format=WeightsFormat.TAR_GZ, step=1, template="script")
    ModelVersion.objects.create(tenant=tenant, name="gone", version=1, weights_sha256="cd" * 32, weights_bytes=5,
                                weights_format=WeightsFormat.TAR_GZ, step=1, template="script")
    client = client_for(owner)
    status, body = post(client, environment, {"model": "broken"})
    assert status == 400 and "is not a readable .tar.gz of a folder" in body["source"][0], body
    status, body = post(client, environment, {"model": "gone"})
    assert status == 400 and "cannot be read from the model store" in body["source"][0], body
    assert not InferenceEndpoint.objects.exists()

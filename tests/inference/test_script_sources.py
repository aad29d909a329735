"""A script job's checkpoint as an endpoint's source: taken when the shipped server's own loader loads it (the
shipped model saved through the SDK), refused with a 400 naming `source` otherwise, nothing stored."""

import io
import zipfile

import pytest
import torch

from runners.bundles.models import Bundle
from runners.clusters.registry import get_backend
from runners.inference.models import InferenceEndpoint
from runners.inference.services import SERVER_LOADS
from runners.workloads.train import CHECKPOINT_FORMAT, CharModel, checkpoint_state
from tests.support.jobs import (
    demo_cluster_with_flavors,
    give_quota,
    ready_environment,
    script_job_with_checkpoint,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

SHA = "ab" * 32


@pytest.fixture
def environment(tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    Bundle.objects.create(tenant=tenant, sha256=SHA, size_bytes=2048, unpacked_bytes=8192, files=3)
    return ready_environment(actor=owner, tenant=tenant)


def script_job(owner, environment, what, *, step=10):
    return script_job_with_checkpoint(owner, environment, what, bundle=SHA, step=step)


def post(client, environment, job):
    answer = client.post("/api/v1/endpoints/", {
        "tenant": "acme", "environment": environment.id, "name": "chat", "source": {"job": job.id},
        "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 1, "warm_replicas": 0,
    }, format="json")
    return answer.status_code, answer.json()


def test_the_shipped_model_saved_by_a_script_through_the_sdk_is_served(client_for, owner, environment):
    model = CharModel()
    state = checkpoint_state(10, model, torch.optim.Adam(model.parameters()), world_size=1)
    job = script_job(owner, environment, state)
    status, body = post(client_for(owner), environment, job)
    assert status == 201, body
    assert body["source"] == {"job": job.id, "step": 10}


def _compressed_archive() -> bytes:
    """A zip as torch.save writes one, but with a deflated member: a few bytes that unpack to many."""
    stream = io.BytesIO()
    with zipfile.ZipFile(stream, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\0" * 1_000_000)
    return stream.getvalue()


@pytest.mark.parametrize("what, words", [
    ({"weights": torch.zeros(3)}, "does not load in the shipped server"),  # another model's state
    ({"format": CHECKPOINT_FORMAT, "model": {"embed.weight": torch.zeros(2, 2)}}, "does not load in the shipped server"),
    (b"not torch at all", "is not a torch.save file"),
    (_compressed_archive(), "compressed members"),
])
def test_any_other_script_checkpoint_is_a_400_naming_source_saying_what_the_server_loads(
    client_for, owner, environment, tmp_path, what, words
):
    if isinstance(what, bytes):
        (tmp_path / "raw.pt").write_bytes(what)
        what = tmp_path / "raw.pt"
    job = script_job(owner, environment, what)
    status, body = post(client_for(owner), environment, job)
    assert status == 400, body
    assert words in body["source"][0] and SERVER_LOADS in body["source"][0], body
    assert "script-checkpoint-" not in body["source"][0]  # the portal's own copy is not named
    assert not InferenceEndpoint.objects.exists()


def test_a_script_checkpoint_past_the_bound_is_refused_unread(client_for, owner, environment, tmp_path, monkeypatch):
    from runners.inference import services

    model = CharModel()
    job = script_job(owner, environment, checkpoint_state(10, model, torch.optim.Adam(model.parameters()),
                                                          world_size=1))
    path = get_backend().jobs.job_dir(job.id) / job.checkpoints.get().uri
    monkeypatch.setattr(services, "SCRIPT_CHECKPOINT_CHECK_MAX_BYTES", path.stat().st_size - 1)
    status, body = post(client_for(owner), environment, job)
    assert status == 400 and "bigger than the shipped model's checkpoint ever is" in body["source"][0]


def test_a_folder_or_a_deleted_script_checkpoint_is_a_400_naming_source(client_for, owner, environment, tmp_path):
    (tmp_path / "save").mkdir()
    (tmp_path / "save" / "config.json").write_text("{}")
    folder = script_job(owner, environment, tmp_path / "save", step=5)
    status, body = post(client_for(owner), environment, folder)
    assert status == 400 and "is a folder" in body["source"][0]

    model = CharModel()
    gone = script_job(owner, environment, checkpoint_state(7, model, torch.optim.Adam(model.parameters()),
                                                           world_size=1), step=7)
    (get_backend().jobs.job_dir(gone.id) / gone.checkpoints.get().uri).unlink()
    status, body = post(client_for(owner), environment, gone)
    assert status == 400 and "was deleted" in body["source"][0]
    assert not InferenceEndpoint.objects.exists()

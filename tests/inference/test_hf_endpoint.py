"""A tiny transformers model served by an endpoint, end to end on the local backend (issue 36's "done").

A script job (its train.py below, packed into a bundle and run through the jobs API in the sandbox) builds a
randomly initialised 2-layer GPT-2 and a byte-level BPE tokenizer trained on a few lines (nothing downloaded),
saves both with save_pretrained and records the folder as its checkpoint through the SDK. That checkpoint is
promoted to a model version (kept as the folder's .tar.gz), an endpoint serves the version, and the real `openai`
client streams a completion and a chat completion through the edge (a real process) with an API token: the text is
what the model itself generates greedily. Another tenant's token gets 404, no token 401. A rollout to the job's
checkpoint named directly (promoted at the rollout) is served the same way. Replicas are real server processes.
"""

import httpx
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from gpuportal import bundle as packing

from runners.clusters.registry import get_backend
from runners.inference.models import EndpointState, InferenceEndpoint
from runners.jobs.models import Job
from runners.registry.models import ModelVersion, WeightsFormat
from runners.workloads import sandbox
from tenants.services import token_create
from tests.support.edge import running_edge
from tests.support.endpoints import drive, ready_count
from tests.support.jobs import (
    admit_and_launch,
    demo_cluster_with_flavors,
    give_quota,
    job_data,
    ready_environment,
    reconcile_until,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox here: {sandbox.unavailable()}"),
]

# The script job: the model and its tokenizer, made here (the Hub is told it is offline), saved as one folder.
TRAIN_PY = '''
import os

# Set here, not in the job's env: the portal's env policy keeps HF_* to the host.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import gpuportal
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

LINES = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny model",
         "serving at the edge with a token", "a system prompt many requests share"]

ctx = gpuportal.init(metrics_interval_s=0)
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
tokenizer.train_from_iterator(LINES * 10, trainers.BpeTrainer(
    vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
torch.manual_seed(0)
# No end-of-text token: every request runs to its max_tokens.
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=len(fast), bos_token_id=None, eos_token_id=None))
folder = ctx.job_dir / "hf-save"
model.save_pretrained(folder)
fast.save_pretrained(folder)
ctx.report(1, loss=0.0)
print("saved at", ctx.checkpoint(1, folder), flush=True)
ctx.close()
'''
TOKENS = 8


@pytest.fixture(autouse=True)
def _edge(tmp_path):
    """Requests for endpoints go through the edge (runners/edge/), a real process as in production."""
    with running_edge(tmp_path) as edge:
        yield edge


def _bundle(api, tmp_path) -> str:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.py").write_text(TRAIN_PY)
    archive = SimpleUploadedFile("project.tar.gz", packing.pack(folder), "application/gzip")
    answer = api.post("/api/v1/tenants/acme/bundles/", {"archive": archive}, format="multipart")
    assert answer.status_code == 201, answer.json()
    return answer.json()["sha256"]


def _greedy(folder, prompt: str) -> str:
    """What the saved model itself generates from ``prompt``, greedily (transformers' own generate)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _streamed(client, name: str) -> tuple[str, str]:
    """(the completion's text, the chat's), each streamed through the edge and read chunk by chunk."""
    chunks = list(client.completions.create(model=name, prompt="hello world", max_tokens=TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    finished = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert len(finished) >= 2 and finished[-1] == "length", finished  # streamed: several chunks, then the end
    assert chunks[-1].usage.completion_tokens == TOKENS, chunks[-1]
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=TOKENS, temperature=0, stream=True)
    reply = "".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices)
    return text, reply


def test_the_openai_client_streams_from_an_endpoint_serving_a_tiny_transformers_model_through_the_edge(
        _edge, settings, tmp_path, tenant, other_tenant, owner, outsider, client_for):
    openai = pytest.importorskip("openai")
    from runners.workloads.serve_hf import plain_chat

    settings.BUNDLE_STORAGE_URL = f"file://{tmp_path / 'bundle-storage'}"
    settings.BUNDLE_STORAGE_OPTIONS = {}
    settings.PREEMPTION_GRACE_PERIOD_S = 30
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    api = client_for(owner)

    # The script job saves the model's folder as its checkpoint.
    submitted = api.post("/api/v1/jobs/", job_data(
        environment, name="tiny-gpt", template="script", bundle=_bundle(api, tmp_path),
        command=["python", "train.py"], hyperparameters={}, replicas=1,
        topology={"level": "none", "mode": "preferred"}, memory_mib_per_replica=4096, max_runtime_s=600,
        max_retries=0, env={}), format="json")
    assert submitted.status_code == 201, submitted.json()
    job = Job.objects.get(id=submitted.json()["id"])
    admit_and_launch(job)
    job = reconcile_until(job, {"succeeded", "failed"}, timeout_s=300, pause_s=0.5)
    assert job.state == "succeeded", (job.reason, get_backend().job_logs(job.id, 1, 0, tail=100))
    checkpoint = job.checkpoints.get()
    folder = get_backend().jobs.job_dir(job.id) / checkpoint.uri
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()

    # Promoted to a version (the folder's .tar.gz), which an endpoint of the shipped engine serves.
    promoted = api.post("/api/v1/tenants/acme/models/", {"name": "tiny-gpt", "job": job.id}, format="json")
    assert promoted.status_code == 201, promoted.json()
    assert ModelVersion.objects.get(name="tiny-gpt").weights_format == WeightsFormat.TAR_GZ
    created = api.post("/api/v1/endpoints/", {
        "tenant": "acme", "environment": environment.id, "name": "tiny", "source": {"model": "tiny-gpt"},
        "flavor": "h100-80gb", "min_replicas": 1, "max_replicas": 1, "default_deadline_ms": 20000}, format="json")
    assert created.status_code == 201, created.json()
    endpoint = drive(InferenceEndpoint.objects.get(id=created.json()["id"]),
                     lambda e: e.state == EndpointState.READY, timeout_s=240)

    # Through the edge with the real client and an API token: the model's own greedy text, streamed.
    expected = (_greedy(folder, "hello world"), _greedy(folder, plain_chat([{"role": "user", "content": "hello"}])))
    base_url = f"{_edge.url}/serve/acme/tiny/v1"
    _, token = token_create(user=owner, name="openai client")
    client = openai.OpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=60)
    assert _streamed(client, "tiny") == expected

    # Another tenant's token: the endpoint is none of theirs (404). A token that is no token, or none at all: 401.
    _, theirs = token_create(user=outsider, name="openai client")
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=base_url, api_key=theirs, max_retries=0).completions.create(
            model="tiny", prompt="hello", max_tokens=4, stream=True)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="not-a-token", max_retries=0).completions.create(
            model="tiny", prompt="hello", max_tokens=4)
    anonymous = httpx.post(f"{base_url}/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
    assert anonymous.status_code == 401, anonymous.text

    # The job's checkpoint named directly: promoted at the rollout (a version of the endpoint's name), served alike.
    rolled = api.post(f"/api/v1/endpoints/{endpoint.id}/rollout/", {"source": {"job": job.id}}, format="json")
    assert rolled.status_code == 202, rolled.json()
    endpoint = drive(endpoint, lambda e: e.state == EndpointState.READY and e.generation == 2 and ready_count(e) == 1
                     and not e.replicas.filter(generation=1).exclude(job__state="cancelled").exists(), timeout_s=240)
    assert (endpoint.model_version.name, endpoint.model_version.weights_format) == ("tiny", WeightsFormat.TAR_GZ)
    assert _streamed(client, "tiny") == expected

    assert api.post(f"/api/v1/endpoints/{endpoint.id}/stop/").status_code == 202
    drive(endpoint, lambda e: e.state == EndpointState.STOPPED, timeout_s=120)

"""A foreign engine's replica on Kubernetes (vLLM, TGI, SGLang): its Deployment, validated strictly for 1.30 and the
newest schema, started with the flags its engine documents and probed on the engine's own health route."""

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import JobLaunch, PermanentBackendError, ReplicaPlacement, ServingSettings
from runners.backends.serve_manifests import serve_manifests, serving_deployment_manifest
from runners.nvidia import names

pytestmark = pytest.mark.unit

KUBERNETES_VERSIONS = ("1.30.0", latest_version())
OPTIONS = dict(server_image="registry.example/portal/portal:1", scheduler_name="gpu-portal")
IMAGES = {"vllm": "nvcr.io/nvidia/vllm-openai:v0.8.5", "tgi": "nvcr.io/nvidia/tgi:3.2",
          "sglang": "nvcr.io/nvidia/sglang:v0.4.6"}


def engine_launch(engine="vllm", *, gpus=1, grace_period_s=60, **serving) -> JobLaunch:
    settings = dict(endpoint_id=3, checkpoint="", image=IMAGES[engine], engine=engine, model="/models/llama-3-8b",
                    served_name="chat", max_model_len=8192, dtype="bfloat16")
    settings.update(serving)
    return JobLaunch(
        job_id=21, attempt=2, tenant_slug="acme", namespace="acme--serve", name="chat-g1-r0", template="serve",
        replicas=(ReplicaPlacement(0, "gpu-2", tuple(range(gpus))),), gpu_resource=names.GPU_RESOURCE,
        gpus_per_replica=gpus, cpu_milli_per_replica=4000 * gpus, memory_mib_per_replica=32768 * gpus, steps=1,
        checkpoint_every_steps=0, max_runtime_s=86400, grace_period_s=grace_period_s,
        serving=ServingSettings(**settings),
    )


def _pod(launch: JobLaunch) -> dict:
    return serving_deployment_manifest(launch, **OPTIONS)["spec"]["template"]["spec"]


def _all():
    for label, launch in {
        "vllm": engine_launch("vllm"),
        "vllm-2-gpus-auto": engine_launch("vllm", gpus=2, max_model_len=None, dtype="auto"),
        "tgi": engine_launch("tgi", dtype="float16"),
        "sglang": engine_launch("sglang"),
        "sglang-mig": JobLaunch(**{**engine_launch("sglang").__dict__, "gpu_resource": "nvidia.com/mig-3g.40gb",
                                   "replicas": (ReplicaPlacement(0, "gpu-1", (3,), "3g.40gb", 4),)}),
        "short-grace": engine_launch("vllm", grace_period_s=1),
    }.items():
        for manifest in serve_manifests(launch, **OPTIONS):
            yield pytest.param(manifest, id=f"{label}-{manifest['kind']}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifest", list(_all()))
def test_every_engine_manifest_validates_strictly(manifest, version):
    kubernetes_validate.validate(manifest, version, strict=True)


def test_vllm_serves_the_folder_on_the_replicas_port_with_its_named_settings():
    container = _pod(engine_launch("vllm", gpus=2))["containers"][0]
    assert container["image"] == IMAGES["vllm"]
    assert container["command"] == ["vllm", "serve"]
    assert container["args"] == ["/models/llama-3-8b", "--host", "0.0.0.0", "--port", "8000",
                                 "--served-model-name", "chat", "--tensor-parallel-size", "2",
                                 "--max-model-len", "8192", "--dtype", "bfloat16"]
    assert container["resources"]["limits"] == {"cpu": "8000m", "memory": "65536Mi", names.GPU_RESOURCE: "2"}
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_tgi_and_sglang_get_the_flags_their_launchers_document():
    tgi = _pod(engine_launch("tgi", dtype="float16"))["containers"][0]
    assert tgi["command"] == ["text-generation-launcher"]
    assert tgi["args"] == ["--model-id", "/models/llama-3-8b", "--hostname", "0.0.0.0", "--port", "8000",
                           "--num-shard", "1", "--max-input-tokens", "8191", "--max-total-tokens", "8192",
                           "--dtype", "float16"]
    sglang = _pod(engine_launch("sglang", dtype="auto", max_model_len=None))["containers"][0]
    assert sglang["command"] == ["python3", "-m", "sglang.launch_server"]
    # Metrics are off unless asked for: the autoscaler reads them.
    assert sglang["args"] == ["--model-path", "/models/llama-3-8b", "--host", "0.0.0.0", "--port", "8000",
                              "--served-model-name", "chat", "--tp-size", "1", "--enable-metrics"]


@pytest.mark.parametrize("engine", ["vllm", "tgi", "sglang"])
def test_each_engine_is_probed_on_its_own_health_route_and_drains_within_the_grace_period(engine):
    spec = _pod(engine_launch(engine, dtype="auto"))
    container = spec["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # Loading a big model takes a while: liveness counts only after the start-up allowance (30 minutes).
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] == 1800
    assert container["readinessProbe"]["periodSeconds"] == 2
    # Routing stops before SIGTERM; the engine's HTTP server finishes what it has within the rest of the grace period.
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert spec["terminationGracePeriodSeconds"] == 60
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # Shared memory for its workers, memory-backed; the scratch folder holds its caches (HOME, XDG_CACHE_HOME).
    assert [mount["mountPath"] for mount in container["volumeMounts"]] == ["/dev/shm", "/scratch"]
    shm = next(volume for volume in spec["volumes"] if volume["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "4096Mi"}
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["HOME"] == "/scratch" and env["XDG_CACHE_HOME"] == "/scratch/.cache"
    assert "initContainers" not in spec


def test_nothing_of_the_tenant_passes_through_and_a_bad_launch_is_refused():
    launch = engine_launch("vllm")
    launch = JobLaunch(**{**launch.__dict__, "env": (("LD_PRELOAD", "/x.so"),), "command": ("sh", "-c", "evil")})
    container = _pod(launch)["containers"][0]
    assert "LD_PRELOAD" not in {item["name"] for item in container["env"]}
    assert container["command"] == ["vllm", "serve"] and "sh" not in container["args"]
    with pytest.raises(PermanentBackendError, match="no dtype 'float32'"):
        _pod(engine_launch("tgi", dtype="float32"))
    with pytest.raises(PermanentBackendError, match="names none"):
        _pod(engine_launch("vllm", image=None))
    with pytest.raises(PermanentBackendError, match="serves a model"):
        _pod(engine_launch("sglang", model=""))

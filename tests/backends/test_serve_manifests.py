"""The bodies an inference replica is made of on Kubernetes, validated strictly for 1.30 and the newest schema."""

import json

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import JobLaunch, PermanentBackendError, ReplicaPlacement, ServingSettings
from runners.backends.job_manifests import ATTEMPT_LABEL, JOB_LABEL, PLACEMENT_ANNOTATION
from runners.backends.serve_manifests import (
    ENDPOINT_LABEL,
    RANK_ANNOTATION,
    serve_manifests,
    serving_deployment_manifest,
)
from runners.nvidia import names

pytestmark = pytest.mark.unit

KUBERNETES_VERSIONS = ("1.30.0", latest_version())
OPTIONS = dict(server_image="registry.example/portal/portal:1", scheduler_name="gpu-portal")


def make_launch(**overrides) -> JobLaunch:
    serving = overrides.pop("serving", None) or ServingSettings(
        endpoint_id=3, checkpoint="checkpoints/step-00000040.pt", source_job_id=12, queue_limit=32,
    )
    values = dict(
        job_id=21, attempt=2, tenant_slug="acme", namespace="acme--serve", name="chat-g1-r0", template="serve",
        replicas=(ReplicaPlacement(0, "gpu-2", (5,)),), gpu_resource=names.GPU_RESOURCE, gpus_per_replica=1,
        cpu_milli_per_replica=2000, memory_mib_per_replica=8192, steps=1, checkpoint_every_steps=0,
        max_runtime_s=86400, grace_period_s=60, serving=serving,
    )
    values.update(overrides)
    return JobLaunch(**values)


CUSTOM = ServingSettings(endpoint_id=3, checkpoint="", image="registry.example/acme/server:2")


def _all():
    for label, launch in {
        "shipped": make_launch(),
        "custom": make_launch(serving=CUSTOM),
        "mig": make_launch(gpu_resource="nvidia.com/mig-1g.10gb", replicas=(ReplicaPlacement(0, "gpu-1", (3,), "1g.10gb", 2),)),
        "short-grace": make_launch(grace_period_s=1),
    }.items():
        for manifest in serve_manifests(launch, **OPTIONS):
            yield pytest.param(manifest, id=f"{label}-{manifest['kind']}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifest", list(_all()))
def test_every_serving_manifest_validates_strictly(manifest, version):
    kubernetes_validate.validate(manifest, version, strict=True)


def _pod(launch=None) -> dict:
    return serving_deployment_manifest(launch or make_launch(), **OPTIONS)["spec"]["template"]


def test_one_pod_bound_by_the_portal_where_it_placed_it_never_by_kube_scheduler():
    deployment = serving_deployment_manifest(make_launch(), **OPTIONS)
    spec = deployment["spec"]
    assert (spec["replicas"], spec["strategy"]) == (1, {"type": "Recreate"})
    assert spec["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "gpu-portal", "portal.gpu/tenant": "acme", JOB_LABEL: "21", ATTEMPT_LABEL: "2",
    }
    template = spec["template"]
    assert template["metadata"]["labels"][ENDPOINT_LABEL] == "3"
    assert json.loads(template["metadata"]["annotations"][PLACEMENT_ANNOTATION]) == {"0": "gpu-2"}
    assert template["metadata"]["annotations"][RANK_ANNOTATION] == "0"
    assert template["spec"]["schedulerName"] == "gpu-portal" and "nodeName" not in template["spec"]
    resources = template["spec"]["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"] == {"cpu": "2000m", "memory": "8192Mi", names.GPU_RESOURCE: "1"}


def test_the_server_is_probed_drained_within_the_grace_period_and_locked_down():
    spec = _pod()["spec"]
    container = spec["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # Routing stops before SIGTERM; the drain has the rest of the launch's grace period.
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert spec["terminationGracePeriodSeconds"] == 60
    assert _pod(make_launch(grace_period_s=6))["spec"]["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] == 2
    assert spec["restartPolicy"] == "Always" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_the_shipped_server_reads_the_source_jobs_folder_read_only():
    spec = _pod()["spec"]
    container = spec["containers"][0]
    assert container["image"] == OPTIONS["server_image"]
    assert container["command"] == ["python", "-m", "runners.workloads.serve"]
    assert container["args"][:6] == ["--checkpoint", "/model/checkpoints/step-00000040.pt", "--host", "0.0.0.0",
                                     "--port", "8000"]
    assert container["args"][6:] == make_launch().serving.flags()
    model = next(mount for mount in container["volumeMounts"] if mount["mountPath"] == "/model")
    assert (model["readOnly"], model["subPath"]) == (True, "job-12")
    volume = next(volume for volume in spec["volumes"] if volume["name"] == model["name"])
    assert volume["persistentVolumeClaim"] == {"claimName": "checkpoints", "readOnly": True}
    # Nothing else of the volume is writable, nor mounted at all.
    assert [mount["mountPath"] for mount in container["volumeMounts"]] == ["/model", "/scratch"]


def test_a_custom_image_runs_its_own_entrypoint_with_the_settings_as_variables():
    container = _pod(make_launch(serving=CUSTOM))["spec"]["containers"][0]
    assert container["image"] == CUSTOM.image
    assert "command" not in container and "args" not in container
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["SERVE_HOST"] == "0.0.0.0" and env["SERVE_PORT"] == "8000"
    assert env["SERVE_QUEUE_LIMIT"] == str(CUSTOM.queue_limit) and env["SERVE_MAX_DEADLINE_MS"] == "25000.0"
    assert [mount["mountPath"] for mount in container["volumeMounts"]] == ["/scratch"]


def test_nothing_of_the_tenant_passes_through_but_the_validated_settings():
    launch = make_launch(env=(("LD_PRELOAD", "/x.so"),), command=("sh", "-c", "evil"), image="registry.example/x:1")
    container = _pod(launch)["spec"]["containers"][0]
    assert "LD_PRELOAD" not in {item["name"] for item in container["env"]}
    assert container["command"] == ["python", "-m", "runners.workloads.serve"]
    assert container["image"] == OPTIONS["server_image"]
    for escaping in ("/etc/passwd", "../job-13/checkpoints/step-1.pt", "checkpoints/../../job-13"):
        with pytest.raises(PermanentBackendError, match="inside the source job's folder"):
            _pod(make_launch(serving=ServingSettings(endpoint_id=3, checkpoint=escaping, source_job_id=12)))
    with pytest.raises(PermanentBackendError, match="names no source job"):
        _pod(make_launch(serving=ServingSettings(endpoint_id=3, checkpoint="checkpoints/step-1.pt")))
    with pytest.raises(PermanentBackendError, match="one pod"):
        _pod(make_launch(replicas=(ReplicaPlacement(0, "gpu-1"), ReplicaPlacement(1, "gpu-2"))))


def test_the_endpoints_service_and_budget_cover_its_replicas():
    _deployment, service, budget = serve_manifests(make_launch(), **OPTIONS)
    selector = {"app.kubernetes.io/managed-by": "gpu-portal", ENDPOINT_LABEL: "3"}
    assert (service["metadata"]["name"], budget["metadata"]["name"]) == ("endpoint-3", "endpoint-3")
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert "publishNotReadyAddresses" not in service["spec"]  # only ready replicas get traffic
    assert budget["spec"] == {"maxUnavailable": 1, "unhealthyPodEvictionPolicy": "AlwaysAllow",
                              "selector": {"matchLabels": selector}}

"""The objects a workspace is made of on Kubernetes: valid strictly for 1.30 and the newest schema, Pod Security
"restricted", its key never in the pod spec, and reachable from the portal's namespace on its port alone."""

import base64
import json

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import JobLaunch, PermanentBackendError, ReplicaPlacement, WorkspaceSettings
from runners.backends.job_manifests import ATTEMPT_LABEL, JOB_LABEL, PLACEMENT_ANNOTATION, training_job_manifest
from runners.backends.manifests import (
    SAME_NAMESPACE_POLICY,
    WORKSPACE_LABEL,
    environment_manifests,
)
from runners.backends.serve_manifests import RANK_ANNOTATION
from runners.backends.workspace_manifests import (
    HOME_MOUNT,
    KEY_VARIABLE,
    home_claim_manifest,
    home_claim_name,
    key_secret_manifest,
    parse_home,
    workspace_deployment_manifest,
    workspace_manifests,
    workspace_network_policy_manifest,
    workspace_selector,
)
from runners.nvidia import names
from tests.deploy.test_deploy import pss_violations
from tests.support.k8s import make_spec

pytestmark = pytest.mark.unit

KUBERNETES_VERSIONS = ("1.30.0", latest_version())
PORTAL_NAMESPACE = "gpu-portal"
KEY = "5f" * 32
OPTIONS = dict(image="registry.example/portal/portal:1", scheduler_name="gpu-portal", portal_namespace=PORTAL_NAMESPACE)


WORKSPACE = WorkspaceSettings(workspace_id=9, base_url="/workspaces/9/", key=KEY, home="acme/9")


def make_launch(**overrides) -> JobLaunch:
    values = dict(
        job_id=31, attempt=2, tenant_slug="acme", namespace="acme-vision", name="notebook", template="pytorch-ddp",
        replicas=(ReplicaPlacement(0, "gpu-2", (5,)),), gpu_resource=names.GPU_RESOURCE, gpus_per_replica=1,
        cpu_milli_per_replica=2000, memory_mib_per_replica=8192, steps=1, checkpoint_every_steps=0,
        max_runtime_s=86400, grace_period_s=60, workspace=WORKSPACE,
    )
    values.update(overrides)
    return JobLaunch(**values)


LAUNCHES = {
    "whole-gpu": make_launch(),
    "own-image": make_launch(workspace=WorkspaceSettings(workspace_id=9, base_url="/workspaces/9/", key=KEY,
                                                         home="acme/9", image="registry.example/acme/lab:3")),
    "mig": make_launch(gpu_resource=names.mig_resource("1g.10gb"),
                       replicas=(ReplicaPlacement(0, "gpu-1", (3,), "1g.10gb", 2),)),
    "short-grace": make_launch(grace_period_s=1),
}


def _all():
    for label, launch in LAUNCHES.items():
        for manifest in workspace_manifests(launch, storage_class="fast-rwo", **OPTIONS):
            yield pytest.param(manifest, id=f"{label}-{manifest['kind']}")
        owner = {"metadata": {"name": "job-31-2", "uid": "3f1c7a52-0000-4000-8000-000000000001"}}
        yield pytest.param(key_secret_manifest(launch, owner=owner), id=f"{label}-Secret-owned")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifest", list(_all()))
def test_every_workspace_manifest_validates_strictly(manifest, version):
    kubernetes_validate.validate(manifest, version, strict=True)


def _deployment(launch=None) -> dict:
    return workspace_deployment_manifest(launch or make_launch(), image=OPTIONS["image"],
                                         scheduler_name=OPTIONS["scheduler_name"])


def _pod(launch=None) -> dict:
    return _deployment(launch)["spec"]["template"]


# --- Pod Security "restricted", rule by rule ---------------------------------------------------


@pytest.fixture(params=list(LAUNCHES), ids=list(LAUNCHES))
def pod_spec(request) -> dict:
    return _pod(LAUNCHES[request.param])["spec"]


def _containers(spec: dict) -> list[dict]:
    return [*(spec.get("initContainers") or []), *spec["containers"]]


def test_restricted_the_whole_profile_finds_nothing(pod_spec):
    # The deploy tests' checker, itself shown there to catch each rule on a deliberately bad pod.
    assert pss_violations(pod_spec) == []


def test_restricted_runs_as_non_root_with_a_non_root_user_and_group(pod_spec):
    context = pod_spec["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] > 0 and context["runAsGroup"] > 0
    for container in _containers(pod_spec):
        assert container["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"].get("runAsUser", context["runAsUser"]) != 0


def test_restricted_the_home_claim_is_writable_through_fs_group(pod_spec):
    assert pod_spec["securityContext"]["fsGroup"] == pod_spec["securityContext"]["runAsGroup"]


def test_restricted_seccomp_is_the_runtime_default(pod_spec):
    assert pod_spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in _containers(pod_spec):
        assert container["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_restricted_no_privilege_escalation_and_no_privileged_container(pod_spec):
    for container in _containers(pod_spec):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert not container["securityContext"].get("privileged")


def test_restricted_every_capability_is_dropped_and_none_added(pod_spec):
    for container in _containers(pod_spec):
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_restricted_no_host_namespaces_ports_or_paths(pod_spec):
    assert not any(pod_spec.get(field) for field in ("hostNetwork", "hostPID", "hostIPC", "hostUsers"))
    assert all(not port.get("hostPort") for container in _containers(pod_spec) for port in container.get("ports", []))
    # Only a claim and an emptyDir: no hostPath (nor any other volume type the profile refuses).
    assert sorted(next(iter(set(volume) - {"name"})) for volume in pod_spec["volumes"]) == [
        "emptyDir", "persistentVolumeClaim"]


def test_restricted_tenant_code_gets_no_service_account_token(pod_spec):
    assert pod_spec["automountServiceAccountToken"] is False
    assert pod_spec["enableServiceLinks"] is False


# --- The key -------------------------------------------------------------------------------------


def test_the_key_is_in_the_secret_only_and_the_container_reads_it_from_there():
    launch = make_launch()
    deployment = _deployment(launch)
    assert KEY not in json.dumps(deployment)
    assert base64.b64encode(KEY.encode()).decode() not in json.dumps(deployment)
    secret = key_secret_manifest(launch)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [variable] = [variable for variable in container["env"] if variable["name"] == KEY_VARIABLE]
    assert variable == {"name": "PORTAL_WORKSPACE_KEY", "valueFrom": {"secretKeyRef": {
        "name": secret["metadata"]["name"], "key": "key"}}}
    assert base64.b64decode(secret["data"]["key"]).decode() == KEY
    assert (secret["type"], secret["immutable"]) == ("Opaque", True)
    assert secret["metadata"]["name"] == "job-31-2-workspace-key"  # one per attempt: a new key at every start
    assert KEY not in " ".join(container["command"] + container["args"])


def test_the_variable_is_the_one_the_workspace_server_reads():
    from runners.workloads import workspace

    assert KEY_VARIABLE == workspace.KEY_VARIABLE


def test_the_secret_is_owned_by_its_deployment_once_that_has_a_uid():
    owner = {"metadata": {"name": "job-31-2", "uid": "uid-1"}, "kind": "Deployment"}
    secret = key_secret_manifest(make_launch(), owner=owner)
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "apps/v1", "kind": "Deployment", "name": "job-31-2", "uid": "uid-1"}]
    assert "ownerReferences" not in key_secret_manifest(make_launch())["metadata"]


# --- The pod -------------------------------------------------------------------------------------


def test_one_pod_bound_by_the_portal_where_it_placed_it_with_the_flavors_resources():
    deployment = _deployment()
    spec = deployment["spec"]
    assert (spec["replicas"], spec["strategy"]) == (1, {"type": "Recreate"})
    assert spec["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "gpu-portal", "portal.gpu/tenant": "acme", JOB_LABEL: "31", ATTEMPT_LABEL: "2"}
    template = spec["template"]
    assert template["metadata"]["labels"][WORKSPACE_LABEL] == "9"
    assert json.loads(template["metadata"]["annotations"][PLACEMENT_ANNOTATION]) == {"0": "gpu-2"}
    assert template["metadata"]["annotations"][RANK_ANNOTATION] == "0"
    assert template["spec"]["schedulerName"] == "gpu-portal" and "nodeName" not in template["spec"]
    [container] = template["spec"]["containers"]
    assert container["resources"]["requests"] == container["resources"]["limits"] == {
        "cpu": "2000m", "memory": "8192Mi", names.GPU_RESOURCE: "1"}
    assert deployment["metadata"]["name"] == "job-31-2"


def test_jupyterlab_runs_under_the_base_url_with_its_home_on_the_claim():
    spec = _pod()["spec"]
    [container] = spec["containers"]
    assert container["command"] + container["args"] == [
        "python", "-m", "runners.workloads.workspace", "--port", "8888", "--base-url", "/workspaces/9/",
        "--home", HOME_MOUNT, "--grace-s", "60"]
    assert container["image"] == OPTIONS["image"]  # the portal's own image where the environment names none
    assert container["workingDir"] == HOME_MOUNT
    variables = {variable["name"]: variable.get("value") for variable in container["env"]}
    assert variables["HOME"] == HOME_MOUNT and variables["JUPYTER_RUNTIME_DIR"].startswith("/scratch/")
    assert {"name": "home", "mountPath": HOME_MOUNT} in container["volumeMounts"]
    assert {"name": "home", "persistentVolumeClaim": {"claimName": "workspace-9-home"}} in spec["volumes"]
    assert container["ports"] == [{"name": "jupyter", "containerPort": 8888, "protocol": "TCP"}]
    assert spec["terminationGracePeriodSeconds"] == 60


def test_the_environments_image_wins_where_it_names_one():
    [container] = _pod(LAUNCHES["own-image"])["spec"]["containers"]
    assert container["image"] == "registry.example/acme/lab:3"


def test_readiness_is_a_connection_never_a_request_jupyter_would_refuse():
    [container] = _pod()["spec"]["containers"]
    assert container["readinessProbe"]["tcpSocket"] == {"port": "jupyter"}
    probes = {key: value for key, value in container.items() if key.endswith("Probe")}
    assert not any("httpGet" in probe for probe in probes.values())


def test_nothing_of_the_launchs_variables_or_command_reaches_the_pod():
    launch = make_launch(env=(("EVIL", "1"),), command=("sh", "-c", "evil"), image="registry.example/evil:1")
    text = json.dumps(_deployment(launch))
    assert "EVIL" not in text and "evil" not in text


def test_a_workspace_is_one_pod():
    two = (ReplicaPlacement(0, "gpu-1", (0,)), ReplicaPlacement(1, "gpu-2", (0,)))
    with pytest.raises(PermanentBackendError, match="one pod"):
        _deployment(make_launch(replicas=two))


def test_a_workspace_makes_no_service():
    kinds = [manifest["kind"] for manifest in workspace_manifests(make_launch(), **OPTIONS)]
    assert kinds == ["PersistentVolumeClaim", "NetworkPolicy", "Deployment", "Secret"]


# --- The home claim ------------------------------------------------------------------------------


def test_the_home_maps_to_one_claim_name_per_workspace():
    assert parse_home("acme/9") == ("acme", 9)
    assert home_claim_name("acme/9") == home_claim_name("acme/9") == "workspace-9-home"
    assert home_claim_name("acme/10") != home_claim_name("acme/9")
    assert workspace_selector("acme/9") == \
        "app.kubernetes.io/managed-by=gpu-portal,portal.gpu/tenant=acme,portal.gpu/workspace-id=9"


@pytest.mark.parametrize("home", ["", "acme", "acme/9/x", "/acme/9", "acme/../9", "acme/x", "Acme/9", "acme/09",
                                  "acme/9 ", "acme/9\n", "a,b=c/9"])
def test_anything_but_a_workspaces_home_is_refused(home):
    with pytest.raises(PermanentBackendError, match="Not a workspace's home"):
        home_claim_name(home)


def test_a_launch_whose_home_is_not_its_own_is_refused():
    other = WorkspaceSettings(workspace_id=9, base_url="/workspaces/9/", key=KEY, home="globex/9")
    with pytest.raises(PermanentBackendError, match="not its own"):
        _deployment(make_launch(workspace=other))
    with pytest.raises(PermanentBackendError, match="not its own"):
        home_claim_manifest(make_launch(workspace=WorkspaceSettings(
            workspace_id=9, base_url="/workspaces/9/", key=KEY, home="acme/8")))


def test_the_claim_is_the_workspaces_one_volume_for_one_pod():
    claim = home_claim_manifest(make_launch(), storage_class="fast-rwo")
    assert claim["metadata"]["name"] == "workspace-9-home"
    assert claim["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "gpu-portal", "portal.gpu/tenant": "acme",
                                           WORKSPACE_LABEL: "9"}
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["storageClassName"] == "fast-rwo"
    assert "storageClassName" not in home_claim_manifest(make_launch())["spec"]  # the cluster's default class


# --- Who reaches the pod -------------------------------------------------------------------------


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions) selects a pod with these labels."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if not {"Exists": key in labels, "DoesNotExist": key not in labels, "In": labels.get(key) in values,
                "NotIn": labels.get(key) not in values}[operator]:
            return False
    return True


def _policies(launch: JobLaunch) -> list[dict]:
    spec = make_spec(namespace=launch.namespace)
    environment = [m for m in environment_manifests(spec, portal_namespace=PORTAL_NAMESPACE)
                   if m["kind"] == "NetworkPolicy"]
    return [*environment, workspace_network_policy_manifest(launch, portal_namespace=PORTAL_NAMESPACE)]


def test_the_portals_namespace_alone_reaches_the_workspace_on_its_port_alone():
    launch = make_launch()
    labels = _pod(launch)["metadata"]["labels"]
    ingress = [policy for policy in _policies(launch) if _selects(policy["spec"]["podSelector"], labels)
               and "Ingress" in policy["spec"]["policyTypes"]]
    # Selected by an ingress policy, the pod takes only what those policies' rules let in, all told.
    assert ingress
    rules = [rule for policy in ingress for rule in policy["spec"].get("ingress") or []]
    assert rules == [{
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": PORTAL_NAMESPACE}}}],
        "ports": [{"protocol": "TCP", "port": 8888}],
    }]
    assert [policy["metadata"]["name"] for policy in ingress if policy["spec"].get("ingress")] == ["workspace-9"]


def test_the_namespace_still_reaches_its_other_pods_and_the_workspace_reaches_them():
    launch = make_launch()
    policies = {policy["metadata"]["name"]: policy for policy in _policies(launch)}
    trainer = training_job_manifest(make_launch(workspace=None), trainer_image="x", scheduler_name="gpu-portal",
                                    grace_period_s=30)["spec"]["template"]["metadata"]["labels"]
    assert _selects(policies[SAME_NAMESPACE_POLICY]["spec"]["podSelector"], trainer)
    assert not _selects(policies[SAME_NAMESPACE_POLICY]["spec"]["podSelector"], _pod(launch)["metadata"]["labels"])
    own = policies["workspace-9"]["spec"]
    assert own["egress"] == [{"to": [{"podSelector": {}}]}] and "Egress" in own["policyTypes"]


def test_a_workspace_without_the_portals_namespace_is_refused():
    with pytest.raises(PermanentBackendError, match="KUBERNETES_PORTAL_NAMESPACE"):
        workspace_network_policy_manifest(make_launch(), portal_namespace="")

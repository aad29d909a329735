"""Workspaces on the Kubernetes backend, against the stand-in: claim, policy, Deployment and key; bind, address,
stop, a second start, and the home's deletion.

The environment is made by the backend itself (`ensure_environment`), so its namespace enforces Pod Security
"restricted" (the stand-in's admission refuses a pod that breaks it, as the real plugin does) and has the
environment's NetworkPolicies. The portal's token may do only what deploy/'s RBAC grants it. The stand-in plays
the Deployment and ReplicaSet controllers and a small kubelet (a bound pod runs with an IP; a pod deleted with a
grace period exits 0 a moment later: JupyterLab stops on SIGTERM).
"""

import base64
import time

import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import (
    JobLaunch,
    PermanentBackendError,
    ReplicaPlacement,
    TransientBackendError,
    WorkspaceSettings,
)
from runners.backends.job_manifests import ATTEMPT_LABEL, JOB_LABEL
from runners.backends.manifests import SAME_NAMESPACE_POLICY, WORKSPACE_LABEL, common_labels
from runners.backends.workspace_manifests import workspace_deployment_manifest
from runners.nvidia import names
from tests.support.k8s import api_call, deploy_rbac, gpu_node, make_spec
from tests.support.k8s_standin import KubernetesStandIn
from tests.support.races import wait_until

pytestmark = pytest.mark.e2e

NAMESPACE = "acme-vision"
SPEC = make_spec(namespace=NAMESPACE)
KEY = "a1" * 32
HOME = "acme/9"
CLAIM = "workspace-9-home"
POLICY = "workspace-9"


def make_launch(job_id=61, attempt=1, node="gpu-b", key=KEY, **overrides) -> JobLaunch:
    values = dict(
        job_id=job_id, attempt=attempt, tenant_slug="acme", namespace=NAMESPACE, name="notebook",
        template="pytorch-ddp", replicas=(ReplicaPlacement(0, node, (0,)),), gpu_resource=names.GPU_RESOURCE,
        gpus_per_replica=1, cpu_milli_per_replica=2000, memory_mib_per_replica=8192, steps=1,
        checkpoint_every_steps=0, max_runtime_s=86400, grace_period_s=30,
        workspace=WorkspaceSettings(workspace_id=9, base_url="/workspaces/9/", key=key, home=HOME),
    )
    values.update(overrides)
    return JobLaunch(**values)


def _prepare(api, backend):
    for node in ("gpu-a", "gpu-b"):
        api.put(gpu_node(node))
    backend.ensure_environment(SPEC)
    api.sigterm_exit_code = 0  # JupyterLab stops on SIGTERM and exits 0
    return api


@pytest.fixture
def cluster(standin, backend):
    return _prepare(standin, backend)


def workspace_pods(api, job_id=61, attempt=1) -> list[dict]:
    return api.pods(NAMESPACE, **{JOB_LABEL: str(job_id), ATTEMPT_LABEL: str(attempt)})


def launched(backend, api, launch=None) -> JobLaunch:
    """Launch, then let the stand-in's controllers make the pod and a sync bind it (as the reconcile's reads do)."""
    launch = launch or make_launch()
    backend.launch_job(launch)

    def bound() -> bool:
        backend._sync(force=True)
        return any(pod["spec"].get("nodeName") for pod in workspace_pods(api, launch.job_id, launch.attempt))

    assert wait_until(bound, timeout_s=10)
    backend._sync(force=True)  # the watch sees the binding
    return launch


def names_of(api, plural: str) -> set[str]:
    return {name for kind, namespace, name in api.objects() if kind == plural and namespace == NAMESPACE}


def secret_key(api, name: str) -> str:
    return base64.b64decode(api.get("secrets", name, NAMESPACE)["data"]["key"]).decode()


@pytest.mark.parametrize("version", ["1.30.0", latest_version()])
def test_a_launch_makes_claim_policy_deployment_and_key_and_binds_the_restricted_pod(make_backend, version):
    # Every body written is validated strictly for this version, by the same RBAC the portal holds.
    with KubernetesStandIn(validate_version=version, admin_tokens={"standin-token"}, portal_rbac=deploy_rbac(),
                           watch_hold_s=0.1, check_answers=True) as api:
        backend = make_backend(api.url)
        _prepare(api, backend)
        namespace = api.get("namespaces", NAMESPACE)
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        launched(backend, api)
        assert CLAIM in names_of(api, "persistentvolumeclaims")
        assert POLICY in names_of(api, "networkpolicies")
        assert names_of(api, "deployments") == {"job-61-1"}
        assert names_of(api, "secrets") == {"job-61-1-workspace-key"}
        assert names_of(api, "services") == set()  # the edge reaches the pod's IP: no Service
        assert secret_key(api, "job-61-1-workspace-key") == KEY
        secret = api.get("secrets", "job-61-1-workspace-key", NAMESPACE)
        deployment = api.get("deployments", "job-61-1", NAMESPACE)
        assert secret["metadata"]["ownerReferences"][0]["uid"] == deployment["metadata"]["uid"]
        [pod] = workspace_pods(api)
        # Admitted under Pod Security "restricted", on the node the portal chose, through pods/binding.
        assert pod["spec"]["nodeName"] == "gpu-b" and pod["spec"]["schedulerName"] == "gpu-portal"
        assert KEY not in str(pod)
        # The key exists before the pod is bound (so it never starts without it).
        posts = [(r.path.rsplit("/", 1)[-1], r.status) for r in api.requests if r.method == "POST"]
        assert posts.index(("secrets", 201)) < posts.index(("binding", 201))
        assert backend.workspace_address(61, 1) == f"http://{pod['status']['podIP']}:8888"
        assert backend.job_status(61, 1).phase == "running"
        assert api.invalid_answers == [] and api.controller_errors == []


def test_a_pod_of_another_namespace_that_copies_an_attempts_labels_is_never_its_address_nor_bound(
        backend, make_backend, cluster):
    """Another tenant's editors may make pods with any labels in their own namespace. One that copies this
    workspace's attempt labels (and is newer, with an IP, and waits for the portal's scheduler) must not become
    the workspace's address, where the edge would send its owner's browser with the key, nor get bound."""
    launch = launched(backend, cluster)
    [real] = workspace_pods(cluster)
    other = "globex-lab"
    backend.ensure_environment(make_spec(environment_id=8, tenant_slug="globex", namespace=other))
    forged = workspace_deployment_manifest(launch, image="registry.example/evil:1", scheduler_name="gpu-portal")
    template = forged["spec"]["template"]
    cluster.put({"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "job-61-1-forged", "namespace": other, **template["metadata"],
                              "creationTimestamp": "2999-01-01T00:00:00Z"},
                 "spec": template["spec"], "status": {"phase": "Running", "podIP": "10.66.6.6"}})
    real_address = f"http://{real['status']['podIP']}:8888"
    backend._sync(force=True)
    assert backend.workspace_address(61, 1) == real_address

    # Another process (a worker that did not launch it) knows the namespace from the portal's jobs_open, or
    # from the caller; knowing neither, it says nothing rather than guess.
    elsewhere = make_backend()
    elsewhere._sync(force=True)
    assert elsewhere.workspace_address(61, 1) is None
    assert elsewhere.workspace_address(61, 1, namespace=NAMESPACE) == real_address
    elsewhere.jobs_open({(61, 1): NAMESPACE})
    elsewhere._sync(force=True)
    assert elsewhere.workspace_address(61, 1) == real_address
    assert elsewhere.job_status(61, 1).phase == "running"
    # And the forged pod was bound by neither.
    assert not cluster.pods(other)[0]["spec"].get("nodeName")


def test_the_namespace_refuses_a_pod_that_is_not_restricted(backend, cluster):
    """What the launch above passed is enforced here: the same Deployment without the security context is refused."""
    deployment = workspace_deployment_manifest(make_launch(job_id=62), image="x", scheduler_name="gpu-portal")
    del deployment["spec"]["template"]["spec"]["securityContext"]
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        del container["securityContext"]
    cluster.put(deployment)
    assert wait_until(lambda: cluster.events(NAMESPACE, reason="FailedCreate"), timeout_s=10)
    [event] = cluster.events(NAMESPACE, reason="FailedCreate")
    assert 'violates PodSecurity "restricted' in event["message"]
    assert workspace_pods(cluster, job_id=62) == []


def test_launching_again_changes_nothing(backend, cluster):
    launch = launched(backend, cluster)
    before = {key: obj["metadata"]["resourceVersion"] for key, obj in cluster.objects().items()}
    cluster.clear_log()
    backend.launch_job(launch)
    backend._sync(force=True)
    assert {key: obj["metadata"]["resourceVersion"] for key, obj in cluster.objects().items()} == before
    assert len(workspace_pods(cluster)) == 1
    # The claim and the key were there already: 409, which is fine.
    creates = {r.path.rsplit("/", 1)[-1]: r.status for r in cluster.requests if r.method == "POST"}
    assert creates == {"persistentvolumeclaims": 409, "secrets": 409}


def test_the_address_is_unknown_until_the_pod_has_an_ip_and_an_ipv6_one_is_bracketed(backend, cluster):
    assert backend.workspace_address(61, 1) is None
    launched(backend, cluster)
    [pod] = workspace_pods(cluster)
    status, answer = api_call(cluster, "PATCH", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}",
                              {"status": {"podIP": "fd00::7"}}, content_type="application/merge-patch+json")
    assert status == 200, answer
    backend._sync(force=True)
    assert backend.workspace_address(61, 1) == "http://[fd00::7]:8888"


def test_stop_removes_the_pod_and_the_key_and_keeps_the_home(backend, cluster):
    launched(backend, cluster)
    cluster.clear_log()
    backend.stop_job(61, 1, grace_period_s=30)
    deletes = [r for r in cluster.requests if r.method == "DELETE"]
    assert [r.path.rsplit("/", 1)[-1] for r in deletes if "/secrets/" in r.path] == ["job-61-1-workspace-key"]
    assert [r.query.get("propagationPolicy") for r in deletes if "/deployments/" in r.path] == [["Orphan"]]
    assert [r.query["gracePeriodSeconds"] for r in deletes if "/pods/" in r.path] == [["30"]]
    time.sleep(0.1)  # the stand-in's kubelet: SIGTERM, JupyterLab stops, exit 0
    backend._sync(force=True)
    status = backend.job_status(61, 1)
    assert (status.phase, status.exit_codes) == ("exited", {0: 0})
    backend.forget_job(61, 1)
    time.sleep(0.1)
    assert workspace_pods(cluster) == []
    assert names_of(cluster, "secrets") == set() and names_of(cluster, "deployments") == set()
    assert CLAIM in names_of(cluster, "persistentvolumeclaims") and POLICY in names_of(cluster, "networkpolicies")


def test_a_second_start_mounts_the_same_claim_with_a_new_key(backend, cluster):
    launched(backend, cluster)
    claim_uid = cluster.get("persistentvolumeclaims", CLAIM, NAMESPACE)["metadata"]["uid"]
    backend.stop_job(61, 1, grace_period_s=30)
    time.sleep(0.1)
    backend.forget_job(61, 1)
    # The next start is a new job, with a new key.
    launched(backend, cluster, make_launch(job_id=63, node="gpu-a", key="b2" * 32))
    assert cluster.get("persistentvolumeclaims", CLAIM, NAMESPACE)["metadata"]["uid"] == claim_uid
    assert names_of(cluster, "secrets") == {"job-63-1-workspace-key"}
    assert secret_key(cluster, "job-63-1-workspace-key") == "b2" * 32
    [pod] = workspace_pods(cluster, job_id=63)
    assert {"name": "home", "persistentVolumeClaim": {"claimName": CLAIM}} in pod["spec"]["volumes"]
    assert pod["spec"]["nodeName"] == "gpu-a"


def test_deleting_the_home_removes_the_claim_and_the_policy_and_tolerates_what_is_gone(backend, cluster):
    launched(backend, cluster)
    backend.stop_job(61, 1, grace_period_s=30)
    time.sleep(0.1)
    backend.forget_job(61, 1)
    # Someone removed the claim between the list and the delete: the delete's 404 counts as done.
    cluster.inject(404, method="DELETE", path_contains=f"/persistentvolumeclaims/{CLAIM}")
    backend.delete_workspace_home(HOME)
    cluster.clear_log()
    backend.delete_workspace_home(HOME)  # again: it finds the policy gone, and deletes the claim for real
    assert CLAIM not in names_of(cluster, "persistentvolumeclaims")
    assert POLICY not in names_of(cluster, "networkpolicies")
    backend.delete_workspace_home(HOME)  # nothing left: nothing to do
    # The environment's own policies are never the workspace's.
    assert SAME_NAMESPACE_POLICY in names_of(cluster, "networkpolicies")


def test_a_key_already_gone_does_not_stop_a_stop(backend, cluster):
    launched(backend, cluster)
    cluster.delete("secrets", "job-61-1-workspace-key", NAMESPACE)
    backend.stop_job(61, 1, grace_period_s=30)
    backend.stop_job(61, 1, grace_period_s=30)  # again: nothing left to delete
    time.sleep(0.1)
    backend._sync(force=True)
    assert backend.job_status(61, 1).phase == "exited"


def test_an_environment_synced_before_workspaces_leaves_them_out_at_the_launch(backend, cluster):
    # The same-namespace policy as it was: every pod of the namespace reaches every other.
    old = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"name": SAME_NAMESPACE_POLICY, "namespace": NAMESPACE, "labels": common_labels(SPEC)},
           "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "ingress": [{"from": [{"podSelector": {}}]}],
                    "egress": [{"to": [{"podSelector": {}}]}]}}
    status, answer = api_call(cluster, "PATCH", f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies/"
                              f"{SAME_NAMESPACE_POLICY}?fieldManager=gpu-portal&force=true", old,
                              content_type="application/apply-patch+yaml")
    assert status == 200, answer
    launched(backend, cluster)
    policy = cluster.get("networkpolicies", SAME_NAMESPACE_POLICY, NAMESPACE)
    assert policy["spec"]["podSelector"] == {"matchExpressions": [{"key": WORKSPACE_LABEL, "operator": "DoesNotExist"}]}
    assert policy["metadata"]["labels"] == common_labels(SPEC)  # still the environment's, for its sync's prune
    backend.ensure_environment(SPEC)  # and the environment's sync leaves it as it is
    assert cluster.get("networkpolicies", SAME_NAMESPACE_POLICY, NAMESPACE)["spec"] == policy["spec"]


def test_a_claim_of_that_name_that_is_not_the_portals_is_never_mounted(backend, cluster):
    cluster.put({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                 "metadata": {"name": CLAIM, "namespace": NAMESPACE},
                 "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    with pytest.raises(PermanentBackendError, match="not made by the portal"):
        backend.launch_job(make_launch())
    assert names_of(cluster, "deployments") == set() and names_of(cluster, "secrets") == set()


def test_a_failing_call_is_the_backends_transient_or_permanent_error(backend, cluster):
    cluster.inject(503, method="POST", path_contains="/secrets")
    with pytest.raises(TransientBackendError):
        backend.launch_job(make_launch())
    cluster.inject(403, method="POST", path_contains="/secrets", message="admission webhook denied the request")
    with pytest.raises(PermanentBackendError, match="admission webhook"):
        backend.launch_job(make_launch())
    launched(backend, cluster)  # once the server takes it, the launch goes through
    assert secret_key(cluster, "job-61-1-workspace-key") == KEY


def test_a_workspace_over_quota_says_why_it_waits(backend, cluster):
    cluster.put({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "operator-gpus", "namespace": NAMESPACE},
                 "spec": {"hard": {"requests.nvidia.com/gpu": "0"}}})
    backend.launch_job(make_launch())
    assert wait_until(lambda: cluster.events(NAMESPACE, reason="FailedCreate"), timeout_s=10)
    status = backend.job_status(61, 1)
    assert status.phase == "running" and "exceeded quota: operator-gpus" in status.waiting


def test_another_process_reads_the_workspace_from_its_pod_and_deployment(make_backend, backend, cluster):
    launched(backend, cluster)
    assert make_backend().job_status(61, 1).phase == "running"
    backend.forget_job(61, 1)
    time.sleep(0.1)
    status = make_backend().job_status(61, 1)
    assert status.phase == "lost" and "gone" in status.reason

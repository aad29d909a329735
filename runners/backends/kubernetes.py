"""The Kubernetes backend: one namespace per environment, partitions through the NVIDIA GPU Operator.

Every object comes from `manifests.environment_manifests` and is sent with
server-side apply under one field manager, so a repeated call changes nothing.
A create that finds the object already there (409 AlreadyExists) counts as done,
and so does a delete of something already gone (404). The official client makes
every call; answers are read as plain JSON so errors keep the API's own message.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import urllib3
from kubernetes import client, config

from runners.backends import k8s_inventory, k8s_partitions
from runners.backends.base import (
    AttemptStatus,
    BackendError,
    EnvironmentSpec,
    JobLaunch,
    NodeInfo,
    PartitionSpec,
    PermanentBackendError,
    TransientBackendError,
)
from runners.backends.manifests import (
    ENVIRONMENT_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    environment_manifests,
    ownership_selector,
)
from runners.nvidia import names

logger = logging.getLogger(__name__)

APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
# Worth retrying: throttling, a server in trouble, or a request that timed out on its side.
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Kind:
    """Where the typed client keeps one kind's methods, and their name stem."""

    api: str  # core | networking | rbac
    method_stem: str
    namespaced: bool = True


KINDS = {
    "Namespace": Kind("core", "namespace", namespaced=False),
    "ServiceAccount": Kind("core", "service_account"),
    "ResourceQuota": Kind("core", "resource_quota"),
    "LimitRange": Kind("core", "limit_range"),
    "NetworkPolicy": Kind("networking", "network_policy"),
    "Role": Kind("rbac", "role"),
    "RoleBinding": Kind("rbac", "role_binding"),
    "Node": Kind("core", "node", namespaced=False),
    "Pod": Kind("core", "pod"),
    "ConfigMap": Kind("core", "config_map"),
}
# The kinds an environment is made of, and so the ones pruning may remove.
ENVIRONMENT_KINDS = ("ServiceAccount", "ResourceQuota", "LimitRange", "NetworkPolicy", "Role", "RoleBinding")


class ApiStatusError(Exception):
    """An answer outside what the caller accepts, kept raw until the caller decides what it means."""

    def __init__(self, status: int, body: dict, doing: str) -> None:
        self.status = status
        self.body = body
        self.reason = body.get("reason", "")
        self.api_message = body.get("message", "")
        super().__init__(f"{doing}: the API server answered {status} {self.reason}: {self.api_message}".strip())

    @property
    def namespace_terminating(self) -> bool:
        causes = (self.body.get("details") or {}).get("causes") or []
        return any(cause.get("reason") == "NamespaceTerminating" for cause in causes) or (
            "being terminated" in self.api_message
        )

    def backend_error(self) -> BackendError:
        """The portal's view: retry later, or tell an operator what to fix."""
        if self.status in TRANSIENT_STATUSES or self.status == 0:
            return TransientBackendError(str(self))
        if self.status == 404 and (self.body.get("details") or {}).get("kind") == "namespaces":
            return TransientBackendError(f"{self} (the namespace was deleted meanwhile; trying again recreates it)")
        if self.status == 403 and self.namespace_terminating:
            return TransientBackendError(f"{self} (the namespace is still being deleted; trying again shortly)")
        # A 409 other than AlreadyExists is an optimistic-concurrency conflict: someone wrote in between.
        if self.status == 409 and self.reason != "AlreadyExists":
            return TransientBackendError(str(self))
        if self.status in (401, 403):
            return PermanentBackendError(
                f"{self}. Check the portal's Kubernetes credentials and the RBAC they are granted."
            )
        return PermanentBackendError(str(self))


class KubernetesBackend:
    """Environments as namespaces on a Kubernetes cluster, through the official client."""

    name = "kubernetes"

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        # No defaults here: every option is a KUBERNETES_* setting, with its one default in
        # portal/settings.py (runners.registry.kubernetes_backend_options reads them).
        field_manager: str,
        username_template: str,
        request_timeout_s: float,
        gpu_operator_namespace: str,
        mig_parted_config_map: str,
        device_plugin_config_map: str,
        topology_labels: k8s_inventory.TopologyLabels,
    ) -> None:
        self.api_client = api_client
        self.apis = {
            "core": client.CoreV1Api(api_client),
            "networking": client.NetworkingV1Api(api_client),
            "rbac": client.RbacAuthorizationV1Api(api_client),
        }
        self.field_manager = field_manager
        self.username_template = username_template
        self.request_timeout_s = request_timeout_s
        self.gpu_operator_namespace = gpu_operator_namespace
        self.mig_parted_config_map = mig_parted_config_map
        self.device_plugin_config_map = device_plugin_config_map
        self.topology_labels = topology_labels

    @classmethod
    def from_kubeconfig(cls, *, in_cluster: bool, kubeconfig: str | None, **options) -> "KubernetesBackend":
        """The backend for a cluster reached through in-cluster config or a kubeconfig file."""
        configuration = client.Configuration()
        try:
            if in_cluster:
                config.load_incluster_config(client_configuration=configuration)
            else:
                config.load_kube_config(config_file=kubeconfig or None, client_configuration=configuration)
        except config.ConfigException as exc:
            raise PermanentBackendError(
                f"Cannot load the Kubernetes configuration ({exc}); set KUBECONFIG or KUBERNETES_IN_CLUSTER=true."
            ) from None
        return cls(client.ApiClient(configuration), **options)

    # --- One API call ------------------------------------------------------------

    def _call(
        self, kind: str, verb: str, *args, accept: tuple[int, ...] = (200, 201), subresource: str = "", **kwargs
    ) -> tuple[int, dict]:
        """Call `<verb>_[namespaced_]<kind>[_<subresource>]` on the typed client; (status, JSON body) if accepted."""
        where = KINDS[kind]
        method = f"{verb}_namespaced_{where.method_stem}" if where.namespaced else f"{verb}_{where.method_stem}"
        if subresource:
            method = f"{method}_{subresource}"
        if verb == "list" and where.namespaced and not args:
            method = f"list_{where.method_stem}_for_all_namespaces"
        doing = f"{method}({', '.join(map(str, args))})"
        try:
            response = getattr(self.apis[where.api], method)(
                *args, _preload_content=False, _request_timeout=self.request_timeout_s, **kwargs
            )
            status, data = response.status, response.data
        except client.ApiException as exc:
            status, data = exc.status or 0, exc.body or b""
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # Connection refused, reset, or timed out: the API server may be back in a moment.
            raise TransientBackendError(f"{doing}: the Kubernetes API could not be reached: {exc}") from None
        body = _json(data)
        if status not in accept:
            raise ApiStatusError(status, body, doing)
        return status, body

    def _checked(self, *args, **kwargs) -> tuple[int, dict]:
        """_call, with an unaccepted answer turned into the portal's backend error."""
        try:
            return self._call(*args, **kwargs)
        except ApiStatusError as exc:
            raise exc.backend_error() from None

    def _apply(self, manifest: dict) -> dict:
        """Server-side apply one object; force, since the portal is the only rightful owner of these fields."""
        name = manifest["metadata"]["name"]
        args = (name, manifest["metadata"]["namespace"]) if KINDS[manifest["kind"]].namespaced else (name,)
        return self._checked(
            manifest["kind"], "patch", *args,
            body=manifest, field_manager=self.field_manager, force=True, _content_type=APPLY_PATCH,
        )[1]

    # --- Environments ------------------------------------------------------------

    def ensure_environment(self, spec: EnvironmentSpec) -> None:
        """Create or converge every object of the environment, then remove ones no longer wanted."""
        try:
            manifests = environment_manifests(spec, username_template=self.username_template)
        except ValueError as exc:
            raise PermanentBackendError(f"Cannot build environment {spec.environment_id}: {exc}") from None
        self._ensure_namespace(spec, manifests[0])
        for manifest in manifests:
            self._apply(manifest)
        self._prune(spec, wanted={(m["kind"], m["metadata"]["name"]) for m in manifests})

    def _ensure_namespace(self, spec: EnvironmentSpec, namespace: dict) -> None:
        status, current = self._checked("Namespace", "read", spec.namespace, accept=(200, 404))
        if status == 404:
            status, _ = self._checked(
                "Namespace", "create", body=namespace, field_manager=self.field_manager, accept=(201, 409)
            )
            if status == 201:
                return
            # 409: someone created it between our read and this create. That is just as good if it is
            # ours, so look again before applying over it.
            current = self._checked("Namespace", "read", spec.namespace)[1]
        if (current.get("status") or {}).get("phase") == "Terminating":
            raise TransientBackendError(
                f"Namespace {spec.namespace} is still being deleted; the environment is created once it is gone."
            )
        owner = _owner(current)
        if owner is None:
            # Someone else's namespace (kube-system, an operator's, a team's own): taking it over
            # would put our policies on it, and deleting the environment would delete it.
            raise PermanentBackendError(
                f"Namespace {spec.namespace} already exists and was not made by the portal; "
                "give this environment another name."
            )
        if owner != str(spec.environment_id):
            raise PermanentBackendError(
                f"Namespace {spec.namespace} already belongs to portal environment {owner}; "
                "give this environment another namespace."
            )

    def _prune(self, spec: EnvironmentSpec, *, wanted: set[tuple[str, str]]) -> None:
        """Delete objects built for this environment earlier that it no longer has (members who left)."""
        for kind in ENVIRONMENT_KINDS:
            listing = self._checked(kind, "list", spec.namespace, label_selector=ownership_selector(spec))[1]
            for item in listing.get("items") or []:
                name = item["metadata"]["name"]
                if (kind, name) not in wanted:
                    logger.info("Removing %s %s/%s, which environment %s no longer has.", kind, spec.namespace, name,
                                spec.environment_id)
                    self._checked(kind, "delete", name, spec.namespace, accept=(200, 202, 404))

    def delete_environment(self, spec: EnvironmentSpec) -> bool:
        """Ask for the namespace (and with it everything inside) to be deleted; never waits.

        True once it is gone. False while it is Terminating: the namespace controller is still
        removing what is inside (or a finalizer holds it), and the caller asks again later.
        A namespace already Terminating is not deleted a second time.
        """
        status, current = self._checked("Namespace", "read", spec.namespace, accept=(200, 404))
        if status == 404:
            return True
        owner = _owner(current)
        if owner is None:
            # Never labelled by the portal, so never this environment's: someone else's to delete.
            logger.warning("Not deleting namespace %s: the portal did not make it.", spec.namespace)
            return True
        if owner != str(spec.environment_id):
            raise PermanentBackendError(
                f"Namespace {spec.namespace} belongs to portal environment {owner}, not {spec.environment_id}; "
                "refusing to delete it."
            )
        if not (current.get("metadata") or {}).get("deletionTimestamp"):
            status, _ = self._checked("Namespace", "delete", spec.namespace, accept=(200, 202, 404))
            if status == 404:
                return True
        return not self.environment_exists(spec)

    def environment_exists(self, spec: EnvironmentSpec) -> bool:
        """Whether this environment's namespace exists, Terminating included."""
        status, current = self._checked("Namespace", "read", spec.namespace, accept=(200, 404))
        return status == 200 and _owner(current) == str(spec.environment_id)


    # --- Inventory and partitions ----------------------------------------------

    def discover_inventory(self) -> list[NodeInfo]:
        """GPU nodes (and nodes in a pool), from GFD labels and allocatable resources."""
        items = self._checked("Node", "list")[1].get("items") or []
        nodes = []
        for item in items:
            try:
                nodes.append(k8s_inventory.node_info(item, labels=self.topology_labels))
            except (ValueError, ArithmeticError) as exc:
                # One node with a quantity we cannot read must not hide the rest of the cluster.
                logger.warning("Skipping node %s: %s", (item.get("metadata") or {}).get("name"), exc)
        return [node for node in nodes if node.gpus or node.pool]

    def _patch_node(self, node_name: str, patch: dict) -> dict:
        return self._checked("Node", "patch", node_name, body=patch, _content_type=MERGE_PATCH)[1]

    def cordon(self, node_name: str) -> None:
        self._patch_node(node_name, {"spec": {"unschedulable": True}})

    def uncordon(self, node_name: str) -> None:
        self._patch_node(node_name, {"spec": {"unschedulable": None}})

    def node_workloads(self, node_name: str) -> list[str]:
        """Portal-launched pods on the node that have not finished; DaemonSets and system pods are not ours."""
        items = self._checked(
            "Pod", "list", field_selector=f"spec.nodeName={node_name}", label_selector=f"{MANAGED_BY_LABEL}={MANAGED_BY}"
        )[1].get("items") or []
        return sorted(
            f"{item['metadata']['namespace']}/{item['metadata']['name']}"
            for item in items
            if (item.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        )

    def evict(self, node_name: str, workload: str, *, grace_period_s: int) -> None:
        """Evict through the API, so PodDisruptionBudgets are honoured (429 means not yet: retried)."""
        namespace, _, name = workload.partition("/")
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"gracePeriodSeconds": grace_period_s},
        }
        self._checked("Pod", "create", name, namespace, body=body, subresource="eviction", accept=(200, 201, 404))

    def _update_config_map(self, name: str, change) -> None:
        """Read-modify-write one of the GPU Operator's ConfigMaps; a concurrent writer makes us read again."""
        for _attempt in range(5):
            status, current = self._checked("ConfigMap", "read", name, self.gpu_operator_namespace, accept=(200, 404))
            data = dict(current.get("data") or {}) if status == 200 else {}
            desired = change(data)
            if status == 200 and desired == data:
                return
            body = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": self.gpu_operator_namespace},
                "data": desired,
            }
            try:
                if status == 404:
                    self._call("ConfigMap", "create", self.gpu_operator_namespace, body=body)
                else:
                    body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                    self._call("ConfigMap", "replace", name, self.gpu_operator_namespace, body=body)
                return
            except ApiStatusError as exc:
                if exc.status != 409:
                    raise exc.backend_error() from None
        raise TransientBackendError(f"ConfigMap {self.gpu_operator_namespace}/{name} kept changing; trying again shortly.")

    def apply_partition(self, node_name: str, partition: PartitionSpec) -> None:
        """Write the profile into the operator's ConfigMap, then point the node's labels at it."""
        request = k8s_partitions.partition_request(partition)
        if request.mig_parted_entry is not None:
            self._update_config_map(
                self.mig_parted_config_map,
                lambda data: {
                    **data,
                    names.MIG_PARTED_CONFIG_KEY: request.mig_parted_config_text(data.get(names.MIG_PARTED_CONFIG_KEY)),
                },
            )
        if request.device_plugin_config is not None:
            self._update_config_map(
                self.device_plugin_config_map, lambda data: {**data, request.name: request.device_plugin_config}
            )
        self._patch_node(node_name, {"metadata": {"labels": dict(request.node_labels)}})

    def partition_applied(self, node_name: str, partition: PartitionSpec) -> bool:
        node = self._checked("Node", "read", node_name)[1]
        if k8s_partitions.partition_failed(node):
            raise PermanentBackendError(
                f"MIG Manager could not apply {partition.name} on {node_name} ({names.MIG_CONFIG_STATE_LABEL}={names.MIG_CONFIG_STATE_FAILED}); "
                "see the nvidia-mig-manager pod's log on that node."
            )
        return k8s_partitions.partition_done(node, partition)

    # --- Jobs: not built yet ------------------------------------------------------
    # Training jobs on Kubernetes (an indexed batch/v1 Job, a headless Service, the checkpoint
    # PVC, pods bound to the placed nodes) are not implemented. A launch fails with this
    # reason, so the job ends failed saying so instead of pretending to run.

    NOT_YET = "Training jobs on the Kubernetes backend are not implemented yet; run them on the local backend."

    def launch_job(self, launch: JobLaunch) -> int | None:
        raise PermanentBackendError(self.NOT_YET)

    def job_status(self, job_id: int, attempt: int) -> AttemptStatus:
        return AttemptStatus("lost", reason=self.NOT_YET)

    def stop_job(self, job_id: int, attempt: int, *, grace_period_s: int) -> None:
        return None

    def kill_job(self, job_id: int, attempt: int) -> None:
        return None

    def forget_job(self, job_id: int, attempt: int) -> None:
        return None

    def job_logs(self, job_id: int, attempt: int, rank: int, *, tail: int) -> str:
        return ""

    def job_metrics(self, job_id: int) -> list[dict]:
        return []

    def job_checkpoints(self, job_id: int) -> list[dict]:
        return []


def _owner(namespace: dict) -> str | None:
    """The portal environment id a Namespace object is labelled with, if any."""
    return ((namespace.get("metadata") or {}).get("labels") or {}).get(ENVIRONMENT_LABEL)


def _json(data) -> dict:
    """An answer's body as JSON; text that is not JSON (a proxy's error page) becomes its message."""
    if not data:
        return {}
    try:
        parsed = json.loads(data)
    except ValueError:
        text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
        return {"message": text[:300]}
    return parsed if isinstance(parsed, dict) else {"message": str(parsed)[:300]}

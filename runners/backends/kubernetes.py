"""The Kubernetes backend: one namespace per environment, partitions through the NVIDIA GPU Operator.

Every object comes from `manifests.environment_manifests` and is sent with
server-side apply under one field manager, so a repeated call changes nothing.
A create that finds the object already there (409 AlreadyExists) counts as done,
and so does a delete of something already gone (404). The official client's
`kubernetes.dynamic` client makes every call: it learns each kind's path from
the server's discovery documents, so no method names are built by hand; answers
are read as plain JSON so errors keep the API's own message.

Training attempts are an indexed batch/v1 Job and a headless Service in the
environment's namespace, with the environment's checkpoint PVC. Their pods name
the portal's scheduler, so kube-scheduler never places them; this backend binds
each one to the node the portal chose for its completion index through the
pods/binding subresource, as a secondary scheduler does, but only pods of the
attempts the portal holds open (`jobs_open`, plus what this process launched
since): a leftover pod of an ended attempt is never started on GPUs already given
to someone else. How attempts stand is read from a pod watch
(`runners.backends.k8s_jobs`); progress from rank 0's log, incrementally, from a
cursor the portal keeps (`job_progress`). An attempt with a replica that has no pod
yet reads its controller's FailedCreate Events (one list, by field selector) and
says why it waits (`AttemptStatus.waiting`): the API server refuses the pods (a
ResourceQuota exceeded, Pod Security), and the controller keeps trying.

An inference replica (a launch with `serving`) is a one-pod Deployment instead,
bound the same way, with its endpoint's Service and PodDisruptionBudget
(`runners.backends.serve_manifests`); `serving_address` is its pod's IP. Stopping
one deletes the Deployment and then its ReplicaSet, both orphaning what they made,
so nothing makes a new pod while the server drains; the pod itself is deleted with
the grace period. A replacement pod (the ReplicaSet's, should the pod have vanished)
is never bound: the attempt is over, and the portal relaunches with a new one.

A workspace (a launch with `workspace`) is such a one-pod Deployment too, bound and read the same way
(`runners.backends.workspace_manifests`): JupyterLab, its home folder a claim of the workspace's (made at its
first start, kept across its stops, deleted by `delete_workspace_home`), its key in a Secret of the attempt's
(the pod reads it through a secretKeyRef), and a NetworkPolicy of the workspace's that lets in the portal's
namespace alone, on WORKSPACE_PORT alone. `workspace_address` is its pod's IP. A stop deletes the attempt's
Secret with its Deployment; the claim and the policy stay for the next start.

A member's own kubeconfig (`member_kubeconfig`) is a ServiceAccount of theirs for that
environment in the portal's members namespace (`member_accounts_namespace`, where no
tenant has rights, so nobody can run a pod as it), a RoleBinding to their tier's Role in
the environment's namespace, and a token from the TokenRequest API
(`runners.backends.k8s_access`); every environment sync re-binds those ServiceAccounts to
their owners' current tier and deletes those of people who left, and deleting the
environment deletes its members' ServiceAccounts (the namespace's deletion cannot reach them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import PurePosixPath

import urllib3

from runners.backends import dcgm, k8s_access, k8s_inventory, k8s_jobs, k8s_partitions
from runners.backends.base import (
    PROGRESS_READ_MAX_BYTES,
    AttemptStatus,
    BackendError,
    CheckpointElsewhere,
    CheckpointFile,
    EnvironmentSpec,
    GpuReading,
    JobLaunch,
    MemberBinding,
    NodeInfo,
    PartitionSpec,
    PermanentBackendError,
    ProgressRead,
    TransientBackendError,
)
from runners.backends.job_manifests import (
    ATTEMPT_LABEL,
    CHECKPOINT_CLAIM,
    CHECKPOINT_MOUNT,
    JOB_LABEL,
    checkpoint_pvc_manifest,
    job_manifests,
)
from runners.backends.k8s_client import ResourceNotFoundError, client, config, dynamic, parse_quantity
from runners.backends.manifests import (
    ENVIRONMENT_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NOT_A_WORKSPACE,
    SAME_NAMESPACE_POLICY,
    TENANT_LABEL,
    WORKSPACE_LABEL,
    WORKSPACE_PORT,
    environment_manifests,
    ownership_selector,
    same_namespace_policy_spec,
)
from runners.backends.serve_manifests import ENDPOINT_LABEL, SERVER_PORT, endpoint_manifests, serve_manifests
from runners.backends.workspace_manifests import (
    home_claim_manifest,
    key_secret_manifest,
    key_secret_name,
    workspace_deployment_manifest,
    workspace_network_policy_manifest,
    workspace_selector,
)
from runners.nvidia import names
from runners.storage import cache_grants

logger = logging.getLogger(__name__)

APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
# Worth retrying: throttling, a server in trouble, or a request that timed out on its side.
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


# Every kind the backend touches, by the API version it is served under; discovery gives the rest.
KINDS = {
    "Namespace": "v1",
    "ServiceAccount": "v1",
    "ResourceQuota": "v1",
    "LimitRange": "v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1",
    "Node": "v1",
    "Pod": "v1",
    "ConfigMap": "v1",
    "Service": "v1",
    "PersistentVolumeClaim": "v1",
    # A workspace attempt's key; the portal creates and deletes these, and never reads one.
    "Secret": "v1",
    "Job": "batch/v1",
    "Deployment": "apps/v1",
    "ReplicaSet": "apps/v1",
    "PodDisruptionBudget": "policy/v1",
    # Core v1, where the Job and ReplicaSet controllers record FailedCreate (client-go's EventRecorder).
    "Event": "v1",
}
# The label selector of everything the portal made.
OWN = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
# The HTTP method of each verb the backend uses.
VERBS = {"read": "GET", "list": "GET", "create": "POST", "patch": "PATCH", "replace": "PUT", "delete": "DELETE"}
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
        if self.status == 401 or (self.status == 403 and self.rbac_refusal):
            return PermanentBackendError(
                f"{self}. Check the portal's Kubernetes credentials and the RBAC they are granted."
            )
        # Any other 403 is the server's policy, not the caller's rights (a ResourceQuota exceeded,
        # a volume whose class cannot expand, an admission webhook): its own message says what.
        return PermanentBackendError(str(self))

    @property
    def rbac_refusal(self) -> bool:
        """Whether a 403 is RBAC's: `... is forbidden: User "..." cannot <verb> resource ...`."""
        return bool(re.search(r'\bUser "[^"]*" cannot ', self.api_message)) or not self.api_message


class KubernetesBackend:
    """Environments as namespaces on a Kubernetes cluster, through the official client."""

    name = "kubernetes"

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        # No defaults here: every option is a KUBERNETES_* setting, with its one default in
        # portal/settings.py (runners.clusters.registry.kubernetes_backend_options reads them).
        field_manager: str,
        username_template: str,
        portal_namespace: str,
        request_timeout_s: float,
        gpu_operator_namespace: str,
        mig_parted_config_map: str,
        device_plugin_config_map: str,
        topology_labels: k8s_inventory.TopologyLabels,
        scheduler_name: str,
        trainer_image: str,
        checkpoint_storage_class: str,
        checkpoint_volume_size: str,
        finished_job_ttl_s: int,
        watch_timeout_s: int,
        node_lost_timeout_s: float,
        # Where members' ServiceAccounts live (KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE), and what a member's
        # kubeconfig names as the server and its CA (KUBECONFIG_SERVER_URL, KUBECONFIG_CA_FILE; None: the portal's own).
        member_accounts_namespace: str,
        kubeconfig_server_url: str | None,
        kubeconfig_ca_file: str | None,
        # The Prometheus that scrapes the DCGM exporter (PROMETHEUS_URL); None: no GPU readings.
        prometheus_url: str | None = None,
        # The node cache agents' token (CACHE_AGENT_TOKEN): it keys the grant each dataset volume carries.
        cache_agent_token: str = "",
    ) -> None:
        self.api_client = api_client
        self.field_manager = field_manager
        self.username_template = username_template
        self.portal_namespace = portal_namespace
        self.request_timeout_s = request_timeout_s
        self.gpu_operator_namespace = gpu_operator_namespace
        self.mig_parted_config_map = mig_parted_config_map
        self.device_plugin_config_map = device_plugin_config_map
        self.topology_labels = topology_labels
        self.scheduler_name = scheduler_name
        self.trainer_image = trainer_image
        self.checkpoint_storage_class = checkpoint_storage_class
        self.checkpoint_volume_size = checkpoint_volume_size
        self.finished_job_ttl_s = finished_job_ttl_s
        self.watch_timeout_s = watch_timeout_s
        self.node_lost_timeout_s = node_lost_timeout_s
        self.member_accounts_namespace = member_accounts_namespace
        self.kubeconfig_server_url = kubeconfig_server_url
        self.kubeconfig_ca_file = kubeconfig_ca_file
        self.prometheus_url = prometheus_url
        self.cache_grant_key = cache_grants.grant_key(cache_agent_token) if cache_agent_token else b""
        # Discovery is read on the first call, not here: building the backend touches no network.
        self._dynamic: dynamic.DynamicClient | None = None
        self._resources: dict[tuple[str, str], object] = {}
        self._discovery_dir = tempfile.TemporaryDirectory(prefix="gpu-portal-discovery-")
        # The portal's pods, kept by a watch; what each attempt's pods said, kept past their deletion.
        self.tracker = k8s_jobs.PodTracker()
        self.pods = k8s_jobs.WatchedList(self._list_pods, self._watch_pods, on_change=self.tracker.changed)
        self._synced_at = 0.0
        self._sync_lock = threading.Lock()
        self._watch_lock = threading.Lock()
        # Why each node counts as lost (None: it does not), read once per sync for all attempts.
        self._node_verdicts: dict[str, str | None] = {}
        # Status reads within this long of the last sync answer from the cache (one reconcile
        # pass reads every attempt; one watch serves them all).
        self.min_sync_interval_s = 0.5
        # The attempts whose pods may be bound: the set the portal last gave jobs_open, and what
        # this process launched since. Pods of any other attempt are left unbound, logged once each (by uid).
        # The attempts the portal holds open, each with the namespace it runs in (None where the caller did not
        # say): a pod counts as an attempt's only in that namespace. Its labels alone say nothing, since a
        # tenant's editors may make pods, Jobs and Deployments with any labels in their own namespaces.
        self._open_attempts: dict[tuple[int, int], str | None] = {}
        self._launched_since: dict[tuple[int, int], str] = {}
        self._unbound_noted: set[str] = set()
        # Bytes of pod log read by job_progress, all told (what the reconcile's reads cost).
        self.log_bytes_read = 0
        # The cached pods by attempt, built on first use after each sync.
        self._pods_by_attempt: dict[tuple[int, int], list[dict]] | None = None
        # The pods node_workloads last listed, per node, by "namespace/name".
        self._listed_workloads: dict[str, dict[str, dict]] = {}

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

    def _resource(self, kind: str, subresource: str = ""):
        """The dynamic client's resource (or subresource) for a kind, found through discovery once."""
        cached = self._resources.get((kind, subresource))
        if cached is None:
            if self._dynamic is None:
                cache_file = os.path.join(self._discovery_dir.name, "discovery.json")
                self._dynamic = dynamic.DynamicClient(self.api_client, cache_file=cache_file)
            for fresh in (False, True):
                try:
                    if fresh:
                        self._dynamic.resources.invalidate_cache()
                    resource = self._dynamic.resources.get(api_version=KINDS[kind], kind=kind)
                    cached = resource.subresources[subresource] if subresource else resource
                    break
                except (ResourceNotFoundError, KeyError):
                    continue
            else:
                # Every kind here is one any conformant cluster serves, and the client reads a
                # discovery answer of 503 as an empty list: most likely a hiccup, so retry later.
                raise TransientBackendError(
                    f"Discovery does not list {KINDS[kind]} {kind}{'/' + subresource if subresource else ''} "
                    "(twice); trying again later."
                )
            self._resources[(kind, subresource)] = cached
        return cached

    def _call(
        self,
        kind: str,
        verb: str,
        name: str | None = None,
        namespace: str | None = None,
        *,
        body: dict | None = None,
        accept: tuple[int, ...] = (200, 201),
        subresource: str = "",
        stream: bool = False,
        timeout_s: float | None = None,
        **params,
    ):
        """One request: (status, JSON body) if the status is accepted; with stream, the open response instead.

        `params` are the dynamic client's (label_selector, field_selector, field_manager,
        force_conflicts, content_type, grace_period_seconds, propagation_policy, watch,
        resource_version, timeout_seconds, query_params).
        """
        doing = f"{VERBS[verb]} {kind}{'/' + subresource if subresource else ''} {namespace or ''}/{name or ''}"
        try:
            resource = self._resource(kind, subresource)
            path = resource.path(name=name, namespace=namespace)
            response = self._dynamic.request(
                VERBS[verb], path, body=body, serialize=False,
                _request_timeout=timeout_s or self.request_timeout_s, **params,
            )
            status = response.status
            data = None if stream else response.data
        except client.ApiException as exc:
            status, data, response = exc.status or 0, exc.body or b"", None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # Connection refused, reset, or timed out: the API server may be back in a moment.
            raise TransientBackendError(f"{doing}: the Kubernetes API could not be reached: {exc}") from None
        if stream and response is not None and status in accept:
            return status, response
        body_json = _json(data)
        if status not in accept:
            raise ApiStatusError(status, body_json, doing)
        return status, body_json

    def _checked(self, *args, **kwargs) -> tuple[int, dict]:
        """_call, with an unaccepted answer turned into the portal's backend error."""
        try:
            return self._call(*args, **kwargs)
        except ApiStatusError as exc:
            raise exc.backend_error() from None

    def _apply(self, manifest: dict, *, timeout_s: float | None = None) -> dict:
        """Server-side apply one object; force, since the portal is the only rightful owner of these fields."""
        metadata = manifest["metadata"]
        return self._checked(
            manifest["kind"], "patch", metadata["name"], metadata.get("namespace"),
            body=manifest, field_manager=self.field_manager, force_conflicts=True, content_type=APPLY_PATCH,
            timeout_s=timeout_s,
        )[1]

    def _delete(self, kind: str, name: str, namespace: str | None, **options) -> None:
        """Delete one object; one already gone (404) counts as deleted."""
        self._checked(kind, "delete", name, namespace, accept=(200, 202, 404), **options)

    # --- Environments ------------------------------------------------------------

    def ensure_environment(self, spec: EnvironmentSpec) -> None:
        """Create or converge every object of the environment, then remove ones no longer wanted."""
        try:
            manifests = environment_manifests(spec, username_template=self.username_template,
                                              portal_namespace=self.portal_namespace)
        except ValueError as exc:
            raise PermanentBackendError(f"Cannot build environment {spec.environment_id}: {exc}") from None
        self._ensure_namespace(spec, manifests[0])
        for manifest in manifests:
            self._apply(manifest)
        self._prune(spec, wanted={(m["kind"], m["metadata"]["name"]) for m in manifests})
        self._converge_member_access(spec)

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
        """Delete objects built for this environment earlier that it no longer has.

        Members' own access (MEMBER_ACCESS_LABEL) is left to `_converge_member_access`, which decides
        by each object's username: a ServiceAccount made by a download running now is in no list
        this prune could have been given.
        """
        for kind in ENVIRONMENT_KINDS:
            listing = self._checked(kind, "list", namespace=spec.namespace, label_selector=ownership_selector(spec))[1]
            for item in listing.get("items") or []:
                name = item["metadata"]["name"]
                if k8s_access.MEMBER_ACCESS_LABEL in (item["metadata"].get("labels") or {}):
                    continue
                if (kind, name) not in wanted:
                    logger.info("Removing %s %s/%s, which environment %s no longer has.", kind, spec.namespace, name,
                                spec.environment_id)
                    self._delete(kind, name, spec.namespace)

    def delete_environment(self, spec: EnvironmentSpec) -> bool:
        """Ask for the namespace (and with it everything inside) to be deleted; never waits.

        True once it is gone. False while it is Terminating: the namespace controller is still
        removing what is inside (or a finalizer holds it), and the caller asks again later.
        A namespace already Terminating is not deleted a second time.
        """
        # Its members' ServiceAccounts live in the members namespace: the namespace's deletion does not reach them.
        self._delete_member_accounts(spec)
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


    # --- Members' own access (a kubeconfig per member) ----------------------------

    def cluster_endpoint(self) -> k8s_access.ClusterEndpoint:
        """The API server's URL and CA for members: KUBECONFIG_SERVER_URL and KUBECONFIG_CA_FILE, else the
        portal's own configuration (wrong where the portal runs in the cluster: https://10.96.0.1)."""
        configuration = self.api_client.configuration
        ca_path = self.kubeconfig_ca_file or configuration.ssl_ca_cert
        ca_pem = None
        if ca_path:
            try:
                with open(ca_path, "rb") as ca_file:
                    ca_pem = ca_file.read()
            except OSError as exc:
                raise PermanentBackendError(f"Cannot read the cluster's CA ({ca_path}): {exc}") from None
        insecure = not ca_pem and not (self.kubeconfig_ca_file or configuration.verify_ssl)
        return k8s_access.ClusterEndpoint(
            server=self.kubeconfig_server_url or configuration.host, ca_pem=ca_pem, insecure_skip_tls_verify=insecure
        )

    def _ensure_accounts_namespace(self, timeout_s: float) -> None:
        """The members namespace, made once; someone else making it first (409) is as good."""
        self._checked(
            "Namespace", "create", body=k8s_access.accounts_namespace_manifest(self.member_accounts_namespace),
            field_manager=self.field_manager, accept=(201, 409), timeout_s=timeout_s,
        )

    def member_kubeconfig(
        self, spec: EnvironmentSpec, member: MemberBinding, *, expiration_s: int, timeout_s: float
    ) -> k8s_access.MemberKubeconfig:
        """Ensure the member's ServiceAccount and RoleBinding, and mint a token through TokenRequest.

        Every call is bounded by `timeout_s` (it runs while a person waits for a download). A cluster
        that cannot be reached is a TransientBackendError naming its server; one that refuses, a
        PermanentBackendError naming it. AccessRefused (no kubeconfig without TLS verification, or
        the ServiceAccount's name already taken by another user's) is neither: nothing was minted.
        """
        endpoint = self.cluster_endpoint()
        if endpoint.insecure_skip_tls_verify:
            raise k8s_access.AccessRefused(
                f"The portal reaches the cluster at {endpoint.server} without verifying its TLS certificate, and "
                "will not hand out a kubeconfig that does not either; set KUBECONFIG_CA_FILE to the cluster's CA."
            )
        accounts = self.member_accounts_namespace
        try:
            manifests = k8s_access.member_access_manifests(spec, member, accounts_namespace=accounts)
            token_request = k8s_access.token_request_manifest(expiration_s=expiration_s)
        except ValueError as exc:
            raise PermanentBackendError(f"Cannot give {member.username} access to {spec.namespace}: {exc}") from None
        service_account = manifests[0]["metadata"]["name"]
        try:
            self._ensure_accounts_namespace(timeout_s)
            status, current = self._checked("ServiceAccount", "read", service_account, accounts, accept=(200, 404),
                                            timeout_s=timeout_s)
            holder = ((current.get("metadata") or {}).get("annotations") or {}).get(k8s_access.USERNAME_ANNOTATION)
            if status == 200 and holder != member.username:
                raise k8s_access.AccessRefused(
                    f"ServiceAccount {accounts}/{service_account} already exists for {holder or 'someone else'}, "
                    f"not {member.username}; an operator has to look at it before {member.username} gets a kubeconfig."
                )
            for manifest in manifests:
                self._apply(manifest, timeout_s=timeout_s)
            for stale in k8s_access.stale_role_binding_names(member, spec.namespace):
                self._delete("RoleBinding", stale, spec.namespace, timeout_s=timeout_s)
            answer = self._checked(
                "ServiceAccount", "create", service_account, accounts, body=token_request,
                subresource="token", timeout_s=timeout_s,
            )[1]
        except k8s_access.AccessRefused:
            raise
        except TransientBackendError as exc:
            raise TransientBackendError(f"The Kubernetes cluster at {endpoint.server} cannot be reached now: {exc}") from None
        except PermanentBackendError as exc:
            raise PermanentBackendError(f"The Kubernetes cluster at {endpoint.server} refused: {exc}") from None
        status = answer.get("status") or {}
        try:
            token = status["token"]
            expires_at = datetime.fromisoformat(status["expirationTimestamp"].replace("Z", "+00:00"))
        except (KeyError, TypeError, ValueError):
            raise PermanentBackendError(
                f"The cluster at {endpoint.server} answered the TokenRequest without a token and expiry."
            ) from None
        text = k8s_access.kubeconfig_text(cluster=endpoint, spec=spec, username=member.username, token=token)
        return k8s_access.MemberKubeconfig(text=text, expires_at=expires_at, service_account=service_account)

    def revoke_member_access(self, spec: EnvironmentSpec, username: str) -> None:
        """Delete the member's RoleBindings here and their ServiceAccount for it; the tokens minted for it stop working."""
        for binding in k8s_access.all_role_binding_names(username, spec.namespace):
            self._delete("RoleBinding", binding, spec.namespace)
        self._delete("ServiceAccount", k8s_access.service_account_name(username, spec.namespace),
                     self.member_accounts_namespace)

    def _member_access_items(self, kind: str, spec: EnvironmentSpec, namespace: str) -> list[dict]:
        selector = f"{ownership_selector(spec)},{k8s_access.MEMBER_ACCESS_LABEL}=true"
        return self._checked(kind, "list", namespace=namespace, label_selector=selector)[1].get("items") or []

    def _delete_member_accounts(self, spec: EnvironmentSpec) -> None:
        """Delete every member ServiceAccount of this environment in the members namespace."""
        for item in self._member_access_items("ServiceAccount", spec, self.member_accounts_namespace):
            self._delete("ServiceAccount", item["metadata"]["name"], self.member_accounts_namespace)

    def _converge_member_access(self, spec: EnvironmentSpec) -> None:
        """Re-bind members' ServiceAccounts to their current tier; delete the access of people who left.

        Decided per object by its username annotation against `spec.members`, never by what a list
        taken earlier held, so a ServiceAccount a download makes meanwhile is kept. ServiceAccounts
        made in the environment's own namespace (before they moved to the members namespace) go.
        """
        roles = {member.username: member for member in spec.members}
        accounts = self.member_accounts_namespace

        def username_of(item: dict) -> str | None:
            return (item["metadata"].get("annotations") or {}).get(k8s_access.USERNAME_ANNOTATION)

        for item in self._member_access_items("ServiceAccount", spec, accounts):
            name, username = item["metadata"]["name"], username_of(item)
            member = roles.get(username)
            if member is None or name != k8s_access.service_account_name(username, spec.namespace):
                logger.info("Removing ServiceAccount %s/%s: %s is no longer a member of %s.", accounts, name,
                            username, spec.tenant_slug)
                self._delete("ServiceAccount", name, accounts)
                continue
            self._apply(k8s_access.role_binding_manifest(spec, member, accounts_namespace=accounts))
        for item in self._member_access_items("RoleBinding", spec, spec.namespace):
            name, username = item["metadata"]["name"], username_of(item)
            member = roles.get(username)
            if member is None or name != k8s_access.role_binding_name(username, spec.namespace, member.role):
                self._delete("RoleBinding", name, spec.namespace)
        for item in self._member_access_items("ServiceAccount", spec, spec.namespace):
            self._delete("ServiceAccount", item["metadata"]["name"], spec.namespace)

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
        return self._checked("Node", "patch", node_name, body=patch, content_type=MERGE_PATCH)[1]

    def cordon(self, node_name: str) -> None:
        self._patch_node(node_name, {"spec": {"unschedulable": True}})

    def uncordon(self, node_name: str) -> None:
        self._patch_node(node_name, {"spec": {"unschedulable": None}})

    def node_workloads(self, node_name: str) -> list[str]:
        """Portal-launched pods on the node that have not finished; DaemonSets and system pods are not ours."""
        items = self._checked(
            "Pod", "list", field_selector=f"spec.nodeName={node_name}", label_selector=OWN
        )[1].get("items") or []
        found = {
            f"{item['metadata']['namespace']}/{item['metadata']['name']}": item
            for item in items
            if (item.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        }
        self._listed_workloads[node_name] = found  # what workload_job and evict read (a drain lists, then asks of each)
        return sorted(found)

    def evict(self, node_name: str, workload: str, *, grace_period_s: int) -> None:
        """Evict through the API, so PodDisruptionBudgets are honoured.

        A 429 is the budget saying not yet (another pod of it is not ready): logged, and the drain
        asks again on its next step rather than stopping. A pod already gone (404) is evicted.
        """
        namespace, _, name = workload.partition("/")
        if ((self._listed(workload) or {}).get("metadata") or {}).get("deletionTimestamp"):
            return  # already being deleted (evicted before): its grace period runs
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"gracePeriodSeconds": grace_period_s},
        }
        try:
            self._call("Pod", "create", name, namespace, body=body, subresource="eviction", accept=(200, 201, 404))
        except ApiStatusError as exc:
            if exc.status != 429:
                raise exc.backend_error() from None
            logger.info("Pod %s on %s cannot be evicted yet (%s); the drain asks again.", workload, node_name,
                        exc.api_message or exc.reason)

    def workload_job(self, workload: str) -> str:
        """The portal job a workload of node_workloads belongs to (`job-<id>`, from the pod's labels), else its name.

        Pods are named `job-<id>-<attempt>-<index>-<suffix>` by the Job controller (a Deployment's
        pod by its ReplicaSet): only the label says whose a pod is.
        """
        namespace, _, name = workload.partition("/")
        pod = self._listed(workload)
        if pod is None:  # a list by name: the portal's role may list pods, not get them
            items = self._checked("Pod", "list", namespace=namespace, field_selector=f"metadata.name={name}")[1]
            pod = next(iter(items.get("items") or []), {})
        job_id = ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_LABEL)
        return f"job-{job_id}" if job_id else name

    def _listed(self, workload: str) -> dict | None:
        """The pod as node_workloads last listed it, if it did."""
        return next((found[workload] for found in self._listed_workloads.values() if workload in found), None)

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
                    self._call("ConfigMap", "create", namespace=self.gpu_operator_namespace, body=body)
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

    # --- Jobs ----------------------------------------------------------------------

    def _attempt_selector(self, job_id: int, attempt: int | None = None) -> str:
        selector = f"{OWN},{JOB_LABEL}={job_id}"
        return selector if attempt is None else f"{selector},{ATTEMPT_LABEL}={attempt}"

    def launch_job(self, launch: JobLaunch) -> int | None:
        """Ensure the checkpoint PVC, apply the rendezvous Service and the indexed Job, then bind what pods exist.

        Applying again changes nothing, so a redelivered launch is harmless. The attempt counts
        as open in this process until the portal's next jobs_open; the pods the Job controller
        creates later are bound by the next sync (the reconcile's status reads).
        """
        if launch.workspace is not None:
            return self._launch_workspace(launch)
        if launch.serving is not None:
            return self._launch_serving(launch)
        if launch.template == "custom" and not (launch.image and launch.command):
            raise PermanentBackendError("A custom job needs an image and a command.")
        # Open from now on in this process, so its pods are bound at once (and by every later sync here).
        self._launched_since[(launch.job_id, launch.attempt)] = launch.namespace
        self._ensure_checkpoint_volume(launch)
        for manifest in job_manifests(
            launch, trainer_image=self.trainer_image, scheduler_name=self.scheduler_name,
            grace_period_s=launch.grace_period_s, finished_ttl_s=self.finished_job_ttl_s,
            cache_grant_key=self.cache_grant_key,
        ):
            self._apply(manifest)
        self._sync(force=True)
        # The trainer resumes from the newest checkpoint on the volume, which the portal recorded.
        return launch.resume_from_step

    def _ensure_checkpoint_volume(self, launch: JobLaunch) -> None:
        """The environment's checkpoint PVC: created once, then only ever grown.

        A claim's storage class and access modes cannot change, nor can it shrink: after an operator
        changes KUBERNETES_CHECKPOINT_STORAGE_CLASS or KUBERNETES_CHECKPOINT_VOLUME_SIZE, existing
        environments keep their claim as it is (new ones get the new class), and a larger size is
        asked for with a patch of the request alone. A refusal of that (a class without
        allowVolumeExpansion) is logged saying so, and the launch goes on with the volume there is.
        """
        manifest = checkpoint_pvc_manifest(
            namespace=launch.namespace, tenant_slug=launch.tenant_slug,
            storage_class=self.checkpoint_storage_class, size=self.checkpoint_volume_size,
        )
        namespace = launch.namespace
        status, current = self._checked("PersistentVolumeClaim", "read", CHECKPOINT_CLAIM, namespace, accept=(200, 404))
        if status == 404:
            status, _ = self._checked("PersistentVolumeClaim", "create", namespace=namespace, body=manifest,
                                      field_manager=self.field_manager, accept=(201, 409))
            return  # 409: another launch made it meanwhile, from the same settings
        spec = current.get("spec") or {}
        have = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
        want = self.checkpoint_volume_size
        try:
            if have and parse_quantity(want) <= parse_quantity(have):
                return
        except ValueError:
            logger.warning("Checkpoint volume %s/%s: cannot compare its size %r with %r; leaving it as it is.",
                           namespace, CHECKPOINT_CLAIM, have, want)
            return
        try:
            self._call("PersistentVolumeClaim", "patch", CHECKPOINT_CLAIM, namespace,
                       body={"spec": {"resources": {"requests": {"storage": want}}}}, content_type=MERGE_PATCH)
        except ApiStatusError as exc:
            error = exc.backend_error()
            if isinstance(error, TransientBackendError):
                raise error from None
            storage_class = spec.get("storageClassName") or "the cluster's default"
            logger.warning(
                "Checkpoint volume %s/%s stays at %s, not %s: the cluster refused to grow it (%s). Growing a claim "
                "needs a storage class with allowVolumeExpansion: true; %s is not one, it seems.",
                namespace, CHECKPOINT_CLAIM, have, want, exc, storage_class,
            )

    def _launch_serving(self, launch: JobLaunch) -> None:
        """Apply the replica's Deployment, then its endpoint's Service and PodDisruptionBudget; bind its pod.

        The shipped server runs the trainer's image (as pytorch-ddp jobs do). The checkpoint
        volume is applied too when the replica serves a job's checkpoint: it is where that is.
        """
        manifests = serve_manifests(launch, server_image=self.trainer_image, scheduler_name=self.scheduler_name,
                                    cache_grant_key=self.cache_grant_key)
        self._launched_since[(launch.job_id, launch.attempt)] = launch.namespace
        if launch.serving.source_job_id is not None:
            self._ensure_checkpoint_volume(launch)
        for manifest in manifests:
            self._apply(manifest)
        self._sync(force=True)

    def _launch_workspace(self, launch: JobLaunch) -> None:
        """Make the workspace's policy and home claim, apply the attempt's Deployment, then its key's Secret; bind its pod.

        The policy comes before any pod, so the pod is never reachable from elsewhere; the Secret after the
        Deployment, whose dependent it is (the answer gives its uid). Everything is idempotent: a redelivered
        launch re-applies what is there and finds the claim and the Secret made (409). The attempt counts as
        open in this process only once its Secret exists, so this process binds its pod only then (one bound
        sooner by another process waits in the kubelet, which retries a missing secretKeyRef).
        """
        claim = home_claim_manifest(launch, storage_class=self.checkpoint_storage_class)
        policy = workspace_network_policy_manifest(launch, portal_namespace=self.portal_namespace)
        deployment = workspace_deployment_manifest(launch, image=self.trainer_image, scheduler_name=self.scheduler_name)
        self._isolate_workspaces(launch.namespace)
        self._apply(policy)
        self._ensure_workspace_home(claim)
        applied = self._apply(deployment)
        self._checked("Secret", "create", namespace=launch.namespace, body=key_secret_manifest(launch, owner=applied),
                      field_manager=self.field_manager, accept=(201, 409))
        self._launched_since[(launch.job_id, launch.attempt)] = launch.namespace
        self._sync(force=True)

    def _isolate_workspaces(self, namespace: str) -> None:
        """Make sure the environment's same-namespace policy leaves workspaces' pods out.

        An environment synced before workspaces ran here lets every pod of the namespace reach every other; its
        next sync brings the policy up to date, and so does this, first, keeping the policy's labels (so the
        sync's prune still knows it as the environment's). A namespace without that policy opens nothing to
        the workspace: its own policy is then the only one that selects its pod.
        """
        items = self._checked("NetworkPolicy", "list", namespace=namespace, label_selector=OWN)[1].get("items") or []
        current = next((item for item in items if item["metadata"]["name"] == SAME_NAMESPACE_POLICY), None)
        if current is None or (current.get("spec") or {}).get("podSelector") == NOT_A_WORKSPACE:
            return
        labels = current["metadata"].get("labels") or {}
        logger.info("Leaving workspaces out of %s/%s, which predates them.", namespace, SAME_NAMESPACE_POLICY)
        self._apply({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": SAME_NAMESPACE_POLICY, "namespace": namespace,
                         "labels": {key: labels[key] for key in (MANAGED_BY_LABEL, TENANT_LABEL, ENVIRONMENT_LABEL)
                                    if key in labels}},
            "spec": same_namespace_policy_spec(),
        })

    def _ensure_workspace_home(self, claim: dict) -> None:
        """The workspace's home claim: created at its first start, then found there (409) and kept as it is.

        A claim of that name that is not the portal's for this workspace (a member made it) is never mounted
        as its home; one being deleted is waited for.
        """
        metadata = claim["metadata"]
        name, namespace = metadata["name"], metadata["namespace"]
        status, _ = self._checked("PersistentVolumeClaim", "create", namespace=namespace, body=claim,
                                  field_manager=self.field_manager, accept=(201, 409))
        if status == 201:
            return
        status, current = self._checked("PersistentVolumeClaim", "read", name, namespace, accept=(200, 404))
        if status == 404:
            raise TransientBackendError(f"The home claim {namespace}/{name} went away while the workspace started; "
                                        "trying again makes it.")
        labels = (current.get("metadata") or {}).get("labels") or {}
        if any(labels.get(key) != value for key, value in metadata["labels"].items()):
            raise PermanentBackendError(
                f"PersistentVolumeClaim {namespace}/{name} already exists and was not made by the portal for this "
                "workspace; an operator has to look at it before the workspace starts."
            )
        if (current.get("metadata") or {}).get("deletionTimestamp"):
            raise TransientBackendError(f"The home claim {namespace}/{name} is still being deleted.")

    # Pods of every attempt, kept current by a watch. Several worker processes each keep their
    # own; binding is idempotent (409 once bound), so they never disagree about a pod.

    def _list_pods(self) -> tuple[list[dict], str]:
        listing = self._checked("Pod", "list", label_selector=OWN)[1]
        return listing.get("items") or [], (listing.get("metadata") or {}).get("resourceVersion", "")

    def _watch_pods(self, resource_version: str):
        """Events since resource_version, for up to watch_timeout_s; 410 Gone raises WatchGone."""
        try:
            _status, response = self._call(
                "Pod", "list", label_selector=OWN, watch=True,
                resource_version=resource_version, timeout_seconds=self.watch_timeout_s,
                allow_watch_bookmarks=True, stream=True, accept=(200,),
                timeout_s=self.watch_timeout_s + self.request_timeout_s,
            )
        except ApiStatusError as exc:
            if exc.status == 410:
                raise k8s_jobs.WatchGone(exc.api_message) from None
            raise exc.backend_error() from None
        try:
            for line in response:
                if line.strip():
                    yield json.loads(line)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientBackendError(f"The pod watch broke off: {exc}") from None
        except ValueError as exc:
            raise TransientBackendError(f"The pod watch sent something that is not JSON: {exc}") from None
        finally:
            response.release_conn()

    def jobs_open(self, attempts: set[tuple[int, int]]) -> None:
        """The attempts the portal holds open now: only their pods are bound, and only they are remembered.

        Replaces the open set (and what this process launched before now); the trackers drop
        every other attempt, whichever process ended it, so memory stays bounded by the open ones.
        """
        with self._sync_lock:
            if isinstance(attempts, dict):
                self._open_attempts = {(int(job_id), int(attempt)): namespace
                                       for (job_id, attempt), namespace in attempts.items()}
            else:
                self._open_attempts = {(int(job_id), int(attempt)): None for job_id, attempt in attempts}
            self._launched_since = {}
            self.tracker.prune(set(self._open_attempts))

    def _is_open(self, attempt: tuple[int, int] | None) -> bool:
        return attempt is not None and (attempt in self._open_attempts or attempt in self._launched_since)

    def _namespace_of(self, attempt: tuple[int, int] | None) -> str | None:
        """The namespace an open attempt runs in, where this process knows it (its launch, or the portal's
        jobs_open)."""
        if attempt is None:
            return None
        return self._launched_since.get(attempt) or self._open_attempts.get(attempt)

    @staticmethod
    def _in_namespace(pods: list[dict], namespace: str | None) -> list[dict]:
        return pods if namespace is None else [pod for pod in pods if pod["metadata"].get("namespace") == namespace]

    def _sync(self, *, force: bool = False) -> None:
        """Bring the pod cache up to date (at most every min_sync_interval_s) and bind open attempts' pods still unbound.

        The watch (or list) runs under `_watch_lock` alone, one at a time: a caller that finds one
        under way reads the cache as it is (a forced sync waits for that watch, then watches again).
        `_sync_lock` is held only while what the watch brought is applied and the pods to bind
        are picked; the bindings are sent after it is released. No lock of the cache's is held
        across a network wait.
        """
        if not force and time.monotonic() - self._synced_at < self.min_sync_interval_s:
            return
        if not self._watch_lock.acquire(blocking=force):
            return
        try:
            if not force and time.monotonic() - self._synced_at < self.min_sync_interval_s:
                return
            read = self.pods.read()
            with self._sync_lock:
                self.pods.take(read)
                to_bind = self._to_bind()
            for pod in to_bind:
                try:
                    self._bind(pod)
                except BackendError as exc:
                    # One pod the server will not bind (being deleted, refused) must not
                    # stop the others, nor the status reads this sync serves.
                    metadata = pod["metadata"]
                    logger.warning("Could not bind pod %s/%s yet: %s", metadata["namespace"], metadata["name"], exc)
        finally:
            self._watch_lock.release()

    def _to_bind(self) -> list[dict]:
        """After a sync (under _sync_lock): reset what was read per sync, and pick the pods to bind."""
        self._synced_at = time.monotonic()
        self._node_verdicts = {}
        self._pods_by_attempt = None
        present = set()
        to_bind = []
        for pod in list(self.pods.items.values()):
            metadata = pod["metadata"]
            present.add(metadata.get("uid", ""))
            if not k8s_jobs.needs_binding(pod, self.scheduler_name):
                continue
            attempt = k8s_jobs.attempt_of(pod)
            if self.tracker.vanished.get(attempt) or self.tracker.disrupted.get(attempt):
                # A replacement (a Deployment's) for a pod that vanished or was evicted: that attempt is over.
                if metadata.get("uid", "") not in self._unbound_noted:
                    self._unbound_noted.add(metadata.get("uid", ""))
                    logger.warning("Leaving pod %s/%s unbound: attempt %s lost a replica.",
                                   metadata["namespace"], metadata["name"], attempt)
                continue
            if not self._is_open(attempt):
                # A leftover of an attempt that ended (or never was): starting it would put it
                # on GPUs the portal has given to someone else.
                if metadata.get("uid", "") not in self._unbound_noted:
                    self._unbound_noted.add(metadata.get("uid", ""))
                    logger.warning("Leaving pod %s/%s unbound: its attempt %s is not open.",
                                   metadata["namespace"], metadata["name"], attempt)
                continue
            expected = self._namespace_of(attempt)
            if expected is not None and metadata.get("namespace") != expected:
                # The attempt's labels on a pod of another namespace: not the portal's, whoever made it.
                if metadata.get("uid", "") not in self._unbound_noted:
                    self._unbound_noted.add(metadata.get("uid", ""))
                    logger.warning("Leaving pod %s/%s unbound: it carries attempt %s's labels, and that attempt "
                                   "runs in %s.", metadata["namespace"], metadata["name"], attempt, expected)
                continue
            to_bind.append(pod)
        self._unbound_noted &= present
        return to_bind

    def _bind(self, pod: dict) -> None:
        node = k8s_jobs.placed_node(pod)
        metadata = pod["metadata"]
        if node is None:
            logger.warning("Pod %s/%s has no placement for its index; leaving it unbound.",
                           metadata["namespace"], metadata["name"])
            return
        status, _ = self._checked(
            "Pod", "create", metadata["name"], metadata["namespace"], subresource="binding",
            body=k8s_jobs.binding_body(pod, node), accept=(200, 201, 404, 409),
        )
        if status in (200, 201):
            logger.info("Bound pod %s/%s to %s.", metadata["namespace"], metadata["name"], node)

    def _node_lost(self, node_name: str) -> str | None:
        if node_name not in self._node_verdicts:
            status, node = self._checked("Node", "read", node_name, accept=(200, 404))
            self._node_verdicts[node_name] = k8s_jobs.node_lost_reason(
                node_name, node if status == 200 else None,
                lost_after_s=self.node_lost_timeout_s, now=datetime.now(timezone.utc),
            )
        return self._node_verdicts[node_name]

    def _cached_pods(self, key: tuple[int, int]) -> list[dict]:
        """The attempt's pods in the watch cache (indexed once per sync: a pass reads every attempt): those that carry
        its labels, in its namespace where this process knows it (`_namespace_of`)."""
        index = self._pods_by_attempt
        if index is None:
            index = {}
            for pod in list(self.pods.items.values()):
                attempt = k8s_jobs.attempt_of(pod)
                if attempt is not None:
                    index.setdefault(attempt, []).append(pod)
            self._pods_by_attempt = index
        return self._in_namespace(index.get(key, []), self._namespace_of(key))

    def job_status(self, job_id: int, attempt: int) -> AttemptStatus:
        self._sync()
        key = (job_id, attempt)
        pods = self._cached_pods(key)
        nodes = {(pod.get("spec") or {}).get("nodeName") for pod in pods if k8s_jobs.pod_exit_code(pod) is None}
        vanished_nodes = self.tracker.vanished_nodes.get(key, {})
        nodes |= set(vanished_nodes.values())
        lost = {node: reason for node in sorted(filter(None, nodes)) if (reason := self._node_lost(node))}
        job = None
        replicas = self.tracker.replicas.get(key, 0)
        exits = self.tracker.exits.get(key, {})
        live_ranks = {k8s_jobs.pod_rank(pod) for pod in pods}
        if not replicas or any(rank not in exits and rank not in live_ranks for rank in range(replicas)):
            # A replica this process knows nothing of: the Job's own status says how it went.
            job = self._read_controller(pods, job_id, attempt)
            spec = (job or {}).get("spec") or {}
            replicas = replicas or spec.get("completions", spec.get("replicas", 0))
        status = k8s_jobs.attempt_status(
            replicas=replicas, pods=pods, exits=self.tracker.exits.get(key, {}),
            vanished=self.tracker.vanished.get(key, {}), job=job, lost_nodes=lost, vanished_nodes=vanished_nodes,
            disrupted=self.tracker.disrupted.get(key, {}),
        )
        if status.phase == "running" and job is not None:
            # Some replica has no pod yet (the Job was read for that reason alone): say why, if the cluster refuses them.
            status = dataclasses.replace(status, waiting=self._pods_refused(job))
        return status

    def _pods_refused(self, controller: dict) -> str:
        """Why the cluster refuses to make an attempt's pods, from the FailedCreate Events its controller
        recorded (one list call): on its Job, or on its Deployment's ReplicaSets; "" when there is none.

        Read only for an attempt with a replica that has no pod. A failed read says nothing (it is
        logged): the attempt's status does not depend on it.
        """
        metadata = controller.get("metadata") or {}
        name = metadata.get("name", "")
        deployed = _deployed(metadata)
        selector = ("involvedObject.kind=ReplicaSet" if deployed else f"involvedObject.kind=Job,involvedObject.name={name}")
        try:
            listing = self._checked("Event", "list", namespace=metadata.get("namespace"),
                                    field_selector=f"{selector},reason={k8s_jobs.FAILED_CREATE}")[1]
        except BackendError as exc:
            logger.warning("Could not read why the pods of %s/%s are not created: %s", metadata.get("namespace"), name, exc)
            return ""
        events = listing.get("items") or []
        if deployed:
            return k8s_jobs.pods_refused(events, name_prefix=f"{name}-")
        return k8s_jobs.pods_refused(events, uid=metadata.get("uid", ""))

    def _read_controller(self, pods: list[dict], job_id: int, attempt: int) -> dict | None:
        """The attempt's Job, or its Deployment for an inference replica or a workspace (its pods say which); None
        once gone."""
        if not pods:
            for kind in ("Job", "Deployment"):
                listing = self._checked(kind, "list", label_selector=self._attempt_selector(job_id, attempt))[1]
                if items := listing.get("items") or []:
                    return items[0]
            return None
        metadata = pods[0]["metadata"]
        kind = "Deployment" if _deployed(metadata) else "Job"
        status, found = self._checked(kind, "read", f"job-{job_id}-{attempt}", metadata["namespace"], accept=(200, 404))
        return found if status == 200 else None

    def _controllers(self, kind: str, selector: str, propagation: str) -> None:
        """Delete every object of `kind` the selector finds (a Job or ReplicaSet), with this propagation."""
        for item in self._checked(kind, "list", label_selector=selector)[1].get("items") or []:
            self._delete(kind, item["metadata"]["name"], item["metadata"]["namespace"], propagation_policy=propagation)

    def _attempt_pods(self, job_id: int, attempt: int | None = None) -> list[dict]:
        """The pods of an attempt (or of every attempt of the job), read now rather than from the cache."""
        return self._checked("Pod", "list", label_selector=self._attempt_selector(job_id, attempt))[1].get("items") or []

    def stop_job(self, job_id: int, attempt: int, *, grace_period_s: int) -> None:
        """Delete the attempt's Job (orphaning its pods, so nothing recreates them), then each pod with the grace period.

        The kubelet sends SIGTERM, so the trainer checkpoints and exits 75; past the grace
        period it is killed. Deleting the pods ourselves is what carries the grace period:
        pods deleted by the garbage collector would get their own default instead.
        """
        # The Job first: once it is deleted its controller makes no more pods, so the list below has them all.
        # An inference replica's Deployment, then its ReplicaSet, likewise (each deleted alone, the
        # ReplicaSet would be remade by the Deployment, or go on making pods).
        selector = self._attempt_selector(job_id, attempt)
        self._controllers("Job", selector, "Orphan")
        self._delete_deployments(selector, "Orphan")
        for pod in self._attempt_pods(job_id, attempt):
            if not k8s_jobs.pod_finished(pod):
                metadata = pod["metadata"]
                self._delete("Pod", metadata["name"], metadata["namespace"], grace_period_seconds=grace_period_s)

    def kill_job(self, job_id: int, attempt: int) -> None:
        # One second, as `kubectl delete --now`: grace 0 would be a force delete, removing the pod
        # object while its containers may still hold the GPUs.
        self.stop_job(job_id, attempt, grace_period_s=1)

    def forget_job(self, job_id: int, attempt: int) -> None:
        """The attempt is over and its outcome recorded: its Job (or Deployment), every pod of it and its Service go.

        Idempotent (what is already gone counts as deleted). The Job goes first, with
        propagationPolicy Background: its controller makes no more pods, and should a pod
        delete below fail, the garbage collector still removes the pods, where Orphan would
        leave them with no owner, a leftover nothing ever removes. Each pod is then deleted
        with one second (the server takes the shorter of that and what the collector asked;
        finished and unbound pods go at once), so nothing of an ended attempt holds its GPUs
        or is bound later. Logs go with the pods: the portal has recorded the progress.
        An inference replica's or a workspace's Deployment and ReplicaSet go the same way (see _delete_deployments);
        a workspace's key goes with them, its home claim and policy stay.
        """
        selector = self._attempt_selector(job_id, attempt)
        self._controllers("Job", selector, "Background")
        self._delete_deployments(selector, "Background")
        for pod in self._attempt_pods(job_id, attempt):
            metadata = pod["metadata"]
            self._delete("Pod", metadata["name"], metadata["namespace"], grace_period_seconds=1)
        for service in self._checked("Service", "list", label_selector=selector)[1].get("items") or []:
            self._delete("Service", service["metadata"]["name"], service["metadata"]["namespace"])
        key = (job_id, attempt)
        with self._sync_lock:
            self.tracker.forget(key)
            self._open_attempts.pop(key, None)
            self._launched_since.pop(key, None)

    def _delete_deployments(self, selector: str, propagation: str) -> None:
        """Delete an inference replica's (or a workspace's) Deployment, then its ReplicaSet, with this propagation.

        The Deployment first (else it would remake the ReplicaSet), the ReplicaSet always (a
        retry after a failure in between finds it alone): once both are gone or being deleted,
        nothing makes a pod for the attempt. The endpoint's shared objects go first if this
        was its last replica: the replica takes no new requests from here on. A workspace's key
        goes before its Deployment, so a retry finds the Deployment to say where the key is.
        """
        deployments = self._checked("Deployment", "list", label_selector=selector)[1].get("items") or []
        for deployment in deployments:
            self._release_endpoint(deployment)
            self._release_workspace(deployment)
            metadata = deployment["metadata"]
            self._delete("Deployment", metadata["name"], metadata["namespace"], propagation_policy=propagation)
        self._controllers("ReplicaSet", selector, propagation)

    def _release_endpoint(self, deployment: dict) -> None:
        """Delete the endpoint's Service and PodDisruptionBudget if this Deployment is the endpoint's last.

        A replica launched meanwhile applies its Deployment before those two: if the second
        look finds one, they are applied again here, so an endpoint with a replica never stays
        without them (one applied after that look recreates them itself).
        """
        metadata = deployment["metadata"]
        labels = metadata.get("labels") or {}
        namespace, endpoint = metadata["namespace"], labels.get(ENDPOINT_LABEL)
        if endpoint is None:
            return
        selector = f"{OWN},{ENDPOINT_LABEL}={endpoint}"

        def others() -> bool:
            items = self._checked("Deployment", "list", namespace=namespace, label_selector=selector)[1].get("items") or []
            return any(item["metadata"]["name"] != metadata["name"] and not item["metadata"].get("deletionTimestamp")
                       for item in items)

        if others():
            return
        shared = endpoint_manifests(namespace=namespace, tenant_slug=labels.get(TENANT_LABEL, ""), endpoint_id=int(endpoint))
        for manifest in shared:
            self._delete(manifest["kind"], manifest["metadata"]["name"], namespace)
        if others():
            for manifest in shared:
                self._apply(manifest)

    def _release_workspace(self, deployment: dict) -> None:
        """Delete a workspace attempt's key (its Secret), if this Deployment is a workspace's; its home claim stays.

        Deleted here, not left to the garbage collector: a stop deletes the Deployment orphaning its dependents,
        the Secret among them.
        """
        metadata = deployment["metadata"]
        labels = metadata.get("labels") or {}
        if WORKSPACE_LABEL not in labels:
            return
        try:
            name = key_secret_name(int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL]))
        except (KeyError, ValueError):
            logger.warning("Deployment %s/%s of a workspace names no attempt; its key is left to the garbage "
                           "collector.", metadata["namespace"], metadata["name"])
            return
        self._delete("Secret", name, metadata["namespace"])

    def workspace_address(self, job_id: int, attempt: int, *, namespace: str = "") -> str | None:
        """`http://<pod IP>:WORKSPACE_PORT` of the workspace's pod (the newest with an IP), from the watch cache."""
        return self._pod_address(job_id, attempt, WORKSPACE_PORT, namespace)

    def delete_workspace_home(self, home: str) -> None:
        """Delete a deleted workspace's home claim and its policy, wherever they are (by its labels); idempotent.

        Its keys went with its attempts (each stop and forget deletes its attempt's Secret).
        """
        selector = workspace_selector(home)
        for claim in self._checked("PersistentVolumeClaim", "list", label_selector=selector)[1].get("items") or []:
            self._delete("PersistentVolumeClaim", claim["metadata"]["name"], claim["metadata"]["namespace"])
        for policy in self._checked("NetworkPolicy", "list", label_selector=selector)[1].get("items") or []:
            self._delete("NetworkPolicy", policy["metadata"]["name"], policy["metadata"]["namespace"])

    def serving_address(self, job_id: int, attempt: int, *, namespace: str = "") -> str | None:
        """`http://<pod IP>:SERVER_PORT` of the replica's pod (the newest with an IP), from the watch cache."""
        return self._pod_address(job_id, attempt, SERVER_PORT, namespace)

    def _pod_address(self, job_id: int, attempt: int, port: int, namespace: str = "") -> str | None:
        """`http://<pod IP>:<port>` of the attempt's newest pod with an IP (an IPv6 one in brackets) in the attempt's
        namespace (``namespace``, else as this process knows it); None before, and None while the namespace is
        unknown: a person's traffic, with the attempt's key, never goes to a pod found by its labels alone."""
        self._sync()
        key = (job_id, attempt)
        namespace = namespace or self._namespace_of(key)
        if not namespace:
            return None
        pods = [pod for pod in self._in_namespace(self._cached_pods(key), namespace)
                if (pod.get("status") or {}).get("podIP")]
        if not pods:
            return None
        pod = max(pods, key=lambda pod: (pod["metadata"].get("creationTimestamp") or "", pod["metadata"]["name"]))
        address = pod["status"]["podIP"]
        return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"

    def _read_log(self, pod: dict, query: list[tuple[str, object]]) -> bytes | None:
        """One read of a pod's workload log; None when there is none (the pod is gone, or its container has not started)."""
        metadata = pod["metadata"]
        try:
            _status, response = self._call(
                "Pod", "read", metadata["name"], metadata["namespace"], subresource="log",
                query_params=[("container", k8s_jobs.workload_container(pod)), *query], stream=True, accept=(200,),
            )
        except ApiStatusError as exc:
            if exc.status in (400, 404):  # gone, or its container has not started yet
                return None
            raise exc.backend_error() from None
        try:
            return response.data
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientBackendError(f"Reading the log of pod {metadata['namespace']}/{metadata['name']} "
                                        f"broke off: {exc}") from None
        finally:
            response.release_conn()

    def job_logs(self, job_id: int, attempt: int, rank: int, *, tail: int) -> str:
        for pod in self._attempt_pods(job_id, attempt):
            if k8s_jobs.pod_rank(pod) == rank:
                data = self._read_log(pod, [("tailLines", tail)] if tail else [])
                return (data or b"").decode(errors="replace")
        return ""

    def _rank0_pod(self, job_id: int, attempt: int) -> dict | None:
        """Rank 0's pod of the attempt from the watch cache (the newest, should there be two)."""
        pods = [pod for pod in self._cached_pods((job_id, attempt)) if k8s_jobs.pod_rank(pod) == 0]
        return max(pods, key=lambda pod: (pod["metadata"].get("creationTimestamp") or "", pod["metadata"]["name"]),
                   default=None)

    def job_checkpoint(self, job_id: int, namespace: str, path: str) -> CheckpointFile:
        """Never read here: a job's checkpoints are on its environment's volume claim in the cluster, which the
        portal mounts nowhere (reading one would mean a pod of the portal's in the tenant's namespace, or an exec
        into the tenant's own pods). The message says how a member gets it."""
        raise CheckpointElsewhere(
            f"The kubernetes backend keeps checkpoints on the volume claim {CHECKPOINT_CLAIM!r} of namespace "
            f"{namespace}, which the portal does not read: get the environment's kubeconfig "
            f"(`portal kubeconfig <environment>`), then copy it from a pod that mounts the claim at "
            f"{CHECKPOINT_MOUNT} (a running replica of the job, or a pod of your own): "
            f"`kubectl -n {namespace} cp <pod>:{CHECKPOINT_MOUNT}/job-{job_id}/{path} ./{PurePosixPath(path).name}`."
        )

    def job_progress(self, job_id: int, attempt: int, cursor: dict) -> ProgressRead:
        """Records rank 0 wrote since the cursor: one read of its pod's log, from where the last one stopped.

        `timestamps=true` and `sinceTime` from the cursor (see k8s_jobs.LogCursor), at most
        PROGRESS_READ_MAX_BYTES (`limitBytes`). A cursor of another attempt or pod starts this
        pod's log afresh. No pod, a pod gone, a container not started or a log that cannot be
        read now: no records, and the cursor handed back as it came, so nothing is lost or read twice.
        """
        unchanged = ProgressRead(cursor=dict(cursor or {}))
        self._sync()
        pod = self._rank0_pod(job_id, attempt)
        if pod is None:
            return unchanged
        metadata = pod["metadata"]
        position = k8s_jobs.LogCursor.resume(cursor or {}, job_id=job_id, attempt=attempt, pod_uid=metadata.get("uid", ""))
        query: list[tuple[str, object]] = [("timestamps", "true"), ("limitBytes", PROGRESS_READ_MAX_BYTES)]
        if position.since is not None:
            query.append(("sinceTime", k8s_jobs.since_time(position.since)))
        try:
            data = self._read_log(pod, query)
        except BackendError as exc:
            # A pod on an unreachable node has no readable log; the status is read regardless.
            logger.warning("Could not read the log of pod %s/%s now: %s", metadata["namespace"], metadata["name"], exc)
            return unchanged
        if data is None:
            return unchanged
        self.log_bytes_read += len(data)
        chunk = k8s_jobs.read_progress(data, position, limit=PROGRESS_READ_MAX_BYTES)
        if chunk.skipped_second is not None:
            logger.warning("Pod %s/%s logged more in the second %s than one read takes (%d bytes); "
                           "skipping the rest of that second.", metadata["namespace"], metadata["name"],
                           k8s_jobs.since_time(chunk.skipped_second), PROGRESS_READ_MAX_BYTES)
        return ProgressRead(metrics=chunk.metrics, checkpoints=chunk.checkpoints, stops=chunk.stops,
                            datasets=chunk.datasets, cursor=chunk.cursor.as_dict(), bytes_read=len(data))

    def gpu_readings(self, attempts: set[tuple[int, int]]) -> dict[tuple[int, int], list[GpuReading]]:
        """The attempts' devices as the DCGM exporter last saw them, read from Prometheus in one query.

        The exporter names the pod and the container that hold each device. A device counts only
        when the watch cache has that pod as a replica of one of these attempts (by its labels,
        never its name: a Deployment's pod is named with a random suffix) and the container is the
        replica's workload container (an injected sidecar holding a GPU is not the replica).
        Everything else the query returns (other workloads, other tenants, attempts not asked
        for) is dropped. No PROMETHEUS_URL: nothing to read.
        """
        if self.prometheus_url is None or not attempts:
            return {}
        replicas = self._replica_pods(attempts)
        if not replicas:
            return {}
        found: dict[tuple[int, int], list[GpuReading]] = {}
        for device in dcgm.read_devices(self.prometheus_url):
            replica = replicas.get((device.namespace, device.pod))
            if replica is None or device.container != replica[2]:
                continue
            key, rank, _container = replica
            found.setdefault(key, []).append(GpuReading(
                rank=rank, device=device.device, at=device.at, source="dcgm", gpu_util_pct=device.gpu_util_pct,
                memory_used_mib=device.memory_used_mib, power_w=device.power_w,
            ))
        for readings in found.values():
            readings.sort(key=lambda reading: (reading.rank, reading.device))
        return found

    def _replica_pods(self, attempts: set[tuple[int, int]]) -> dict[tuple[str, str], tuple[tuple[int, int], int, str]]:
        """(namespace, pod name) -> (attempt, rank, workload container) of the attempts' pods in the watch cache."""
        self._sync()
        replicas = {}
        for key in {(int(job_id), int(attempt)) for job_id, attempt in attempts}:
            for pod in self._cached_pods(key):
                rank = k8s_jobs.pod_rank(pod)
                if rank is not None:
                    metadata = pod["metadata"]
                    replicas[(metadata["namespace"], metadata["name"])] = (key, rank, k8s_jobs.workload_container(pod))
        return replicas


def _deployed(metadata: dict) -> bool:
    """Whether an attempt's object (its pod, or its controller) is an inference replica's or a workspace's: a
    Deployment runs it, not a Job."""
    labels = metadata.get("labels") or {}
    return ENDPOINT_LABEL in labels or WORKSPACE_LABEL in labels


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

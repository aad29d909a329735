"""A local HTTP stand-in for the Kubernetes API server (1.30), strict where the portal depends on it.

It answers like a real API server where the backend can tell: discovery
(`/version`, `/api`, `/apis`, each group version's resource list, which the
dynamic client reads first), Status objects with the real reasons and causes
(NotFound, AlreadyExists, Forbidden, Conflict, Invalid, Expired, TooManyRequests),
namespaces that go Terminating on delete (a second delete is 409) and vanish with
everything in them a little later (403 NamespaceTerminating for new content).

Server-side apply is a merge typed by the OpenAPI schema kubernetes-validate ships
(`x-kubernetes-list-type` map lists by their `x-kubernetes-list-map-keys`, sets,
atomic lists and maps): each manager owns the fields it applied (FieldsV1
managedFields); a field another manager owns with another value is a 409
FieldManagerConflict unless force=true; a field a manager stops applying goes
unless another owns it. resourceVersion moves only when the content changes.
Updates that change immutable fields are refused as the real server refuses them
(422 FieldValueInvalid: a Job's template, selector and completion mode, a
Deployment's or ReplicaSet's selector, a RoleBinding's roleRef, a pod's spec but
its images; a PersistentVolumeClaim, bound at creation, may only grow: 422
FieldValueForbidden to shrink or change its class, 403 when its StorageClass is
not in `expandable_storage_classes`).

Watches (label selectors honoured) stay open, chunked, sending events as they
happen until timeoutSeconds (at most `watch_hold_s`), end with a BOOKMARK when
allowWatchBookmarks asks, and answer a resourceVersion older than the watch
cache's `watch_window_s` (or compacted with `compact()`) with an ERROR event
holding a 410 Status (or with HTTP 410, `gone_as="status"`).

Pod creation goes through admission: LimitRange defaults (and requests from
limits), Pod Security "restricted" where the namespace's
`pod-security.kubernetes.io/enforce` label says so (403 with the plugin's
wording), and ResourceQuota (403 `exceeded quota`, counting pods not finished).
`put()` stores past admission, as someone writing to etcd would.

The controllers work on their own, as on a real cluster: a pass runs every `controller_period_s` in
the stand-in's own thread (and before each request), and a Job or ReplicaSet gets its pods only once it
has existed `controller_delay_s`, so a create returns before its pods exist. A pod create that admission
refuses is what the real Job and ReplicaSet controllers make of it: a core v1 Warning Event FailedCreate
on the owner (`Error creating: <the admission message>`, source and reportingComponent the controller,
count and first/last timestamps; a repeat bumps the count of the same Event), and another try after a
backoff (doubling from `failed_create_backoff_s`), so the pods come once the quota frees. Events are
listed per namespace or cluster-wide with the field selectors the API server supports for them (pods'
too); another key is 400 `field label not supported: <key>`.

For partition changes it serves nodes (merge patches: cordon, labels), pods
with their eviction subresource (policy/v1: the one PodDisruptionBudget over the
pod must allow a disruption, 429 with a DisruptionBudget cause otherwise; the pod
gets the DisruptionTarget condition and is deleted gracefully), and ConfigMaps
(PUT with a resourceVersion check, 409 Conflict when stale), and plays a small
GPU Operator: when a node's `nvidia.com/mig.config` or
`nvidia.com/device-plugin.config` label changes, it reads the operator's
ConfigMaps and, a moment later, advertises the new extended resources and sets
`nvidia.com/mig.config.state`.

For training jobs it serves Services, PersistentVolumeClaims and batch/v1 Jobs,
and plays the Job controller for Indexed Jobs with backoffLimit 0 (one pod per
completion index with the index annotation and label; a pod that fails or
vanishes fails the Job; all succeeded completes it; activeDeadlineSeconds counts
from the Job's start and fails it with DeadlineExceeded, its pods deleted; the
TTL controller deletes a finished Job ttlSecondsAfterFinished later; deleting the
Job orphans its pods unless propagationPolicy says Background/Foreground, when
the garbage collector deletes them `gc_delay_s` later with their own grace), and
a small kubelet: a pod bound through pods/binding (409 once it is bound) is
admitted by its node's kubelet (Failed with reason OutOf<resource> and no
container when the node's allocatable cannot fit it, NodeAffinity when its
nodeSelector does not match) and runs at once; a pod bound to a node that does
not exist never runs and the pod garbage collector deletes it; a running pod
deleted with a grace period is Terminating for `pod_stop_delay_s`, then exits
with `sigterm_exit_code` and goes; with grace 0 it goes at once. Pod logs are what
the test wrote (`write_log`, each line with the time it was written, given or
now; per container, the previous instance's kept by `crash_container` for
previous=true), served as the kubelet serves them: `container` (required when
the pod has several), `tailLines`, `timestamps` (RFC3339 with nine fractional
digits and a space before each line), `sinceTime` (inclusive, to the second: the
API server passes it on without fractions) or `sinceSeconds`, and `limitBytes`
(cutting the answer, timestamps included, wherever the limit falls); only lines
since the last `rotate_log` (the kubelet serves the current file); 400 while the
container has not started; `follow` is not served. Bytes and reads served are
counted per pod (`log_bytes_served`, `log_reads`). It is not a scheduler (the
portal binds pods itself) and runs no container.

For inference replicas it serves apps/v1 Deployments and ReplicaSets and policy/v1
PodDisruptionBudgets (their status kept by a disruption controller), and plays the
Deployment controller (a ReplicaSet per pod template, named and labelled with a
pod-template-hash; a changed template rolls out: Recreate scales the old ones to 0
and waits for their pods to go, RollingUpdate once the new pods are ready) and the
ReplicaSet controller (pods until `replicas` are active: neither terminating nor
finished; extra ones deleted). Deleting either cascades as the API server's default
for apps/v1 does (Background: the garbage collector deletes the dependents
`gc_delay_s` later) unless propagationPolicy is Orphan, which leaves the dependents
without their owner. The kubelet restarts a crashed container of such a pod in place
(`crash_container`).

For workspaces it serves Secrets too (a workspace attempt's key), stored as written; its kubelet
does not check that a pod's secretKeyRef names one (a real kubelet holds the container back until it does).

For members' own kubeconfigs it serves the serviceaccounts/token subresource (an
authentication.k8s.io/v1 TokenRequest answered with a random token, remembered with
its namespace, ServiceAccount and expiry: at least 10 minutes, at most 2^32 s,
shortened to `max_token_expiration_s` when set) and checks bearer tokens as an API
server with RBAC does: a request without a token may do anything; one of
`admin_tokens` (the portal's own; without that list, any token it did not mint)
may do anything too, unless `portal_rbac` gives the RBAC objects deploy/ renders,
when it is `portal_user` and may do what those grant it (an apply that creates is
also checked as a create; writing a Role or RoleBinding that grants more than it
holds needs escalate or bind); a minted token may do what the Roles its
ServiceAccount is bound to by RoleBindings allow, in the binding's namespace only,
whichever namespace the ServiceAccount lives in (a subject names its namespace; one
without means the binding's) (403 Forbidden with the real wording otherwise,
cluster-scoped reads included); an unknown or expired token, or one whose
ServiceAccount was deleted, is 401 Unauthorized, discovery included. That is enough
for the real `kubectl get pods`, which reads `/api`, `/apis`, each group's resource
list and then the pods (the stand-in answers a PodList where kubectl asks for a
Table; kubectl prints it).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
import secrets
import ssl
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import yaml

APPLY_PATCH = "application/apply-patch+yaml"


@dataclass(frozen=True)
class ResourceType:
    """One REST resource the stand-in serves."""

    plural: str
    kind: str
    api_version: str
    namespaced: bool

    @property
    def prefix(self) -> str:
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"


RESOURCE_TYPES = {
    resource.plural: resource
    for resource in (
        ResourceType("namespaces", "Namespace", "v1", namespaced=False),
        ResourceType("resourcequotas", "ResourceQuota", "v1", namespaced=True),
        ResourceType("limitranges", "LimitRange", "v1", namespaced=True),
        ResourceType("serviceaccounts", "ServiceAccount", "v1", namespaced=True),
        ResourceType("networkpolicies", "NetworkPolicy", "networking.k8s.io/v1", namespaced=True),
        ResourceType("roles", "Role", "rbac.authorization.k8s.io/v1", namespaced=True),
        ResourceType("rolebindings", "RoleBinding", "rbac.authorization.k8s.io/v1", namespaced=True),
        ResourceType("nodes", "Node", "v1", namespaced=False),
        ResourceType("pods", "Pod", "v1", namespaced=True),
        ResourceType("configmaps", "ConfigMap", "v1", namespaced=True),
        ResourceType("services", "Service", "v1", namespaced=True),
        ResourceType("persistentvolumeclaims", "PersistentVolumeClaim", "v1", namespaced=True),
        ResourceType("secrets", "Secret", "v1", namespaced=True),
        ResourceType("jobs", "Job", "batch/v1", namespaced=True),
        ResourceType("deployments", "Deployment", "apps/v1", namespaced=True),
        ResourceType("replicasets", "ReplicaSet", "apps/v1", namespaced=True),
        ResourceType("poddisruptionbudgets", "PodDisruptionBudget", "policy/v1", namespaced=True),
        # Core v1 Events, not events.k8s.io/v1: the Job and ReplicaSet controllers record theirs with
        # client-go's tools/record EventRecorder, which writes core v1 Events (kube-controller-manager
        # 1.30 included; the scheduler's events.k8s.io recorder is another), and both APIs serve the
        # same stored objects. Core v1 is what `kubectl describe` reads and the one whose field
        # selectors name `involvedObject.*`.
        ResourceType("events", "Event", "v1", namespaced=True),
    )
}
# Subresources served, by resource: (name, kind, verbs), as discovery lists them.
SUBRESOURCES = {
    "pods": (("eviction", "Eviction", ["create"]), ("binding", "Binding", ["create"]), ("log", "Pod", ["get"])),
    "serviceaccounts": (("token", "TokenRequest", ["create"]),),
}
# A subresource served under another group than its resource's, as discovery says so.
_SUBRESOURCE_GROUPS = {("serviceaccounts", "token"): ("authentication.k8s.io", "v1")}
# The shortest token a TokenRequest may ask for, as the real API server enforces it.
MIN_TOKEN_EXPIRATION_S = 600
_PATH = re.compile(
    r"^(?P<prefix>/api/v1|/apis/[^/]+/v1)"
    r"(?:/namespaces/(?P<namespace>[^/]+))?/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>eviction|binding|log|token))?$"
)
MERGE_PATCH = "application/merge-patch+json"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
# The group versions discovery answers for, besides /version, /api and /apis.
_DISCOVERY_PATHS = {"/api/v1"} | {f"/apis/{r.api_version}" for r in RESOURCE_TYPES.values() if "/" in r.api_version}
# What the simulated GPU Operator reads; the backend's defaults.
GPU_OPERATOR_NAMESPACE = "gpu-operator"
MIG_PARTED_CONFIG_MAP = "portal-mig-parted-config"
DEVICE_PLUGIN_CONFIG_MAP = "portal-device-plugin-config"
# Fields the server owns; they never count as "the content changed".
_SERVER_FIELDS = ("resourceVersion", "managedFields", "uid", "creationTimestamp", "generation", "deletionTimestamp")


@dataclass
class RecordedRequest:
    """One request as the stand-in saw it, and what it answered."""

    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    status: int = 0


@dataclass
class Fault:
    """Answer the next `count` matching requests with `status`, after `delay_s`; a 2xx status only delays."""

    status: int
    method: str | None = None
    path_contains: str = ""
    count: int = 1
    reason: str = ""
    message: str = "injected fault"
    delay_s: float = 0.0
    details: dict | None = None  # The Status's details (name, kind, causes), as a real error carries them.

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and self.path_contains in path


@dataclass
class MintedToken:
    """A token the TokenRequest subresource handed out, and whose it is."""

    namespace: str
    service_account: str
    service_account_uid: str
    expires_at: float  # time.time()

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


@dataclass
class _State:
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)  # (plural, namespace, name)
    events: list[tuple[int, str, str, dict, float]] = field(default_factory=list)  # (rv, type, plural, object, when)
    resource_version: int = 100
    oldest_watchable_rv: int = 0
    namespace_gone_at: dict[str, float] = field(default_factory=dict)


def status_body(code: int, reason: str, message: str, **details) -> dict:
    """A metav1.Status as the API server sends it with an error."""
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    if details:
        body["details"] = details
    return body


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, **details):
        super().__init__(message)
        self.code = code
        self.body = status_body(code, reason, message, **details)


class KubernetesStandIn:
    """Start with `with KubernetesStandIn() as api:`; `api.url` is the host for a kube client."""

    def __init__(
        self, *, termination_delay_s: float = 0.2, validate_version: str | None = None, operator_delay_s: float = 0.05,
        gone_as: str = "event", pod_stop_delay_s: float = 0.05, gc_delay_s: float = 0.05, tls: bool = False,
        admin_tokens: Iterable[str] | None = None, expandable_storage_classes: Iterable[str | None] = (),
        max_token_expiration_s: int | None = None, check_answers: bool = False, watch_hold_s: float | None = None,
        watch_window_s: float | None = 75.0, portal_rbac: Iterable[dict] | None = None,
        portal_user: str = "system:serviceaccount:gpu-portal:gpu-portal", controller_delay_s: float = 0.05,
        controller_period_s: float | None = 0.02, failed_create_backoff_s: float = 0.1,
        history_clock: Callable[[], float] = time.monotonic,
    ):
        # Serve HTTPS with a certificate from a CA made at start (`ca_pem`): kubectl sends a bearer
        # token only over TLS, so tests that run the real kubectl with a member's token need it.
        self.tls = tls
        self.ca_pem: bytes | None = None
        self._tls_dir: tempfile.TemporaryDirectory | None = None
        # The garbage collector: how long after an owner (a Job, Deployment or ReplicaSet) deleted
        # with propagationPolicy Background (or Foreground) it deletes the dependents (pods with
        # their own grace period), as it works asynchronously on a real cluster.
        self.gc_delay_s = gc_delay_s
        self._collect_at: dict[tuple[str, str, str], float] = {}  # (plural, namespace, name)
        # How long the simulated GPU Operator takes to re-partition a node after its label changes.
        self.operator_delay_s = operator_delay_s
        self._reconfigure_at: dict[str, float] = {}
        # How long a deleted namespace stays Terminating; float("inf") models a stuck finalizer.
        self.termination_delay_s = termination_delay_s
        # With a version, every body written is checked by kubernetes-validate in strict mode, as a
        # server with fieldValidation=Strict would; off by default because it costs ~20 ms a request.
        self.validate_version = validate_version
        # A watch from a compacted resourceVersion: a real server answers 200 with an ERROR event
        # holding a 410 Status ("event"); some proxies and older servers answer HTTP 410 ("status").
        self.gone_as = gone_as
        # The simulated kubelet: how long a pod deleted with a grace period takes to stop, and the
        # exit code it stops with (75: the shipped trainer checkpointed on SIGTERM).
        self.pod_stop_delay_s = pod_stop_delay_s
        self.sigterm_exit_code = 75
        # Each pod's log lines as (Unix time in nanoseconds, that time as served, text without its newline).
        # A pod's first container's log is under (namespace, pod), another container's under (namespace, "pod/container").
        self.pod_logs: dict[tuple[str, str], list[tuple[int, str, str]]] = {}
        # The log of each container's previous instance, kept when the kubelet restarts it (previous=true).
        self.previous_logs: dict[tuple[str, str], list[tuple[int, str, str]]] = {}
        self.log_bytes_served: dict[tuple[str, str], int] = {}
        self.log_reads: dict[tuple[str, str], int] = {}
        self._stopping_pods: dict[tuple[str, str], float] = {}
        self._job_indexes: dict[tuple[str, str], set[int]] = {}  # indexes the Job controller made a pod for
        self._job_done: dict[tuple[str, str], dict[int, str]] = {}
        # StorageClasses with allowVolumeExpansion: a bound claim of another class cannot grow (403).
        self.expandable_storage_classes: set[str | None] = set(expandable_storage_classes)
        # Who owns which fields of each object: key -> manager -> (operation, apiVersion, field paths).
        self._fields: dict[tuple[str, str, str], dict[str, tuple[str, str, set]]] = {}
        self._job_started: dict[tuple[str, str], float] = {}  # time.monotonic() the controller first saw the Job
        self._job_expire_at: dict[tuple[str, str], float] = {}  # when the TTL controller deletes a finished Job
        self.requests: list[RecordedRequest] = []
        self.discovery_requests: list[RecordedRequest] = []
        self.faults: list[Fault] = []
        # Bearer tokens with every right (the portal's own credentials); a request with no token has them too.
        # None: any token the stand-in did not mint has them (its users before it minted any send what they like).
        self.admin_tokens: set[str] | None = None if admin_tokens is None else set(admin_tokens)
        # Tokens minted through serviceaccounts/token, by their text.
        self.tokens: dict[str, MintedToken] = {}
        # With check_answers, each JSON answer is checked against the 1.30 OpenAPI schema (strict, as
        # kubernetes-validate ships it); what fails is kept in invalid_answers as (method, path, why).
        self.check_answers = check_answers
        self.invalid_answers: list[tuple[str, str, str]] = []
        # How long a watch stays open waiting for events: None for its timeoutSeconds, as a real server
        # holds it; 0 answers the events so far at once. The watch cache's history: events older than
        # `watch_window_s` are forgotten (a watch from before them is 410), as the API server's cache
        # keeps about 75 s of them. `history_clock` dates those events: a test that must know which side
        # of the window an event falls on passes a clock it moves itself.
        self.watch_hold_s = watch_hold_s
        self.watch_window_s = watch_window_s
        self._history_clock = history_clock
        # The portal's own rights: with RBAC objects (deploy/'s ClusterRole, Roles and their bindings), a
        # request with one of `admin_tokens` is `portal_user` and may do only what those bind to it.
        self.portal_user = portal_user
        self.portal_rbac: list[dict] | None = None if portal_rbac is None else [copy.deepcopy(o) for o in portal_rbac]
        self._caller: object = None  # who the request being routed comes from (under the lock)
        # The API server's --service-account-max-token-expiration (None: not set).
        self.max_token_expiration_s = max_token_expiration_s
        # The controllers work on their own, as on a real cluster: a Job or ReplicaSet gets its pods only
        # once it has existed `controller_delay_s`, from a pass that runs every `controller_period_s` in
        # the stand-in's own thread (and before each request), so a create returns before its pods exist.
        # A pod create that admission refuses (ResourceQuota, Pod Security, ...) is recorded as a Warning
        # Event FailedCreate on its Job or ReplicaSet and tried again after a backoff that doubles from
        # `failed_create_backoff_s` (up to 16 times that), as the controllers requeue with backoff.
        # controller_period_s None: no thread of their own (they run before each request only), for a
        # benchmark with thousands of objects, where a pass takes long.
        self.controller_delay_s = controller_delay_s
        self.controller_period_s = controller_period_s
        self.failed_create_backoff_s = failed_create_backoff_s
        self._created_at: dict[str, float] = {}  # a Job's or ReplicaSet's uid -> time.monotonic() it was created
        self._create_retry: dict[str, tuple[float, int]] = {}  # owner uid -> (when to try again, refusals in a row)
        self.controller_errors: list[str] = []  # what a background pass raised (it goes on with the next)
        self._controllers_stop = threading.Event()
        self._controller_thread: threading.Thread | None = None
        self._state = _State()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified on every event, for open watches
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- Lifecycle -------------------------------------------------------------

    def start(self) -> "KubernetesStandIn":
        standin = self

        class Handler(_Handler):
            api = standin

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        if self.tls:
            self._server.socket = self._tls_context().wrap_socket(self._server.socket, server_side=True)
        # A short poll keeps stop() quick; the default half second would dominate a test run.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="k8s-standin", daemon=True
        )
        self._thread.start()
        self._controllers_stop.clear()
        if self.controller_period_s is not None:
            self._controller_thread = threading.Thread(target=self._run_controllers, name="k8s-standin-controllers",
                                                       daemon=True)
            self._controller_thread.start()
        return self

    def _run_controllers(self) -> None:
        """The controllers' passes between requests: pods are made, stopped and collected whether or not anyone asks."""
        while not self._controllers_stop.wait(self.controller_period_s):
            try:
                with self._lock:
                    self._reap()
            except Exception as exc:  # noqa: BLE001 - kept for the test to see; the next pass goes on
                self.controller_errors.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._controllers_stop.set()
        if self._controller_thread is not None:
            self._controller_thread.join(timeout=5)
        if self._server:
            self._server.shutdown()
            self._server.server_close()
        if self._tls_dir is not None:
            self._tls_dir.cleanup()

    def _tls_context(self) -> ssl.SSLContext:
        """A CA and a server certificate for 127.0.0.1 it signed, made with the openssl binary."""
        self._tls_dir = tempfile.TemporaryDirectory(prefix="k8s-standin-tls-")
        folder = self._tls_dir.name

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=30)

        curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=standin-ca",
                "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        openssl("req", *curve, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
        with open(f"{folder}/server.ext", "w") as ext:
            ext.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
        openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", "server.crt", "-days", "2", "-extfile", "server.ext")
        with open(f"{folder}/ca.crt", "rb") as ca:
            self.ca_pem = ca.read()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(f"{folder}/server.crt", f"{folder}/server.key")
        return context

    def __enter__(self) -> "KubernetesStandIn":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    # --- Test helpers ------------------------------------------------------------

    def finish_termination(self, namespace: str) -> None:
        """Let a Terminating namespace go now (its finalizers are done), whatever the delay."""
        with self._lock:
            if namespace in self._state.namespace_gone_at:
                self._state.namespace_gone_at[namespace] = 0.0

    def inject(self, status: int, **fault) -> Fault:
        """Make the next matching request(s) fail; see Fault for the knobs."""
        injected = Fault(status=status, **fault)
        with self._lock:
            self.faults.append(injected)
        return injected

    def objects(self) -> dict[tuple[str, str, str], dict]:
        """A snapshot of everything stored, keyed by (plural, namespace, name)."""
        with self._lock:
            self._reap()
            return copy.deepcopy(self._state.objects)

    def get(self, plural: str, name: str, namespace: str = "") -> dict | None:
        return self.objects().get((plural, namespace, name))

    def put(self, obj: dict) -> dict:
        """Store an object directly, as if someone else had created it (past admission, as a write to etcd)."""
        resource = next(r for r in RESOURCE_TYPES.values() if r.kind == obj["kind"])
        with self._lock:
            return self._create(resource, obj.get("metadata", {}).get("namespace", ""), obj, manager="someone-else",
                                admit=False)

    def compact(self) -> None:
        """Forget the watch history, as etcd compaction does; older resourceVersions answer 410."""
        with self._lock:
            self._state.events.clear()
            self._state.oldest_watchable_rv = self._state.resource_version

    def clear_log(self) -> None:
        with self._lock:
            self.requests.clear()

    def writes(self) -> list[RecordedRequest]:
        """Requests that could change something (everything but GET)."""
        return [r for r in self.requests if r.method != "GET"]

    # --- The API ---------------------------------------------------------------

    def expire_token(self, token: str) -> None:
        """Make a minted token expired now, as if its expirationSeconds had passed."""
        with self._lock:
            self.tokens[token].expires_at = time.time() - 1

    def handle(
        self, method: str, raw_path: str, content_type: str, body: bytes, authorization: str = ""
    ) -> tuple[int, object]:
        url = urlsplit(raw_path)
        query = parse_qs(url.query)
        record = RecordedRequest(method, url.path, query, content_type)
        try:
            with self._lock:
                self._reap()
                caller = self._authenticate(authorization)
        except ApiError as error:
            record.status = error.code
            with self._lock:
                self.requests.append(record)
            return error.code, error.body
        if method == "GET" and (url.path in ("/version", "/api", "/apis") or url.path.rstrip("/") in _DISCOVERY_PATHS):
            # Discovery is the client's one-time homework, kept apart so tests count only API calls.
            with self._lock:
                self.discovery_requests.append(record)
            record.status = 200
            return 200, self._discovery(url.path.rstrip("/"))
        with self._lock:
            self.requests.append(record)
            fault = next((f for f in self.faults if f.count > 0 and f.matches(method, url.path)), None)
            if fault:
                fault.count -= 1
        if fault:
            if fault.delay_s:
                time.sleep(fault.delay_s)
            record.status = fault.status
            if 200 <= fault.status < 300:
                # A slow but successful answer: only the delay was wanted, so serve the real request.
                fault = None
            else:
                return fault.status, status_body(fault.status, fault.reason or _REASONS.get(fault.status, "InternalError"),
                                                 fault.message, **(fault.details or {}))
        try:
            with self._lock:
                self._reap()
                if caller is not None:
                    self._authorize(caller, method, url.path, query)
                self._caller = caller
                try:
                    code, answer = self._route(method, url.path, query, content_type, body)
                finally:
                    self._caller = None
        except ApiError as error:
            code, answer = error.code, error.body
        record.status = code
        if self.check_answers and isinstance(answer, dict):
            problem = answer_problem(answer)
            if problem:
                with self._lock:
                    self.invalid_answers.append((method, url.path, problem))
        return code, answer

    def _route(self, method, path, query, content_type, body):
        match = _PATH.match(path)
        resource = RESOURCE_TYPES.get(match["plural"]) if match else None
        if not match or resource is None or resource.prefix != match["prefix"]:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        namespace, name = match["namespace"] or "", match["name"]
        all_namespaces = resource.namespaced and not namespace and name is None and method == "GET"
        if resource.namespaced != bool(namespace) and not all_namespaces:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if match["sub"] == "token" and resource.plural == "serviceaccounts" and name is not None and method == "POST":
            return 201, self._token_request(namespace, name, self._parse(body))
        if match["sub"]:
            if resource.plural != "pods" or name is None or (method, match["sub"]) not in (
                ("POST", "eviction"), ("POST", "binding"), ("GET", "log")
            ):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            if match["sub"] == "eviction":
                return 201, self._evict(namespace, name, self._parse(body))
            if match["sub"] == "binding":
                return 201, self._bind(namespace, name, self._parse(body))
            return 200, self._log(namespace, name, query)
        if name is None:
            if method == "GET":
                return self._list(resource, namespace, query)
            if method == "POST":
                created = self._parse(body)
                if isinstance(created.get("metadata"), dict) and created["metadata"].get("name"):
                    self._check_portal_escalation(resource, namespace, created)
                return 201, self._create(resource, namespace, created, manager=_one(query, "fieldManager"))
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on a collection here")
        if method == "GET":
            return 200, self._read(resource, namespace, name)
        if method == "PATCH":
            if content_type.split(";")[0].strip() == MERGE_PATCH:
                return 200, self._merge(resource, namespace, name, self._parse(body), _one(query, "fieldManager"))
            return self._apply(resource, namespace, name, content_type, query, self._parse(body))
        if method == "PUT":
            return 200, self._replace(resource, namespace, name, self._parse(body), _one(query, "fieldManager"))
        if method == "DELETE":
            options = self._parse(body) if body else {}
            grace = _one(query, "gracePeriodSeconds") or options.get("gracePeriodSeconds")
            policy = _one(query, "propagationPolicy") or options.get("propagationPolicy") or ""
            return 200, self._delete(resource, namespace, name, grace_period_s=None if grace in (None, "") else int(grace),
                                     propagation=policy)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")

    @staticmethod
    def _parse(body: bytes) -> dict:
        try:
            parsed = yaml.safe_load(body or b"{}")  # JSON is YAML, so this reads both.
        except yaml.YAMLError as exc:
            raise ApiError(400, "BadRequest", f"the body could not be decoded: {exc}") from exc
        if not isinstance(parsed, dict):
            raise ApiError(400, "BadRequest", "the body must be an object")
        return parsed

    def _key(self, resource: ResourceType, namespace: str, name: str) -> tuple[str, str, str]:
        return (resource.plural, namespace, name)

    def _not_found(self, resource: ResourceType, name: str) -> ApiError:
        return ApiError(404, "NotFound", f'{resource.plural} "{name}" not found', name=name, kind=resource.plural)

    def _read(self, resource, namespace, name) -> dict:
        obj = self._state.objects.get(self._key(resource, namespace, name))
        if obj is None:
            raise self._not_found(resource, name)
        return copy.deepcopy(obj)

    def _list(self, resource, namespace, query):
        if _one(query, "watch") in ("1", "true"):
            return self._watch(resource, namespace, query)
        selector = _parse_selector(_one(query, "labelSelector"))
        fields = _field_terms(resource.kind, _one(query, "fieldSelector"))
        items = [
            copy.deepcopy(obj)
            for (plural, obj_namespace, _name), obj in sorted(self._state.objects.items())
            if plural == resource.plural and (not namespace or obj_namespace == namespace)
            and _selects(selector, obj["metadata"].get("labels") or {})
            and _fields_select(resource.kind, fields, obj)
        ]
        return 200, {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": {"resourceVersion": str(self._state.resource_version)},
            "items": items,
        }

    def _watch(self, resource, namespace, query):
        """A watch, as the API server's watch cache serves it: 410 for a version older than the cache keeps
        (an ERROR event, or HTTP 410 with `gone_as="status"`); otherwise the events since that version, then
        the stream stays open for new ones until `timeoutSeconds` (at most `watch_hold_s`), ending with a
        BOOKMARK at the version reached when allowWatchBookmarks asks for bookmarks."""
        selector = _parse_selector(_one(query, "labelSelector"))
        self._expire_history()
        since = int(_one(query, "resourceVersion") or self._state.resource_version)
        if since < self._state.oldest_watchable_rv:
            gone = ApiError(410, "Expired", f"too old resource version: {since} ({self._state.oldest_watchable_rv})")
            if self.gone_as == "status":
                raise gone
            return 200, json.dumps({"type": "ERROR", "object": gone.body}) + "\n"
        timeout_s = float(_one(query, "timeoutSeconds") or 0) or self.watch_hold_s or 0.0
        hold_s = min(timeout_s, self.watch_hold_s) if self.watch_hold_s is not None else timeout_s
        bookmarks = _one(query, "allowWatchBookmarks") in ("true", "1")

        def selected(since_rv: int) -> list[tuple[int, str]]:
            return [
                (rv, json.dumps({"type": kind, "object": obj}))
                for rv, kind, plural, obj, _at in self._state.events
                if rv > since_rv and plural == resource.plural
                and (not namespace or obj["metadata"].get("namespace") == namespace)
                and _selects(selector, obj["metadata"].get("labels") or {})
            ]

        def stream():
            last, deadline = since, time.monotonic() + hold_s
            while True:
                with self._changed:
                    self._reap()
                    lines = selected(last)
                    if lines:
                        last = lines[-1][0]
                    remaining = deadline - time.monotonic()
                    if not lines and remaining > 0:
                        self._changed.wait(min(remaining, 0.02))
                    reached = self._state.resource_version
                for _rv, line in lines:
                    yield line + "\n"
                if remaining <= 0:
                    break
            if bookmarks:
                yield json.dumps({"type": "BOOKMARK", "object": {
                    "kind": resource.kind, "apiVersion": resource.api_version,
                    "metadata": {"resourceVersion": str(max(last, reached))}}}) + "\n"

        if hold_s <= 0:
            # Answer at once: the events so far (and the bookmark), the stream closed.
            return 200, "".join(stream())
        return 200, stream()

    def _expire_history(self) -> None:
        """The watch cache keeps `watch_window_s` of history; older resourceVersions answer 410."""
        if self.watch_window_s is None:
            return
        horizon = self._history_clock() - self.watch_window_s
        keep = next((i for i, event in enumerate(self._state.events) if event[4] >= horizon), len(self._state.events))
        if keep:
            self._state.oldest_watchable_rv = max(self._state.oldest_watchable_rv, self._state.events[keep - 1][0])
            del self._state.events[:keep]

    def _check_namespace_open(self, resource, namespace) -> None:
        if not resource.namespaced:
            return
        ns = self._state.objects.get(("namespaces", "", namespace))
        if ns is None:
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found', name=namespace, kind="namespaces")
        if ns["status"].get("phase") == "Terminating":
            # The real server's wording and cause, from the NamespaceLifecycle admission plugin.
            raise ApiError(
                403, "Forbidden",
                f"{resource.plural} is forbidden: unable to create new content in namespace {namespace} "
                "because it is being terminated",
                kind=resource.plural,
                causes=[{"reason": "NamespaceTerminating", "message": f"namespace {namespace} is being terminated",
                         "field": "metadata.namespace"}],
            )

    def _check_schema(self, obj: dict) -> None:
        if not self.validate_version:
            return
        import kubernetes_validate

        try:
            kubernetes_validate.validate(obj, self.validate_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise ApiError(422, "Invalid", f"{obj.get('kind')} is invalid: {exc.message}", kind=obj.get("kind")) from None

    def _check_identity(self, resource, namespace, obj, name=None) -> str:
        if obj.get("apiVersion") != resource.api_version or obj.get("kind") != resource.kind:
            raise ApiError(400, "BadRequest", f"the body is {obj.get('apiVersion')}/{obj.get('kind')}, "
                                              f"this endpoint serves {resource.api_version}/{resource.kind}")
        metadata = obj.get("metadata") or {}
        if not metadata.get("name"):
            raise ApiError(422, "Invalid", f"{resource.kind} is invalid: metadata.name: Required value", kind=resource.kind)
        if name is not None and metadata["name"] != name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        if resource.namespaced and metadata.get("namespace", namespace) != namespace:
            raise ApiError(400, "BadRequest", "the namespace of the object does not match the namespace on the URL")
        self._check_schema(obj)
        return metadata["name"]

    def _admit_pod(self, namespace: str, name: str, pod: dict) -> None:
        """The admission plugins a pod's creation goes through, in the API server's order: LimitRanger
        (container defaults), PodSecurity (the namespace's enforce level), ResourceQuota (403 exceeded quota)."""
        spec = pod.setdefault("spec", {})
        for (plural, ns, _n), limit_range in self._state.objects.items():
            if plural != "limitranges" or ns != namespace:
                continue
            for item in (limit_range.get("spec") or {}).get("limits") or []:
                if item.get("type") != "Container":
                    continue
                for container in spec.get("containers") or []:
                    resources = container.setdefault("resources", {})
                    for field_name, default in (("limits", "default"), ("requests", "defaultRequest")):
                        for key, value in (item.get(default) or {}).items():
                            resources.setdefault(field_name, {}).setdefault(key, value)
        for container in spec.get("containers") or []:
            # A request left unset defaults to its limit, as the API server's defaulting does.
            for key, value in ((container.get("resources") or {}).get("limits") or {}).items():
                container["resources"].setdefault("requests", {}).setdefault(key, value)
        labels = (self._state.objects.get(("namespaces", "", namespace)) or {}).get("metadata", {}).get("labels") or {}
        if labels.get("pod-security.kubernetes.io/enforce") == "restricted":
            problems = _restricted_violations(spec)
            if problems:
                raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: violates PodSecurity "restricted:'
                               f'{labels.get("pod-security.kubernetes.io/enforce-version", "latest")}": '
                               + ", ".join(problems), name=name, kind="pods")
        account = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
        if account != "default" and ("serviceaccounts", namespace, account) not in self._state.objects:
            # The ServiceAccount admission plugin (every namespace's "default" one is taken as there).
            raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: error looking up service account '
                           f'{namespace}/{account}: serviceaccount "{account}" not found', name=name, kind="pods")
        usage = _pod_usage(pod)
        for (plural, ns, quota_name), quota in sorted(self._state.objects.items()):
            if plural != "resourcequotas" or ns != namespace:
                continue
            hard = (quota.get("spec") or {}).get("hard") or {}
            missing = [key for key in hard if key.startswith(("requests.", "limits.")) and key not in usage
                       and key.partition(".")[2] in ("cpu", "memory")]
            if missing:
                raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: failed quota: {quota_name}: must specify '
                               + ",".join(sorted(missing)), name=name, kind="pods")
            used = self._quota_used(namespace, hard)
            over = sorted(key for key in hard if key in usage and used.get(key, 0) + usage[key] > _quantity(hard[key]))
            if over:
                requested = ",".join(f"{k}={_show(usage[k])}" for k in over)
                taken = ",".join(f"{k}={_show(used.get(k, 0))}" for k in over)
                limited = ",".join(f"{k}={hard[k]}" for k in over)
                raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: exceeded quota: {quota_name}, '
                               f"requested: {requested}, used: {taken}, limited: {limited}", name=name, kind="pods")

    def _quota_used(self, namespace: str, hard: dict) -> dict[str, float]:
        """What the namespace's pods that have not finished use of each quota'd resource."""
        used: dict[str, float] = {}
        for (plural, ns, _n), pod in self._state.objects.items():
            if plural == "pods" and ns == namespace and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                for key, value in _pod_usage(pod).items():
                    if key in hard:
                        used[key] = used.get(key, 0) + value
        return used

    def _kubelet_admit(self, pod: dict, node: dict) -> tuple[str, str] | None:
        """The kubelet's admission of a pod bound to its node: (reason, message) when it rejects it."""
        selector = pod["spec"].get("nodeSelector") or {}
        node_labels = node["metadata"].get("labels") or {}
        if any(node_labels.get(k) != v for k, v in selector.items()):
            return "NodeAffinity", "Pod was rejected: Predicate NodeAffinity failed: node(s) didn't match Pod's node affinity/selector"
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        used: dict[str, float] = {}
        for (plural, _ns, _n), other in self._state.objects.items():
            if plural == "pods" and other is not pod and other["spec"].get("nodeName") == node["metadata"]["name"] \
                    and (other.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                for key, value in _pod_requests(other).items():
                    used[key] = used.get(key, 0) + value
        for key, value in sorted(_pod_requests(pod).items()):
            capacity = _quantity(allocatable.get(key, 0))
            if value and used.get(key, 0) + value > capacity:
                return f"OutOf{key}", (f"Pod was rejected: Node didn't have enough resource: {key}, requested: "
                                       f"{_show(value)}, used: {_show(used.get(key, 0))}, capacity: {_show(capacity)}")
        return None

    def _check_update(self, resource, name: str, existing: dict, updated: dict) -> None:
        """Update validation and admission for fields that cannot change, as the real server refuses them:
        422 Invalid (FieldValueInvalid "field is immutable", FieldValueForbidden for a PVC's spec), or 403
        from the PersistentVolumeClaimResize admission plugin for a claim whose class cannot expand."""
        group = resource.api_version.rpartition("/")[0]
        qualified = f"{resource.kind}.{group}" if group else resource.kind
        old_spec, new_spec = existing.get("spec") or {}, updated.get("spec") or {}

        def invalid(path: str, value, cause: str, detail: str) -> ApiError:
            text = f"Invalid value: {json.dumps(value, sort_keys=True)}: {detail}" if cause == "FieldValueInvalid" \
                else f"Forbidden: {detail}"
            return ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: {path}: {text}', name=name,
                            group=group, kind=resource.kind,
                            causes=[{"reason": cause, "message": text, "field": path}])

        for path in _IMMUTABLE.get(resource.kind, ()):
            before, after = _at(existing, path), _at(updated, path)
            if before != after:
                raise invalid(path, after, "FieldValueInvalid", "field is immutable")
        if resource.kind == "PersistentVolumeClaim":
            old_size = _at(existing, "spec.resources.requests.storage")
            new_size = _at(updated, "spec.resources.requests.storage")
            others = [k for k in set(old_spec) | set(new_spec) if k not in ("resources", "volumeAttributesClassName")
                      and old_spec.get(k) != new_spec.get(k)]
            if others:
                raise invalid("spec", None, "FieldValueForbidden", "spec is immutable after creation except "
                              "resources.requests and volumeAttributesClassName for bound claims")
            if old_size and new_size and _quantity(new_size) < _quantity(old_size):
                raise invalid("spec.resources.requests.storage", None, "FieldValueForbidden",
                              "field can not be less than previous value")
            if old_size and new_size and _quantity(new_size) > _quantity(old_size) and (
                new_spec.get("storageClassName") not in self.expandable_storage_classes
            ):
                raise ApiError(403, "Forbidden", f'persistentvolumeclaims "{name}" is forbidden: only dynamically '
                               "provisioned pvc can be resized and the storageclass that provisions the pvc must "
                               "support resize", name=name, kind="persistentvolumeclaims")
        if resource.kind == "Pod" and _pod_spec_mutable_part(old_spec) != _pod_spec_mutable_part(new_spec):
            raise invalid("spec", None, "FieldValueForbidden",
                          "pod updates may not change fields other than `spec.containers[*].image`, "
                          "`spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` "
                          "(only additions to existing tolerations), `spec.terminationGracePeriodSeconds` "
                          "(allow it to be set to 1 if it was previously negative)")

    def _bump(self) -> str:
        self._state.resource_version += 1
        return str(self._state.resource_version)

    def _record_event(self, kind: str, resource: ResourceType, obj: dict) -> None:
        if kind == "DELETED":
            # A deleted Job's or ReplicaSet's controller timers go with it.
            self._created_at.pop(obj["metadata"].get("uid"), None)
            self._create_retry.pop(obj["metadata"].get("uid"), None)
        self._state.events.append((int(obj["metadata"]["resourceVersion"]), kind, resource.plural, copy.deepcopy(obj),
                                   self._history_clock()))
        self._changed.notify_all()

    def _create(self, resource, namespace, obj, *, manager, admit: bool = True, operation: str = "Update",
                fields: set | None = None) -> dict:
        name = self._check_identity(resource, namespace, obj)
        key = self._key(resource, namespace, name)
        if key in self._state.objects:
            raise ApiError(409, "AlreadyExists", f'{resource.plural} "{name}" already exists', name=name,
                           kind=resource.plural)
        self._check_namespace_open(resource, namespace)
        stored = copy.deepcopy(obj)
        if resource.kind == "Pod" and admit:
            self._admit_pod(namespace, name, stored)
            stored["status"] = {"phase": "Pending"}  # status is the kubelet's: a create's is dropped
        metadata = stored.setdefault("metadata", {})
        if resource.namespaced:
            metadata["namespace"] = namespace
        metadata.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=_now(),
            resourceVersion=self._bump(),
        )
        if resource.kind in ("Job", "ReplicaSet"):
            self._created_at[metadata["uid"]] = time.monotonic()
        schema = _schema_of(resource)
        self._fields[key] = {manager or "unknown": (operation, resource.api_version,
                                                    set(_leaves(_applied_part(stored), schema)) if fields is None else fields)}
        metadata["managedFields"] = self._managed_fields(key)
        if resource.kind == "Namespace":
            # The API server adds these itself, as it does on a real cluster.
            metadata.setdefault("labels", {})["kubernetes.io/metadata.name"] = name
            stored["spec"] = {"finalizers": ["kubernetes"]}
            stored["status"] = {"phase": "Active"}
        if resource.kind == "PersistentVolumeClaim":
            # Bound at once (a provisioner made its volume), so resize rules are those of a bound claim.
            spec = stored.get("spec") or {}
            stored["status"] = {"phase": "Bound", "accessModes": spec.get("accessModes") or [],
                                "capacity": dict((spec.get("resources") or {}).get("requests") or {})}
        self._state.objects[key] = stored
        self._record_event("ADDED", resource, stored)
        return copy.deepcopy(stored)

    def _apply(self, resource, namespace, name, content_type, query, applied):
        """Server-side apply, as structured-merge-diff does it with the OpenAPI schema's list and map types:
        the applied fields merge into the object (map lists by their keys, sets by value, atomic lists whole);
        a field another manager owns with another value is a 409 conflict unless force=true (which takes it
        over); a field this manager applied before and dropped now goes, unless another manager owns it."""
        if content_type.split(";")[0].strip() != APPLY_PATCH:
            raise ApiError(415, "UnsupportedMediaType", f"the stand-in only serves server-side apply, not {content_type}")
        manager = _one(query, "fieldManager")
        if not manager:
            raise ApiError(422, "Invalid", "PatchOptions.meta.k8s.io is invalid: fieldManager: Required value: "
                                           "is required for apply patch")
        force = _one(query, "force") in ("true", "1")
        self._check_identity(resource, namespace, applied, name)
        key = self._key(resource, namespace, name)
        existing = self._state.objects.get(key)
        self._check_portal_escalation(resource, namespace, applied)
        schema = _schema_of(resource)
        applied_fields = set(_leaves(_applied_part(applied), schema))
        if existing is None:
            if self._caller is PORTAL:
                # An apply that creates is authorized as a create too.
                self._check_portal("create", resource.api_version.rpartition("/")[0], resource.plural, namespace,
                                   name, resource.plural)
            self._create(resource, namespace, applied, manager=manager, operation="Apply", fields=applied_fields)
            return 201, copy.deepcopy(self._state.objects[key])
        if resource.kind == "RoleBinding" and "roleRef" in applied and applied["roleRef"] != existing.get("roleRef"):
            raise ApiError(422, "Invalid", f'RoleBinding.rbac.authorization.k8s.io "{name}" is invalid: '
                                           "roleRef: Invalid value: cannot change roleRef", name=name,
                           group="rbac.authorization.k8s.io", kind="RoleBinding",
                           causes=[{"reason": "FieldValueInvalid", "message": "Invalid value: cannot change roleRef",
                                    "field": "roleRef"}])
        owners = self._fields.setdefault(key, {})
        current_leaves = _leaves(_applied_part(existing), schema)
        applied_leaves = _leaves(_applied_part(applied), schema)
        conflicts = sorted({(other, path) for other, (_op, _version, paths) in owners.items() if other != manager
                            for path in paths & applied_fields
                            if path in current_leaves and current_leaves[path] != applied_leaves.get(path)}, key=str)
        if conflicts and not force:
            listed = [(other, _field_path(path)) for other, path in conflicts]
            versions = {other: owners[other][1] for other, _path in conflicts}
            text = "; ".join(f'conflict with "{other}" using {versions[other]}: {where}' for other, where in listed) \
                if len(listed) == 1 else "\n".join(f'* {other} ({versions[other]}): {where}' for other, where in listed)
            message = f"Apply failed with {len(listed)} conflict{'s' if len(listed) > 1 else ''}: {text}"
            raise ApiError(409, "Conflict", message, name=name, group=resource.api_version.rpartition("/")[0],
                           kind=resource.plural, causes=[
                               {"reason": "FieldManagerConflict", "field": where,
                                "message": f'conflict with "{other}" using {versions[other]}'}
                               for other, where in listed])
        for other, path in conflicts:
            owners[other][2].discard(path)  # force: the applier takes these over
        previous = owners.get(manager, ("Apply", resource.api_version, set()))[2]
        others_paths = set().union(*(paths for other, (_op, _v, paths) in owners.items() if other != manager))
        updated = copy.deepcopy(existing)
        for path in sorted(previous - applied_fields - others_paths, key=_removal_order):
            _remove_path(updated, path, schema)
        _merge_applied(updated, _applied_part(applied), schema)
        self._check_update(resource, name, existing, updated)
        owners[manager] = ("Apply", resource.api_version, applied_fields)
        for other in [other for other, (_op, _v, paths) in owners.items() if not paths and other != manager]:
            del owners[other]
        updated["metadata"]["managedFields"] = self._managed_fields(key)
        if _content(updated) != _content(existing):
            updated["metadata"]["resourceVersion"] = self._bump()
            self._record_event("MODIFIED", resource, updated)
        self._state.objects[key] = updated
        return 200, copy.deepcopy(updated)

    def _managed_fields(self, key) -> list[dict]:
        """metadata.managedFields as the API server writes them (FieldsV1 sets), from who owns what."""
        return [{"manager": manager, "operation": operation, "apiVersion": version, "time": _now(),
                 "fieldsType": "FieldsV1", "fieldsV1": _fields_v1(paths)}
                for manager, (operation, version, paths) in self._fields.get(key, {}).items()]

    def _take_fields(self, resource, key, manager: str, before: dict | None, after: dict) -> None:
        """An update (create, merge patch, PUT) owns the fields it set or changed, taking them from others."""
        schema = _schema_of(resource)
        old, new = _leaves(_applied_part(before or {}), schema), _leaves(_applied_part(after), schema)
        changed = {path for path, value in new.items() if old.get(path, _MISSING) != value}
        owners = self._fields.setdefault(key, {})
        for other, (_op, _v, paths) in list(owners.items()):
            paths -= changed
            paths &= set(new)
            if not paths and other != manager:
                del owners[other]
        entry = owners.get(manager)
        mine = (entry[2] if entry else set()) | changed
        owners[manager] = ("Update" if not entry or entry[0] == "Update" else entry[0], resource.api_version, mine)
        after["metadata"]["managedFields"] = self._managed_fields(key)

    def _delete(self, resource, namespace, name, *, grace_period_s: int | None = None, propagation: str = "") -> dict:
        key = self._key(resource, namespace, name)
        obj = self._state.objects.get(key)
        if obj is None:
            raise self._not_found(resource, name)
        if resource.kind == "Pod":
            return self._delete_pod(key, obj, grace_period_s)
        if resource.kind == "Job":
            # batch/v1 Jobs deleted through the API orphan their pods unless told otherwise; the
            # garbage collector deletes them a moment later otherwise.
            for pod_key, pod in list(self._owned("pods", namespace, obj)):
                if propagation in ("Background", "Foreground"):
                    self._collect_at[pod_key] = time.monotonic() + self.gc_delay_s
                else:
                    pod["metadata"].pop("ownerReferences", None)
                    pod["metadata"]["resourceVersion"] = self._bump()
                    self._record_event("MODIFIED", RESOURCE_TYPES["pods"], pod)
            self._job_indexes.pop((namespace, name), None)
            self._job_done.pop((namespace, name), None)
            self._job_started.pop((namespace, name), None)
            self._job_expire_at.pop((namespace, name), None)
        if resource.kind in ("Deployment", "ReplicaSet"):
            # apps/v1 cascades in the background by default; Orphan leaves the dependents ownerless.
            dependents = "replicasets" if resource.kind == "Deployment" else "pods"
            for dependent_key, dependent in list(self._owned(dependents, namespace, obj)):
                if propagation == "Orphan":
                    dependent["metadata"].pop("ownerReferences", None)
                    dependent["metadata"]["resourceVersion"] = self._bump()
                    self._record_event("MODIFIED", RESOURCE_TYPES[dependents], dependent)
                else:
                    self._collect_at[dependent_key] = time.monotonic() + self.gc_delay_s
        if resource.kind == "Namespace":
            if obj["status"].get("phase") == "Terminating":
                # Its finalizers still run: the real server refuses a second delete.
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on namespaces "{name}": The system is '
                               "ensuring all content is removed from this namespace.  Upon completion, this namespace "
                               "will automatically be purged by the system.", name=name, kind="namespaces")
            if obj["status"].get("phase") != "Terminating":
                obj["status"]["phase"] = "Terminating"
                obj["metadata"]["deletionTimestamp"] = _now()
                obj["metadata"]["resourceVersion"] = self._bump()
                self._record_event("MODIFIED", resource, obj)
                self._state.namespace_gone_at[name] = time.monotonic() + self.termination_delay_s
            return copy.deepcopy(obj)
        del self._state.objects[key]
        obj["metadata"]["resourceVersion"] = self._bump()
        self._record_event("DELETED", resource, obj)
        return copy.deepcopy(obj)

    def _merge(self, resource, namespace, name, patch, manager: str = "") -> dict:
        """A JSON merge patch (RFC 7386), as `kubectl cordon` and label changes send."""
        key = self._key(resource, namespace, name)
        existing = self._state.objects.get(key)
        if existing is None:
            raise self._not_found(resource, name)
        updated = _merge_patch(existing, patch)
        self._check_update(resource, name, existing, updated)
        self._take_fields(resource, key, manager or "unknown", existing, updated)
        if _content(updated) != _content(existing):
            updated["metadata"]["resourceVersion"] = self._bump()
            self._record_event("MODIFIED", resource, updated)
            if resource.kind == "Node" and _partition_labels(existing) != _partition_labels(updated):
                self._reconfigure_at[name] = time.monotonic() + self.operator_delay_s
        self._state.objects[key] = updated
        return copy.deepcopy(updated)

    def _replace(self, resource, namespace, name, obj, manager: str = "") -> dict:
        """PUT: replace the whole object, refusing a stale resourceVersion with 409 Conflict."""
        self._check_identity(resource, namespace, obj, name)
        key = self._key(resource, namespace, name)
        existing = self._state.objects.get(key)
        if existing is None:
            raise self._not_found(resource, name)
        sent = (obj.get("metadata") or {}).get("resourceVersion")
        if sent and sent != existing["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {resource.plural} "{name}": the object '
                                            "has been modified; please apply your changes to the latest version and try again")
        self._check_update(resource, name, existing, obj)
        updated = copy.deepcopy(obj)
        for kept in ("uid", "creationTimestamp"):
            updated["metadata"][kept] = existing["metadata"].get(kept)
        updated["metadata"]["namespace"] = namespace
        self._take_fields(resource, key, manager or "unknown", existing, updated)
        updated["metadata"]["resourceVersion"] = self._bump()
        self._state.objects[key] = updated
        self._record_event("MODIFIED", resource, updated)
        return copy.deepcopy(updated)

    def _evict(self, namespace, name, eviction) -> dict:
        """The eviction subresource, as policy/v1 serves it: the one PodDisruptionBudget over the pod must allow
        a disruption (429 with a DisruptionBudget cause otherwise); the pod gets the DisruptionTarget condition
        and is deleted gracefully (the eviction's deleteOptions, else the pod's own grace period)."""
        key = ("pods", namespace, name)
        pod = self._state.objects.get(key)
        if pod is None:
            raise self._not_found(RESOURCE_TYPES["pods"], name)
        if eviction.get("kind") != "Eviction" or eviction.get("apiVersion") not in ("policy/v1", "policy/v1beta1"):
            raise ApiError(400, "BadRequest", "the body must be a policy/v1 Eviction")
        grace = (eviction.get("deleteOptions") or {}).get("gracePeriodSeconds")
        success = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        phase = (pod.get("status") or {}).get("phase")
        if pod["metadata"].get("deletionTimestamp") or phase in ("Succeeded", "Failed", "Pending"):
            # Terminating, finished or not yet running: no budget is consulted.
            if not pod["metadata"].get("deletionTimestamp"):
                self._delete_pod(key, pod, grace)
            return success
        budgets = [b for b in self._budgets_over(pod)]
        if len(budgets) > 1:
            raise ApiError(500, "InternalError", "This pod has more than one PodDisruptionBudget, which the eviction "
                                                 "subresource does not support.")
        if budgets:
            budget = budgets[0]
            status = self._budget_status(budget)
            if status["disruptionsAllowed"] <= 0:
                raise ApiError(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.",
                               causes=[{"reason": "DisruptionBudget",
                                        "message": f"The disruption budget {budget['metadata']['name']} needs "
                                                   f"{status['desiredHealthy']} healthy pods and has "
                                                   f"{status['currentHealthy']} currently"}])
            budget.setdefault("status", {}).setdefault("disruptedPods", {})[name] = _now()
        conditions = [c for c in pod["status"].get("conditions", []) if c.get("type") != "DisruptionTarget"]
        conditions.append({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                           "message": "Eviction API: evicting", "lastTransitionTime": _now()})
        pod["status"]["conditions"] = conditions
        pod["metadata"]["resourceVersion"] = self._bump()
        self._record_event("MODIFIED", RESOURCE_TYPES["pods"], pod)
        self._delete_pod(key, pod, None if grace is None else int(grace))
        return success

    def _budgets_over(self, pod: dict):
        labels = pod["metadata"].get("labels") or {}
        namespace = pod["metadata"]["namespace"]
        for (plural, ns, _name), budget in self._state.objects.items():
            if plural == "poddisruptionbudgets" and ns == namespace and _label_selects(
                (budget.get("spec") or {}).get("selector"), labels
            ):
                yield budget

    def _budget_status(self, budget: dict) -> dict:
        """What the disruption controller would write: healthy pods, how many must stay, how many may go."""
        namespace = budget["metadata"]["namespace"]
        spec = budget.get("spec") or {}
        pods = [pod for (plural, ns, _n), pod in self._state.objects.items()
                if plural == "pods" and ns == namespace and _label_selects(spec.get("selector"), pod["metadata"].get("labels") or {})]
        healthy = sum(1 for pod in pods if not pod["metadata"].get("deletionTimestamp") and any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in (pod.get("status") or {}).get("conditions", [])))
        # The expected count is the scale of the pods' controllers (an integer minAvailable needs none).
        owners, ownerless = {}, False
        for pod in pods:
            ref = next((r for r in pod["metadata"].get("ownerReferences", []) if r.get("controller")), None)
            owner = ref and next((o for (plural, ns, _n), o in self._state.objects.items()
                                  if ns == namespace and o["metadata"].get("uid") == ref.get("uid")), None)
            if owner is None:
                ownerless = True
            else:
                owners[ref["uid"]] = int((owner.get("spec") or {}).get("replicas", owner["spec"].get("parallelism", 1)))
        expected = sum(owners.values())
        min_available, max_unavailable = spec.get("minAvailable"), spec.get("maxUnavailable")
        if isinstance(min_available, int):
            desired, expected = min_available, len(pods)
        elif ownerless:
            desired = expected + 1  # the controller cannot tell the scale: no disruption allowed
        elif min_available is not None:
            desired = -(-expected * int(str(min_available).rstrip("%")) // 100)
        else:
            unavailable = max_unavailable if isinstance(max_unavailable, int) else (
                expected * int(str(max_unavailable or "0").rstrip("%")) // 100)
            desired = max(expected - unavailable, 0)
        return {"currentHealthy": healthy, "desiredHealthy": desired, "expectedPods": expected,
                "disruptionsAllowed": max(healthy - desired, 0)}

    # --- Discovery, as the dynamic client reads it -----------------------------

    def _discovery(self, path: str) -> dict:
        if path == "/version":
            return {"major": "1", "minor": "30", "gitVersion": "v1.30.0-standin", "platform": "linux/amd64"}
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        groups = sorted({r.api_version for r in RESOURCE_TYPES.values() if "/" in r.api_version})
        if path == "/apis":
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": group.split("/")[0], "versions": [{"groupVersion": group, "version": "v1"}],
                 "preferredVersion": {"groupVersion": group, "version": "v1"}}
                for group in groups
            ]}
        group_version = "v1" if path == "/api/v1" else path.removeprefix("/apis/")
        resources = []
        for resource in RESOURCE_TYPES.values():
            if resource.api_version != group_version:
                continue
            resources.append({"name": resource.plural, "singularName": resource.kind.lower(), "kind": resource.kind,
                              "namespaced": resource.namespaced,
                              "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]})
            for sub, kind, verbs in SUBRESOURCES.get(resource.plural, ()):
                entry = {"name": f"{resource.plural}/{sub}", "singularName": "", "kind": kind,
                         "namespaced": resource.namespaced, "verbs": verbs}
                if (resource.plural, sub) in _SUBRESOURCE_GROUPS:
                    entry["group"], entry["version"] = _SUBRESOURCE_GROUPS[(resource.plural, sub)]
                resources.append(entry)
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}

    # --- Tokens and RBAC, for members' own kubeconfigs ---------------------------

    def _token_request(self, namespace: str, name: str, request: dict) -> dict:
        """serviceaccounts/token: a fresh random token for the ServiceAccount, remembered with its expiry."""
        account = self._state.objects.get(("serviceaccounts", namespace, name))
        if account is None:
            raise self._not_found(RESOURCE_TYPES["serviceaccounts"], name)
        if request.get("apiVersion") != "authentication.k8s.io/v1" or request.get("kind") != "TokenRequest":
            raise ApiError(400, "BadRequest", "the body must be an authentication.k8s.io/v1 TokenRequest")
        self._check_schema(request)
        seconds = int((request.get("spec") or {}).get("expirationSeconds") or 3600)
        if seconds < MIN_TOKEN_EXPIRATION_S:
            raise ApiError(422, "Invalid", "TokenRequest.authentication.k8s.io is invalid: spec.expirationSeconds: "
                                           f"Invalid value: {seconds}: may not specify a duration less than 10 minutes",
                           kind="TokenRequest")
        if seconds > 2**32:
            raise ApiError(422, "Invalid", "TokenRequest.authentication.k8s.io is invalid: spec.expirationSeconds: "
                                           f"Invalid value: {seconds}: may not specify a duration larger than 2^32 seconds",
                           kind="TokenRequest")
        if self.max_token_expiration_s is not None:
            # --service-account-max-token-expiration: the server shortens the token and says so in its answer.
            seconds = min(seconds, self.max_token_expiration_s)
        token = secrets.token_urlsafe(32)
        expires_at = time.time() + seconds
        self.tokens[token] = MintedToken(namespace, name, account["metadata"]["uid"], expires_at)
        return {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": _now()},
            "spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": seconds},
            "status": {"token": token, "expirationTimestamp": datetime.fromtimestamp(int(expires_at), timezone.utc)
                       .strftime("%Y-%m-%dT%H:%M:%SZ")},
        }

    def _authenticate(self, authorization: str) -> MintedToken | None:
        """Who is calling: None for the portal's own credentials (or none at all), else the minted token."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        bearer = scheme.lower() == "bearer"
        if bearer and token not in self.tokens and (self.admin_tokens is None or token in self.admin_tokens):
            return PORTAL if self.portal_rbac is not None and self.admin_tokens is not None else None
        minted = self.tokens.get(token) if bearer else None
        account = minted and self._state.objects.get(("serviceaccounts", minted.namespace, minted.service_account))
        if minted is None or minted.expires_at <= time.time() or account is None or (
            account["metadata"]["uid"] != minted.service_account_uid
        ):
            # Unknown, expired, or its ServiceAccount deleted (and perhaps made again): the token is dead.
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return minted

    def _authorize(self, caller: MintedToken, method: str, path: str, query: dict) -> None:
        """RBAC for a minted token: what the Roles bound to its ServiceAccount in a namespace allow there."""
        if path in ("/version", "/api", "/apis") or path.rstrip("/") in _DISCOVERY_PATHS:
            return  # discovery is open to every authenticated caller (system:discovery)
        match = _PATH.match(path)
        resource = RESOURCE_TYPES.get(match["plural"]) if match else None
        if resource is None:
            return  # the route answers 404
        namespace, name, sub = match["namespace"] or "", match["name"], match["sub"]
        if method == "GET":
            verb = "get" if name else ("watch" if _one(query, "watch") in ("1", "true") else "list")
        else:
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update",
                    "DELETE": "delete" if name else "deletecollection"}.get(method, method.lower())
        if sub == "log":
            verb = "get"
        group = resource.api_version.rpartition("/")[0]
        plural = f"{resource.plural}/{sub}" if sub else resource.plural
        if caller is PORTAL:
            self._check_portal(verb, group, plural, namespace, name, resource.plural)
            return
        if namespace and self._rbac_allows(caller, namespace, verb, group, plural):
            return
        raise _forbidden(caller.user, verb, group, plural, namespace, name, resource.plural)

    def _portal_rules(self, namespace: str) -> list[dict]:
        """The rules deploy/'s RBAC grants the portal's user in a namespace ("" : cluster-wide ones only)."""
        objects = self.portal_rbac or []
        user_namespace, _, user_name = self.portal_user.removeprefix("system:serviceaccount:").partition(":")

        def names_portal(binding: dict) -> bool:
            return any(s.get("kind") == "ServiceAccount" and s.get("name") == user_name
                       and s.get("namespace", binding["metadata"].get("namespace")) == user_namespace
                       or s.get("kind") == "User" and s.get("name") == self.portal_user
                       for s in binding.get("subjects") or [])

        def role(kind: str, name: str, role_namespace: str) -> list[dict]:
            found = next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name
                          and (kind == "ClusterRole" or o["metadata"].get("namespace") == role_namespace)), None)
            return (found or {}).get("rules") or []

        rules = []
        for binding in objects:
            if binding["kind"] == "ClusterRoleBinding" and names_portal(binding):
                rules += role("ClusterRole", binding["roleRef"]["name"], "")
            elif binding["kind"] == "RoleBinding" and namespace and binding["metadata"].get("namespace") == namespace \
                    and names_portal(binding):
                rules += role(binding["roleRef"]["kind"], binding["roleRef"]["name"], namespace)
        return rules

    def _portal_allows(self, verb: str, group: str, plural: str, namespace: str, name: str | None) -> bool:
        return any(_matches(rule.get("verbs"), verb) and _matches(rule.get("apiGroups"), group)
                   and _matches(rule.get("resources"), plural)
                   and (not rule.get("resourceNames") or (name is not None and name in rule["resourceNames"]))
                   for rule in self._portal_rules(namespace))

    def _check_portal(self, verb, group, plural, namespace, name, kind_plural) -> None:
        if not self._portal_allows(verb, group, plural, namespace, name):
            raise _forbidden(self.portal_user, verb, group, plural, namespace, name, kind_plural)

    def _check_portal_escalation(self, resource, namespace: str, obj: dict) -> None:
        """RBAC's escalation checks for the portal's writes of a Role (escalate) or a RoleBinding (bind):
        needed unless the portal itself holds every right the Role grants."""
        if self._caller is not PORTAL or resource.kind not in ("Role", "RoleBinding"):
            return
        if resource.kind == "Role":
            rules, role_name, verb = obj.get("rules") or [], obj["metadata"]["name"], "escalate"
        else:
            ref = obj.get("roleRef") or {}
            stored = self._state.objects.get(("roles", namespace, ref.get("name", ""))) or {}
            rules, role_name, verb = stored.get("rules") or [], ref.get("name", ""), "bind"
        held = all(self._portal_allows(v, g, r, namespace, None)
                   for rule in rules for v in rule.get("verbs") or [] for g in rule.get("apiGroups") or [""]
                   for r in rule.get("resources") or [])
        if not held and not self._portal_allows(verb, "rbac.authorization.k8s.io", "roles", namespace, role_name):
            raise ApiError(403, "Forbidden", f'{resource.plural}.rbac.authorization.k8s.io "{obj["metadata"]["name"]}" '
                           f'is forbidden: user "{self.portal_user}" (groups=["system:serviceaccounts" '
                           '"system:authenticated"]) is attempting to grant RBAC permissions not currently held',
                           name=obj["metadata"]["name"], group="rbac.authorization.k8s.io", kind=resource.plural)

    def _rbac_allows(self, caller: MintedToken, namespace: str, verb: str, group: str, plural: str) -> bool:
        subject = {"kind": "ServiceAccount", "name": caller.service_account, "namespace": caller.namespace}
        for (kind, obj_namespace, _name), binding in self._state.objects.items():
            if kind != "rolebindings" or obj_namespace != namespace:
                continue
            if not any({k: s.get(k, namespace if k == "namespace" else None) for k in subject} == subject
                       for s in binding.get("subjects") or []):
                continue
            ref = binding.get("roleRef") or {}
            role = self._state.objects.get(("roles", namespace, ref.get("name", ""))) if ref.get("kind") == "Role" else None
            for rule in (role or {}).get("rules") or []:
                if (_matches(rule.get("verbs"), verb) and _matches(rule.get("apiGroups"), group)
                        and _matches(rule.get("resources"), plural)):
                    return True
        return False

    # --- Pods: binding, logs, a small kubelet, and the Job controller --------------

    def _bind(self, namespace, name, binding) -> dict:
        """pods/binding, as a scheduler sends it: the pod is assigned to the node and (here) starts at once."""
        pod = self._state.objects.get(("pods", namespace, name))
        if pod is None:
            raise self._not_found(RESOURCE_TYPES["pods"], name)
        self._check_schema(binding)
        target = binding.get("target") or {}
        if binding.get("kind") != "Binding" or target.get("kind") != "Node" or not target.get("name"):
            raise ApiError(400, "BadRequest", "the body must be a v1 Binding whose target is a Node")
        if pod["spec"].get("nodeName"):
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} is '
                                            f"already assigned to node \"{pod['spec']['nodeName']}\"")
        pod["spec"]["nodeName"] = target["name"]
        node = self._state.objects.get(("nodes", "", target["name"]))
        if node is None:
            # Bound to a node that does not exist: no kubelet runs it, and the pod garbage collector deletes it.
            pod["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}
            pod["metadata"]["resourceVersion"] = self._bump()
            self._record_event("MODIFIED", RESOURCE_TYPES["pods"], pod)
            self._collect_at[("pods", namespace, name)] = time.monotonic() + self.gc_delay_s
            return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        rejected = self._kubelet_admit(pod, node)
        if rejected:
            # The kubelet refuses it: Failed at once, no container ever made.
            pod["status"] = {"phase": "Failed", "reason": rejected[0], "message": rejected[1], "startTime": _now()}
            pod["metadata"]["resourceVersion"] = self._bump()
            self._record_event("MODIFIED", RESOURCE_TYPES["pods"], pod)
            return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        pod["status"] = {
            "phase": "Running", "startTime": _now(), "podIP": f"10.0.0.{len(self._state.objects) % 250 + 1}",
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {"name": c["name"], "ready": True, "restartCount": 0, "image": c.get("image", ""), "imageID": "",
                 "state": {"running": {"startedAt": _now()}}}
                for c in pod["spec"].get("containers", [])
            ],
        }
        pod["metadata"]["resourceVersion"] = self._bump()
        self._record_event("MODIFIED", RESOURCE_TYPES["pods"], pod)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _log(self, namespace, name, query) -> bytes:
        """pods/log as the kubelet answers it: tailLines first, then since, then timestamps, then limitBytes."""
        pod = self._state.objects.get(("pods", namespace, name))
        if pod is None:
            raise self._not_found(RESOURCE_TYPES["pods"], name)
        tail, limit = _count_param(query, "tailLines", minimum=0), _count_param(query, "limitBytes", minimum=1)
        since_seconds = _count_param(query, "sinceSeconds", minimum=1)
        since_text = _one(query, "sinceTime")
        if since_text and since_seconds is not None:
            raise ApiError(422, "Invalid", "PodLogOptions is invalid: at most one of `sinceTime` or `sinceSeconds` "
                                           "may be specified")
        names = [c["name"] for c in pod["spec"].get("containers") or []]
        container = _one(query, "container")
        if not container:
            if len(names) > 1:
                raise ApiError(400, "BadRequest", f"a container name must be specified for pod {name}, choose one of: "
                                                  f"[{' '.join(names)}]")
            container = names[0] if names else "trainer"
        elif container not in names:
            raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {name}")
        if (pod.get("status") or {}).get("phase", "Pending") == "Pending":
            raise ApiError(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: '
                                              "ContainerCreating")
        log_key = (namespace, name) if not names or container == names[0] else (namespace, f"{name}/{container}")
        if _one(query, "previous") in ("true", "1"):
            if log_key not in self.previous_logs:
                raise ApiError(400, "BadRequest", f'previous terminated container "{container}" in pod "{name}" '
                                                  "not found")
            source = self.previous_logs[log_key]
        else:
            source = self.pod_logs.get(log_key, [])
        since_ns = 0
        if since_text:
            try:
                since = datetime.fromisoformat(since_text.replace("Z", "+00:00"))
            except ValueError:
                raise ApiError(400, "BadRequest", f"invalid sinceTime {since_text!r}: not RFC3339") from None
            # The API server hands sinceTime on to the kubelet as RFC3339 without fractions.
            since_ns = int(since.timestamp()) * 1_000_000_000
        elif since_seconds is not None:
            since_ns = time.time_ns() - since_seconds * 1_000_000_000
        lines = source
        if tail is not None:
            lines = lines[-tail:] if tail else []
        stamped = _one(query, "timestamps") in ("true", "1")
        payload = "".join(
            (f"{shown} " if stamped else "") + text + "\n" for at, shown, text in lines if at >= since_ns
        ).encode()
        if limit is not None:
            payload = payload[:limit]
        self.log_bytes_served[(namespace, name)] = self.log_bytes_served.get((namespace, name), 0) + len(payload)
        self.log_reads[(namespace, name)] = self.log_reads.get((namespace, name), 0) + 1
        return payload

    def _delete_pod(self, key, pod, grace_period_s) -> dict:
        """A running pod deleted with a grace period is Terminating until its container stops (the kubelet's part)."""
        if grace_period_s is None:
            grace_period_s = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        metadata = pod["metadata"]
        running = (pod.get("status") or {}).get("phase") == "Running"
        if grace_period_s > 0 and running:
            if not metadata.get("deletionTimestamp"):
                metadata["deletionTimestamp"] = _now()
                metadata["deletionGracePeriodSeconds"] = grace_period_s
                metadata["resourceVersion"] = self._bump()
                self._record_event("MODIFIED", RESOURCE_TYPES["pods"], pod)
                self._stopping_pods[key[1:]] = time.monotonic() + self.pod_stop_delay_s
            return copy.deepcopy(pod)
        del self._state.objects[key]
        self._stopping_pods.pop(key[1:], None)
        metadata["resourceVersion"] = self._bump()
        self._record_event("DELETED", RESOURCE_TYPES["pods"], pod)
        return copy.deepcopy(pod)

    def _terminate(self, pod: dict, exit_code: int, reason: str) -> None:
        pod["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
        for container in pod["status"].get("containerStatuses", []):
            container["ready"] = False
            container["state"] = {"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": _now()}}
        pod["metadata"]["resourceVersion"] = self._bump()
        self._record_event("MODIFIED", RESOURCE_TYPES["pods"], pod)

    def _stop_pods(self) -> None:
        """Terminating pods whose container has stopped: their exit code is written, then they go."""
        now = time.monotonic()
        for (namespace, name), due in list(self._stopping_pods.items()):
            if due > now:
                continue
            del self._stopping_pods[(namespace, name)]
            key = ("pods", namespace, name)
            pod = self._state.objects.get(key)
            if pod is None:
                continue
            if pod["status"].get("phase") == "Running":
                self._terminate(pod, self.sigterm_exit_code, "Error" if self.sigterm_exit_code else "Completed")
            del self._state.objects[key]
            pod["metadata"]["resourceVersion"] = self._bump()
            self._record_event("DELETED", RESOURCE_TYPES["pods"], pod)

    def _owned(self, plural: str, namespace: str, owner: dict):
        """(key, object) of each `plural` object in the namespace that the owner owns."""
        uid = owner["metadata"]["uid"]
        for key, obj in list(self._state.objects.items()):
            if key[0] == plural and key[1] == namespace and any(
                ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences", [])
            ):
                yield key, obj

    def _expire_jobs(self) -> None:
        """The TTL-after-finished controller: a finished Job goes `ttlSecondsAfterFinished` after it finished,
        deleted with Background propagation (its pods follow through the garbage collector)."""
        now = time.monotonic()
        for (namespace, name), due in list(self._job_expire_at.items()):
            if due > now:
                continue
            del self._job_expire_at[(namespace, name)]
            if ("jobs", namespace, name) in self._state.objects:
                self._delete(RESOURCE_TYPES["jobs"], namespace, name, propagation="Background")

    def _run_jobs(self) -> None:
        """The Job controller, for what the portal's Jobs use: Indexed, parallelism = completions, backoffLimit 0."""
        for key, job in list(self._state.objects.items()):
            if key[0] != "jobs":
                continue
            namespace, name = key[1], key[2]
            status = job.setdefault("status", {})
            if any(c["type"] in ("Complete", "Failed") for c in status.get("conditions", [])):
                continue
            pods = {int(pod["metadata"]["annotations"][COMPLETION_INDEX]): (pod_key, pod)
                    for pod_key, pod in self._owned("pods", namespace, job)}
            made = self._job_indexes.setdefault((namespace, name), set())
            # What each index's pod ended as, kept once seen (the real controller tracks it with finalizers).
            done = self._job_done.setdefault((namespace, name), {})
            for index, (_k, pod) in pods.items():
                if pod["status"].get("phase") in ("Succeeded", "Failed"):
                    done.setdefault(index, pod["status"]["phase"])
            completions = job["spec"].get("completions", 1)
            succeeded = sum(1 for phase in done.values() if phase == "Succeeded")
            # An index whose pod failed, or vanished before it succeeded, fails the Job (backoffLimit 0).
            failed = [i for i in made if done.get(i) == "Failed" or (i not in pods and i not in done)]
            before = copy.deepcopy(status)
            # activeDeadlineSeconds counts from the Job's start (when the controller first saw it),
            # before any pod is bound, pulled or started.
            started = self._job_started.setdefault((namespace, name), time.monotonic())
            status.setdefault("startTime", job["metadata"].get("creationTimestamp") or _now())
            deadline = job["spec"].get("activeDeadlineSeconds")
            if deadline is not None and not failed and succeeded < completions and (
                time.monotonic() - started >= int(deadline)
            ):
                status["conditions"] = [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
                                         "message": "Job was active longer than specified deadline",
                                         "lastTransitionTime": _now()}]
                for pod_key, pod in pods.values():
                    if pod["status"].get("phase") not in ("Succeeded", "Failed"):
                        failed.append(int(pod["metadata"]["annotations"][COMPLETION_INDEX]))
                        self._delete_pod(pod_key, pod, None)
            elif failed:
                status["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                         "message": "Job has reached the specified backoff limit",
                                         "lastTransitionTime": _now()}]
                for pod_key, pod in pods.values():
                    if pod["status"].get("phase") not in ("Succeeded", "Failed"):
                        self._delete_pod(pod_key, pod, None)
            elif succeeded == completions:
                status["conditions"] = [{"type": "Complete", "status": "True", "lastTransitionTime": _now()}]
                status["completionTime"] = _now()
            elif self._may_make_pods(job):
                for index in range(completions):
                    if index in made:
                        continue
                    try:
                        self._make_pod(namespace, job, index)
                    except ApiError as error:
                        self._refused(job, RESOURCE_TYPES["jobs"], error, "job-controller")
                        break
                    made.add(index)
                else:
                    self._create_retry.pop(job["metadata"]["uid"], None)
            status["succeeded"], status["failed"] = succeeded, len(set(failed))
            status["active"] = sum(1 for _k, pod in pods.values() if pod["status"].get("phase") in ("Pending", "Running")
                                   and not pod["metadata"].get("deletionTimestamp"))
            if any(c["type"] in ("Complete", "Failed") for c in status.get("conditions", [])):
                ttl = job["spec"].get("ttlSecondsAfterFinished")
                if ttl is not None:
                    self._job_expire_at[(namespace, name)] = time.monotonic() + int(ttl)
            if status != before:
                job["metadata"]["resourceVersion"] = self._bump()
                self._record_event("MODIFIED", RESOURCE_TYPES["jobs"], job)

    def _run_deployments(self) -> None:
        """The Deployment controller: a ReplicaSet per pod template (named and labelled with its hash); a changed
        template rolls out a new one and scales the old ones to 0 (Recreate: first, and the new one waits for
        their pods to go; RollingUpdate: once the new one's pods are ready); `replicas` scales the current one."""
        for key, deployment in list(self._state.objects.items()):
            if key[0] != "deployments":
                continue
            spec = deployment["spec"]
            template = copy.deepcopy(spec["template"])
            template_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
            owned = list(self._owned("replicasets", key[1], deployment))
            current = next((rs for _k, rs in owned
                            if (rs["metadata"].get("labels") or {}).get("pod-template-hash") == template_hash), None)
            old = [rs for _k, rs in owned if rs is not current]
            desired = spec.get("replicas", 1)
            recreate = (spec.get("strategy") or {}).get("type") == "Recreate"
            ready_new = 0 if current is None else sum(
                1 for _k, pod in self._owned("pods", key[1], current)
                if any(c.get("type") == "Ready" and c.get("status") == "True"
                       for c in (pod.get("status") or {}).get("conditions", [])))
            if recreate or ready_new >= desired:
                for replica_set in old:
                    self._scale(replica_set, 0)
            if recreate and any(any(self._owned("pods", key[1], rs)) for rs in old):
                continue  # Recreate: the new pods wait until the old ones are gone
            if current is not None:
                self._scale(current, desired)
                continue
            labels = {**(template.get("metadata") or {}).get("labels", {}), "pod-template-hash": template_hash}
            template.setdefault("metadata", {})["labels"] = labels
            name = deployment["metadata"]["name"]
            replica_set = {
                "apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": f"{name}-{template_hash}", "namespace": key[1], "labels": labels,
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": name,
                                                  "uid": deployment["metadata"]["uid"], "controller": True}]},
                "spec": {
                    "replicas": desired,
                    "selector": {"matchLabels": {**spec["selector"]["matchLabels"], "pod-template-hash": template_hash}},
                    "template": template,
                },
            }
            try:
                self._create(RESOURCE_TYPES["replicasets"], key[1], replica_set, manager="deployment-controller")
            except ApiError:
                continue  # the namespace is going away: its Deployments go with it

    def _scale(self, replica_set: dict, replicas: int) -> None:
        if replica_set["spec"].get("replicas", 1) != replicas:
            replica_set["spec"]["replicas"] = replicas
            replica_set["metadata"]["resourceVersion"] = self._bump()
            self._record_event("MODIFIED", RESOURCE_TYPES["replicasets"], replica_set)

    def _run_disruption(self) -> None:
        """The disruption controller: each PodDisruptionBudget's status, and evicted pods forgotten once gone."""
        for key, budget in list(self._state.objects.items()):
            if key[0] != "poddisruptionbudgets":
                continue
            status = budget.setdefault("status", {})
            before = copy.deepcopy(status)
            disrupted = {pod: at for pod, at in (status.get("disruptedPods") or {}).items()
                         if ("pods", key[1], pod) in self._state.objects}
            status.update(self._budget_status(budget), observedGeneration=1)
            if disrupted:
                status["disruptedPods"] = disrupted
            else:
                status.pop("disruptedPods", None)
            if status != before:
                budget["metadata"]["resourceVersion"] = self._bump()
                self._record_event("MODIFIED", RESOURCE_TYPES["poddisruptionbudgets"], budget)

    def _run_replica_sets(self) -> None:
        """The ReplicaSet controller: a new pod for each one missing from `replicas` active ones."""
        for key, replica_set in list(self._state.objects.items()):
            if key[0] != "replicasets":
                continue
            active = [(pod_key, pod) for pod_key, pod in self._owned("pods", key[1], replica_set)
                      if not pod["metadata"].get("deletionTimestamp")
                      and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
            for pod_key, pod in active[replica_set["spec"].get("replicas", 1):]:
                self._delete_pod(pod_key, pod, None)  # scaled down: the extra pods go, with their grace
            missing = replica_set["spec"].get("replicas", 1) - len(active)
            if missing <= 0 or not self._may_make_pods(replica_set):
                continue
            for _missing in range(missing):
                template = replica_set["spec"]["template"]
                name = replica_set["metadata"]["name"]
                metadata = copy.deepcopy(template.get("metadata") or {})
                metadata["name"] = f"{name}-{uuid.uuid4().hex[:5]}"
                metadata["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name,
                                                "uid": replica_set["metadata"]["uid"], "controller": True}]
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
                       "spec": copy.deepcopy(template["spec"]), "status": {"phase": "Pending"}}
                try:
                    self._create(RESOURCE_TYPES["pods"], key[1], pod, manager="replicaset-controller")
                except ApiError as error:
                    self._refused(replica_set, RESOURCE_TYPES["replicasets"], error, "replicaset-controller")
                    break
            else:
                self._create_retry.pop(replica_set["metadata"]["uid"], None)

    def _may_make_pods(self, owner: dict) -> bool:
        """Whether the controller makes pods for this Job or ReplicaSet now: it has existed `controller_delay_s`,
        and the backoff after a refused create has passed."""
        uid = owner["metadata"]["uid"]
        now = time.monotonic()
        if now - self._created_at.get(uid, 0.0) < self.controller_delay_s:
            return False
        retry = self._create_retry.get(uid)
        return retry is None or retry[0] <= now

    def _refused(self, owner: dict, resource: ResourceType, error: ApiError, component: str) -> None:
        """A pod create the API server refused: the controller records FailedCreate on its owner and tries
        again after a backoff (doubling with each refusal in a row)."""
        uid = owner["metadata"]["uid"]
        refusals = self._create_retry.get(uid, (0.0, 0))[1] + 1
        backoff = self.failed_create_backoff_s * 2 ** min(refusals - 1, 4)
        self._create_retry[uid] = (time.monotonic() + backoff, refusals)
        self._warn(owner, resource, "FailedCreate", f"Error creating: {error.body['message']}", component)

    def _warn(self, involved: dict, resource: ResourceType, reason: str, message: str, component: str) -> None:
        """A Warning Event about an object, as client-go's EventRecorder writes it (core v1: involvedObject,
        source, count, first and last timestamps; named `<object>.<hex nanoseconds>`). A repeat (same object,
        type and reason) bumps the count, last timestamp and message of the Event there is, as the recorder's
        correlator combines similar events. Nothing is recorded in a namespace being deleted (the create is
        refused there, and the recorder drops it)."""
        metadata = involved["metadata"]
        namespace = metadata.get("namespace") or "default"
        now = _now()
        for (plural, event_namespace, _name), event in self._state.objects.items():
            if plural == "events" and event_namespace == namespace and event["type"] == "Warning" \
                    and event["reason"] == reason and event["involvedObject"].get("uid") == metadata["uid"]:
                event.update(message=message, count=event.get("count", 1) + 1, lastTimestamp=now)
                event["metadata"]["resourceVersion"] = self._bump()
                self._record_event("MODIFIED", RESOURCE_TYPES["events"], event)
                return
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{metadata['name']}.{time.time_ns():x}", "namespace": namespace},
            "involvedObject": {"kind": resource.kind, "apiVersion": resource.api_version, "name": metadata["name"],
                               "namespace": namespace, "uid": metadata["uid"],
                               "resourceVersion": metadata.get("resourceVersion", "")},
            "reason": reason, "message": message, "type": "Warning", "count": 1,
            "firstTimestamp": now, "lastTimestamp": now, "source": {"component": component},
            "reportingComponent": component, "reportingInstance": "",
        }
        try:
            self._create(RESOURCE_TYPES["events"], namespace, event, manager=component)
        except ApiError:
            pass  # the namespace is being deleted: the recorder's create is refused and dropped

    def events(self, namespace: str = "", **fields: str) -> list[dict]:
        """Events (of one namespace, or all) whose fields (dotted paths, as a field selector names them) have these values."""
        with self._lock:
            self._reap()
            return [copy.deepcopy(obj) for (plural, ns, _), obj in sorted(self._state.objects.items())
                    if plural == "events" and (not namespace or ns == namespace)
                    and all(str(_at(obj, path) or "") == value for path, value in fields.items())]

    def _make_pod(self, namespace: str, job: dict, index: int) -> None:
        template = job["spec"]["template"]
        name = job["metadata"]["name"]
        metadata = copy.deepcopy(template.get("metadata") or {})
        metadata["name"] = f"{name}-{index}-{uuid.uuid4().hex[:5]}"
        metadata.setdefault("annotations", {})[COMPLETION_INDEX] = str(index)
        metadata.setdefault("labels", {})[COMPLETION_INDEX] = str(index)
        metadata["labels"]["batch.kubernetes.io/job-name"] = name
        metadata["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                        "uid": job["metadata"]["uid"], "controller": True}]
        spec = copy.deepcopy(template["spec"])
        spec["hostname"] = f"{name}-{index}"
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec, "status": {"phase": "Pending"}}
        self._create(RESOURCE_TYPES["pods"], namespace, pod, manager="job-controller")

    # --- Test helpers for pods and nodes ------------------------------------------

    def pods(self, namespace: str = "", *, as_is: bool = False, **labels: str) -> list[dict]:
        """Pods (of one namespace, or all) whose labels include the given ones; `as_is`: as stored now,
        without a controllers' pass first (what their own thread has done)."""
        with self._lock:
            if not as_is:
                self._reap()
            return [copy.deepcopy(obj) for (plural, ns, _), obj in sorted(self._state.objects.items())
                    if plural == "pods" and (not namespace or ns == namespace)
                    and all((obj["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())]

    def finish_pod(self, namespace: str, name: str, exit_code: int, *, log: str = "") -> None:
        """The pod's container exits with this code (its kubelet reports it)."""
        with self._lock:
            pod = self._state.objects[("pods", namespace, name)]
            if log:
                self.write_log(namespace, name, log)
            self._terminate(pod, exit_code, "Completed" if exit_code == 0 else "Error")
            self._reap()

    def crash_container(self, namespace: str, name: str, exit_code: int) -> None:
        """The pod's container exits with this code and its kubelet restarts it in place (restartPolicy Always)."""
        with self._lock:
            pod = self._state.objects[("pods", namespace, name)]
            first = (pod["spec"].get("containers") or [{}])[0].get("name")
            for container in pod["status"].get("containerStatuses", []):
                log_key = (namespace, name) if container["name"] == first else (namespace, f"{name}/{container['name']}")
                self.previous_logs[log_key] = self.pod_logs.pop(log_key, [])
                container["lastState"] = {"terminated": {"exitCode": exit_code, "reason": "Error", "finishedAt": _now()}}
                container["restartCount"] = container.get("restartCount", 0) + 1
                container["state"] = {"running": {"startedAt": _now()}}
            pod["metadata"]["resourceVersion"] = self._bump()
            self._record_event("MODIFIED", RESOURCE_TYPES["pods"], pod)

    def write_log(self, namespace: str, name: str, text: str, *, at: datetime | int | None = None,
                  container: str = "") -> None:
        """The pod's container (its first, or the one named) writes these lines, all at `at` (a datetime, or
        Unix nanoseconds), or now.

        Lines written now get increasing times, as a container runtime stamps them.
        """
        pod_name = name
        if container:
            with self._lock:
                pod = self._state.objects.get(("pods", namespace, name)) or {}
                first = ((pod.get("spec") or {}).get("containers") or [{}])[0].get("name")
            pod_name = name if container == first else f"{name}/{container}"
        self.append_log(namespace, pod_name, [(at, line) for line in text.splitlines()])

    def append_log(self, namespace: str, name: str, lines: Iterable[tuple[datetime | int | None, str]]) -> None:
        """Lines the pod's container writes, each with its time (None: now)."""
        with self._lock:
            log = self.pod_logs.setdefault((namespace, name), [])
            for at, line in lines:
                if at is None:
                    stamp = max(time.time_ns(), log[-1][0] + 1 if log else 0)
                elif isinstance(at, datetime):
                    stamp = int(at.timestamp()) * 1_000_000_000 + at.microsecond * 1000
                else:
                    stamp = int(at)
                log.append((stamp, _log_time(stamp), line))

    def rotate_log(self, namespace: str, name: str) -> None:
        """The kubelet rotates the pod's log file: what was written so far is no longer served."""
        with self._lock:
            self.pod_logs[(namespace, name)] = []

    def set_node_ready(self, name: str, ready: bool, *, since: str | None = None) -> None:
        """The node's Ready condition, as the node lifecycle controller writes it."""
        with self._lock:
            node = self._state.objects[("nodes", "", name)]
            conditions = [c for c in node.setdefault("status", {}).get("conditions", []) if c["type"] != "Ready"]
            conditions.append({"type": "Ready", "status": "True" if ready else "Unknown",
                               "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                               "lastTransitionTime": since or _now()})
            node["status"]["conditions"] = conditions
            node["metadata"]["resourceVersion"] = self._bump()
            self._record_event("MODIFIED", RESOURCE_TYPES["nodes"], node)

    def delete(self, plural: str, name: str, namespace: str = "") -> None:
        """Remove an object as someone else would (a node taken out of the cluster)."""
        with self._lock:
            obj = self._state.objects.pop((plural, namespace, name))
            obj["metadata"]["resourceVersion"] = self._bump()
            self._record_event("DELETED", RESOURCE_TYPES[plural], obj)

    def _reconfigure_nodes(self) -> None:
        """The GPU Operator's part: re-cut GPUs whose node asked for a new layout, once its delay passed."""
        now = time.monotonic()
        for name, due in list(self._reconfigure_at.items()):
            if due > now:
                continue
            del self._reconfigure_at[name]
            node = self._state.objects.get(("nodes", "", name))
            if node is not None:
                self._reconfigure(node)

    def _config_map_data(self, name: str) -> dict:
        config_map = self._state.objects.get(("configmaps", GPU_OPERATOR_NAMESPACE, name)) or {}
        return config_map.get("data") or {}

    def _reconfigure(self, node: dict) -> None:
        from runners.nvidia.names import mig_resource

        labels = node["metadata"].setdefault("labels", {})
        gpu_count = int(labels.get("nvidia.com/gpu.count", "0"))
        allocatable = {k: v for k, v in node["status"]["allocatable"].items() if not k.startswith("nvidia.com/")}
        mig_config = labels.get("nvidia.com/mig.config", "all-disabled")
        plugin_config = labels.get("nvidia.com/device-plugin.config")
        state = "success"
        if mig_config != "all-disabled":
            parsed = yaml.safe_load(self._config_map_data(MIG_PARTED_CONFIG_MAP).get("config.yaml") or "{}") or {}
            entries = (parsed.get("mig-configs") or {}).get(mig_config)
            if not entries:
                state = "failed"  # MIG Manager cannot find the layout the label names.
            else:
                for entry in entries:
                    for profile, instances in (entry.get("mig-devices") or {}).items():
                        resource = mig_resource(profile)
                        allocatable[resource] = str(int(allocatable.get(resource, "0")) + instances * gpu_count)
        elif plugin_config:
            parsed = yaml.safe_load(self._config_map_data(DEVICE_PLUGIN_CONFIG_MAP).get(plugin_config) or "{}") or {}
            sharing = (parsed.get("sharing") or {}).get("timeSlicing") or {}
            replicas = sum(item["replicas"] for item in sharing.get("resources", []) if item["name"] == "nvidia.com/gpu")
            resource = "nvidia.com/gpu.shared" if sharing.get("renameByDefault") else "nvidia.com/gpu"
            allocatable[resource] = str(replicas * gpu_count)
        else:
            allocatable["nvidia.com/gpu"] = str(gpu_count)
        if state == "success":
            node["status"]["allocatable"] = allocatable
        labels["nvidia.com/mig.config.state"] = state
        node["metadata"]["resourceVersion"] = self._bump()
        self._record_event("MODIFIED", RESOURCE_TYPES["nodes"], node)

    def _collect_garbage(self) -> None:
        """The garbage collector's part: pods of Jobs deleted with Background propagation go, with their own grace."""
        now = time.monotonic()
        for key, due in list(self._collect_at.items()):
            if due > now:
                continue
            del self._collect_at[key]
            obj = self._state.objects.get(key)
            if obj is None or obj["metadata"].get("deletionTimestamp"):
                continue
            if key[0] == "pods" and obj["spec"].get("nodeName") and ("nodes", "", obj["spec"]["nodeName"]) not in self._state.objects:
                self._delete_pod(key, obj, 0)  # PodGC: its node is gone, so nothing waits for a kubelet
            elif key[0] == "pods":
                self._delete_pod(key, obj, None)
            else:
                self._delete(RESOURCE_TYPES[key[0]], key[1], key[2], propagation="Background")

    def _reap(self) -> None:
        """One pass of every controller (the operator, collector, kubelet's stops, TTL, Job, Deployment,
        ReplicaSet and disruption controllers), then finish deleting namespaces whose termination delay
        has passed, with everything in them."""
        self._reconfigure_nodes()
        self._collect_garbage()
        self._stop_pods()
        self._expire_jobs()
        self._run_jobs()
        self._run_deployments()
        self._run_replica_sets()
        self._run_disruption()
        now = time.monotonic()
        for namespace, gone_at in list(self._state.namespace_gone_at.items()):
            if gone_at > now:
                continue
            del self._state.namespace_gone_at[namespace]
            for timers in (self._job_started, self._job_expire_at, self._job_indexes, self._job_done):
                for gone in [k for k in timers if k[0] == namespace]:
                    del timers[gone]
            for key in [key for key in self._state.objects if key[1] == namespace or key == ("namespaces", "", namespace)]:
                obj = self._state.objects.pop(key)
                obj["metadata"]["resourceVersion"] = self._bump()
                self._record_event("DELETED", RESOURCE_TYPES[key[0]], obj)
            for owned in [k for k in self._fields if k[1] == namespace or k == ("namespaces", "", namespace)]:
                del self._fields[owned]


_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict",
            410: "Expired", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
            504: "Timeout"}


PORTAL = object()  # The caller of a request made with the portal's own token, when its RBAC is modelled.


def _forbidden(user: str, verb: str, group: str, plural: str, namespace: str, name: str | None, kind: str) -> ApiError:
    """RBAC's 403, worded as the API server words it."""
    where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    target = f'{plural} "{name}"' if name else plural
    return ApiError(403, "Forbidden", f'{target} is forbidden: User "{user}" cannot {verb} resource "{plural}" in API '
                                      f'group "{group}" {where}', kind=kind, **({"name": name} if name else {}))


def _matches(allowed: list[str] | None, value: str) -> bool:
    return bool(allowed) and ("*" in allowed or value in allowed)


def _one(query: dict[str, list[str]], name: str) -> str:
    return (query.get(name) or [""])[0]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _log_time(stamp_ns: int) -> str:
    """A log line's time as the kubelet writes it with timestamps=true (RFC3339, nine fractional digits)."""
    seconds, nanos = divmod(stamp_ns, 1_000_000_000)
    return f"{_log_second(seconds)}.{nanos:09d}Z"


@functools.lru_cache(maxsize=4096)
def _log_second(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def _count_param(query: dict[str, list[str]], name: str, *, minimum: int) -> int | None:
    """A whole-number query parameter of pods/log, refused as the API server refuses it."""
    text = _one(query, name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ApiError(400, "BadRequest", f"{name}: invalid value {text!r}: not an integer") from None
    if value < minimum:
        bound = "must be greater than or equal to 0" if minimum == 0 else f"must be greater than {minimum - 1}"
        raise ApiError(422, "Invalid", f"PodLogOptions is invalid: {name}: Invalid value: {value}: {bound}")
    return value


# Fields a validated update refuses to change (FieldValueInvalid "field is immutable"), by kind.
_IMMUTABLE = {
    "Job": ("spec.selector", "spec.template", "spec.completionMode"),
    "Deployment": ("spec.selector",),
    "ReplicaSet": ("spec.selector",),
    "PodDisruptionBudget": (),
    "Service": ("spec.clusterIP",),
}
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIXES = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "Ki": 2**10, "Mi": 2**20,
             "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def _quantity(text) -> float:
    """A resource.Quantity's value ("10Gi", "500m", 4)."""
    match = _QUANTITY.match(str(text).strip())
    if not match or match[2] not in _SUFFIXES:
        raise ApiError(400, "BadRequest", f"quantities must match the regular expression, not {text!r}")
    return float(match[1]) * _SUFFIXES[match[2]]


def _at(obj: dict, path: str):
    for part in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _pod_spec_mutable_part(spec: dict) -> dict:
    """A pod's spec without what an update may change (images, the deadline, tolerations, the grace)."""
    fixed = copy.deepcopy(spec)
    for name in ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds"):
        fixed.pop(name, None)
    for key in ("containers", "initContainers"):
        for container in fixed.get(key) or []:
            container.pop("image", None)
    return fixed


# --- Server-side apply's field sets, typed by the OpenAPI schema kubernetes-validate ships --------

_MISSING = object()
_SCHEMA_VERSION = "1.30.0"


@functools.cache
def _definitions_file() -> dict:
    import kubernetes_validate

    folder = f"{kubernetes_validate.__path__[0]}/kubernetes-json-schema/v{_SCHEMA_VERSION}-local-strict"
    with open(f"{folder}/_definitions.json") as definitions:
        return json.load(definitions)


def _definitions() -> dict:
    return _definitions_file()["$defs"]


def _resolve(schema) -> dict:
    if not isinstance(schema, dict):
        return {}
    while "$ref" in schema:
        schema = _definitions().get(schema["$ref"].rpartition("/")[2], {})
    return schema


@functools.cache
def _schema_name(api_version: str, kind: str) -> str | None:
    group, _, version = api_version.rpartition("/")
    for name, definition in _definitions().items():
        for gvk in definition.get("x-kubernetes-group-version-kind") or []:
            if (gvk.get("group", ""), gvk.get("version"), gvk.get("kind")) == (group, version, kind):
                return name
    return None


def _schema_of(resource: ResourceType) -> dict:
    name = _schema_name(resource.api_version, resource.kind)
    return _definitions()[name] if name else {}


def _child(schema: dict, key: str) -> dict:
    properties = schema.get("properties") or {}
    if key in properties:
        return _resolve(properties[key])
    extra = schema.get("additionalProperties")
    return _resolve(extra) if isinstance(extra, dict) else {}


def _applied_part(obj: dict) -> dict:
    """What apply manages of an object: all but its identity and status, of its metadata the labels and annotations."""
    part = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    metadata = {k: v for k, v in (obj.get("metadata") or {}).items() if k in ("labels", "annotations") and v}
    if metadata:
        part["metadata"] = metadata
    return part


def _key_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _leaves(value, schema, prefix: tuple = ()) -> dict[tuple, object]:
    """The field paths a value sets, each with its value: maps by key (unless atomic), lists by their type
    (a map list by its keys, a set by value, any other list whole)."""
    schema = _resolve(schema)
    found: dict[tuple, object] = {}
    if isinstance(value, dict) and value and schema.get("x-kubernetes-map-type") != "atomic":
        for key, item in value.items():
            found.update(_leaves(item, _child(schema, key), prefix + (key,)))
        return found
    list_type = schema.get("x-kubernetes-list-type")
    if isinstance(value, list) and value and list_type in ("map", "set"):
        items = _resolve(schema.get("items"))
        for item in value:
            if list_type == "map" and isinstance(item, dict):
                keys = schema.get("x-kubernetes-list-map-keys") or []
                ident = ("k", _key_json({k: item[k] for k in keys if k in item}))
                found.update(_leaves(item, items, prefix + (ident,)) or {prefix + (ident,): item})
            else:
                found[prefix + (("v", _key_json(item)),)] = item
        return found
    found[prefix] = value
    return found


def _merge_applied(target: dict, applied: dict, schema) -> None:
    """Merge an applied configuration into the object, in place, as its schema types each field."""
    schema = _resolve(schema)
    for key, value in applied.items():
        child, current = _child(schema, key), target.get(key)
        if isinstance(value, dict) and isinstance(current, dict) and child.get("x-kubernetes-map-type") != "atomic":
            _merge_applied(current, value, child)
        elif isinstance(value, list) and isinstance(current, list) and child.get("x-kubernetes-list-type") == "map":
            keys = child.get("x-kubernetes-list-map-keys") or []
            items = _resolve(child.get("items"))
            for item in value:
                same = next((c for c in current if isinstance(c, dict) and isinstance(item, dict)
                             and all(c.get(k) == item.get(k) for k in keys)), None)
                if same is None:
                    current.append(copy.deepcopy(item))
                else:
                    _merge_applied(same, item, items)
        elif isinstance(value, list) and isinstance(current, list) and child.get("x-kubernetes-list-type") == "set":
            current.extend(copy.deepcopy(item) for item in value if item not in current)
        else:
            target[key] = copy.deepcopy(value)


def _remove_path(obj: dict, path: tuple, schema) -> None:
    """Remove the field at a path, and the maps, lists and list items left empty by it (never metadata itself)."""
    chain, node = [], obj
    for element in path:
        if isinstance(element, tuple):
            if not isinstance(node, list):
                return
            kind, text = element
            wanted = json.loads(text)
            index = next((i for i, item in enumerate(node) if (
                kind == "k" and isinstance(item, dict) and all(item.get(k) == v for k, v in wanted.items())
            ) or (kind == "v" and item == wanted)), None)
            if index is None:
                return
            chain.append((node, index))
            node = node[index]
        else:
            if not isinstance(node, dict) or element not in node:
                return
            chain.append((node, element))
            node = node[element]
    for container, element in reversed(chain):
        if container is obj and element == "metadata":
            break
        del container[element]
        if container:
            break


def _removal_order(path: tuple) -> tuple:
    """Deepest fields first, and an item's key fields after its others (the item is found by them)."""
    is_key = len(path) >= 2 and isinstance(path[-2], tuple) and path[-2][0] == "k" \
        and isinstance(path[-1], str) and path[-1] in json.loads(path[-2][1])
    return (-len(path), is_key, str(path))


def _field_path(path: tuple) -> str:
    """A field path as apply's conflict messages write it: .spec.template.spec.containers[name="trainer"].image."""
    text = ""
    for element in path:
        if isinstance(element, tuple):
            value = json.loads(element[1])
            text += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in value.items()) + "]" if element[0] == "k" \
                else f"[{element[1]}]"
        else:
            text += f".{element}"
    return text


def _fields_v1(paths) -> dict:
    """A FieldsV1 set (f:, k:, v: keys) of field paths."""
    root: dict = {}
    for path in paths:
        node = root
        for element in path:
            if isinstance(element, tuple):
                node = node.setdefault(f"{element[0]}:{element[1]}", {})
                if element[0] == "k":
                    node.setdefault(".", {})
            else:
                node = node.setdefault(f"f:{element}", {})
    return root


@functools.cache
def _meta_validator(name: str):
    """A validator for a meta/v1 type (status-meta-v1, watchevent-meta-v1), its references resolved as
    kubernetes-validate resolves them."""
    import jsonschema
    import kubernetes_validate
    from referencing import Registry, Resource

    folder = f"{kubernetes_validate.__path__[0]}/kubernetes-json-schema/v{_SCHEMA_VERSION}-local-strict"
    with open(f"{folder}/{name}.json") as schema_file:
        schema = json.load(schema_file)
    registry = Resource.from_contents(_definitions_file()) @ Registry()
    registry = Resource.from_contents(schema) @ registry
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def answer_problem(answer: dict) -> str:
    """Why an answer does not fit the Kubernetes 1.30 OpenAPI schema (strict), or "" when it does."""
    import jsonschema
    import kubernetes_validate

    try:
        if answer.get("kind") == "Status":
            _meta_validator("status-meta-v1").validate(answer)
        elif set(answer) == {"type", "object"}:
            _meta_validator("watchevent-meta-v1").validate(answer)
            return answer_problem(answer["object"])
        elif "kind" in answer and "apiVersion" in answer and answer.get("kind") != "APIResourceList":
            kubernetes_validate.validate(answer, _SCHEMA_VERSION, strict=True)
    except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
        return str(getattr(exc, "message", exc)).splitlines()[0]
    except kubernetes_validate.SchemaNotFoundError:
        return f"no schema for {answer.get('apiVersion')}/{answer.get('kind')}"
    return ""


def _show(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{int(value * 1000)}m"


def _pod_requests(pod: dict) -> dict[str, float]:
    """A pod's requests by resource (a container's limit where it has no request), as the kubelet sums them."""
    total: dict[str, float] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for key, value in ((resources.get("limits") or {}) | (resources.get("requests") or {})).items():
            total[key] = total.get(key, 0) + _quantity(value)
    return total


def _pod_usage(pod: dict) -> dict[str, float]:
    """What a pod counts against a ResourceQuota: requests.X, limits.X, cpu and memory (requests), pods."""
    usage: dict[str, float] = {"pods": 1, "count/pods": 1}
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for field_name in ("requests", "limits"):
            for key, value in (resources.get(field_name) or {}).items():
                usage[f"{field_name}.{key}"] = usage.get(f"{field_name}.{key}", 0) + _quantity(value)
                if field_name == "requests" and key in ("cpu", "memory", "ephemeral-storage"):
                    usage[key] = usage.get(key, 0) + _quantity(value)
    return usage


_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                       "secret"}


def _restricted_violations(spec: dict) -> list[str]:
    """What the Pod Security "restricted" profile finds wrong in a pod spec, worded as the admission plugin words it."""
    problems = []
    pod_context = spec.get("securityContext") or {}
    containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
    if any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")):
        problems.append("host namespaces (hostNetwork=true, hostPID=true or hostIPC=true)")
    privileged = [c["name"] for c in containers if (c.get("securityContext") or {}).get("privileged")]
    if privileged:
        problems.append(f"privileged ({_containers(privileged)} must not set securityContext.privileged=true)")
    escalating = [c["name"] for c in containers if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False]
    if escalating:
        problems.append(f"allowPrivilegeEscalation != false ({_containers(escalating)} must set "
                        "securityContext.allowPrivilegeEscalation=false)")
    capable = [c["name"] for c in containers
               if "ALL" not in (((c.get("securityContext") or {}).get("capabilities") or {}).get("drop") or [])
               or set(((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}]
    if capable:
        problems.append(f"unrestricted capabilities ({_containers(capable)} must set "
                        'securityContext.capabilities.drop=["ALL"])')
    volumes = sorted(v["name"] for v in spec.get("volumes") or [] if not (set(v) - {"name"}) <= _RESTRICTED_VOLUMES)
    if volumes:
        problems.append(f"restricted volume types (volumes {', '.join(repr(v) for v in volumes)} use restricted types)")
    root = [c["name"] for c in containers if not (c.get("securityContext") or {}).get(
        "runAsNonRoot", pod_context.get("runAsNonRoot"))]
    if root:
        problems.append(f"runAsNonRoot != true (pod or {_containers(root)} must set securityContext.runAsNonRoot=true)")
    if pod_context.get("runAsUser") == 0 or any((c.get("securityContext") or {}).get("runAsUser") == 0 for c in containers):
        problems.append("runAsUser=0 (pod and containers must not set runAsUser=0)")
    seccomp = [c["name"] for c in containers if ((c.get("securityContext") or {}).get("seccompProfile") or
                                                 pod_context.get("seccompProfile") or {}).get("type")
               not in ("RuntimeDefault", "Localhost")]
    if seccomp:
        problems.append(f"seccompProfile (pod or {_containers(seccomp)} must set securityContext.seccompProfile.type "
                        'to "RuntimeDefault" or "Localhost")')
    return problems


def _containers(names: list[str]) -> str:
    quoted = ", ".join(f'"{n}"' for n in names)
    return f"container {quoted}" if len(names) == 1 else f"containers {quoted}"


def _content(obj: dict) -> dict:
    stripped = copy.deepcopy(obj)
    for name in _SERVER_FIELDS:
        stripped.get("metadata", {}).pop(name, None)
    return stripped


def _merge_patch(target, patch):
    """RFC 7386: null removes a key, objects merge, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merge_patch(merged.get(key), value)
    return merged


def _partition_labels(node: dict) -> tuple:
    labels = node["metadata"].get("labels") or {}
    return labels.get("nvidia.com/mig.config"), labels.get("nvidia.com/device-plugin.config")


# The field selectors the API server (1.30) supports, by kind, where the stand-in is strict about
# them (pkg/apis/core/v1/conversion.go); another key is 400 "field label not supported: <key>". Other
# kinds take any dotted path, as before.
_FIELD_LABELS = {
    "Event": {"involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
              "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
              "reportingComponent", "source", "type", "metadata.namespace", "metadata.name"},
    "Pod": {"metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
            "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP", "status.podIPs",
            "status.nominatedNodeName"},
}
# A selectable field that is not the object's field of the same path.
_FIELD_PATHS = {("Event", "source"): "source.component"}


def _field_terms(kind: str, selector: str) -> list[tuple[str, bool, str]]:
    """A field selector's terms as (path, equal, value): `a=b`, `a==b` and `a!=b`, comma-separated."""
    terms = []
    for term in filter(None, (part.strip() for part in selector.split(","))):
        match = re.fullmatch(r"([^=!]+?)\s*(==|=|!=)\s*(.*)", term)
        if match is None:
            raise ApiError(400, "BadRequest", f"invalid selector: '{selector}'; can't understand '{term}'")
        path, operator, value = match.groups()
        if kind in _FIELD_LABELS and path not in _FIELD_LABELS[kind]:
            raise ApiError(400, "BadRequest", f"field label not supported: {path}")
        terms.append((path, operator != "!=", value))
    return terms


def _fields_select(kind: str, terms: list[tuple[str, bool, str]], obj: dict) -> bool:
    for path, equal, value in terms:
        found = _at(obj, _FIELD_PATHS.get((kind, path), path))
        text = str(found).lower() if isinstance(found, bool) else "" if found is None else str(found)
        if (text == value) != equal:
            return False
    return True


def _parse_selector(selector: str) -> list[tuple[str, str]]:
    """Equality-based label selectors only (`a=b,c==d`), which is all the backend sends."""
    pairs = []
    for term in filter(None, (part.strip() for part in selector.split(","))):
        if "!=" in term or "=" not in term:
            raise ApiError(400, "BadRequest", f"the stand-in understands only equality selectors, not {term!r}")
        key, value = term.replace("==", "=").split("=", 1)
        pairs.append((key.strip(), value.strip()))
    return pairs


def _label_selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels, and matchExpressions In/NotIn/Exists/DoesNotExist); empty selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if (operator == "In" and labels.get(key) not in values) or (operator == "NotIn" and labels.get(key) in values) \
                or (operator == "Exists" and key not in labels) or (operator == "DoesNotExist" and key in labels):
            return False
    return True


def _selects(selector: list[tuple[str, str]], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector)


class _Handler(BaseHTTPRequestHandler):
    api: KubernetesStandIn
    protocol_version = "HTTP/1.1"  # Keep-alive, as the kube client's connection pool expects.
    # Without these, Nagle and delayed ACKs add ~40 ms to every small request on loopback.
    disable_nagle_algorithm = True
    wbufsize = -1

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        code, answer = self.api.handle(self.command, self.path, self.headers.get("Content-Type", ""), body,
                                       authorization=self.headers.get("Authorization", ""))
        if not isinstance(answer, (bytes, str, dict, list)):
            # An open watch: each event sent as it comes, chunked, until the stream ends.
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                self.wfile.flush()  # the headers now: the client's call returns while the watch is open
                for line in answer:
                    data = line.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True  # the client went away mid-watch
            return
        if isinstance(answer, bytes):
            payload = answer
        else:
            payload = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if self.path.split("?")[0].endswith("/log") else "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve

    def log_message(self, format, *args) -> None:  # Quiet: tests read the request log instead.
        pass

"""The stand-in's conformance suite: for each call the portal's Kubernetes backend makes, the status
code, reason and cause a real API server (1.30) answers, each case from the Kubernetes API conventions
(https://github.com/kubernetes/community/blob/master/contributors/devel/sig-architecture/api-conventions.md),
run against the stand-in; every answer is checked against the OpenAPI schema kubernetes-validate ships.

The calls are read from the code (runners/backends/*.py, the backend's `_checked`/`_call`/`_delete`/
`_apply` calls), so a new call without a row here fails `test_every_backend_call_has_a_row`.
"""

import ast
import json
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.support.k8s import api_call, gpu_node
from tests.support.k8s_standin import APPLY_PATCH, MERGE_PATCH, KubernetesStandIn, answer_problem
from tests.support.races import wait_until

pytestmark = pytest.mark.e2e

BACKENDS = pathlib.Path(__file__).resolve().parents[2] / "runners" / "backends"
NS = "acme-vision"
PODS = f"/api/v1/namespaces/{NS}/pods"
APPLY = "?fieldManager=gpu-portal&force=true"


def check_schema(body) -> None:
    """An answer against its kind's schema (a Status, a WatchEvent, an object or list), strict: no unknown fields."""
    if isinstance(body, dict):
        assert not answer_problem(body), (answer_problem(body), body)


def check_watch(stream: str | dict) -> list[dict]:
    """A watch's events, one JSON object a line (a stream of one reads as that object)."""
    events = [stream] if isinstance(stream, dict) else [json.loads(line) for line in stream.splitlines() if line.strip()]
    for event in events:
        check_schema(event)
        assert event["type"] in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")
    return events


@dataclass
class Case:
    """One call and what a real server answers it: status, reason (errors), a cause's reason if any."""

    name: str
    call: Callable[[KubernetesStandIn], tuple[int, object]]
    status: int
    reason: str = ""
    cause: str = ""


def namespace(name=NS) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def config_map(name="portal-mig-parted-config", **extra) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **extra}, "data": {"a": "b"}}


def claim(size="10Gi") -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "checkpoints", "namespace": NS},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}}}


def secret(name="job-1-1-workspace-key") -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS}, "type": "Opaque",
            "immutable": True, "data": {"key": "a2V5"}}


def safe_pod(name="trainer", gpus=1) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": {"app": "llm"}},
            "spec": {"containers": [{"name": "trainer", "image": "trainer",
                                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def job(image="trainer") -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "job-1-1", "namespace": NS},
            "spec": {"completions": 1, "backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "containers": [{"name": "trainer", "image": image}]}}}}


def role_binding(role="member") -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "olivia", "namespace": NS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": "olivia", "namespace": NS}]}


def post(path, body):
    return lambda api: api_call(api, "POST", path, body)


def get(path):
    return lambda api: api_call(api, "GET", path)


def delete(path):
    return lambda api: api_call(api, "DELETE", path)


def apply(path, body):
    return lambda api: api_call(api, "PATCH", f"{path}/{body['metadata']['name']}{APPLY}", body, content_type=APPLY_PATCH)


def then(*steps):
    """Run the steps in order; the last one's answer is the case's."""
    def run(api):
        answer = None
        for step in steps:
            answer = step(api)
        return answer
    return run


def bound(name="trainer"):
    return then(post(PODS, safe_pod(name)), post(f"{PODS}/{name}/binding", binding(name)))


def binding(name, node="gpu-a"):
    return {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name}, "target": {"kind": "Node", "name": node}}


def eviction(name):
    return {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": NS},
            "deleteOptions": {"gracePeriodSeconds": 30}}


def replace_stale(api):
    api_call(api, "POST", "/api/v1/namespaces/gpu-operator/configmaps", config_map())
    _status, current = api_call(api, "GET", "/api/v1/namespaces/gpu-operator/configmaps/portal-mig-parted-config")
    api_call(api, "PUT", "/api/v1/namespaces/gpu-operator/configmaps/portal-mig-parted-config", current)
    return api_call(api, "PUT", "/api/v1/namespaces/gpu-operator/configmaps/portal-mig-parted-config", current)


def watch_from(version: str):
    return get(f"/api/v1/pods?watch=true&resourceVersion={version}&timeoutSeconds=1&labelSelector=app%3Dllm")


def compacted_watch(api):
    api_call(api, "POST", PODS, safe_pod())
    api.compact()
    return watch_from("101")(api)


def budget_exhausted(api):
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "llm", "namespace": NS},
              "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "llm"}}}}
    api_call(api, "POST", f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets", budget)
    bound()(api)
    return api_call(api, "POST", f"{PODS}/trainer/eviction", eviction("trainer"))


def terminating(api):
    api_call(api, "DELETE", f"/api/v1/namespaces/{NS}")
    return api


def token(seconds):
    return then(post(f"/api/v1/namespaces/{NS}/serviceaccounts",
                     {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "olivia"}}),
                post(f"/api/v1/namespaces/{NS}/serviceaccounts/olivia/token",
                     {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                      "spec": {"expirationSeconds": seconds}}))


def refused_job(api):
    """A Job whose pod a ResourceQuota refuses: the Job controller records FailedCreate on it."""
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pods", "namespace": NS},
             "spec": {"hard": {"pods": "0"}}}
    api_call(api, "POST", f"/api/v1/namespaces/{NS}/resourcequotas", quota)
    apply(JOBS, job())(api)
    assert wait_until(lambda: api.events(NS, reason="FailedCreate"), timeout_s=10)
    return api


EVENTS = f"/api/v1/namespaces/{NS}/events"
CM = "/api/v1/namespaces/gpu-operator/configmaps"
CLAIMS = f"/api/v1/namespaces/{NS}/persistentvolumeclaims"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
BINDINGS = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
POLICIES = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"

# (kind, verb, subresource): the cases. Kind "*" stands for a call whose kind is a variable (any of KINDS).
TABLE: dict[tuple[str, str, str], list[Case]] = {
    ("Namespace", "read", ""): [
        Case("exists", get(f"/api/v1/namespaces/{NS}"), 200),
        Case("missing", get("/api/v1/namespaces/nope"), 404, "NotFound"),
    ],
    ("Namespace", "create", ""): [
        Case("new", post("/api/v1/namespaces", namespace("fresh")), 201),
        Case("taken", post("/api/v1/namespaces", namespace()), 409, "AlreadyExists"),
    ],
    ("Namespace", "delete", ""): [
        Case("active", delete(f"/api/v1/namespaces/{NS}"), 200),
        Case("terminating", then(terminating, delete(f"/api/v1/namespaces/{NS}")), 409, "Conflict"),
        Case("missing", delete("/api/v1/namespaces/nope"), 404, "NotFound"),
    ],
    ("ConfigMap", "read", ""): [
        Case("missing", get(f"{CM}/nope"), 404, "NotFound"),
    ],
    ("ConfigMap", "create", ""): [
        Case("new", post(CM, config_map()), 201),
        Case("taken", then(post(CM, config_map()), post(CM, config_map())), 409, "AlreadyExists"),
    ],
    ("ConfigMap", "replace", ""): [
        Case("stale resourceVersion", replace_stale, 409, "Conflict"),
        Case("missing", lambda api: api_call(api, "PUT", f"{CM}/nope", config_map("nope")), 404, "NotFound"),
    ],
    ("Node", "list", ""): [Case("all", get("/api/v1/nodes"), 200)],
    ("Node", "read", ""): [
        Case("exists", get("/api/v1/nodes/gpu-a"), 200),
        Case("missing", get("/api/v1/nodes/nope"), 404, "NotFound"),
    ],
    ("Node", "patch", ""): [
        Case("cordon", lambda api: api_call(api, "PATCH", "/api/v1/nodes/gpu-a", {"spec": {"unschedulable": True}},
                                            content_type=MERGE_PATCH), 200),
        Case("missing", lambda api: api_call(api, "PATCH", "/api/v1/nodes/nope", {"spec": {}}, content_type=MERGE_PATCH),
             404, "NotFound"),
    ],
    ("PersistentVolumeClaim", "create", ""): [
        Case("new", post(CLAIMS, claim()), 201),
        Case("taken", then(post(CLAIMS, claim()), post(CLAIMS, claim())), 409, "AlreadyExists"),
        Case("namespace terminating", then(terminating, post(CLAIMS, claim())), 403, "Forbidden", "NamespaceTerminating"),
    ],
    ("PersistentVolumeClaim", "read", ""): [
        Case("missing", get(f"{CLAIMS}/checkpoints"), 404, "NotFound"),
    ],
    ("PersistentVolumeClaim", "patch", ""): [
        Case("shrink", then(post(CLAIMS, claim("10Gi")),
                            lambda api: api_call(api, "PATCH", f"{CLAIMS}/checkpoints",
                                                 {"spec": {"resources": {"requests": {"storage": "5Gi"}}}},
                                                 content_type=MERGE_PATCH)), 422, "Invalid", "FieldValueForbidden"),
        Case("grow without expansion", then(post(CLAIMS, claim("10Gi")),
                                            lambda api: api_call(api, "PATCH", f"{CLAIMS}/checkpoints",
                                                                 {"spec": {"resources": {"requests": {"storage": "20Gi"}}}},
                                                                 content_type=MERGE_PATCH)), 403, "Forbidden"),
    ],
    ("PersistentVolumeClaim", "list", ""): [
        Case("all namespaces", get("/api/v1/persistentvolumeclaims?labelSelector=portal.gpu%2Fworkspace-id%3D9"), 200),
    ],
    ("PersistentVolumeClaim", "delete", ""): [
        Case("exists", then(post(CLAIMS, claim()), delete(f"{CLAIMS}/checkpoints")), 200),
        Case("missing", delete(f"{CLAIMS}/nope"), 404, "NotFound"),
    ],
    ("Secret", "create", ""): [
        Case("new", post(SECRETS, secret()), 201),
        Case("taken", then(post(SECRETS, secret()), post(SECRETS, secret())), 409, "AlreadyExists"),
        Case("namespace terminating", then(terminating, post(SECRETS, secret())), 403, "Forbidden",
             "NamespaceTerminating"),
    ],
    ("Secret", "delete", ""): [
        Case("exists", then(post(SECRETS, secret()), delete(f"{SECRETS}/job-1-1-workspace-key")), 200),
        Case("missing", delete(f"{SECRETS}/nope"), 404, "NotFound"),
    ],
    ("NetworkPolicy", "list", ""): [
        Case("in a namespace", get(f"{POLICIES}?labelSelector=app.kubernetes.io%2Fmanaged-by%3Dgpu-portal"), 200),
        Case("all namespaces", get("/apis/networking.k8s.io/v1/networkpolicies?labelSelector=portal.gpu%2F"
                                   "workspace-id%3D9"), 200),
    ],
    ("NetworkPolicy", "delete", ""): [Case("missing", delete(f"{POLICIES}/nope"), 404, "NotFound")],
    ("Pod", "list", ""): [Case("all namespaces", get("/api/v1/pods?labelSelector=app%3Dllm"), 200)],
    ("Pod", "watch", ""): [
        Case("from now", watch_from("100"), 200),
        Case("compacted", compacted_watch, 200, "Expired"),  # 200 with an ERROR event holding a 410 Status
    ],
    ("Pod", "read", ""): [Case("missing", get(f"{PODS}/nope"), 404, "NotFound")],
    ("Pod", "delete", ""): [
        Case("running, graceful", then(bound(), delete(f"{PODS}/trainer?gracePeriodSeconds=30")), 200),
        Case("missing", delete(f"{PODS}/nope"), 404, "NotFound"),
    ],
    ("Pod", "create", "binding"): [
        Case("unbound", bound(), 201),
        Case("already bound", then(bound(), post(f"{PODS}/trainer/binding", binding("trainer", "gpu-b"))), 409, "Conflict"),
        Case("missing", post(f"{PODS}/nope/binding", binding("nope")), 404, "NotFound"),
    ],
    ("Pod", "create", "eviction"): [
        Case("no budget", then(bound(), post(f"{PODS}/trainer/eviction", eviction("trainer"))), 201),
        Case("budget exhausted", budget_exhausted, 429, "TooManyRequests", "DisruptionBudget"),
        Case("missing", post(f"{PODS}/nope/eviction", eviction("nope")), 404, "NotFound"),
    ],
    ("Pod", "read", "log"): [
        Case("running", then(bound(), get(f"{PODS}/trainer/log?tailLines=10")), 200),
        Case("not started", then(post(PODS, safe_pod()), get(f"{PODS}/trainer/log")), 400, "BadRequest"),
        Case("bad tailLines", then(bound(), get(f"{PODS}/trainer/log?tailLines=-1")), 422, "Invalid"),
    ],
    ("ServiceAccount", "read", ""): [
        Case("missing", get(f"/api/v1/namespaces/{NS}/serviceaccounts/nope"), 404, "NotFound"),
    ],
    ("ServiceAccount", "create", "token"): [
        Case("an hour", token(3600), 201),
        Case("under ten minutes", token(60), 422, "Invalid"),
        Case("missing account", post(f"/api/v1/namespaces/{NS}/serviceaccounts/nope/token",
                                     {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}),
             404, "NotFound"),
    ],
    ("ServiceAccount", "delete", ""): [
        Case("missing", delete(f"/api/v1/namespaces/{NS}/serviceaccounts/nope"), 404, "NotFound"),
    ],
    ("RoleBinding", "delete", ""): [Case("missing", delete(f"{BINDINGS}/nope"), 404, "NotFound")],
    ("Service", "delete", ""): [Case("missing", delete(f"/api/v1/namespaces/{NS}/services/nope"), 404, "NotFound")],
    ("Service", "list", ""): [Case("all namespaces", get("/api/v1/services?labelSelector=app%3Dllm"), 200)],
    ("Deployment", "list", ""): [Case("all namespaces", get("/apis/apps/v1/deployments"), 200)],
    ("Deployment", "delete", ""): [
        Case("missing", delete(f"{DEPLOYMENTS}/nope?propagationPolicy=Background"), 404, "NotFound"),
    ],
    ("Event", "list", ""): [
        Case("a refused Job's", then(refused_job, get(f"{EVENTS}?fieldSelector=involvedObject.kind%3DJob%2C"
                                                       "involvedObject.name%3Djob-1-1%2Creason%3DFailedCreate")), 200),
        Case("none", get(f"{EVENTS}?fieldSelector=involvedObject.kind%3DReplicaSet%2Creason%3DFailedCreate"), 200),
        Case("unsupported field", get(f"{EVENTS}?fieldSelector=spec.nodeName%3Dgpu-a"), 400, "BadRequest"),
    ],
    ("*", "apply", ""): [
        Case("creates", apply(JOBS, job()), 201),
        Case("updates", then(apply(JOBS, job()), apply(JOBS, job())), 200),
        Case("immutable template", then(apply(JOBS, job()), apply(JOBS, job("other"))), 422, "Invalid", "FieldValueInvalid"),
        Case("roleRef changed", then(apply(BINDINGS, role_binding()), apply(BINDINGS, role_binding("owner"))),
             422, "Invalid", "FieldValueInvalid"),
        Case("namespace terminating", then(terminating, apply(JOBS, job())), 403, "Forbidden", "NamespaceTerminating"),
        Case("namespace missing", apply("/apis/batch/v1/namespaces/nope/jobs", job() | {"metadata": {"name": "j"}}),
             404, "NotFound"),
    ],
    ("*", "read", ""): [Case("missing", get(f"{JOBS}/nope"), 404, "NotFound")],
    ("*", "list", ""): [Case("in a namespace", get(f"{JOBS}?labelSelector=app%3Dllm"), 200)],
    ("*", "delete", ""): [
        Case("exists", then(apply(JOBS, job()), delete(f"{JOBS}/job-1-1?propagationPolicy=Background")), 200),
        Case("missing", delete(f"{JOBS}/nope"), 404, "NotFound"),
    ],
    ("*", "patch", ""): [
        Case("merge", lambda api: api_call(api, "PATCH", "/api/v1/nodes/gpu-a",
                                           {"metadata": {"labels": {"a": "b"}}}, content_type=MERGE_PATCH), 200),
    ],
}


def backend_calls() -> set[tuple[str, str, str]]:
    """(kind, verb, subresource) of each call in runners/backends/*.py; "*" where the kind is a variable."""
    found = set()
    for path in sorted(BACKENDS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                    and node.func.attr in ("_checked", "_call", "_delete", "_apply")):
                continue
            if any(isinstance(arg, ast.Starred) for arg in node.args):
                continue  # _checked handing its arguments on to _call
            keywords = {k.arg: k.value for k in node.keywords}
            literal = node.args and isinstance(node.args[0], ast.Constant)
            kind = node.args[0].value if literal else "*"
            if node.func.attr == "_apply":
                kind, verb = "*", "apply"
            elif node.func.attr == "_delete":
                verb = "delete"
            else:
                verb = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
                if verb == "patch" and isinstance(keywords.get("content_type"), ast.Name) \
                        and keywords["content_type"].id == "APPLY_PATCH":
                    verb = "apply"
                if verb == "list" and "watch" in keywords:
                    verb = "watch"
            sub = keywords.get("subresource")
            found.add((kind, verb, sub.value if isinstance(sub, ast.Constant) else ""))
    return found


def test_every_backend_call_has_a_row():
    calls = backend_calls()
    assert ("Pod", "create", "binding") in calls and ("*", "apply", "") in calls  # the scan reads the code
    missing = sorted(call for call in calls if call not in TABLE)
    assert not missing, f"calls of runners/backends/ without a row in this table: {missing}"


@pytest.fixture
def standin():
    # Every JSON answer of every request a case makes is checked against the schema, not only the last.
    with KubernetesStandIn(termination_delay_s=60, pod_stop_delay_s=60, check_answers=True) as api:
        for name in (NS, "gpu-operator"):
            api_call(api, "POST", "/api/v1/namespaces", namespace(name))
        api.put(gpu_node("gpu-a"))
        api.put(gpu_node("gpu-b"))
        yield api
        assert api.invalid_answers == []


CASES = [pytest.param(verb, case, id=f"{kind}-{verb}{'-' + sub if sub else ''}-{case.name}")
         for (kind, verb, sub), cases in TABLE.items() for case in cases]


@pytest.mark.parametrize(("verb", "case"), CASES)
def test_case(standin, verb, case):
    status, body = case.call(standin)
    assert status == case.status, body
    if verb == "watch":
        events = check_watch(body)
        if case.reason:
            # A watch's error comes as its last event: an ERROR holding the Status.
            assert events[-1]["type"] == "ERROR", events
            body = events[-1]["object"]
            assert body["code"] == 410
        else:
            return
    elif isinstance(body, dict):
        check_schema(body)
    if case.reason:
        assert body["kind"] == "Status" and body["status"] == "Failure" and body["code"] in (status, 410)
        assert body["reason"] == case.reason, body
        causes = [c.get("reason") for c in (body.get("details") or {}).get("causes") or []]
        assert case.cause in causes if case.cause else True, body


def test_watch_events_validate(standin):
    bound()(standin)
    status, stream = watch_from("100")(standin)
    assert status == 200
    assert [e["type"] for e in check_watch(stream)] == ["ADDED", "MODIFIED"]

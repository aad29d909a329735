"""An endpoint on vLLM, end to end on the Kubernetes backend against the API stand-in.

Each replica's pod runs "vLLM": a small HTTP server in this test that speaks vLLM's protocol as vLLM documents it
(`/health` 200 once the model is loaded, `/metrics` with `vllm:num_requests_running`, `vllm:num_requests_waiting`
and `vllm:kv_cache_usage_perc`), one per pod, on a loopback address of its own at the replica's port. The stand-in's
kubelet gives a pod an address nothing answers at; the test reports the pod's address as its fake engine's (a
status update, as a kubelet's), so the reconcile reads the engine where the pod is. The rest is the portal's own:
deploy, schedule, launch (the Deployment, strictly valid), readiness, the autoscaler from the engine's own
metrics, scale-in and a rollout to another image.
"""

import ipaddress
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runners.backends.manifests import SERVER_PORT
from runners.clusters.registry import get_backend
from runners.inference.models import EndpointState, InferenceEndpoint
from tests.support.endpoints import drive, ready_count
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment
from tests.support.k8s import api_call, gpu_node

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

IMAGE = "nvcr.io/nvidia/vllm-openai:v0.8.5"
NEWER = "nvcr.io/nvidia/vllm-openai:v0.9.0"
FIRST_ADDRESS = ipaddress.ip_address("127.0.36.1")


class FakeVllm(ThreadingHTTPServer):
    """vLLM's health and metrics routes, answering from what the test sets."""

    daemon_threads = True

    def __init__(self, host: str):
        self.loaded = True
        self.running = self.waiting = 0
        self.kv_cache = 0.0
        self.health_reads = self.metrics_reads = 0
        super().__init__((host, SERVER_PORT), _Handler)
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def metrics(self) -> str:
        labels = '{engine="0",model_name="chat"}'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {float(self.running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {float(self.waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} {self.kv_cache}\n"
            "# TYPE vllm:prompt_tokens_total counter\n"
            f"vllm:prompt_tokens_total{labels} 42.0\n"
        )


class _Handler(BaseHTTPRequestHandler):
    server: FakeVllm

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/health":
            self.server.health_reads += 1
            # vLLM answers /health only once its engine is up; while it loads, nothing is ready.
            status, body, kind = (200, b"", "text/plain") if self.server.loaded else (503, b"", "text/plain")
        elif self.path == "/metrics":
            self.server.metrics_reads += 1
            status, body, kind = 200, self.server.metrics().encode(), "text/plain; version=0.0.4"
        else:
            status, body, kind = 404, json.dumps({"detail": "Not Found"}).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):
        pass


class Engines:
    """One fake vLLM per replica pod, each on its own loopback address; the pod's status says that address."""

    def __init__(self, cluster, namespace: str):
        self.cluster, self.namespace = cluster, namespace
        self.by_pod: dict[str, FakeVllm] = {}
        self.servers: list[FakeVllm] = []

    def route(self) -> None:
        for pod in self.cluster.pods(self.namespace):
            name = pod["metadata"]["name"]
            if name in self.by_pod or (pod.get("status") or {}).get("phase") != "Running":
                continue
            if pod["metadata"].get("deletionTimestamp") or not pod["spec"].get("nodeName"):
                continue
            server = FakeVllm(str(FIRST_ADDRESS + len(self.servers)))
            self.servers.append(server)
            self.by_pod[name] = server
            status, answer = api_call(self.cluster, "PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{name}",
                                      {"status": {"podIP": server.server_address[0]}},
                                      content_type="application/merge-patch+json")
            assert status == 200, answer

    def live(self) -> list[FakeVllm]:
        names = {pod["metadata"]["name"] for pod in self.cluster.pods(self.namespace)}
        return [server for name, server in self.by_pod.items() if name in names]

    def set_all(self, **values) -> None:
        for server in self.servers:
            for key, value in values.items():
                setattr(server, key, value)

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def world(kubernetes_cluster, settings, tenant, owner):
    settings.PREEMPTION_GRACE_PERIOD_S = 20
    settings.ENDPOINT_SCALE_IN_AFTER_S = 2
    settings.ENDPOINT_TARGET_INFLIGHT = 8
    settings.ALLOWED_IMAGE_REGISTRIES = ["nvcr.io/nvidia"]
    for node in ("gpu-a", "gpu-b"):
        kubernetes_cluster.put(gpu_node(node))
    kubernetes_cluster.sigterm_exit_code = 0  # the engine finishes what it has, then exits 0
    get_backend().min_sync_interval_s = 0  # every pass reads the watch
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    engines = Engines(kubernetes_cluster, environment.namespace)
    yield {"environment": environment, "engines": engines, "cluster": kubernetes_cluster}
    engines.close()


def _deployments(cluster, namespace: str) -> dict[str, dict]:
    return {name: obj for (plural, ns, name), obj in cluster.objects().items()
            if plural == "deployments" and ns == namespace}


def _until(engines: Engines, condition):
    def check(endpoint) -> bool:
        engines.route()
        return condition(endpoint)
    return check


def test_a_vllm_endpoint_is_probed_on_its_health_route_scaled_by_its_metrics_scaled_in_and_rolled_out(
        world, client_for, owner):
    engines, cluster = world["engines"], world["cluster"]
    namespace = world["environment"].namespace
    client = client_for(owner)
    created = client.post("/api/v1/endpoints/", {
        "tenant": "acme", "environment": world["environment"].id, "name": "chat", "engine": "vllm", "image": IMAGE,
        "source": {"path": "/models/llama-3-8b"}, "max_model_len": 8192, "dtype": "bfloat16", "flavor": "h100-80gb",
        "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 3}, format="json")
    assert created.status_code == 201, created.json()
    endpoint = InferenceEndpoint.objects.get(id=created.json()["id"])

    # The replica's Deployment: vLLM's own command and flags, probed on /health.
    endpoint = drive(endpoint, _until(engines, lambda e: len(engines.servers) == 1))
    [deployment] = _deployments(cluster, namespace).values()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == IMAGE and container["command"] == ["vllm", "serve"]
    assert container["args"] == ["/models/llama-3-8b", "--host", "0.0.0.0", "--port", "8000", "--served-model-name",
                                 "chat", "--tensor-parallel-size", "1", "--max-model-len", "8192", "--dtype",
                                 "bfloat16"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"

    # Still loading: /health answers 503, so the replica is not ready and the endpoint still deploys.
    [first] = engines.servers
    first.loaded = False
    endpoint = drive(endpoint, _until(engines, lambda e: first.health_reads >= 2))
    assert endpoint.state == EndpointState.DEPLOYING and ready_count(endpoint) == 0
    first.loaded = True
    endpoint = drive(endpoint, _until(engines, lambda e: e.state == EndpointState.READY))
    assert ready_count(endpoint) == 1 and endpoint.replicas.get().address == f"http://{FIRST_ADDRESS}:8000"

    # vLLM's own gauges drive the autoscaler: 6 running and 10 waiting need two replicas at 8 each.
    engines.set_all(running=6, waiting=10)
    endpoint = drive(endpoint, _until(engines, lambda e: e.desired_replicas == 2 and ready_count(e) == 2))
    assert "16 requests in flight need 2 replicas" in endpoint.scale_events.first().reason
    sample = endpoint.samples.order_by("-at").first()
    assert sample.running >= 6 and sample.queue_depth >= 10 and sample.kv_cache_use == pytest.approx(0.0)

    # A light load whose KV caches are full: vLLM is about to queue or preempt, so one replica more.
    engines.set_all(running=1, waiting=0, kv_cache=0.95)
    endpoint = drive(endpoint, _until(engines, lambda e: e.desired_replicas == 3 and ready_count(e) == 3))
    assert "KV caches are 95% full" in endpoint.scale_events.first().reason

    # Idle: after the scale-in window, back to one replica; the others drain and their Deployments go.
    engines.set_all(running=0, waiting=0, kv_cache=0.05)
    endpoint = drive(endpoint, _until(engines, lambda e: e.desired_replicas == 1 and ready_count(e) == 1
                                      and e.state == EndpointState.READY and len(_deployments(cluster, namespace)) == 1))
    assert endpoint.scale_events.first().reason.startswith("Scale in")

    # A rollout to another image and model: a new replica starts, is ready, then the old one drains. Never fewer
    # than one ready on the way.
    since = endpoint.samples.order_by("-at").first().at
    answer = client.post(f"/api/v1/endpoints/{endpoint.id}/rollout/",
                         {"source": {"path": "/models/llama-3.1-8b"}, "image": NEWER}, format="json")
    assert answer.status_code == 202, answer.json()
    endpoint = drive(endpoint, _until(engines, lambda e: e.state == EndpointState.READY and e.replicas.filter(
        generation=2, ready=True).count() == 1 and len(_deployments(cluster, namespace)) == 1))
    [deployment] = _deployments(cluster, namespace).values()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == NEWER and container["args"][0] == "/models/llama-3.1-8b"
    assert min(endpoint.samples.filter(at__gt=since).values_list("ready_replicas", flat=True)) >= 1

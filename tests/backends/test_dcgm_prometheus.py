"""GPU readings on the Kubernetes backend: a real Prometheus scraping a DCGM exporter stand-in, pods from the API stand-in.

The jobs and replicas are launched on the API stand-in as in test_kubernetes_jobs.py and
test_kubernetes_serving.py, so their pods carry what the backend's manifests put on them (and a
serving replica's pod the ReplicaSet's random suffix). The exporter attributes devices to those
pods by namespace, pod and container, as dcgm-exporter does through the kubelet; Prometheus
(Debian's, started per module) scrapes it every second.
"""

import time

import pytest

from runners.backends import dcgm
from runners.backends.base import GpuReading, JobLaunch, ReplicaPlacement, ServingSettings, TransientBackendError
from runners.backends.job_manifests import ATTEMPT_LABEL, COMPLETION_INDEX_ANNOTATION, JOB_LABEL
from runners.nvidia import names
from tests.support.k8s import environment_namespace, gpu_node
from tests.support.prometheus import DcgmDevice, DcgmExporter, running_prometheus

pytestmark = pytest.mark.e2e

NAMESPACE = "acme-train"
OTHER_NAMESPACE = "globex-train"


@pytest.fixture(scope="module")
def exporter():
    with DcgmExporter() as served:
        yield served


@pytest.fixture(scope="module")
def prometheus(exporter):
    with running_prometheus([exporter.target]) as server:
        yield server


@pytest.fixture
def cluster(standin):
    """Two GPU nodes and the environment's namespace."""
    for node in ("gpu-a", "gpu-b"):
        standin.put(gpu_node(node))
    environment_namespace(standin, NAMESPACE)  # its pods' ServiceAccount too, or admission refuses them
    return standin


@pytest.fixture
def backend(make_backend, prometheus):
    return make_backend(prometheus_url=prometheus.url)


def training(job_id: int, placement: dict[int, tuple[str, tuple[int, ...]]], **overrides) -> JobLaunch:
    values = dict(
        job_id=job_id, attempt=1, tenant_slug="acme", namespace=NAMESPACE, name="llm", template="pytorch-ddp",
        replicas=tuple(ReplicaPlacement(rank, node, gpus) for rank, (node, gpus) in placement.items()),
        gpu_resource=names.GPU_RESOURCE, gpus_per_replica=len(next(iter(placement.values()))[1]),
        cpu_milli_per_replica=4000, memory_mib_per_replica=16384, steps=100, checkpoint_every_steps=10,
        max_runtime_s=3600, grace_period_s=30,
    )
    values.update(overrides)
    return JobLaunch(**values)


def serving(job_id: int, node: str) -> JobLaunch:
    return JobLaunch(
        job_id=job_id, attempt=1, tenant_slug="acme", namespace=NAMESPACE, name="chat-g1-r0", template="serve",
        replicas=(ReplicaPlacement(0, node, (0,)),), gpu_resource=names.GPU_RESOURCE, gpus_per_replica=1,
        cpu_milli_per_replica=2000, memory_mib_per_replica=8192, steps=1, checkpoint_every_steps=0,
        max_runtime_s=86400, grace_period_s=45,
        serving=ServingSettings(endpoint_id=3, checkpoint="checkpoints/step-00000040.pt", source_job_id=12),
    )


def launched(backend, api, launch: JobLaunch) -> dict[int, dict]:
    """Launch, let the stand-in's controllers make the pods and the backend bind them; the pods by rank."""
    backend.launch_job(launch)
    api.objects()  # the controllers run
    backend._sync(force=True)
    backend._sync(force=True)  # the watch sees the bindings
    pods = api.pods(NAMESPACE, **{JOB_LABEL: str(launch.job_id), ATTEMPT_LABEL: str(launch.attempt)})
    return {int(pod["metadata"]["annotations"].get(COMPLETION_INDEX_ANNOTATION, 0)): pod for pod in pods}


def held_by(pod: dict, uuid: str, gpu: int, *, container: str | None = None, namespace: str | None = None,
            **figures) -> DcgmDevice:
    """A device the exporter attributes to the pod's workload container (or the one named)."""
    return DcgmDevice(
        uuid=uuid, gpu=gpu, hostname=pod["spec"]["nodeName"], namespace=namespace or pod["metadata"]["namespace"],
        pod=pod["metadata"]["name"], container=container or pod["spec"]["containers"][0]["name"], **figures,
    )


def served(exporter, devices: list[DcgmDevice]) -> float:
    """Serve the devices and wait until Prometheus has them; when they were set."""
    set_at = time.time()
    exporter.set(devices)
    exporter.wait_scraped()
    return set_at


def test_two_replicas_of_two_gpus_give_four_readings_each_with_its_rank_and_figures(backend, cluster, exporter):
    pods = launched(backend, cluster, training(41, {0: ("gpu-a", (0, 1)), 1: ("gpu-b", (0, 1))}))
    other = launched(backend, cluster, training(42, {0: ("gpu-a", (2,))}))
    set_at = served(exporter, [
        held_by(pods[0], "GPU-a0", 0, gpu_util=87, gr_engine_active=0.81, fb_used_mib=40536, power_w=612.25),
        held_by(pods[0], "GPU-a1", 1, gpu_util=85, gr_engine_active=0.79, fb_used_mib=40100, power_w=598.5),
        held_by(pods[1], "GPU-b0", 0, gpu_util=91, gr_engine_active=0.88, fb_used_mib=41000, power_w=640),
        held_by(pods[1], "GPU-b1", 1, gpu_util=90, gr_engine_active=0.86, fb_used_mib=40990, power_w=633.75),
        held_by(other[0], "GPU-a2", 2, gpu_util=12, gr_engine_active=0.1, fb_used_mib=2048, power_w=120),
        # Free GPUs: the exporter labels no pod on them.
        DcgmDevice("GPU-a3", 3, "gpu-a", gpu_util=0, fb_used_mib=0, power_w=70),
    ])
    readings = backend.gpu_readings({(41, 1), (42, 1)})
    assert set(readings) == {(41, 1), (42, 1)}
    figures = {(r.rank, r.device): (r.gpu_util_pct, r.memory_used_mib, r.power_w) for r in readings[(41, 1)]}
    assert figures == {
        (0, "GPU-a0"): (87.0, 40536.0, 612.25), (0, "GPU-a1"): (85.0, 40100.0, 598.5),
        (1, "GPU-b0"): (91.0, 41000.0, 640.0), (1, "GPU-b1"): (90.0, 40990.0, 633.75),
    }
    assert [(r.rank, r.device, r.gpu_util_pct) for r in readings[(42, 1)]] == [(0, "GPU-a2", 12.0)]
    every = readings[(41, 1)] + readings[(42, 1)]
    assert {r.source for r in every} == {"dcgm"}
    # When Prometheus scraped the sample (a scrape under way when they were set may have carried them).
    assert all(set_at - 1.5 <= r.at <= time.time() for r in every)
    # Asked for one attempt, only that one's.
    assert set(backend.gpu_readings({(42, 1)})) == {(42, 1)}


def test_a_mig_instance_reads_the_graphics_engine_activity_as_its_utilization(backend, cluster, exporter):
    launch = training(43, {0: ("gpu-a", (0,))}, gpu_resource=names.mig_resource("1g.10gb"))
    pods = launched(backend, cluster, launch)
    served(exporter, [
        held_by(pods[0], "GPU-a0", 0, model_name="NVIDIA A100-SXM4-80GB", mig_profile="1g.10gb", mig_instance=9,
                gr_engine_active=0.4375, fb_used_mib=9216),
        # The whole GPU, which no pod holds (its instances are the pods'), and another instance of it.
        DcgmDevice("GPU-a0", 0, "gpu-a", model_name="NVIDIA A100-SXM4-80GB", gpu_util=64, power_w=300),
        DcgmDevice("GPU-a0", 0, "gpu-a", model_name="NVIDIA A100-SXM4-80GB", mig_profile="3g.40gb", mig_instance=2,
                   gr_engine_active=0.9, fb_used_mib=30000),
    ])
    [reading] = backend.gpu_readings({(43, 1)})[(43, 1)]
    assert (reading.rank, reading.device) == (0, "GPU-a0/9")
    assert (reading.gpu_util_pct, reading.memory_used_mib, reading.power_w) == (43.75, 9216.0, None)


def test_a_serving_replica_is_attributed_by_its_pods_labels_not_its_random_name(backend, cluster, exporter):
    pods = launched(backend, cluster, serving(51, "gpu-b"))
    pod = pods[0]
    # The ReplicaSet's pod: job-51-1-<template hash>-<random>, nothing the backend could parse a rank from.
    assert pod["metadata"]["name"].startswith("job-51-1-") and len(pod["metadata"]["name"].split("-")) == 5
    served(exporter, [held_by(pod, "GPU-b0", 0, gpu_util=33, gr_engine_active=0.3, fb_used_mib=12000, power_w=250)])
    readings = backend.gpu_readings({(51, 1)})
    assert readings == {(51, 1): [GpuReading(
        rank=0, device="GPU-b0", at=readings[(51, 1)][0].at, source="dcgm",
        gpu_util_pct=33.0, memory_used_mib=12000.0, power_w=250.0,
    )]}


def test_series_of_other_pods_sidecars_and_namespaces_are_not_returned(backend, cluster, exporter):
    pods = launched(backend, cluster, training(44, {0: ("gpu-a", (0,)), 1: ("gpu-b", (0,))}))
    not_asked = launched(backend, cluster, training(45, {0: ("gpu-a", (1,))}))
    served(exporter, [
        held_by(pods[0], "GPU-a0", 0, gpu_util=70, fb_used_mib=1000, power_w=400),
        # A sidecar the mesh injected into rank 1's pod, holding a GPU of its own.
        held_by(pods[1], "GPU-b0", 0, container="istio-proxy", gpu_util=5, fb_used_mib=10, power_w=80),
        # Another tenant's pod of the same name, in its namespace.
        held_by(pods[0], "GPU-b1", 1, namespace=OTHER_NAMESPACE, gpu_util=99, fb_used_mib=70000, power_w=700),
        # An open attempt the call did not ask about.
        held_by(not_asked[0], "GPU-a1", 1, gpu_util=50, fb_used_mib=500, power_w=300),
    ])
    readings = backend.gpu_readings({(44, 1)})
    assert {key: [(r.rank, r.device, r.gpu_util_pct) for r in found] for key, found in readings.items()} == {
        (44, 1): [(0, "GPU-a0", 70.0)],
    }
    # An attempt with nothing to read is left out; one with no pods costs no query.
    served(exporter, [])
    assert backend.gpu_readings({(44, 1)}) == {}
    assert backend.gpu_readings({(99, 1)}) == {}


def test_prometheus_down_is_a_transient_error(make_backend, cluster, exporter):
    with running_prometheus([exporter.target]) as server:
        backend = make_backend(prometheus_url=server.url)
        launched(backend, cluster, training(46, {0: ("gpu-a", (0,))}))
        server.stop()
        with pytest.raises(TransientBackendError, match="could not be reached"):
            backend.gpu_readings({(46, 1)})


def test_without_a_prometheus_there_are_no_readings(make_backend, cluster):
    backend = make_backend()
    launched(backend, cluster, training(47, {0: ("gpu-a", (0,))}))
    cluster.clear_log()
    assert backend.prometheus_url is None and backend.gpu_readings({(47, 1)}) == {}
    assert cluster.requests == []  # not even the pod watch


def test_a_query_prometheus_refuses_is_a_transient_error_with_its_reason(prometheus):
    with pytest.raises(TransientBackendError, match="answered 400 .*parse error"):
        dcgm.query(prometheus.url, 'DCGM_FI_DEV_GPU_UTIL{pod!=""')


# --- The grouping, on answers as Prometheus gives them ----------------------------------------


def series(name: str | None, value: str, **labels: str) -> dict:
    metric = {"UUID": "GPU-1", "gpu": "1", "Hostname": "gpu-a", "modelName": "NVIDIA H100 80GB HBM3",
              "namespace": "ns", "pod": "p", "container": "trainer", "instance": "10.0.0.5:9400", **labels}
    if name is None:
        metric[dcgm.TIMESTAMP_LABEL] = "1"
    else:
        metric["__name__"] = name
    return {"metric": metric, "value": [1700000100.0, value]}


def test_the_sample_time_is_the_scrape_and_a_whole_gpu_falls_back_to_the_engine_activity():
    [reading] = dcgm.device_readings([
        series(dcgm.GR_ENGINE_ACTIVE, "0.5"), series(dcgm.FB_USED, "NaN"), series(dcgm.POWER_USAGE, "300.5"),
        series(None, "1700000091.25"),
    ], evaluated_at=1700000100.0)
    assert (reading.device, reading.at, reading.gpu_util_pct, reading.memory_used_mib, reading.power_w) == (
        "GPU-1", 1700000091.25, 50.0, None, 300.5,
    )
    assert (reading.gpu, reading.hostname, reading.mig_profile) == ("1", "gpu-a", "")


def test_a_mig_instance_ignores_a_gpu_util_and_is_its_own_device():
    mig = {"GPU_I_ID": "3", "GPU_I_PROFILE": "2g.20gb"}
    readings = dcgm.device_readings([
        series(dcgm.GPU_UTIL, "97", **mig), series(dcgm.GR_ENGINE_ACTIVE, "0.25", **mig),
        series(dcgm.GPU_UTIL, "97"), series(dcgm.GR_ENGINE_ACTIVE, "0.9"),
        series(dcgm.GPU_UTIL, "10", container="sidecar"),
    ], evaluated_at=1700000100.0)
    assert sorted((r.container, r.device, r.mig_profile, r.gpu_util_pct, r.at) for r in readings) == [
        ("sidecar", "GPU-1", "", 10.0, 1700000100.0),
        ("trainer", "GPU-1", "", 97.0, 1700000100.0),
        ("trainer", "GPU-1/3", "2g.20gb", 25.0, 1700000100.0),
    ]

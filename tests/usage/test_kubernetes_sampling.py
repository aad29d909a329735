"""Utilization on the Kubernetes backend: each DCGM sample lands on the right tenant, job, attempt and rank.

Two tenants' training jobs (acme: 2 replicas x 1 GPU, globex: 1 replica x 1 GPU) go through the
portal's own path on the API stand-in: inventory sync of its GPU nodes, quota, a ready
environment, `job_submit`, the scheduling cycle, the launch, and the reconcile that finds the pods
bound and running. A stand-in for NVIDIA's DCGM exporter then serves one device per pod, labelled
with the pod's real namespace, name (the Job controller's random suffix included) and container
as the stand-in made them, plus a decoy device held by a pod that is no job of the portal; a real
Prometheus (Debian's, one per module, scraping every half second with honor_labels) takes them in.
One pass of the sampler (`sampling.sample_run`, what the beat runs) must then store exactly one
row per job device, each with its tenant, job, attempt, rank and figures, source "dcgm", and
nothing of the decoy; through the API a tenant reads its job's series and gets 404 for the other
tenant's job.
"""

import time

import pytest

from runners.clusters.registry import get_backend
from runners.jobs import reconcile
from runners.jobs import services as jobs
from runners.jobs.models import Job
from runners.usage import sampling
from runners.usage.models import Resolution, UtilizationSample
from tests.support.jobs import admit_and_launch, demo_cluster_with_flavors, give_quota, job_data, ready_environment
from tests.support.k8s import gpu_node, job_pods, portal_pod
from tests.support.prometheus import DcgmDevice, DcgmExporter, running_prometheus

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]


@pytest.fixture(scope="module")
def exporter():
    with DcgmExporter() as served:
        yield served


@pytest.fixture(scope="module")
def prometheus(exporter):
    with running_prometheus([exporter.target], scrape_interval_s=0.5) as server:
        yield server


@pytest.fixture
def cluster(kubernetes_cluster, settings, prometheus):
    """The stand-in's two GPU nodes, the portal's backend reading the DCGM exporter through Prometheus."""
    settings.PROMETHEUS_URL = prometheus.url
    get_backend.cache_clear()  # built again, with the URL
    for node in ("gpu-a", "gpu-b"):
        kubernetes_cluster.put(gpu_node(node))
    get_backend().min_sync_interval_s = 0  # every pass reads the watch
    return kubernetes_cluster


def _running(api, job: Job) -> tuple[Job, dict[int, dict]]:
    """Cycle, launch and one reconcile pass, after which the job runs; its attempt's pods on the stand-in, by rank."""
    attempt = admit_and_launch(job)
    reconcile.jobs_reconcile_run()
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.state == "running" and attempt.started_at is not None, job.reason
    by_rank = job_pods(api, job, attempt.number)
    placed = {replica["replica"]: replica["node"] for replica in attempt.placement}
    # Bound where the portal placed each replica, and running.
    assert {rank: (pod["spec"]["nodeName"], pod["status"]["phase"]) for rank, pod in by_rank.items()} == {
        rank: (node, "Running") for rank, node in placed.items()
    }
    return job, by_rank


def _held_by(pod: dict, gpu: int, **figures) -> DcgmDevice:
    """The device as the exporter attributes it to the pod's first container (the trainer, for a replica)."""
    node = pod["spec"]["nodeName"]
    return DcgmDevice(uuid=f"GPU-{node}-{gpu}", gpu=gpu, hostname=node, namespace=pod["metadata"]["namespace"],
                      pod=pod["metadata"]["name"], container=pod["spec"]["containers"][0]["name"], **figures)


def _placed_gpu(job: Job, rank: int) -> int:
    [gpu] = next(r["gpus"] for r in job.attempts.get(number=1).placement if r["replica"] == rank)
    return gpu


def test_dcgm_samples_through_prometheus_are_attributed_to_each_tenants_job_and_replica(
    cluster, exporter, tenant, other_tenant, owner, outsider, client_for
):
    flavors = demo_cluster_with_flavors()
    for who in (tenant, other_tenant):
        give_quota(who, flavors["h100-80gb"], guaranteed=8, max=8)
    acme_env = ready_environment(actor=owner, tenant=tenant)
    globex_env = ready_environment(actor=outsider, tenant=other_tenant)
    acme, acme_pods = _running(cluster, jobs.job_submit(
        actor=owner, data=job_data(acme_env, name="acme-llm", replicas=2, gpus_per_replica=1)))
    globex, globex_pods = _running(cluster, jobs.job_submit(
        actor=outsider, data=job_data(globex_env, name="globex-vit", replicas=1, gpus_per_replica=1,
                                      topology={"level": "none", "mode": "required"})))
    assert set(acme_pods) == {0, 1} and set(globex_pods) == {0}

    # A pod of acme's namespace that is no replica of any job (the portal's label, none of a job's),
    # holding a GPU on the same node as acme's replicas: its series must be attributed to nobody.
    decoy_node = acme_pods[0]["spec"]["nodeName"]
    cluster.put(portal_pod("notebook-olivia", decoy_node, namespace=acme_env.namespace))
    [decoy_pod] = [pod for pod in cluster.pods(acme_env.namespace) if pod["metadata"]["name"] == "notebook-olivia"]

    # One device per replica, figures distinct from one another (and from the decoy's).
    figures = {
        (acme.id, 0): dict(gpu_util=87, gr_engine_active=0.81, fb_used_mib=40536, power_w=612.25),
        (acme.id, 1): dict(gpu_util=64, gr_engine_active=0.6, fb_used_mib=30100, power_w=498.5),
        (globex.id, 0): dict(gpu_util=23, gr_engine_active=0.2, fb_used_mib=9216, power_w=210.75),
    }
    devices = {
        (acme.id, rank): _held_by(pod, _placed_gpu(acme, rank), **figures[(acme.id, rank)])
        for rank, pod in acme_pods.items()
    }
    devices[(globex.id, 0)] = _held_by(globex_pods[0], _placed_gpu(globex, 0), **figures[(globex.id, 0)])
    # The decoy's GPU is one no replica holds (each UUID is one physical GPU).
    held = {(device.hostname, device.gpu) for device in devices.values()}
    decoy_gpu = next(index for index in range(8) if (decoy_node, index) not in held)
    decoy = _held_by(decoy_pod, decoy_gpu, gpu_util=99, gr_engine_active=0.97, fb_used_mib=79000, power_w=699.5)
    set_at = time.time()
    exporter.set([*devices.values(), decoy])
    exporter.wait_scraped()

    assert sampling.sample_run() == {"attempts": 2, "samples": 3}

    rows = UtilizationSample.objects.order_by("job_id", "rank")
    assert {
        (row.tenant_id, row.job_id, row.attempt, row.rank, row.device, row.source, row.resolution,
         row.gpu_util_pct, row.memory_used_mib, row.power_w)
        for row in rows
    } == {
        (job.tenant_id, job.id, 1, rank, devices[(job.id, rank)].uuid, "dcgm", Resolution.RAW,
         float(figures[(job.id, rank)]["gpu_util"]), float(figures[(job.id, rank)]["fb_used_mib"]),
         figures[(job.id, rank)]["power_w"])
        for job, rank in [(acme, 0), (acme, 1), (globex, 0)]
    }
    assert rows.count() == 3  # exactly one per job device: nothing twice, nothing for the decoy
    assert not rows.filter(device=decoy.uuid).exists()
    # Stamped with Prometheus's scrape time (a scrape under way when the devices were set may carry them).
    assert all(set_at - 1.5 <= row.at.timestamp() <= time.time() for row in rows)

    # Through the API, acme reads its job's two replicas; globex's job does not exist for acme.
    acme_api = client_for(owner)
    answer = acme_api.get(f"/api/v1/utilization/?job={acme.id}")
    assert answer.status_code == 200, answer.json()
    series = answer.json()["series"]
    assert [(s["job"], s["attempt"], s["rank"], s["device"], s["source"], s["simulated"]) for s in series] == [
        (acme.id, 1, rank, devices[(acme.id, rank)].uuid, "dcgm", False) for rank in (0, 1)
    ]
    assert [[(p["gpu_util_pct"], p["memory_used_mib"], p["power_w"]) for p in s["points"]] for s in series] == [
        [(87.0, 40536.0, 612.25)], [(64.0, 30100.0, 498.5)],
    ]
    assert acme_api.get(f"/api/v1/utilization/?job={globex.id}").status_code == 404
    # And the other way round.
    globex_api = client_for(outsider)
    assert [s["rank"] for s in globex_api.get(f"/api/v1/utilization/?job={globex.id}").json()["series"]] == [0]
    assert globex_api.get(f"/api/v1/utilization/?job={acme.id}").status_code == 404

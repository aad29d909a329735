"""The cycle tells placement which nodes' caches hold a queued job's dataset shards, and placement
prefers them among nodes otherwise as good; a job whose data is cached nowhere, or that may no
longer read its dataset, is placed as before."""

import pytest

from runners.clusters.models import Node
from runners.datasets import services as datasets
from runners.datasets.models import DatasetVersion, VersionShard
from runners.jobs.models import Job
from runners.nodecache.models import CachedBlob
from runners.scheduling import services as scheduling
from tests.support.jobs import give_quota, submit

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

ONE_GPU = dict(replicas=1, gpus_per_replica=1, topology={"level": "none", "mode": "preferred"})


@pytest.fixture
def images(owner, tenant):
    """A sealed dataset of acme, two shards."""
    dataset = datasets.dataset_create(actor=owner, tenant=tenant, name="images")
    version = DatasetVersion.objects.create(dataset=dataset, number=1, manifest_sha256="1" * 64)
    for position, sha256 in enumerate(("a" * 64, "b" * 64)):
        VersionShard.objects.create(version=version, position=position, sha256=sha256, bytes=3 << 30, stored=True,
                                    members=[[f"{position}.txt", 10]])
    datasets.version_seal(actor=owner, tenant=tenant, version=version, shards=2)
    return dataset


def _node_of(job) -> str:
    return job.attempts.order_by("-number").first().placement[0]["node"]


def _cache(node_name: str, sha256: str, size: int) -> None:
    CachedBlob.objects.create(node=Node.objects.get(name=node_name), kind="shards", sha256=sha256, bytes=size)


def test_a_job_goes_to_the_equally_good_node_whose_cache_holds_its_shards(flavors, tenant, owner, acme_env, images):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    _cache("h100-node-2", "a" * 64, 3 << 30)
    _cache("h100-node-2", "b" * 64, 3 << 30)
    _cache("h100-node-1", "a" * 64, 3 << 30)  # one shard of two: holds less
    _cache("h100-node-1", "c" * 64, 9 << 30)  # another dataset's shard counts for nothing
    reader = submit(owner, acme_env, name="reader", datasets=[{"name": "images"}], **ONE_GPU)
    plain = submit(owner, acme_env, name="plain", **ONE_GPU)
    scheduling.cycle_run()
    # Both empty H100 nodes score the same; without cached data the first by name wins.
    assert _node_of(reader) == "h100-node-2"
    assert _node_of(plain) == "h100-node-1"


def test_a_job_whose_dataset_it_can_no_longer_read_is_placed_without_preference(flavors, tenant, owner, acme_env, images):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    _cache("h100-node-2", "a" * 64, 3 << 30)
    job = submit(owner, acme_env, name="reader", datasets=[{"name": "images"}], **ONE_GPU)
    # Its dataset went away after the submit (as a share withdrawn would make it unreadable).
    Job.objects.filter(id=job.id).update(spec={**job.spec, "datasets": [{"name": "gone", "version": 1}]})
    result = scheduling.cycle_run()
    assert result["admitted"] == [job.id]
    assert _node_of(job) == "h100-node-1"

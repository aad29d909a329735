"""Which version a job read: the SDK's record in the job folder, read back with the attempt's progress, writes the
use's read_at once (the first read), only for a version the job's spec pinned; the API, the CLI's source and
the datasets page show it."""

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from gpuportal.datasets import record_read

from runners.clusters.registry import get_backend
from runners.datasets import services
from runners.datasets.models import DatasetUse, DatasetVersion, VersionShard
from runners.jobs import attempts
from runners.jobs import services as jobs
from runners.jobs.models import Job
from runners.scheduling import services as scheduling
from tests.support.jobs import give_quota, job_data, play_launch

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def _sealed(dataset, number):
    version = DatasetVersion.objects.create(dataset=dataset, number=number, manifest_sha256=f"{number:064x}")
    VersionShard.objects.create(version=version, position=0, sha256=f"{number:064x}", bytes=1000, stored=True,
                                members=[["0.txt", 10]])
    return services.version_seal(actor=dataset.created_by, tenant=dataset.tenant, version=version, shards=1)


@pytest.fixture
def running(owner, tenant, acme_env, flavors):
    """A running job of acme that names images (pinned to version 2 of 2) and text; its open attempt."""
    images = services.dataset_create(actor=owner, tenant=tenant, name="images")
    _sealed(images, 1)
    _sealed(images, 2)
    _sealed(services.dataset_create(actor=owner, tenant=tenant, name="text"), 1)
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    job = jobs.job_submit(actor=owner, data=job_data(acme_env, datasets=[{"name": "images"}, {"name": "text"}]))
    assert job.spec["datasets"] == [{"name": "images", "version": 2}, {"name": "text", "version": 1}]
    scheduling.cycle_run()
    return job, play_launch(job)


def test_the_version_the_script_read_is_recorded_once_and_shown(running, client_for, owner):
    job, attempt = running
    job_dir = get_backend().jobs.job_dir(job.id)
    record_read(job_dir, name="images", version=1, attempt=attempt.number, rank=0)  # not the version pinned
    record_read(job_dir, name="nope", version=2, attempt=attempt.number, rank=0)  # not a dataset of the spec
    record_read(job_dir, name="images", version=2, attempt=attempt.number, rank=0)
    before = timezone.now()
    attempts.progress_record(Job.objects.get(id=job.id), attempt, get_backend())

    uses = {use.version.dataset.name: use for use in DatasetUse.objects.select_related("version__dataset")}
    assert set(uses) == {"images", "text"}  # the records added no use
    read_at = uses["images"].read_at
    assert read_at is not None and uses["images"].created_at <= read_at <= timezone.now()
    assert abs(read_at - before) < timedelta(seconds=30)
    assert uses["text"].read_at is None

    # A later attempt reads it again: the first read stays.
    record_read(job_dir, name="images", version=2, attempt=attempt.number + 1, rank=0)
    record_read(job_dir, name="text", version=1, attempt=attempt.number + 1, rank=0)
    attempts.progress_record(Job.objects.get(id=job.id), attempt, get_backend())
    assert DatasetUse.objects.get(id=uses["images"].id).read_at == read_at
    assert DatasetUse.objects.get(id=uses["text"].id).read_at is not None

    api = client_for(owner)
    shown = api.get("/api/v1/tenants/acme/datasets/images/versions/2/").json()["jobs"]
    assert [(use["job_id"], use["read_at"] is not None) for use in shown] == [(job.id, True)]
    assert api.get("/api/v1/tenants/acme/datasets/images/versions/1/").json()["jobs"] == []

    page = Client()
    page.force_login(owner)
    html = page.get("/tenants/acme/datasets/").content.decode()
    assert f'data-read="{job.id}">read {timezone.localtime(read_at):%Y-%m-%d %H:%M:%S}' in html


def test_a_read_time_the_script_claims_is_kept_within_the_use_and_now(running):
    job, _attempt = running
    use = DatasetUse.objects.get(version__dataset__name="images")
    past = {"name": "images", "version": 2, "time": "2001-01-01T00:00:00+00:00"}
    assert services.uses_read(job_id=job.id, records=[past, {"name": "text", "version": 1, "time": "not a time"}]) == 2
    use.refresh_from_db()
    assert use.read_at == use.created_at
    assert DatasetUse.objects.get(version__dataset__name="text").read_at is not None
    assert services.uses_read(job_id=job.id, records=[past]) == 0

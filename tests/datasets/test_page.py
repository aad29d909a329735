"""The datasets page: the tenant's datasets and those shared with it, each sealed version's size and shards and
the tenant's jobs that used it; another tenant's page is the friendly 404."""

import pytest
from django.test import Client

from runners.datasets import services
from runners.datasets.models import DatasetVersion, VersionShard, VersionState

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def _sealed(dataset, number=1, shards=3):
    version = DatasetVersion.objects.create(dataset=dataset, number=number, manifest_sha256="a" * 64)
    VersionShard.objects.bulk_create([VersionShard(version=version, position=i, sha256=f"{i:064x}", bytes=1000,
                                                   stored=True, members=[[f"{i}.txt", 10]]) for i in range(shards)])
    return services.version_seal(actor=dataset.created_by, tenant=dataset.tenant, version=version, shards=shards)


def test_the_page_lists_own_and_shared_datasets_with_their_versions_and_jobs(owner, tenant, outsider, other_tenant):
    images = services.dataset_create(actor=owner, tenant=tenant, name="images")
    version = _sealed(images)
    DatasetVersion.objects.create(dataset=images, number=2, manifest_sha256="b" * 64)  # open: not shown
    services.uses_record(tenant=tenant, job_id=41, job_name="resnet", versions=[version])
    services.uses_record(tenant=other_tenant, job_id=42, job_name="theirs", versions=[version])
    text = services.dataset_create(actor=outsider, tenant=other_tenant, name="text")
    _sealed(text, shards=2)
    services.dataset_share(actor=outsider, tenant=other_tenant, dataset=text, with_slug="acme")

    client = Client()
    client.force_login(owner)
    page = client.get("/tenants/acme/datasets/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-dataset="images" data-version="1"' in html and 'data-version="2"' not in html
    assert "resnet #41" in html and "theirs" not in html  # only the tenant's own jobs
    assert 'data-dataset="globex/text" data-version="1"' in html and "shared by globex, read-only" in html
    assert "3.0\xa0KB" in html or "2.9\xa0KB" in html
    assert VersionState.SEALED == DatasetVersion.objects.get(number=1, dataset=images).state
    assert '/tenants/acme/datasets/' in client.get("/tenants/acme/").content.decode()

    outsider_client = Client()
    outsider_client.force_login(outsider)
    assert outsider_client.get("/tenants/acme/datasets/").status_code == 404

"""Datasets kept in an S3 bucket (s3fs) of an S3 server the test starts (moto's server mode): a push whose parts
and shards live in the bucket, a forged shard refused there too, and a version registered from an s3:// prefix."""

import pytest

from runners.datasets import services
from runners.datasets.models import VersionState
from tests.datasets.test_api import BASE, FILES, open_and_declare, pack, push, upload
from tests.support.s3 import MotoS3

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]

BUCKET = "portal-data"


@pytest.fixture
def s3(settings):
    with MotoS3(BUCKET) as server:
        settings.DATA_STORAGE_URL = f"s3://{BUCKET}/store"
        settings.DATA_STORAGE_OPTIONS = server.options
        settings.DATASET_UPLOAD_PART_BYTES = 4096
        yield server.filesystem()


def _objects(fs, prefix):
    fs.invalidate_cache()
    try:
        return sorted(fs.find(f"{BUCKET}/{prefix}"))
    except FileNotFoundError:
        return []


def test_a_push_resumes_and_seals_in_a_bucket_and_a_forged_shard_is_never_stored(s3, client_for, owner, tenant,
                                                                                 tmp_path):
    api = client_for(owner)
    api.post(BASE.format(slug="acme"), {"name": "images"})
    shards = pack(tmp_path)
    number, _missing = open_and_declare(api, "acme", "images", shards)
    forged = bytearray(shards[0].path.read_bytes())
    forged[800] ^= 1
    assert upload(api, "acme", "images", number, shards[0], data=bytes(forged)).status_code == 400
    assert _objects(s3, "store/shards") == [] and _objects(s3, "store/uploads") == []
    half = upload(api, "acme", "images", number, shards[1], stop_after=1)
    again, missing = open_and_declare(api, "acme", "images", shards)
    assert again == number and (1, half) in [(m["position"], m["received_bytes"]) for m in missing]
    version = push(api, "acme", "images", shards)
    assert version["state"] == "sealed"
    assert _objects(s3, "store/shards") == sorted(f"{BUCKET}/store/shards/{s.sha256[:2]}/{s.sha256}" for s in shards)
    assert _objects(s3, "store/uploads") == []


def test_a_version_is_registered_from_an_s3_prefix(s3, owner, tenant, settings, tmp_path):
    settings.DATASET_SOURCE_URLS = [f"s3://{BUCKET}/incoming/{{tenant}}/"]
    settings.DATASET_SOURCE_OPTIONS = settings.DATA_STORAGE_OPTIONS
    settings.DATASET_REGISTER_SHARD_BYTES = 12 * 1024
    for path, data in FILES.items():
        s3.pipe_file(f"{BUCKET}/incoming/acme/set/{path}", data)
    dataset = services.dataset_create(actor=owner, tenant=tenant, name="reg")
    version = services.version_register(actor=owner, tenant=tenant, dataset=dataset, url=f"s3://{BUCKET}/incoming/acme/set")
    assert services.version_register_run(version.id) == VersionState.SEALED
    version.refresh_from_db()
    assert version.files == 30
    assert list(version.shard_rows.values_list("sha256", flat=True)) == [s.sha256 for s in pack(tmp_path)]

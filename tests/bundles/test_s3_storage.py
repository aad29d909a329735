"""Bundles kept in an S3 bucket (s3fs) of an S3 server the test starts: moto's server mode, as s3fs's own tests do."""

import tarfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from gpuportal import bundle as bundles

from runners.bundles import services
from runners.bundles.models import Bundle
from tests.bundles.archives import member, project, targz
from tests.support.s3 import MotoS3

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]

BUCKET = "portal-bundles"


@pytest.fixture
def s3(settings):
    """An S3 server on a free port, a bucket in it, and the portal's bundle storage pointed at a prefix there."""
    with MotoS3(BUCKET) as server:
        settings.BUNDLE_STORAGE_URL = f"s3://{BUCKET}/kept"
        settings.BUNDLE_STORAGE_OPTIONS = server.options
        yield server.filesystem()


def _objects(fs) -> list[str]:
    fs.invalidate_cache()
    return sorted(fs.find(BUCKET))


def test_a_bundle_is_stored_read_back_and_deleted_in_a_bucket(s3, client_for, owner, tenant, tmp_path,
                                                              django_capture_on_commit_callbacks):
    api = client_for(owner)
    packed = bundles.pack(project(tmp_path / "proj"))
    sha = bundles.digest(packed)
    url = "/api/v1/tenants/acme/bundles/"

    def upload(data):
        return api.post(url, {"archive": SimpleUploadedFile("b.tar.gz", data)}, format="multipart")

    created = upload(packed)
    assert created.status_code == 201, created.json()
    assert _objects(s3) == [f"{BUCKET}/kept/acme/{sha}.tar.gz"]
    assert s3.cat_file(f"{BUCKET}/kept/acme/{sha}.tar.gz") == packed
    assert upload(packed).status_code == 200 and len(_objects(s3)) == 1

    bundle = services.get_bundle(tenant, sha)
    assert services.bundle_url(bundle) == f"s3://{BUCKET}/kept/acme/{sha}.tar.gz"
    with services.open_archive(bundle) as archive:  # what a backend does: unpack it from the bucket
        bundles.extract(archive, tmp_path / "unpacked")
    assert (tmp_path / "unpacked" / "train.py").read_text() == "print('training')\n"

    with django_capture_on_commit_callbacks(execute=True):
        assert api.delete(f"{url}{sha}/").status_code == 204
    assert _objects(s3) == []
    assert Bundle.objects.get().deleted_at is not None


def test_refused_uploads_leave_the_bucket_empty(s3, client_for, owner, settings):
    api = client_for(owner)
    url = "/api/v1/tenants/acme/bundles/"
    hostile = targz(member("ok.py", b"x"), member("up", kind=tarfile.SYMTYPE, linkname="../../secrets"))
    refused = api.post(url, {"archive": SimpleUploadedFile("b.tar.gz", hostile)}, format="multipart")
    assert refused.status_code == 400 and refused.json()["archive"][0].startswith("up: ")
    settings.BUNDLE_MAX_BYTES = 1024
    too_large = api.post(url, {"archive": SimpleUploadedFile("b.tar.gz", targz(member("big.bin", b"x" * 5000)))},
                         format="multipart")
    assert too_large.status_code == 413 and "big.bin (5000 bytes)" in too_large.json()["detail"]
    assert _objects(s3) == [] and Bundle.objects.count() == 0

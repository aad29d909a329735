"""The signed URL a script job's pods fetch their bundle from, with no login: the archive while the URL is good
and the bundle kept; a changed URL, or one whose bundle was deleted, reads as not found, an expired one as gone."""

import io
import tarfile
from datetime import timedelta

import pytest
from django.utils import timezone
from gpuportal import bundle as packing

from runners.bundles import services as bundles
from runners.bundles.fetch_view import FETCH_URL_MAX_AGE_S, signed_fetch_url

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def stored(tenant, owner, tmp_path, settings):
    settings.BUNDLE_STORAGE_URL = f"file://{tmp_path / 'bundle-storage'}"
    settings.BUNDLE_STORAGE_OPTIONS = {}
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.py").write_text("print('hello')\n")
    bundle, _ = bundles.store(tenant, owner, io.BytesIO(packing.pack(folder)))
    return bundle


def _path(url: str) -> str:
    return url.removeprefix("https://portal.example.com")


def test_the_signed_url_answers_the_bundles_archive_without_a_login(client, stored, settings):
    settings.PORTAL_PUBLIC_URL = "https://portal.example.com/"
    url = signed_fetch_url(stored, job_id=12, attempt=1, since=timezone.now())
    assert url.startswith("https://portal.example.com/bundles/fetch/")
    response = client.get(_path(url))
    assert response.status_code == 200 and response["Content-Type"] == "application/gzip"
    archive = b"".join(response.streaming_content)
    assert packing.digest(archive) == stored.sha256
    with tarfile.open(fileobj=io.BytesIO(archive)) as members:
        assert members.extractfile("train.py").read() == b"print('hello')\n"


def test_each_attempt_has_its_own_url_and_the_same_attempt_always_the_same(stored):
    since = timezone.now()
    first = signed_fetch_url(stored, job_id=12, attempt=1, since=since)
    assert signed_fetch_url(stored, job_id=12, attempt=1, since=since) == first
    assert signed_fetch_url(stored, job_id=12, attempt=2, since=since) != first
    assert signed_fetch_url(stored, job_id=13, attempt=1, since=since) != first


def test_a_changed_url_is_not_found(client, stored):
    path = signed_fetch_url(stored, job_id=12, attempt=1, since=timezone.now())
    token = path.rstrip("/").rsplit("/", 1)[1]
    payload, signature = token.rsplit(":", 1)
    other_last = "B" if signature.endswith("A") else "A"  # a signature that already ends in A must still change
    for bad in (f"{payload}:{signature[:-1]}{other_last}", f"{payload}x:{signature}", "nonsense"):
        assert client.get(f"/bundles/fetch/{bad}/").status_code == 404, bad


def test_a_url_past_its_age_is_gone(client, stored):
    old = signed_fetch_url(stored, job_id=12, attempt=1,
                           since=timezone.now() - timedelta(seconds=FETCH_URL_MAX_AGE_S + 5))
    response = client.get(old)
    assert response.status_code == 410 and b"expired" in response.content
    fresh = signed_fetch_url(stored, job_id=12, attempt=1,
                             since=timezone.now() - timedelta(seconds=FETCH_URL_MAX_AGE_S - 60))
    assert client.get(fresh).status_code == 200


def test_a_deleted_bundles_url_is_not_found(client, stored, owner):
    path = signed_fetch_url(stored, job_id=12, attempt=1, since=timezone.now())
    bundles.delete(stored, actor=owner)
    assert client.get(path).status_code == 404


def test_only_get_is_answered(client, stored):
    path = signed_fetch_url(stored, job_id=12, attempt=1, since=timezone.now())
    assert client.post(path).status_code == 405

"""The bundles API: upload once per tenant and digest, list, get, delete; every refusal stores nothing."""

import io
import os
import tarfile
import threading

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection, transaction
from gpuportal import bundle as bundles
from rest_framework.test import APIClient

from audit.models import AuditEntry
from runners.bundles import services
from runners.bundles.models import Bundle
from runners.bundles.signals import bundle_in_use
from tests.bundles.archives import member, project, stored_files, targz
from tests.support.races import InThread, lock_waiters, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

FIELDS = {"sha256", "tenant", "size_bytes", "unpacked_bytes", "files", "has_requirements", "created_at", "created_by",
          "last_used_at"}


def _url(slug: str, sha: str = "") -> str:
    return f"/api/v1/tenants/{slug}/bundles/" + (f"{sha}/" if sha else "")


def _upload(api, data: bytes, slug: str = "acme", **extra):
    return api.post(_url(slug), {"archive": SimpleUploadedFile("bundle.tar.gz", data, "application/gzip"), **extra},
                    format="multipart")


@pytest.fixture
def folder(tmp_path):
    return project(tmp_path / "proj")


def test_an_upload_is_stored_once_canonically_and_read_back(client_for, owner, tenant, folder, bundle_storage):
    api = client_for(owner)
    packed = bundles.pack(folder)
    created = _upload(api, packed)
    assert created.status_code == 201, created.json()
    body = created.json()
    assert set(body) == FIELDS
    sha = bundles.digest(packed)
    assert body["sha256"] == sha and body["tenant"] == "acme" and body["created_by"] == "olivia"
    assert (body["files"], body["unpacked_bytes"], body["has_requirements"]) == (4, sum(
        p.stat().st_size for p in folder.rglob("*") if p.is_file()), True)
    # Stored at <tenant>/<sha256>.tar.gz, as the server packs it: the same bytes as the CLI's pack.
    assert stored_files(bundle_storage) == [f"acme/{sha}.tar.gz"]
    assert (bundle_storage / "acme" / f"{sha}.tar.gz").read_bytes() == packed
    assert body["size_bytes"] == len(packed)

    # The same files again, packed differently (./ names, folder entries, other times): 200, the same body.
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        archive.add(folder, arcname=".")
    again = _upload(api, out.getvalue())
    assert again.status_code == 200 and again.json() == body
    assert Bundle.objects.count() == 1 and stored_files(bundle_storage) == [f"acme/{sha}.tar.gz"]

    assert api.get(_url("acme", sha)).json() == body
    assert [item["sha256"] for item in api.get(_url("acme")).json()["results"]] == [sha]
    bundle = services.get_bundle(tenant, sha)
    assert services.bundle_url(bundle) == f"file://{bundle_storage}/acme/{sha}.tar.gz"
    with services.open_archive(bundle) as archive:
        assert archive.read() == packed
    assert AuditEntry.objects.filter(action="bundle.uploaded", tenant_slug="acme").count() == 1


def test_two_tenants_with_the_same_files_each_keep_their_own(client_for, owner, outsider, folder, bundle_storage):
    packed = bundles.pack(folder)
    assert _upload(client_for(owner), packed).status_code == 201
    assert _upload(client_for(outsider), packed, slug="globex").status_code == 201
    sha = bundles.digest(packed)
    assert stored_files(bundle_storage) == [f"acme/{sha}.tar.gz", f"globex/{sha}.tar.gz"]


def test_other_tenants_and_non_members_get_404(client_for, owner, outsider, make_user, folder, bundle_storage):
    sha = _upload(client_for(owner), bundles.pack(folder)).json()["sha256"]
    for stranger in (client_for(outsider), client_for(make_user("nobody"))):
        assert stranger.get(_url("acme")).status_code == 404
        assert stranger.get(_url("acme", sha)).status_code == 404
        assert stranger.delete(_url("acme", sha)).status_code == 404
        assert _upload(stranger, targz(member("x.py", b"x"))).status_code == 404
    # Asked through the outsider's own tenant, acme's digest is no bundle of globex.
    assert client_for(outsider).get(_url("globex", sha)).status_code == 404
    assert client_for(owner).get(_url("acme", "0" * 64)).status_code == 404  # an unknown bundle
    assert Bundle.objects.count() == 1 and len(stored_files(bundle_storage)) == 1


def test_a_viewer_reads_but_cannot_upload_or_delete(client_for, owner, viewer, folder, bundle_storage):
    sha = _upload(client_for(owner), bundles.pack(folder)).json()["sha256"]
    api = client_for(viewer)
    assert api.get(_url("acme", sha)).status_code == 200
    refused = _upload(api, targz(member("other.py", b"x")))
    assert refused.status_code == 403
    assert api.delete(_url("acme", sha)).status_code == 403
    assert Bundle.objects.count() == 1 and len(stored_files(bundle_storage)) == 1


def test_delete_removes_the_archive_and_a_new_upload_is_a_new_bundle(
        client_for, teammate, folder, bundle_storage, django_capture_on_commit_callbacks):
    api = client_for(teammate)
    packed = bundles.pack(folder)
    first = _upload(api, packed).json()
    with django_capture_on_commit_callbacks(execute=True):
        assert api.delete(_url("acme", first["sha256"])).status_code == 204
    assert stored_files(bundle_storage) == []
    assert api.get(_url("acme", first["sha256"])).status_code == 404
    assert api.get(_url("acme")).json()["results"] == []
    assert api.delete(_url("acme", first["sha256"])).status_code == 404
    assert AuditEntry.objects.filter(action="bundle.deleted", object_id=str(Bundle.objects.get().id)).exists()

    assert _upload(api, packed).status_code == 201  # kept again: a new row, the old one stays deleted
    assert Bundle.objects.filter(deleted_at__isnull=True).count() == 1 and Bundle.objects.count() == 2
    assert stored_files(bundle_storage) == [f"acme/{first['sha256']}.tar.gz"]


def test_delete_is_refused_naming_the_jobs_that_use_it(client_for, owner, folder, bundle_storage):
    sha = _upload(client_for(owner), bundles.pack(folder)).json()["sha256"]

    def jobs_using(sender, bundle, **kwargs):
        return ["job 12 (running)"] if bundle.sha256 == sha else []

    bundle_in_use.connect(jobs_using)
    try:
        refused = client_for(owner).delete(_url("acme", sha))
    finally:
        bundle_in_use.disconnect(jobs_using)
    assert refused.status_code == 409 and "job 12 (running)" in refused.json()["detail"]
    assert Bundle.objects.get().deleted_at is None and len(stored_files(bundle_storage)) == 1


@pytest.mark.parametrize("hostile, name", [
    (member("../escape.py", b"x"), "../escape.py"),
    (member("/etc/profile.d/x.sh", b"x"), "/etc/profile.d/x.sh"),
    (member("link", kind=tarfile.SYMTYPE, linkname="../../../etc/passwd"), "link"),
    (member("hard", kind=tarfile.LNKTYPE, linkname="/etc/shadow"), "hard"),
    (member("dev/kmem", kind=tarfile.CHRTYPE), "dev/kmem"),
    (member("fifo", kind=tarfile.FIFOTYPE), "fifo"),
])
def test_a_hostile_member_is_a_400_naming_it_and_nothing_is_stored(client_for, owner, bundle_storage, hostile, name):
    response = _upload(client_for(owner), targz(member("train.py", b"print(1)\n"), hostile))
    assert response.status_code == 400
    (message,) = response.json()["archive"]
    assert message.startswith(f"{name}: ")
    assert Bundle.objects.count() == 0 and stored_files(bundle_storage) == []


def test_a_zip_bomb_is_a_400_and_nothing_is_stored(client_for, owner, settings, bundle_storage):
    from tests.bundles.archives import zero_bomb

    settings.BUNDLE_MAX_BYTES = 10**10  # room for it: the compression ratio refuses it
    response = _upload(client_for(owner), zero_bomb(50 * 1000 * 1000))
    assert response.status_code == 400 and "zip bomb" in response.json()["archive"][0]
    assert Bundle.objects.count() == 0 and stored_files(bundle_storage) == []


@pytest.mark.parametrize("data, extra, field", [
    (b"not a tar.gz at all", {}, "archive"),
    (targz(), {}, "archive"),                                # no files in it
    (targz(member("a.py", b"x")), {"name": "mine"}, "name"),  # an unknown field
])
def test_bad_uploads_are_400s_naming_the_field(client_for, owner, bundle_storage, data, extra, field):
    response = _upload(client_for(owner), data, **extra)
    assert response.status_code == 400 and field in response.json(), response.json()
    assert Bundle.objects.count() == 0 and stored_files(bundle_storage) == []


def test_an_upload_without_the_archive_is_a_400_naming_it(client_for, owner, bundle_storage):
    api = client_for(owner)
    missing = api.post(_url("acme"), {}, format="multipart")
    assert missing.status_code == 400 and "archive" in missing.json()
    as_text = api.post(_url("acme"), {"archive": "not a file"}, format="multipart")
    assert as_text.status_code == 400 and "archive" in as_text.json()
    assert Bundle.objects.count() == 0 and stored_files(bundle_storage) == []


def test_over_the_limit_is_a_413_naming_the_limit_and_the_largest_files(client_for, owner, settings, bundle_storage):
    settings.BUNDLE_MAX_BYTES = 20_000
    archive = targz(member("train.py", b"x" * 100), member("weights.bin", os.urandom(15_000)),
                    member("optimizer.bin", os.urandom(9_000)))
    response = _upload(client_for(owner), archive)
    assert response.status_code == 413
    detail = response.json()["detail"]
    assert "20000 bytes" in detail and "optimizer.bin (9000 bytes)" in detail and "weights.bin (15000 bytes)" in detail
    assert Bundle.objects.count() == 0 and stored_files(bundle_storage) == []


def test_a_body_past_any_archive_within_the_limits_is_cut_off_with_a_413(client_for, owner, settings, bundle_storage):
    settings.BUNDLE_MAX_BYTES, settings.BUNDLE_MAX_FILES = 2048, 2
    bound = services.upload_bound()
    huge = os.urandom(bound + 100_000)  # incompressible: the body itself is past the bound
    response = _upload(client_for(owner), targz(member("small.py", b"x"), member("dataset.bin", huge)))
    assert response.status_code == 413
    assert "2048 bytes" in response.json()["detail"] and f"dataset.bin ({len(huge)} bytes)" in response.json()["detail"]
    assert Bundle.objects.count() == 0 and stored_files(bundle_storage) == []


def test_an_upload_larger_than_other_request_bodies_passes(client_for, owner, settings, bundle_storage):
    # Other requests' bodies are bounded at 64 KiB (the middleware reads the setting when the client's first
    # request makes it); a bundle upload is bounded by the bundle limits instead.
    settings.REQUEST_MAX_BODY_BYTES = 64 * 1024
    archive = targz(member("data.bin", os.urandom(3 * 1024 * 1024)))
    assert len(archive) > settings.API_MAX_BODY_BYTES
    response = _upload(client_for(owner), archive)
    assert response.status_code == 201, response.content[:300]


def test_a_failed_row_insert_takes_the_stored_archive_away(tenant, owner, folder, bundle_storage):
    """The archive is written first; when the row then cannot be written, it is removed again."""
    with connection.cursor() as cursor:
        cursor.execute("""
            CREATE FUNCTION refuse_bundle() RETURNS trigger AS $$
            BEGIN RAISE EXCEPTION 'the database refused the row'; END $$ LANGUAGE plpgsql;
            CREATE TRIGGER refuse_bundle BEFORE INSERT ON bundles_bundle FOR EACH ROW EXECUTE FUNCTION refuse_bundle();
        """)
    with pytest.raises(Exception, match="the database refused the row"):
        services.store(tenant, owner, io.BytesIO(bundles.pack(folder)))
    assert Bundle.objects.count() == 0 and stored_files(bundle_storage) == []


def test_an_archive_lost_from_storage_is_put_back_by_the_next_upload(client_for, owner, folder, bundle_storage):
    api = client_for(owner)
    packed = bundles.pack(folder)
    sha = _upload(api, packed).json()["sha256"]
    (bundle_storage / "acme" / f"{sha}.tar.gz").unlink()
    assert _upload(api, packed).status_code == 200
    assert (bundle_storage / "acme" / f"{sha}.tar.gz").read_bytes() == packed


def _session_client(user):
    """A browser's client: logged in, with a CSRF cookie and the same token in the header, checked."""
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(user)
    token = "b" * 32
    client.cookies["csrftoken"] = token
    client.credentials(HTTP_X_CSRFTOKEN=token)
    return client


def test_a_browser_session_uploads_through_the_same_bounded_reading(owner, settings, folder, bundle_storage):
    """The CSRF check of a session reads the form before the view: the upload is bounded there too."""
    api = _session_client(owner)
    assert _upload(api, bundles.pack(folder)).status_code == 201
    settings.BUNDLE_MAX_BYTES, settings.BUNDLE_MAX_FILES = 2048, 2
    huge = os.urandom(services.upload_bound() + 50_000)
    response = _upload(api, targz(member("dataset.bin", huge)))
    assert response.status_code == 413 and f"dataset.bin ({len(huge)} bytes)" in response.json()["detail"]
    assert Bundle.objects.count() == 1 and len(stored_files(bundle_storage)) == 1
    without_token = APIClient(enforce_csrf_checks=True)
    without_token.force_login(owner)
    assert _upload(without_token, targz(member("a.py", b"x"))).status_code == 403


@pytest.mark.django_db(transaction=True)
def test_the_same_files_uploaded_twice_at_once_are_stored_once(tenant, owner, folder, bundle_storage):
    """Both uploads pass the first look (no bundle yet) and wait for the digest's lock: one writes, one finds it."""
    packed = bundles.pack(folder)
    sha = bundles.digest(packed)
    held, release = threading.Event(), threading.Event()

    def hold_the_digest():
        with transaction.atomic():
            services.lock_digest(tenant, sha)
            held.set()
            release.wait(60)

    holder = InThread(hold_the_digest)
    assert held.wait(10)
    uploads = [InThread(services.store, tenant=tenant, user=owner, fileobj=io.BytesIO(packed)) for _ in range(2)]
    try:
        assert wait_until(lambda: lock_waiters() == 2)
    finally:
        release.set()
        holder.outcome()
    results = [upload.outcome() for upload in uploads]
    assert sorted(created for _bundle, created in results) == [False, True]
    assert results[0][0].pk == results[1][0].pk
    assert Bundle.objects.count() == 1 and stored_files(bundle_storage) == [f"acme/{sha}.tar.gz"]


def test_a_delete_never_removes_the_archive_of_an_upload_that_came_after_it(
        tenant, owner, folder, bundle_storage, django_capture_on_commit_callbacks):
    """The archive is removed once the delete commits, unless a kept bundle holds it by then."""
    packed = bundles.pack(folder)
    first, _created = services.store(tenant, owner, io.BytesIO(packed))
    with django_capture_on_commit_callbacks() as after_the_delete:
        services.delete(first, actor=owner)
    again, created = services.store(tenant, owner, io.BytesIO(packed))  # before the removal ran
    assert created and again.pk != first.pk
    for callback in after_the_delete:
        callback()
    assert stored_files(bundle_storage) == [f"acme/{first.sha256}.tar.gz"]
    with services.open_archive(again) as archive:
        assert archive.read() == packed

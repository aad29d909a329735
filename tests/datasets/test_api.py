"""The datasets API: who sees what (own and shared, read-only; anything else a 404), a version invisible until
sealed and unchangeable after, a shard whose bytes are not its hash refused and never stored, shards stored once
across tenants, and jobs naming datasets in their spec."""

import pytest
from gpuportal import datasets as packing

from runners.datasets import selectors, services
from runners.datasets.fetch_view import signed_shard_url
from runners.datasets.models import DatasetUse, VersionState
from runners.storage.blobs import BlobStore
from tests.support.jobs import job_data

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

BASE = "/api/v1/tenants/{slug}/datasets/"
FILES = {f"{index:03d}.txt": f"sample {index}\n".encode() * 200 for index in range(30)}


@pytest.fixture(autouse=True)
def small_parts(settings):
    settings.DATASET_UPLOAD_PART_BYTES = 4096


def pack(tmp_path, files=FILES, name="out"):
    root = tmp_path / f"{name}-files"
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return packing.pack_folder(root, tmp_path / name, max_bytes=12 * 1024)


def open_and_declare(api, slug, name, shards):
    url = BASE.format(slug=slug) + f"{name}/versions/"
    digest = packing.manifest_sha256((s.sha256, s.bytes) for s in shards)
    opened = api.post(url, {"manifest_sha256": digest})
    assert opened.status_code in (200, 201), opened.json()
    number = opened.json()["number"]
    declared = api.post(f"{url}{number}/shards/", {"shards": [
        {"position": i, "sha256": s.sha256, "bytes": s.bytes, "samples": s.samples} for i, s in enumerate(shards)]})
    assert declared.status_code == 200, declared.json()
    return number, declared.json()["missing"]


def upload(api, slug, name, number, shard, *, offset=0, stop_after=None, data=None):
    data = shard.path.read_bytes() if data is None else data
    url = BASE.format(slug=slug) + f"{name}/versions/{number}/shards/{shard.sha256}/"
    sent = 0
    while offset < len(data):
        if stop_after is not None and sent >= stop_after:
            return offset
        part = data[offset:offset + 4096]
        answer = api.put(f"{url}?offset={offset}", part, content_type="application/octet-stream")
        if answer.status_code != 200:
            return answer
        offset, sent = answer.json()["received_bytes"], sent + 1
    return offset


def push(api, slug, name, shards):
    number, missing = open_and_declare(api, slug, name, shards)
    by_sha = {s.sha256: s for s in shards}
    for entry in missing:
        upload(api, slug, name, number, by_sha[entry["sha256"]], offset=entry["received_bytes"])
    sealed = api.post(BASE.format(slug=slug) + f"{name}/versions/{number}/seal/", {"shards": len(shards)})
    assert sealed.status_code == 200, sealed.json()
    return sealed.json()


@pytest.fixture
def pushed(client_for, owner, tenant, tmp_path):
    api = client_for(owner)
    assert api.post(BASE.format(slug="acme"), {"name": "images"}).status_code == 201
    shards = pack(tmp_path)
    return api, shards, push(api, "acme", "images", shards)


def test_a_pushed_version_is_sealed_with_its_index_and_stored_once(pushed, data_store):
    api, shards, version = pushed
    assert version["state"] == "sealed" and version["number"] == 1
    assert version["shards"] == len(shards) > 1 and version["files"] == 30
    assert version["bytes"] == sum(s.bytes for s in shards)
    blobs = BlobStore(f"file://{data_store}", "shards")
    assert sorted(blobs.keys()) == sorted(s.sha256 for s in shards)
    index = api.get(BASE.format(slug="acme") + "images/versions/1/index/?page_size=5").json()
    assert index["count"] == 30 and len(index["results"]) == 5
    assert index["results"][0] == {"path": "000.txt", "bytes": len(FILES["000.txt"]), "shard": 0}
    listed = api.get(BASE.format(slug="acme")).json()["results"]
    assert [(d["reference"], d["latest_version"]["number"]) for d in listed] == [("images", 1)]


def every_row(api, url):
    """The rows of every page of a list, following its next links; and the count its first page gave."""
    page = api.get(url).json()
    count, rows = page["count"], list(page["results"])
    while page["next"]:
        page = api.get(page["next"]).json()
        rows += page["results"]
    return count, rows


def test_each_list_pages_every_row_once_in_order(pushed, tmp_path):
    api, shards, _version = pushed
    push(api, "acme", "images", pack(tmp_path, {"only.txt": b"one file\n"}, name="second"))
    url = BASE.format(slug="acme") + "images/versions/"

    versions = every_row(api, url)
    assert [version["number"] for version in versions[1]] == [2, 1] and versions[0] == 2
    assert every_row(api, f"{url}?page_size=1") == versions
    count, rows = every_row(api, f"{url}1/shards/?page_size=2")
    assert count == len(shards) > 2 and rows == [
        {"position": n, "sha256": s.sha256, "bytes": s.bytes, "samples": s.samples, "stored": True}
        for n, s in enumerate(shards)]
    # The index reads across shard boundaries: pages of 7 files over shards of a few files each.
    count, rows = every_row(api, f"{url}1/index/?page_size=7")
    assert count == 30 and [row["path"] for row in rows] == sorted(FILES)
    assert [row["shard"] for row in rows] == sorted(row["shard"] for row in rows) and rows[-1]["shard"] == len(shards) - 1
    assert api.get(f"{url}1/index/", {"page_size": 7, "page": 5}).json()["results"] == rows[28:]
    assert api.get(f"{url}1/index/", {"page_size": 7, "page": 6}).status_code == 404
    assert every_row(api, f"{url}2/index/") == (1, [{"path": "only.txt", "bytes": 9, "shard": 0}])


def test_an_options_request_on_a_list_describes_what_its_post_takes(pushed):
    api = pushed[0]
    for path, field in (("", "name"), ("images/versions/", "manifest_sha256"), ("images/versions/1/shards/", "shards")):
        answer = api.options(BASE.format(slug="acme") + path)
        assert answer.status_code == 200 and field in answer.json()["actions"]["POST"], (path, answer.content[:300])


def test_the_outsider_gets_404_for_everything_until_it_is_shared_and_then_only_reads(pushed, client_for, outsider,
                                                                                     tmp_path):
    owner_api = pushed[0]
    api = client_for(outsider)
    for path in ("acme/datasets/", "acme/datasets/images/", "acme/datasets/images/versions/1/"):
        assert api.get(f"/api/v1/tenants/{path}").status_code == 404, path
    assert api.get("/api/v1/tenants/globex/datasets/images/").status_code == 404
    assert api.get("/api/v1/tenants/globex/datasets/images/?owner=acme").status_code == 404
    assert api.get("/api/v1/tenants/globex/datasets/").json()["results"] == []

    assert owner_api.post(BASE.format(slug="acme") + "images/shares/", {"tenant": "globex"}).status_code == 201
    shared = api.get("/api/v1/tenants/globex/datasets/").json()["results"]
    assert [(d["reference"], d["owner"], d["shared_with"]) for d in shared] == [("acme/images", "acme", [])]
    assert api.get("/api/v1/tenants/globex/datasets/images/versions/1/").json()["number"] == 1
    # Read-only: globex cannot push to it, nor share it on.
    refused = api.post("/api/v1/tenants/globex/datasets/images/versions/?owner=acme", {"manifest_sha256": "a" * 64})
    assert refused.status_code == 403
    assert api.post("/api/v1/tenants/globex/datasets/images/shares/", {"tenant": "globex"}).status_code == 403

    assert owner_api.delete(BASE.format(slug="acme") + "images/shares/globex/").status_code == 204
    assert api.get("/api/v1/tenants/globex/datasets/images/").status_code == 404


def test_a_viewer_reads_but_does_not_push(pushed, client_for, viewer):
    api = client_for(viewer)
    assert api.get(BASE.format(slug="acme") + "images/").status_code == 200
    assert api.post(BASE.format(slug="acme") + "images/versions/", {"manifest_sha256": "a" * 64}).status_code == 403


def test_a_cut_push_resumes_where_it_stopped_and_nothing_is_visible_before_the_seal(client_for, owner, tenant,
                                                                                     tmp_path, data_store):
    api = client_for(owner)
    api.post(BASE.format(slug="acme"), {"name": "text"})
    shards = pack(tmp_path)
    number, missing = open_and_declare(api, "acme", "text", shards)
    assert len(missing) == len(shards)
    # The push is cut: the first shard whole, the second half sent.
    assert upload(api, "acme", "text", number, shards[0]) == shards[0].bytes
    half = upload(api, "acme", "text", number, shards[1], stop_after=1)
    assert 0 < half < shards[1].bytes
    # Its own tenant reads the open version's shards, and the index of those stored.
    opened = BASE.format(slug="acme") + f"text/versions/{number}/"
    assert [row["stored"] for row in api.get(f"{opened}shards/").json()["results"]] == [True] + [False] * (len(shards) - 1)
    index = api.get(f"{opened}index/").json()
    assert index["count"] == len(index["results"]) > 0 and {row["shard"] for row in index["results"]} == {0}
    # Nothing is visible to readers, nor usable by a job, before the seal.
    assert api.get(BASE.format(slug="acme") + "text/").json()["versions"] == []
    assert api.get(BASE.format(slug="acme")).json()["results"][0]["latest_version"] is None
    assert api.post(BASE.format(slug="acme") + f"text/versions/{number}/seal/", {"shards": len(shards)}).status_code == 409
    with pytest.raises(selectors.UnknownDataset):
        selectors.spec_versions(tenant, [{"name": "text"}])

    # Pushed again: the same open version, and only what is missing, from the byte the portal has.
    again, missing = open_and_declare(api, "acme", "text", shards)
    assert again == number
    assert [(m["position"], m["received_bytes"]) for m in missing][:1] == [(1, half)]
    assert 0 not in [m["position"] for m in missing]
    wrong_offset = api.put(BASE.format(slug="acme") + f"text/versions/{number}/shards/{shards[1].sha256}/?offset=0",
                           b"x", content_type="application/octet-stream")
    assert wrong_offset.status_code == 409 and str(half) in wrong_offset.json()["detail"]
    by_sha = {s.sha256: s for s in shards}
    for entry in missing:
        upload(api, "acme", "text", number, by_sha[entry["sha256"]], offset=entry["received_bytes"])
    sealed = api.post(BASE.format(slug="acme") + f"text/versions/{number}/seal/", {"shards": len(shards)}).json()
    assert sealed["state"] == "sealed" and sealed["number"] == number == 1
    assert not list((data_store / "uploads").rglob("*-*"))  # the parts are gone once joined


def test_a_shard_whose_bytes_do_not_match_its_hash_is_refused_and_nothing_kept(client_for, owner, tenant, tmp_path,
                                                                              data_store):
    api = client_for(owner)
    api.post(BASE.format(slug="acme"), {"name": "bad"})
    shards = pack(tmp_path)
    number, _missing = open_and_declare(api, "acme", "bad", shards)
    forged = bytearray(shards[0].path.read_bytes())
    forged[700] ^= 0xFF
    answer = upload(api, "acme", "bad", number, shards[0], data=bytes(forged))
    assert answer.status_code == 400 and "sha256" in answer.json()
    blobs = BlobStore(f"file://{data_store}", "shards")
    assert not blobs.exists(shards[0].sha256) and list(blobs.keys()) == []
    assert not list((data_store / "uploads").rglob("*-*"))
    # The right bytes are then taken, from the start.
    assert upload(api, "acme", "bad", number, shards[0]) == shards[0].bytes
    assert blobs.exists(shards[0].sha256)


def test_a_sealed_version_never_changes(pushed):
    api, shards, _version = pushed
    url = BASE.format(slug="acme") + "images/versions/1/"
    declared = api.post(f"{url}shards/", {"shards": [{"position": 99, "sha256": "b" * 64, "bytes": 10}]})
    assert declared.status_code == 409 and "never changes" in declared.json()["detail"]
    part = api.put(f"{url}shards/{shards[0].sha256}/?offset=0", b"x", content_type="application/octet-stream")
    assert part.status_code == 409
    assert api.delete(url).status_code == 409
    # The same files pushed again make no new version's shards: a new version, every shard already held.
    number, missing = open_and_declare(api, "acme", "images", shards)
    assert number == 2 and missing == []


def test_another_tenant_must_send_a_shard_it_only_knows_the_hash_of_and_it_is_still_stored_once(
        pushed, client_for, outsider, other_tenant, tmp_path, data_store):
    _api, shards, _version = pushed
    api = client_for(outsider)
    api.post(BASE.format(slug="globex"), {"name": "copy"})
    number, missing = open_and_declare(api, "globex", "copy", shards)
    assert len(missing) == len(shards)  # knowing a hash is not having the bytes
    push(api, "globex", "copy", shards)
    assert sorted(BlobStore(f"file://{data_store}", "shards").keys()) == sorted(s.sha256 for s in shards)
    assert number == 1


def test_jobs_name_datasets_by_version_pinned_at_submit(pushed, client_for, owner, tenant, acme_env, outsider,
                                                        globex_env, flavors):
    from quotas.models import Quota

    Quota.objects.create(tenant=tenant, flavor=flavors["h100-80gb"], guaranteed=2, max=4)
    Quota.objects.create(tenant=outsider.memberships.get().tenant, flavor=flavors["h100-80gb"], guaranteed=2, max=4)
    api = client_for(owner)
    submitted = api.post("/api/v1/jobs/", {**job_data(acme_env), "datasets": [{"name": "images"}]})
    assert submitted.status_code == 201, submitted.json()
    job_id = submitted.json()["id"]
    from runners.jobs.models import Job

    job = Job.objects.get(id=job_id)
    assert job.spec["datasets"] == [{"name": "images", "version": 1}]
    assert DatasetUse.objects.get().job_id == job_id
    shards = pushed[1]
    assert selectors.blobs_for_job_spec(tenant, job.spec) == [(s.sha256, s.bytes) for s in shards]
    version = api.get(BASE.format(slug="acme") + "images/versions/1/").json()
    assert [use["job_id"] for use in version["jobs"]] == [job_id]
    # The launch carries the pinned version's shards, each with a URL signed for the attempt.
    from django.utils import timezone

    from runners.jobs.attempts import _dataset_mounts
    from runners.jobs.models import JobAttempt

    mounts = _dataset_mounts(job, JobAttempt(job=job, number=1, admitted_at=timezone.now()))
    assert [(m.name, m.version, [(r.sha256, r.bytes) for r in m.shards]) for m in mounts] == \
        [("images", 1, [(s.sha256, s.bytes) for s in shards])]
    assert all("/datasets/fetch/" in ref.fetch_url for ref in mounts[0].shards)

    for bad in ([{"name": "nope"}], [{"name": "images", "version": 7}]):
        refused = api.post("/api/v1/jobs/", {**job_data(acme_env), "datasets": bad})
        assert refused.status_code == 404 and "datasets" in refused.json(), refused.json()
    # Another tenant's dataset, unshared: the same 404.
    outsider_api = client_for(outsider)
    refused = outsider_api.post("/api/v1/jobs/", {**job_data(globex_env), "datasets": [{"name": "acme/images"}]})
    assert refused.status_code == 404 and "datasets" in refused.json()


def test_the_signed_shard_url_serves_checked_bytes_only(pushed, client, data_store):
    from django.utils import timezone

    shards = pushed[1]
    url = signed_shard_url(shards[0].sha256, job_id=1, attempt=1, since=timezone.now())
    answer = client.get(url)
    assert answer.status_code == 200 and b"".join(answer.streaming_content) == shards[0].path.read_bytes()
    assert client.get(url[:-3] + "xx/").status_code == 404
    stored = BlobStore(f"file://{data_store}", "shards").path(shards[0].sha256)
    with open(stored, "r+b") as handle:  # the stored bytes rot
        handle.seek(700)
        handle.write(b"\x00\x01")
    assert client.get(url).status_code == 404
    assert services.verify_stored(shards[0].sha256) is False


def test_registering_from_a_folder_outside_the_allowed_urls_is_refused(client_for, owner, tenant, settings, tmp_path):
    api = client_for(owner)
    api.post(BASE.format(slug="acme"), {"name": "reg"})
    settings.DATASET_SOURCE_URLS = [f"file://{tmp_path}/incoming/{{tenant}}/"]
    for url in ("file:///etc/", f"file://{tmp_path}/incoming/globex/", f"file://{tmp_path}/incoming/acme/../globex/"):
        answer = api.post(BASE.format(slug="acme") + "reg/registrations/", {"url": url})
        assert answer.status_code == 400 and "url" in answer.json(), url


def test_registering_from_a_folder_packs_and_seals_a_version(owner, tenant, settings, tmp_path,
                                                             django_capture_on_commit_callbacks):
    settings.DATASET_SOURCE_URLS = [f"file://{tmp_path}/incoming/{{tenant}}/"]
    settings.DATASET_REGISTER_SHARD_BYTES = 12 * 1024
    source = tmp_path / "incoming" / "acme" / "set"
    for path, data in FILES.items():
        source.mkdir(parents=True, exist_ok=True)
        (source / path).write_bytes(data)
    dataset = services.dataset_create(actor=owner, tenant=tenant, name="reg")
    with django_capture_on_commit_callbacks(execute=False):
        version = services.version_register(actor=owner, tenant=tenant, dataset=dataset, url=f"file://{source}")
    assert services.version_register_run(version.id) == VersionState.SEALED
    version.refresh_from_db()
    pushed_shards = pack(tmp_path, name="same")
    # A folder registered and the same folder pushed make the same shards.
    assert list(version.shard_rows.values_list("sha256", flat=True)) == [s.sha256 for s in pushed_shards]
    assert version.files == 30

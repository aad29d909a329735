"""`portal data push` (gpuportal.cli.data.push, the command's own code) against a live portal over HTTP: only what
the portal lacks is sent, a push cut mid-way resumes from the byte the portal has, and the version appears only
once sealed."""

import pytest
from gpuportal.cli import data
from gpuportal.client import Client

from runners.datasets.models import DatasetVersion, VersionState
from tenants.services import token_create

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


class Cut(Exception):
    pass


@pytest.fixture
def portal(live_server, owner, settings):
    settings.DATASET_UPLOAD_PART_BYTES = 8192
    _, token = token_create(user=owner, name="push")
    with Client(live_server.url, token) as client:
        yield client


def _folder(root, count=60):
    for index in range(count):
        (root / f"{index:03d}.bin").parent.mkdir(parents=True, exist_ok=True)
        (root / f"{index:03d}.bin").write_bytes(bytes([index]) * 3000)
    return root


def test_a_cut_push_resumes_and_the_second_push_sends_nothing(portal, tenant, tmp_path, settings):
    folder = _folder(tmp_path / "files")
    seen = []

    def cut_half_way(sent, total):
        seen.append((sent, total))
        if sent > total // 2:
            raise Cut()

    with pytest.raises(Cut):
        data.push(portal, "acme", folder, "frames", shard_bytes=40 * 1024, progress=cut_half_way)
    open_version = DatasetVersion.objects.get()
    assert open_version.state == VersionState.OPEN
    assert portal.dataset("acme", "frames")["versions"] == []  # nothing half-visible

    resumed = []
    version = data.push(portal, "acme", folder, "frames", shard_bytes=40 * 1024,
                        progress=lambda sent, total: resumed.append((sent, total)))
    assert version["state"] == "sealed" and version["number"] == open_version.number and version["files"] == 60
    first_total = seen[0][1]
    # Only the shards the portal lacked were sent, the one cut mid-way from the byte it had of it.
    assert resumed[-1][1] <= first_total - first_total // 2 + 40 * 1024 and resumed[0][0] > 0
    assert resumed[-1][0] == resumed[-1][1]

    # The same folder again: a new version, and not a byte sent.
    again = []
    second = data.push(portal, "acme", folder, "frames", shard_bytes=40 * 1024,
                       progress=lambda sent, total: again.append((sent, total)))
    assert second["number"] == version["number"] + 1 and again == [(0, 0)]
    assert [v["number"] for v in portal.dataset("acme", "frames")["versions"]] == [2, 1]

    # The client reads every page of a list: 60 files are more than one page of the index.
    assert [d["reference"] for d in portal.datasets("acme")] == ["frames"]
    assert [v["number"] for v in portal.dataset_versions("acme", "frames")] == [2, 1]
    files = list(portal.dataset_index("acme", "frames", 2))
    assert [row["path"] for row in files] == [f"{n:03d}.bin" for n in range(60)]
    assert len(files) > settings.REST_FRAMEWORK["PAGE_SIZE"]
    shards = list(portal.dataset_shards("acme", "frames", 2))
    assert [shard["position"] for shard in shards] == list(range(second["shards"])) and all(s["stored"] for s in shards)

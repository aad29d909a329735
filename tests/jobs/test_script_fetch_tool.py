"""gpuportal.fetch, what a script pod's init container runs: the archive copied, its digest checked, then unpacked
safely; anything else leaves the folder empty and says why."""

import io
import tarfile
import urllib.error

import pytest
from gpuportal import bundle as packing
from gpuportal import fetch

pytestmark = pytest.mark.unit


@pytest.fixture
def archive(tmp_path):
    folder = tmp_path / "project"
    (folder / "pkg").mkdir(parents=True)
    (folder / "train.py").write_text("print('hi')\n")
    (folder / "pkg" / "model.py").write_text("LAYERS = 2\n")
    path = tmp_path / "bundle.tar.gz"
    path.write_bytes(packing.pack(folder))
    return path


def test_the_bundle_is_unpacked_when_its_digest_is_the_one_asked_for(archive, tmp_path):
    sha = packing.digest(archive.read_bytes())
    dest = fetch.fetch(f"file://{archive}", tmp_path / "code", sha256=sha)
    assert (dest / "train.py").read_text() == "print('hi')\n" and (dest / "pkg" / "model.py").exists()
    assert fetch.main([f"file://{archive}", str(tmp_path / "again"), "--sha256", sha]) == 0


def test_another_digest_unpacks_nothing(archive, tmp_path, capsys):
    assert fetch.main([f"file://{archive}", str(tmp_path / "code"), "--sha256", "0" * 64]) == 1
    assert "not the bundle's" in capsys.readouterr().err
    assert list((tmp_path / "code").iterdir()) == []


def test_an_archive_past_the_limit_is_refused(archive, tmp_path):
    with pytest.raises(fetch.FetchError, match="larger than 100 bytes"):
        fetch.fetch(f"file://{archive}", tmp_path / "code", max_bytes=100)


def test_a_member_that_would_land_outside_is_refused(tmp_path):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as hostile:
        info = tarfile.TarInfo("../escaped.py")
        info.size = 2
        hostile.addfile(info, io.BytesIO(b"x\n"))
    path = tmp_path / "hostile.tar.gz"
    path.write_bytes(out.getvalue())
    with pytest.raises(fetch.FetchError, match="refused"):
        fetch.fetch(f"file://{path}", tmp_path / "code")
    assert not (tmp_path / "escaped.py").exists()


def test_a_missing_or_refused_archive_is_not_tried_again_a_server_that_failed_is():
    def http(code):
        return urllib.error.HTTPError("https://portal.example.com/bundles/fetch/x/", code, "", {}, None)

    assert fetch._final(FileNotFoundError("missing.tar.gz"))
    assert fetch._final(http(404)) and fetch._final(http(410))
    assert not fetch._final(http(503)) and not fetch._final(ConnectionResetError())


def test_a_missing_archive_says_so(tmp_path):
    with pytest.raises(fetch.FetchError, match="Could not read the bundle"):
        fetch.fetch(f"file://{tmp_path / 'missing.tar.gz'}", tmp_path / "code")

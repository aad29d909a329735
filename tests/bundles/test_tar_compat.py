"""The digest of a folder packed by the system's `tar czf` is the digest of the same folder packed by gpuportal."""

import shutil
import subprocess

import pytest
from gpuportal import bundle

from tests.bundles.archives import project

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs the tar command")
def test_tar_czf_and_pack_give_the_same_digest(tmp_path):
    folder = project(tmp_path / "proj")
    archive = tmp_path / "by-tar.tar.gz"
    subprocess.run(["tar", "czf", str(archive), "-C", str(folder), "."], check=True)
    by_tar = archive.read_bytes()
    assert by_tar != bundle.pack(folder)  # other bytes (times, owners, folder entries) ...
    assert bundle.digest(by_tar) == bundle.digest(bundle.pack(folder))  # ... the same content digest
    # And tar unpacks what pack makes.
    ours = tmp_path / "ours.tar.gz"
    ours.write_bytes(bundle.pack(folder))
    (tmp_path / "out").mkdir()
    subprocess.run(["tar", "xzf", str(ours), "-C", str(tmp_path / "out")], check=True)
    assert (tmp_path / "out" / "run.sh").stat().st_mode & 0o100
    assert (tmp_path / "out" / "sub" / "data.csv").read_text() == "a,b\n1,2\n"

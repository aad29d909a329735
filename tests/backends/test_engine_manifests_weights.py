"""A foreign engine serving a model version's folder (a .tar.gz in the store): fetched through the portal or read from
the node cache, unpacked by an init container into a volume the engine reads only; strictly valid. And the unpack
itself (runners.workloads.unpack_weights): a folder whole or not at all, nothing outside it."""

import io
import tarfile
from dataclasses import replace

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from runners.backends.base import ShardRef
from runners.backends.serve_manifests import serve_manifests, serving_deployment_manifest
from runners.storage import cache_grants
from runners.workloads import unpack_weights
from tests.backends.test_engine_manifests import OPTIONS, engine_launch

pytestmark = pytest.mark.unit

KEY = cache_grants.grant_key("agents-token")
SHA = "ab" * 32
URL = "https://portal.example.com/api/v1/fetch/model-weights/signed"


def version_launch(engine="vllm"):
    launch = engine_launch(engine, model="")
    weights = ShardRef(sha256=SHA, bytes=3 * (1 << 30), fetch_url=URL)
    return replace(launch, serving=replace(launch.serving, weights=weights))


@pytest.mark.parametrize("version", ("1.30.0", latest_version()))
@pytest.mark.parametrize("key", [b"", KEY], ids=["fetch", "cache"])
def test_the_manifests_validate_strictly(version, key):
    for manifest in serve_manifests(version_launch(), cache_grant_key=key, **OPTIONS):
        kubernetes_validate.validate(manifest, version, strict=True)


def test_without_the_node_cache_the_folder_is_fetched_checked_then_unpacked():
    spec = serving_deployment_manifest(version_launch(), **OPTIONS)["spec"]["template"]["spec"]
    fetch, unpack = spec["initContainers"]
    assert fetch["command"][:4] == ["python", "-m", "runners.workloads.fetch_weights", URL]
    assert fetch["command"][4:] == [f"/weights/{SHA}", "--sha256", SHA, "--bytes", str(3 * (1 << 30))]
    assert unpack["command"] == ["python", "-m", "runners.workloads.unpack_weights", f"/weights/{SHA}",
                                 "/model-files/model"]
    assert unpack["image"] == fetch["image"] == OPTIONS["server_image"]
    assert {m["mountPath"]: m.get("readOnly", False) for m in unpack["volumeMounts"]} == {
        "/weights": True, "/model-files": False, "/scratch": False}
    engine = spec["containers"][0]
    assert engine["args"][0] == "/model-files/model"
    # The engine reads the unpacked folder only, never the archive.
    assert [(m["mountPath"], m.get("readOnly", False)) for m in engine["volumeMounts"]] == [
        ("/dev/shm", False), ("/model-files", True), ("/scratch", False)]
    sizes = {v["name"]: v["emptyDir"].get("sizeLimit") for v in spec["volumes"] if "emptyDir" in v}
    assert sizes["weights"] == sizes["model-files"] == f"{3 * 1024 + 64}Mi"


def test_from_the_node_cache_the_view_is_unpacked_and_nothing_is_fetched():
    spec = serving_deployment_manifest(version_launch("sglang"), cache_grant_key=KEY,
                                       **OPTIONS)["spec"]["template"]["spec"]
    [unpack] = spec["initContainers"]
    assert unpack["command"][-2:] == [f"/portal/datasets/{SHA}", "/model-files/model"]
    view = next(m for m in unpack["volumeMounts"] if m["mountPath"] == "/portal/datasets")
    assert view["readOnly"] is True
    csi = next(v for v in spec["volumes"] if "csi" in v)
    assert csi["name"] == view["name"] and csi["csi"]["readOnly"] is True
    engine = spec["containers"][0]
    assert "/portal/datasets" not in {m["mountPath"] for m in engine["volumeMounts"]}
    assert engine["args"][engine["args"].index("--model-path") + 1] == "/model-files/model"


def _archive(path, members: dict[str, bytes], *, evil: tarfile.TarInfo | None = None) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        if evil is not None:
            archive.addfile(evil, io.BytesIO(b"x" * evil.size))


def test_a_folder_is_unpacked_whole_once(tmp_path):
    _archive(tmp_path / "w.tar.gz", {"config.json": b"{}", "model.safetensors": b"\0" * 64,
                                     "tokenizer/tokenizer.json": b"[]"})
    dest = tmp_path / "model-files" / "model"
    dest.parent.mkdir()
    assert unpack_weights.main([str(tmp_path / "w.tar.gz"), str(dest)]) == 0
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        "config.json", "model.safetensors", "tokenizer/tokenizer.json"]
    assert unpack_weights.unpack(tmp_path / "w.tar.gz", dest) is False  # an init container run again keeps it
    assert not (tmp_path / "model-files" / "model.partial").exists()


def test_a_member_leaving_the_folder_is_refused_and_nothing_is_left(tmp_path, capsys):
    info = tarfile.TarInfo("../escape.txt")
    info.size = 4
    _archive(tmp_path / "w.tar.gz", {"config.json": b"{}"}, evil=info)
    dest = tmp_path / "out" / "model"
    dest.parent.mkdir()
    assert unpack_weights.main([str(tmp_path / "w.tar.gz"), str(dest)]) == 1
    assert "does not unpack as a model's folder" in capsys.readouterr().err
    assert list((tmp_path / "out").iterdir()) == [] and not (tmp_path / "escape.txt").exists()


def test_an_absolute_member_lands_inside_the_folder(tmp_path):
    info = tarfile.TarInfo("/etc/cron.d/evil")
    info.size = 4
    _archive(tmp_path / "w.tar.gz", {"config.json": b"{}"}, evil=info)
    assert unpack_weights.unpack(tmp_path / "w.tar.gz", tmp_path / "model") is True
    assert (tmp_path / "model" / "etc" / "cron.d" / "evil").read_bytes() == b"xxxx"


def test_a_link_out_of_the_folder_and_a_file_that_is_no_archive_are_refused(tmp_path):
    link = tarfile.TarInfo("weights")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    _archive(tmp_path / "w.tar.gz", {}, evil=link)
    with pytest.raises(unpack_weights.UnpackError):
        unpack_weights.unpack(tmp_path / "w.tar.gz", tmp_path / "a")
    (tmp_path / "n.tar.gz").write_bytes(b"not gzip")
    with pytest.raises(unpack_weights.UnpackError):
        unpack_weights.unpack(tmp_path / "n.tar.gz", tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

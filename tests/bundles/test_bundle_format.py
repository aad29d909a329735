"""gpuportal.bundle: deterministic packing, ignore patterns, the content digest, the safety check, extraction."""

import gzip
import hashlib
import io
import os
import tarfile

import pytest
from gpuportal import bundle
from gpuportal.bundle import BundleError, BundleTooLarge

from tests.bundles.archives import OneWay, member, project, targz, zero_bomb

pytestmark = pytest.mark.unit

MB = 1000 * 1000


# --- Packing -----------------------------------------------------------------------------------------


def test_packing_the_same_folder_twice_gives_the_same_bytes_whatever_the_times(tmp_path):
    folder = project(tmp_path / "proj")
    first = bundle.pack(folder)
    os.utime(folder / "train.py", (1_000_000, 1_000_000))
    assert bundle.pack(folder) == first
    assert first[4:8] == b"\0\0\0\0"  # gzip's own mtime

    with tarfile.open(fileobj=io.BytesIO(first), mode="r:gz") as archive:
        infos = archive.getmembers()
    assert [info.name for info in infos] == ["requirements.txt", "run.sh", "sub/data.csv", "train.py"]
    assert {info.name: oct(info.mode) for info in infos}["run.sh"] == "0o755"
    assert {oct(info.mode) for info in infos if info.name != "run.sh"} == {"0o644"}
    assert {(info.mtime, info.uid, info.gid, info.uname, info.gname) for info in infos} == {(0, 0, 0, "", "")}


def test_changing_a_file_changes_the_bytes_and_the_digest(tmp_path):
    folder = project(tmp_path / "proj")
    before = bundle.pack(folder)
    (folder / "train.py").write_text("print('other')\n")
    after = bundle.pack(folder)
    assert before != after and bundle.digest(before) != bundle.digest(after)


def test_the_exec_bit_and_the_path_are_part_of_the_digest(tmp_path):
    folder = project(tmp_path / "proj")
    plain = bundle.digest(bundle.pack(folder))
    (folder / "train.py").chmod(0o755)
    executable = bundle.digest(bundle.pack(folder))
    (folder / "train.py").chmod(0o644)
    (folder / "train.py").rename(folder / "main.py")
    renamed = bundle.digest(bundle.pack(folder))
    assert len({plain, executable, renamed}) == 3


def test_the_digest_ignores_folders_times_owners_and_compression(tmp_path):
    folder = project(tmp_path / "proj")
    ours = bundle.digest(bundle.pack(folder))
    # As `tar czf x.tgz -C proj .` writes it: ./ names, folder entries, real times and owners, other order.
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.GNU_FORMAT, compresslevel=9) as archive:
        archive.add(folder, arcname=".", recursive=False)
        for name in ["train.py", "sub", "sub/data.csv", "run.sh", "requirements.txt"]:
            info = archive.gettarinfo(folder / name, arcname=f"./{name}")
            info.uname, info.mtime = "someone", 1_700_000_000
            if info.isreg():
                with (folder / name).open("rb") as data:
                    archive.addfile(info, data)
            else:
                archive.addfile(info)
    assert bundle.digest(out.getvalue()) == ours
    assert bundle.digest(io.BytesIO(out.getvalue())) == ours


def test_the_digest_is_sha256_over_the_sorted_paths_modes_and_file_hashes():
    archive = targz(member("b.py", b"B"), member("a.sh", b"A", mode=0o755))
    expected = hashlib.sha256(
        b"a.sh\x00755\x00" + hashlib.sha256(b"A").digest() + b"b.py\x00644\x00" + hashlib.sha256(b"B").digest()
    ).hexdigest()
    assert bundle.digest(archive) == expected


def test_a_symbolic_link_in_the_folder_is_refused_by_name(tmp_path):
    folder = project(tmp_path / "proj")
    (folder / "data").symlink_to("/etc")
    with pytest.raises(BundleError) as refused:
        bundle.pack(folder)
    assert refused.value.member == "data" and "link" in refused.value.why


def test_an_ignored_link_is_not_packed(tmp_path):
    folder = project(tmp_path / "proj")
    (folder / "data").symlink_to("/etc")
    (folder / ".portalignore").write_text("data\n")
    assert "data" not in _packed(folder)


# --- Ignore patterns ---------------------------------------------------------------------------------


def _packed(folder, **options) -> list[str]:
    return [m.path for m in bundle.check(io.BytesIO(bundle.pack(folder, **options)))]


def _tree(root, paths):
    for path in paths:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(path)
    return root


def test_gitignore_and_portalignore_patterns(tmp_path):
    root = _tree(tmp_path / "p", [
        "train.py", "debug.log", "keep.log", "build/out.o", "src/build/gen.py", "src/app.py", "top.txt", "src/top.txt",
        "data/big/a.bin", "data/small.csv", "docs/a/b/notes.md", "docs/x.md", "cache", "src/cache/c.bin",
        ".git/HEAD", "sub/.gitignore", "sub/local.tmp", "sub/deeper/local.tmp", "other/local.tmp",
        "weights.pt", "lib/weights.pt", "file[1].txt", "#hash.txt", "space .txt",
    ])
    (root / ".gitignore").write_text(
        "# comments and blank lines are skipped\n\n"
        "*.log\n!keep.log\n"          # a glob anywhere, and one taken back
        "build/\n"                    # folders only, at any depth
        "/top.txt\n"                  # anchored to the top
        "data/big\n"                  # a slash in the middle anchors too
        "docs/**/notes.md\n"          # ** for any folders between
        "cache/\n"                    # folders only: the file `cache` stays
        "/weights.pt\n"
        "file\\[1\\].txt\n"           # escaped brackets are literal
        "\\#hash.txt\n"
        "space\\ .txt\n"
    )
    (root / "sub" / ".gitignore").write_text("*.tmp\n")  # only within sub/
    (root / ".portalignore").write_text("data/\n!data/small.csv\n")  # data/ itself excluded: no taking back inside
    packed = _packed(root)
    assert packed == [
        ".gitignore", ".portalignore", "cache", "docs/x.md", "keep.log", "lib/weights.pt", "other/local.tmp",
        "src/app.py", "src/top.txt", "sub/.gitignore", "train.py",
    ]


def test_portalignore_can_take_back_what_gitignore_leaves_out(tmp_path):
    root = _tree(tmp_path / "p", ["train.py", "models/tiny.pt", "models/huge.pt"])
    (root / ".gitignore").write_text("*.pt\n")
    (root / ".portalignore").write_text("!models/tiny.pt\n")
    assert _packed(root) == [".gitignore", ".portalignore", "models/tiny.pt", "train.py"]


def test_pack_without_ignoring_keeps_every_file(tmp_path):
    root = _tree(tmp_path / "p", ["a.log", ".git/HEAD"])
    (root / ".gitignore").write_text("*.log\n")
    assert _packed(root) == [".gitignore"]
    assert _packed(root, ignore=False) == [".git/HEAD", ".gitignore", "a.log"]


@pytest.mark.parametrize("pattern, path, is_folder, expected", [
    ("*.py", "a/b/c.py", False, True),
    ("*.py", "a/b/c.pyc", False, False),
    ("a/*.py", "a/b/c.py", False, False),   # * stops at a slash
    ("a/**/c.py", "a/c.py", False, True),   # ** matches no folder too
    ("a/**/c.py", "a/x/y/c.py", False, True),
    ("**/c.py", "c.py", False, True),
    ("a/**", "a/x/y", False, True),
    ("a/**", "a", True, False),
    ("?.txt", "ab.txt", False, False),
    ("[ab].txt", "b.txt", False, True),
    ("[!ab].txt", "b.txt", False, False),
    ("logs/", "logs", False, False),        # a trailing slash: folders only
    ("logs/", "x/logs", True, True),
])
def test_one_pattern(pattern, path, is_folder, expected):
    assert bundle.ignored(bundle.parse_ignore(pattern), path, is_folder) is expected


def test_the_patterns_agree_with_pathspec_where_it_is_installed():
    """pathspec (a well-kept gitignore implementation) as a second opinion, file paths only."""
    pathspec = pytest.importorskip("pathspec")
    patterns = ["*.log", "!keep.log", "/top.txt", "data/big", "docs/**/notes.md", "**/tmp", "a/**", "[ab].c", "x?z"]
    paths = ["debug.log", "keep.log", "src/keep.log", "top.txt", "src/top.txt", "data/big", "data/bigger",
             "docs/notes.md", "docs/a/b/notes.md", "tmp", "src/tmp", "a/b/c", "a.c", "b.c", "c.c", "xyz", "xz"]
    spec = pathspec.GitIgnoreSpec.from_lines(patterns)
    rules = bundle.parse_ignore("\n".join(patterns))
    assert {p: bundle.ignored(rules, p, False) for p in paths} == {p: spec.match_file(p) for p in paths}


# --- Checking hostile archives -----------------------------------------------------------------------


@pytest.mark.parametrize("hostile, name, why", [
    (member("../evil.py", b"x"), "../evil.py", "'..'"),
    (member("ok/../../evil.py", b"x"), "ok/../../evil.py", "'..'"),
    (member("/etc/cron.d/evil", b"x"), "/etc/cron.d/evil", "absolute"),
    (member("out", kind=tarfile.SYMTYPE, linkname="/etc/passwd"), "out", "symbolic link"),
    (member("inside", kind=tarfile.SYMTYPE, linkname="train.py"), "inside", "symbolic link"),  # any link at all
    (member("hard", kind=tarfile.LNKTYPE, linkname="../../etc/shadow"), "hard", "hard link"),
    (member("dev/sda", kind=tarfile.BLKTYPE), "dev/sda", "device"),
    (member("dev/null", kind=tarfile.CHRTYPE), "dev/null", "device"),
    (member("pipe", kind=tarfile.FIFOTYPE), "pipe", "FIFO"),
    (member("bad\nname.py", b"x"), "bad\nname.py", "control character"),
])
def test_a_hostile_member_is_refused_by_name(hostile, name, why):
    archive = targz(member("train.py", b"print(1)\n"), hostile)
    with pytest.raises(BundleError) as refused:
        bundle.check(io.BytesIO(archive))
    assert refused.value.member == name and why in refused.value.why
    assert str(refused.value).startswith(f"{name}: ")


def test_a_member_twice_and_a_file_that_is_also_a_folder_are_refused():
    with pytest.raises(BundleError, match="a.py: appears twice"):
        bundle.check(io.BytesIO(targz(member("a.py", b"1"), member("./a.py", b"2"))))
    with pytest.raises(BundleError, match="a/b.py: is inside a, which is a file"):
        bundle.check(io.BytesIO(targz(member("a", b"1"), member("a/b.py", b"2"))))
    with pytest.raises(BundleError, match="a: is both a file and a folder"):
        bundle.check(io.BytesIO(targz(member("a/b.py", b"2"), member("a", b"1"))))


def test_more_members_than_allowed_is_refused_at_the_first_one_past():
    archive = targz(*[member(f"f{i:02}.py", b"x") for i in range(11)])
    assert len(bundle.check(io.BytesIO(archive), max_members=11)) == 11
    with pytest.raises(BundleError) as refused:
        bundle.check(io.BytesIO(archive), max_members=10)
    assert refused.value.member == "f10.py" and "limit of 10 members" in refused.value.why


def test_over_the_size_limit_names_the_limit_and_the_largest_files():
    archive = targz(member("small.py", b"x" * 10), member("data.bin", os.urandom(3000)),
                    member("model.bin", os.urandom(5000)), member("after.py", b"y"))
    with pytest.raises(BundleTooLarge) as refused:
        bundle.check(io.BytesIO(archive), max_bytes=6000)
    assert refused.value.member == "model.bin" and refused.value.limit == 6000
    assert refused.value.largest == [("model.bin", 5000), ("data.bin", 3000), ("small.py", 10)]
    assert "limit of 6000 bytes" in refused.value.why and "model.bin (5000 bytes)" in refused.value.why


def test_a_zip_bomb_is_refused_early_without_writing_anything(tmp_path):
    bomb = zero_bomb(200 * MB)
    assert len(bomb) < 1 * MB  # zeros compress about 1000:1
    stream = OneWay(bomb)
    # Even with room for it, the ratio refuses it, long before the whole stream is read.
    with pytest.raises(BundleError) as refused:
        bundle.check(stream, max_bytes=10**12)
    assert refused.value.member == "weights.bin" and "zip bomb" in refused.value.why
    assert stream.read_bytes < len(bomb) / 2

    with pytest.raises(BundleError, match="zip bomb"):
        bundle.extract(io.BytesIO(bomb), tmp_path / "dest", max_bytes=10**12)
    assert list((tmp_path / "dest").iterdir()) == []

    # Under the usual limit, the header's size alone refuses it.
    header_read = OneWay(bomb)
    with pytest.raises(BundleTooLarge):
        bundle.check(header_read)
    assert header_read.read_bytes < 64 * 1024


def test_what_is_not_a_targz_is_refused_naming_the_archive():
    with pytest.raises(BundleError) as refused:
        bundle.check(io.BytesIO(b"PK\x03\x04 this is a zip file"))
    assert refused.value.member == "archive" and "not a readable .tar.gz" in refused.value.why
    plain_tar = io.BytesIO()
    with tarfile.open(fileobj=plain_tar, mode="w") as archive:
        archive.addfile(*member("a.py", b"x"))
    with pytest.raises(BundleError, match="not a readable .tar.gz"):
        bundle.check(io.BytesIO(plain_tar.getvalue()))


def test_a_truncated_archive_is_refused():
    archive = targz(member("a.bin", os.urandom(50_000)))
    with pytest.raises(BundleError, match="not a readable .tar.gz"):
        bundle.check(io.BytesIO(archive[: len(archive) // 2]))


def test_check_reads_a_stream_once_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stream = OneWay(targz(member("./a.py", b"A"), member("sub/", kind=tarfile.DIRTYPE), member("sub/b.py", b"B")))
    members = bundle.check(stream)
    assert [(m.path, m.size, m.executable) for m in members] == [("a.py", 1, False), ("sub/b.py", 1, False)]
    assert members[0].sha256 == hashlib.sha256(b"A").hexdigest()
    assert list(tmp_path.iterdir()) == []


# --- Extracting --------------------------------------------------------------------------------------


def test_extract_unpacks_read_only_files_keeping_the_exec_bit(tmp_path):
    folder = project(tmp_path / "proj")
    members = bundle.extract(io.BytesIO(bundle.pack(folder)), tmp_path / "out")
    assert sorted(m.path for m in members) == ["requirements.txt", "run.sh", "sub/data.csv", "train.py"]
    assert (tmp_path / "out" / "sub" / "data.csv").read_text() == "a,b\n1,2\n"
    assert oct((tmp_path / "out" / "run.sh").stat().st_mode & 0o777) == "0o555"
    assert oct((tmp_path / "out" / "train.py").stat().st_mode & 0o777) == "0o444"
    assert bundle.digest(bundle.pack(tmp_path / "out")) == bundle.digest(bundle.pack(folder))


def test_extract_from_a_stream_that_cannot_seek(tmp_path):
    bundle.extract(OneWay(targz(member("a.py", b"A"))), tmp_path / "out")
    assert (tmp_path / "out" / "a.py").read_bytes() == b"A"


def test_extract_writes_nothing_when_a_later_member_is_hostile(tmp_path):
    archive = targz(member("a.py", b"A"), member("b.py", b"B"), member("../../escape.py", b"x"))
    with pytest.raises(BundleError, match="escape.py"):
        bundle.extract(io.BytesIO(archive), tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
    assert not (tmp_path / "escape.py").exists()


def test_extract_wants_an_empty_folder(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.py").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        bundle.extract(io.BytesIO(targz(member("a.py", b"A"))), tmp_path / "out")


def test_the_archive_bound_covers_an_archive_at_the_limits():
    """Incompressible files up to the limits, in as many members as allowed, still fit the upload bound."""
    files = [member(f"{'d/' * 20}{i:04}-{'n' * 150}.bin", os.urandom(2000)) for i in range(50)]
    archive = targz(*files, compresslevel=1)
    assert len(archive) <= bundle.archive_bound(max_bytes=50 * 2000, max_members=50)
    assert len(gzip.decompress(archive)) <= bundle.stream_bound(max_bytes=50 * 2000, max_members=50)

"""The sandbox's command line and the requirements a job's environment may name, read without running them.

What the sandbox does when it runs (each escape tried and stopped) is tests/backends/test_local_sandbox.py.
"""

import sys

import pytest

from runners.workloads import sandbox, supervise

pytestmark = pytest.mark.unit


def mounts(argv: list[str]) -> dict[str, tuple[str, str]]:
    """Each mount point of a bwrap command line: (kind, source)."""
    found = {}
    for index, arg in enumerate(argv[: argv.index("--")]):
        if arg in ("--ro-bind", "--bind", "--dev-bind", "--symlink"):
            found[argv[index + 2]] = (arg, argv[index + 1])
        elif arg in ("--dir", "--tmpfs", "--proc", "--dev"):
            found[argv[index + 1]] = (arg, "")
    return found


def test_a_replica_sees_its_folders_with_the_writes_it_may_make_and_runs_as_the_account():
    view = sandbox.View(
        read_only=("/srv/bundles/acme/abc",), writable=("/srv/jobs/5",), read_only_over=("/srv/jobs/5/attempts",),
        writable_over=(("/srv/jobs/5/attempts/1/sandbox-attempt", "/srv/jobs/5/attempts/1"),
                       ("/srv/jobs/5/attempts/1/scratch", "/srv/jobs/5/attempts/1/scratch")),
        devices=("/dev/nvidia0",), cwd="/srv/bundles/acme/abc",
        hosts="/srv/jobs/5/attempts/1/sandbox-hosts", tmpfs_bytes=512 * 2**20,
    )
    argv = sandbox.bwrap_argv(view, ["python", "train.py"], account=sandbox.Account(999, 995), process_limit=64)
    found = mounts(argv)
    assert found["/srv/bundles/acme/abc"] == ("--ro-bind", "/srv/bundles/acme/abc")
    assert found["/srv/jobs/5"] == ("--bind", "/srv/jobs/5")
    assert found["/srv/jobs/5/attempts"] == ("--ro-bind", "/srv/jobs/5/attempts")
    assert found["/srv/jobs/5/attempts/1"] == ("--bind", "/srv/jobs/5/attempts/1/sandbox-attempt")
    assert found["/srv/jobs/5/attempts/1/scratch"] == ("--bind", "/srv/jobs/5/attempts/1/scratch")
    assert found["/dev/nvidia0"] == ("--dev-bind", "/dev/nvidia0")
    assert found["/etc/hosts"] == ("--ro-bind", "/srv/jobs/5/attempts/1/sandbox-hosts")
    assert found["/tmp"][0] == "--tmpfs" and found["/proc"][0] == "--proc" and found["/dev"][0] == "--dev"
    tmp = argv.index("/tmp")
    assert argv[tmp - 3: tmp] == ["--size", str(512 * 2**20), "--tmpfs"], "/tmp holds at most the memory limit"
    for path in sandbox.runtime_paths():
        assert found[path] == ("--ro-bind", path)
    # Mounted in order: a folder over another after it; /tmp before anything that lies under it.
    order = ["/srv/jobs/5", "/srv/jobs/5/attempts", "/srv/jobs/5/attempts/1", "/srv/jobs/5/attempts/1/scratch"]
    positions = [max(i for i, arg in enumerate(argv) if arg == path) for path in order]
    assert positions == sorted(positions)
    # The folders bwrap makes above the mounts can be passed through by the account.
    assert argv[argv.index("/srv") - 3: argv.index("/srv") + 1] == ["--perms", "0755", "--dir", "/srv"]
    assert "/srv/jobs" not in found or found["/srv/jobs"][0] == "--dir"
    # Nothing of the host's network is given up or kept by bwrap itself, and no user namespace is made.
    assert not {"--unshare-net", "--share-net", "--unshare-user", "--unshare-all", "--new-session"} & set(argv)
    tail = argv[argv.index("--") + 1:]
    assert tail[:4] == [sys.executable, "-I", "-S", "-c"]
    assert tail[4] == sandbox.DROP and tail[5:] == ["999", "995", "64", "python", "train.py"]
    assert argv[argv.index("--chdir") + 1] == "/srv/bundles/acme/abc"


def test_nothing_of_etc_is_shown_but_what_a_process_needs():
    argv = sandbox.bwrap_argv(sandbox.View(), ["true"], account=sandbox.Account(999, 995), process_limit=8)
    shown = {path for path in mounts(argv) if path.startswith("/etc/")}
    assert shown <= {f"/etc/{name}" for name in sandbox.SYSTEM_ETC}
    assert not {"/etc/shadow", "/etc/gshadow", "/etc/sudoers"} & shown


@pytest.mark.parametrize(
    "line",
    [
        "--index-url http://127.0.0.1:5432/simple",
        "-e ./local-package",
        "-r other.txt",
        "mypkg @ https://example.com/mypkg.whl",
        "https://example.com/mypkg.tar.gz",
        "git+ssh://git@example.com/repo.git",
    ],
)
def test_a_requirement_that_is_not_a_registry_package_is_refused(line):
    assert supervise.requirements_refused(f"six==1.16.0\n{line}\n") == [line]


def test_named_packages_comments_and_markers_pass():
    text = "# pinned\nsix==1.16.0\nrequests[socks]>=2.31 ; python_version >= '3.8'  # for the data\n\n"
    assert supervise.requirements_refused(text) == []

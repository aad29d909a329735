"""The local backend's sandbox for a tenant's own code (`script` jobs): bubblewrap, an unprivileged account.

A sandboxed replica is ``bwrap`` (Debian's ``bubblewrap``), started as root by the attempt's supervisor,
in a fresh mount, PID, IPC, UTS and cgroup namespace. What it sees of the host's files is only:

- read-only: the system (``/usr`` and the ``/lib*``, ``/bin``, ``/sbin`` links), what the C library and
  TLS need of ``/etc`` (``SYSTEM_ETC``), the portal's Python runtime (its interpreter, its virtual
  environment's site-packages with torch and numpy, the ``gpuportal`` package), the job's cached
  environment and the tenant's bundle (its working directory);
- read-write: the job folder (checkpoints, progress files), with the folder of its attempts read-only
  over it (the supervisor's launch record, logs and exit codes are the portal's to write); in place of
  its own attempt's folder, a folder of the attempt's that the replicas may write (``sandbox-attempt``:
  what the SDK writes there, its activity files), and in that the attempt's scratch folder ($HOME,
  $TMPDIR, caches);
- its own ``/tmp`` and ``/dev/shm`` (empty, each at most its memory limit), ``/proc`` and a minimal ``/dev``
  (the NVIDIA device nodes, and the parts of ``/sys`` the driver reads, when the replica was placed on a
  GPU of this host).

Inside, a few lines of our own Python (``DROP``, run by the runtime's interpreter with ``-I -S``) set the
process limit (RLIMIT_NPROC), give up root for the sandbox account (``SANDBOX_USER``, made with
``useradd`` as portal/embedded.py makes PostgreSQL's), put SIGTERM back to its default and execute the
command. bwrap sets no_new_privs, so no set-user-ID program inside can give root back. The memory limit
(RLIMIT_DATA) is the supervisor's, set before bwrap starts, as for every replica.

Network: every replica of one attempt on this host shares one network namespace, the supervisor's own,
which it makes for itself (``private_network``: unshare(2), then its loopback up) once its environment
is built and before any replica starts. So ``MASTER_ADDR=127.0.0.1`` joins the ranks, and nothing
listening on the host (PostgreSQL, Redis, the portal's web server) can be reached. bwrap cannot join a
namespace another bwrap made, and one bwrap per rank with ``--unshare-net`` would cut the ranks apart.

Why not ``--unshare-all`` and ``--new-session``: as root ``--unshare-all`` would also make a user
namespace, in which the sandbox account's uid is not mapped (and the private network is the
supervisor's, made above). ``--new-session`` guards a terminal against input injected with TIOCSTI;
a replica has no terminal (the supervisor is a daemon with none, stdin is /dev/null), and a new
session would take the replica out of the supervisor's process group, where the portal's stop
(SIGTERM to the group) must reach it: bwrap does not pass signals on. bwrap itself ignores SIGTERM
(set before it starts) and dies with its parent (``--die-with-parent``), taking the sandbox with it.

Runs only as root: the account switch and the network namespace need it (``unavailable`` says why
not). Stdlib only.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import pwd
import shutil
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SANDBOX_USER = "portal_sandbox"
BWRAP = "bwrap"
# What of /etc a process needs: the dynamic loader's cache, the C library's name service files (names
# for uids, localhost), time zone, TLS certificates, pip's own configuration, and the links
# Debian's alternatives keep there (some of /usr/bin points into /etc/alternatives).
SYSTEM_ETC = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates", "localtime",
    "hosts", "resolv.conf", "nsswitch.conf", "host.conf", "gai.conf", "passwd", "group", "pip.conf",
)
HOSTNAME = "sandbox"
# The sandbox's /etc/hosts: its name is its loopback (torch.distributed resolves it), and no host's name.
HOSTS = f"127.0.0.1\tlocalhost {HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
GPU_SYS = ("/sys/block", "/sys/bus", "/sys/class", "/sys/dev", "/sys/devices", "/sys/module")
SYSTEM_TOP = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# The few lines that run inside the sandbox, still as root: the process limit, the account, the
# signals, then the command (argv: uid gid process-limit command...).
DROP = (
    "import os,resource,signal,sys\n"
    "uid,gid,nproc=(int(x) for x in sys.argv[1:4])\n"
    "resource.setrlimit(resource.RLIMIT_NPROC,(nproc,nproc))\n"
    "os.setgroups([]);os.setresgid(gid,gid,gid);os.setresuid(uid,uid,uid)\n"
    "signal.signal(signal.SIGTERM,signal.SIG_DFL);signal.signal(signal.SIGINT,signal.SIG_DFL)\n"
    "os.execvp(sys.argv[4],sys.argv[4:])\n"
)
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


@dataclass(frozen=True)
class Account:
    uid: int
    gid: int


@dataclass(frozen=True)
class View:
    """What one sandboxed process sees, besides the system and the runtime (paths are the host's, shown at
    the same place inside)."""

    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    # Read-only again, over a part of a writable folder (mounted after the writable ones, in this order).
    read_only_over: tuple[str, ...] = ()
    # Writable again, inside a read_only_over folder: (host folder, where it is shown), in this order.
    writable_over: tuple[tuple[str, str], ...] = ()
    devices: tuple[str, ...] = ()
    cwd: str = "/"
    # Shown as /etc/hosts instead of the host's (HOSTS: the sandbox's own name on its loopback).
    hosts: str | None = None
    # The most each of /tmp and /dev/shm may hold (they are memory); None: the kernel's default, half of it.
    tmpfs_bytes: int | None = None


# useradd's exit status when the name is already in use (shadow-utils).
USERADD_NAME_TAKEN = 9


def account() -> Account:
    """The sandbox account (created on first use); this process must be root."""
    try:
        entry = pwd.getpwnam(SANDBOX_USER)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
             "--shell", "/usr/sbin/nologin", SANDBOX_USER],
            capture_output=True, text=True,
        )
        # Exit 9: the name is taken. Another process (a second worker, a second pytest process) made the
        # account between the look-up above and now; it is the same account, so use it.
        if made.returncode not in (0, USERADD_NAME_TAKEN):
            raise subprocess.CalledProcessError(made.returncode, made.args, made.stdout, made.stderr)
        entry = pwd.getpwnam(SANDBOX_USER)
    return Account(entry.pw_uid, entry.pw_gid)


def runtime_paths() -> tuple[str, ...]:
    """The portal's Python runtime, as a sandbox shows it: the interpreter's install, the portal's virtual
    environment, and where torch, numpy and gpuportal live if that is elsewhere (an editable gpuportal)."""
    import importlib.util

    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    for name in ("torch", "numpy", "gpuportal"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                real = os.path.realpath(location)
                if not any(real == root or real.startswith(root + os.sep) for root in paths):
                    paths.add(real)
    return tuple(sorted(paths))


def runtime_site_packages() -> str:
    """The portal's virtual environment's site-packages (torch, numpy, gpuportal): what a job's own
    environment adds to its path."""
    import sysconfig

    return sysconfig.get_path("purelib")


def bwrap_argv(view: View, command: list[str], *, account: Account, process_limit: int) -> list[str]:
    """The command line that runs `command` in `view` as the sandbox account, at most `process_limit`
    processes and threads of that account at once. No network namespace of bwrap's own: a replica is in
    its supervisor's private one, an environment's build in the host's (it reaches the package registry)."""
    size = ["--size", str(view.tmpfs_bytes)] if view.tmpfs_bytes else []
    argv = [BWRAP, "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--hostname", HOSTNAME,
            "--proc", "/proc", "--dev", "/dev", "--perms", "1777", *size, "--tmpfs", "/tmp",
            "--perms", "1777", *size, "--tmpfs", "/dev/shm"]
    mounts: list[list[str]] = []
    for top in SYSTEM_TOP:
        path = Path("/") / top
        if path.is_symlink():
            mounts.append(["--symlink", os.readlink(path), str(path)])
        elif path.is_dir():
            mounts.append(["--ro-bind", str(path), str(path)])
    for name in SYSTEM_ETC:
        path = Path("/etc") / name
        if name == "hosts" and view.hosts:
            mounts.append(["--ro-bind", view.hosts, str(path)])
        elif path.exists():
            mounts.append(["--ro-bind", str(path.resolve()), str(path)])
    for path in (*runtime_paths(), *view.read_only):
        mounts.append(["--ro-bind", path, path])
    for path in view.writable:
        mounts.append(["--bind", path, path])
    for path in view.read_only_over:
        mounts.append(["--ro-bind", path, path])
    for source, shown in view.writable_over:
        mounts.append(["--bind", source, shown])
    for path in view.devices:
        mounts.append(["--dev-bind", path, path])
    if view.devices:
        # What the GPU driver reads of /sys to find its devices (the folders a Flatpak sandbox shows).
        for name in GPU_SYS:
            if Path(name).is_dir():
                mounts.append(["--ro-bind", name, name])
    # bwrap makes the folders above a mount point as root, 0700: the account must pass through them.
    made = {"/", "/tmp", "/dev", "/proc"}
    for mount in mounts:
        for parent in reversed(Path(mount[-1]).parents):
            if str(parent) not in made and not _is_mounted_below(parent, mounts):
                made.add(str(parent))
                argv += ["--perms", "0755", "--dir", str(parent)]
        argv += mount
    argv += ["--chdir", view.cwd, "--", sys.executable, "-I", "-S", "-c", DROP, str(account.uid), str(account.gid),
             str(process_limit), *command]
    return argv


def _is_mounted_below(folder: Path, mounts: list[list[str]]) -> bool:
    """Whether a folder is itself a mount point or inside one (so bwrap must not make it)."""
    for mount in mounts:
        target = Path(mount[-1])
        if folder == target or target in folder.parents:
            return True
    return False


@functools.cache
def unavailable() -> str | None:
    """Why a sandbox cannot run here (None: it can); asked once per process."""
    if os.geteuid() != 0:
        return "the sandbox needs the portal to run as root (to switch to its unprivileged account)"
    if shutil.which(BWRAP) is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        who = account()
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"the sandbox account {SANDBOX_USER!r} cannot be made: {getattr(exc, 'stderr', '') or exc}"
    probe = bwrap_argv(View(), [sys.executable, "-I", "-S", "-c", "import os; print(os.getuid())"],
                       account=who, process_limit=64)
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap does not run here: {exc}"
    if done.returncode != 0 or done.stdout.strip() != str(who.uid):
        return f"bwrap does not run here: {(done.stderr or done.stdout).strip()[-300:]}"
    return None


def private_network() -> None:
    """Move this process into a network namespace of its own with its loopback up (root only): what it
    starts afterwards reaches each other on 127.0.0.1 and nothing of the host."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"unshare(CLONE_NEWNET): {os.strerror(error)}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(probe, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))

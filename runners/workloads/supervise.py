"""Run one attempt of a job's replicas on this host and leave their exit codes behind.

    python -m runners.workloads.supervise ATTEMPT_DIR

ATTEMPT_DIR holds ``launch.json``: {"replicas": [{"rank": 0, "argv": [...], "env": {...},
"memory_limit_bytes": N}, ...], "cwd": "..."}. Each replica starts with exactly that environment
and, when ``memory_limit_bytes`` is given, under that data-segment limit (RLIMIT_DATA, soft and
hard, set between fork and exec): every private writable mapping counts (heap, anonymous
mappings such as torch's tensors, thread stacks), so the replica's own memory can never grow
past it; an allocation beyond it fails (torch raises, the trainer exits 1). RLIMIT_AS would
also count the shared libraries mapped read-only and every address-space reservation, which
for torch is three times its resident size (and for CUDA, terabytes).

The supervisor detaches (double fork, its own session, so it outlives the worker that started
it and is never that worker's zombie), writes ``supervisor.pid`` ("<pid> <process group>"), starts
every replica in its process group with stdout and stderr to ``rank-<r>.log``, and writes
``rank-<r>.exit`` (the exit code; -N for a signal) as each one ends, each through a temporary
file and a rename. When a replica fails (not 0, not 75), the others get SIGTERM and, after
``failure_grace_s``, SIGKILL: a rank waiting forever for a dead peer must not hold GPUs.

SIGTERM to the process group reaches every replica (they checkpoint and exit 75); the
supervisor itself ignores it and goes on waiting, so the exit codes are still written.
SIGKILL to the group kills all, supervisor included: no exit files then, which is how the
portal tells a killed attempt from one that ended.

A script job's launch.json may also name its ``environment`` ({"dir", "requirements", "runtime"}) and
its ``sandbox`` (`runners.workloads.sandbox`: the account, the process limit and what the replicas see).
Before any replica starts, the supervisor builds the environment if it is not built yet (`build_environment`:
once per requirements.txt, under a lock, pip from the package registry, wheels only) and, for a sandboxed
attempt, moves itself into a private network namespace that its replicas share. When either fails no
replica starts: ``prepare.failed`` says why (pip's last lines), and the attempt ends with that reason.

The ranks' rendezvous store, as torchrun's agent hosts it: when the replicas' environment says
TORCHELASTIC_USE_AGENT_STORE=True (the local backend sets it for a script job of more than one rank),
the supervisor starts a store host before any replica (``rendezvous-store.log`` keeps what it says):
a small process of the portal's Python that holds torch's TCPStore on MASTER_PORT, in the sandbox
when the attempt has one and in the attempt's private network either way. The ranks connect to it as
clients (torch's env:// rendezvous does so under that variable), so rank 0 may end and exit while
another rank still tears down: without it, rank 0 hosts the store and its exit can abort the others.
The store host ignores SIGTERM (a stopping rank may still need it) and is stopped once every replica
has ended. When it cannot start no replica starts, and ``prepare.failed`` says why.
Node caches: when launch.json names ``caches`` (one per node the attempt was placed on: its folder, its
capacity, the attempt's holder name, the blobs and the datasets), the supervisor fills each node's cache
(`runners.storage.nodecache`) from the blob store before any replica starts: every blob checked against its
key, pinned for the attempt until the portal forgets it, and linked into the attempt's view folder in the
cache, where it also writes the datasets' manifest (``datasets.json``: {name: {"version", "shards": [{"sha256",
"bytes", "path"}]}}, the file PORTAL_DATASETS names). A sandboxed replica sees that view folder read-only
and no other part of the cache. The store's URL and options come in the supervisor's environment
(``PORTAL_DATA_STORAGE``), never in launch.json. What each fill found and pulled is ``cache-fills.json``.
A fill that fails (the cache is full of pinned blobs, a blob is missing or does not hash to its key)
starts no replica, and ``prepare.failed`` says why.
Resume from the store: when launch.json names a ``restore`` (the job's newest durable checkpoint, which the
job folder of the node the attempt landed on may lack), the supervisor restores it from the store's chunks
into the job folder before any replica starts (`runners.workloads.checkpoint_restore`, with the same
PORTAL_DATA_STORAGE); one it cannot restore starts no replica, and ``prepare.failed`` says why.
Stdlib only (torch is imported by the store host alone; fsspec by a fill, through runners.storage).
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
import venv
from pathlib import Path

from runners.storage.cache_grants import DATASETS_MANIFEST
from runners.workloads import checkpoint_restore, sandbox

LAUNCH_FILE = "launch.json"
PID_FILE = "supervisor.pid"
PREPARE_FAILED_FILE = "prepare.failed"
EXIT_CODES_OK = (0, 75)
# Written last into a built environment: a folder without it is a build that did not finish.
ENV_READY_FILE = ".portal-env-ready"
ENV_BUILD_TIMEOUT_S = 1800
# The sandbox account's processes while pip builds an environment (pip and the interpreter it runs).
BUILD_PROCESS_LIMIT = 256
# How many of pip's last lines a failed build gives as its reason.
REASON_LINES = 12
REASON_CHARS = 800
# The host's variables pip keeps: its own settings, proxies and certificates.
PIP_VARIABLES = ("PIP_", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
                 "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE")
# The ranks' rendezvous store: the variable that makes torch's env:// rendezvous a client of it, what the
# store host says once it listens, how long it may take to start (it imports torch) and to stop.
AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"
STORE_LOG_FILE = "rendezvous-store.log"
STORE_READY = b"listening\n"
STORE_START_TIMEOUT_S = 120
STORE_STOP_TIMEOUT_S = 10
# The node caches: where the store's URL and options come from, the fills' record, the datasets' manifest.
STORAGE_VARIABLE = "PORTAL_DATA_STORAGE"
CACHE_FILLS_FILE = "cache-fills.json"
# The store host (argv: port world-size): SIGTERM ignored first, then the store, then "listening" on
# stdout, then it holds the store until its stdin ends (the supervisor closes it, or the supervisor died).
STORE_HOST = (
    "import signal,sys\n"
    "signal.signal(signal.SIGTERM,signal.SIG_IGN);signal.signal(signal.SIGINT,signal.SIG_IGN)\n"
    "import torch.distributed as dist\n"
    "store=dist.TCPStore('127.0.0.1',int(sys.argv[1]),int(sys.argv[2]),is_master=True,wait_for_workers=False)\n"
    "sys.stdout.write('listening\\n');sys.stdout.flush()\n"
    "sys.stdin.buffer.read()\n"
)


def log_path(attempt_dir: Path, rank: int) -> Path:
    return attempt_dir / f"rank-{rank}.log"


def exit_path(attempt_dir: Path, rank: int) -> Path:
    return attempt_dir / f"rank-{rank}.exit"


def _write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temp, path)


def _before_exec(memory_limit_bytes: int | None, *, sandboxed: bool = False):
    """What a replica's child process does between fork and exec (this process has no other threads)."""

    def prepare() -> None:
        # The replicas take SIGTERM the default way (the trainer installs its own handler). A sandbox's
        # bwrap ignores it (it would die, and the sandbox with it, before the command could checkpoint);
        # the command gets the default back inside (runners.workloads.sandbox.DROP).
        disposition = signal.SIG_IGN if sandboxed else signal.SIG_DFL
        signal.signal(signal.SIGTERM, disposition)
        signal.signal(signal.SIGINT, disposition)
        if memory_limit_bytes:
            resource.setrlimit(resource.RLIMIT_DATA, (int(memory_limit_bytes), int(memory_limit_bytes)))

    return prepare


def requirements_refused(text: str) -> list[str]:
    """The lines of a requirements.txt that name anything but a package of the registry: options (another
    index, a file, an editable folder) and URLs (a direct reference)."""
    refused = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#") and (line.startswith("-") or "://" in line or "@" in line):
            refused.append(line)
    return refused


def _last_lines(text: str) -> str:
    """pip's last lines, at most REASON_CHARS of them from the end (the portal keeps 1,000 of a reason)."""
    return "\n".join(text.strip().splitlines()[-REASON_LINES:])[-REASON_CHARS:]


def build_environment(environment: dict, box: dict | None, log: Path) -> str | None:
    """Build the job's Python environment unless it is built: None once it is, else why not.

    A virtual environment of the runtime's interpreter whose site-packages adds the runtime's own (a .pth
    file: torch, numpy and gpuportal import without being installed again, and what requirements.txt pins
    comes first), then ``pip install --only-binary=:all: -r requirements.txt`` into it: wheels only, so
    no package's own code runs while it is built. With a sandbox, pip runs in it as the sandbox account,
    seeing only the requirements file and the environment (with the host's network: the registry). One
    build at a time per environment (an exclusive lock beside it); the others wait for it and use it.
    pip's output goes to `log` too (the rank 0 log the tenant reads).
    """
    folder = Path(environment["dir"])
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / ENV_READY_FILE).exists():
            return None
        requirements = Path(environment["requirements"])
        refused = requirements_refused(requirements.read_text(errors="replace"))
        if refused:
            return ("requirements.txt may name only packages of the package registry; not: "
                    + "; ".join(refused)[:500])
        shutil.rmtree(folder, ignore_errors=True)  # a build that did not finish
        venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(folder)
        python = folder / "bin" / "python"
        site_packages = subprocess.run(
            [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
        (Path(site_packages) / "portal-runtime.pth").write_text(
            f"import site; site.addsitedir({environment['runtime']!r})\n")
        pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--only-binary=:all:",
               "--no-input", "--progress-bar", "off", "-r", str(requirements)]
        env = {name: value for name, value in os.environ.items() if name.startswith(PIP_VARIABLES)}
        env.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME="/tmp", PIP_DISABLE_PIP_VERSION_CHECK="1")
        if box is not None:
            for root, folders, files in os.walk(folder):
                for name in folders + files:
                    os.lchown(os.path.join(root, name), box["uid"], box["gid"])
            os.chown(folder, box["uid"], box["gid"])
            view = sandbox.View(read_only=(str(requirements),), writable=(str(folder),), cwd=str(folder))
            pip = sandbox.bwrap_argv(view, pip, account=sandbox.Account(box["uid"], box["gid"]),
                                     process_limit=BUILD_PROCESS_LIMIT)
        try:
            done = subprocess.run(pip, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=ENV_BUILD_TIMEOUT_S, preexec_fn=_before_exec(None))
            output, failed = done.stdout + done.stderr, done.returncode != 0
        except subprocess.TimeoutExpired:
            output, failed = f"pip ran past {ENV_BUILD_TIMEOUT_S} s.", True
        with open(log, "a") as stream:
            stream.write(f"Building the job's Python environment (pip install -r {requirements.name}):\n{output}\n")
        if failed:
            shutil.rmtree(folder, ignore_errors=True)
            return f"Could not build the job's Python environment from requirements.txt:\n{_last_lines(output)}"
        _write_atomically(folder / ENV_READY_FILE, f"{time.time()}\n")
        return None


def fill_caches(attempt_dir: Path, launch: dict) -> str | None:
    """Fill each node cache the launch names with its blobs, pinned for the attempt, and write the datasets'
    manifest into the attempt's view: None once done, else why not."""
    caches = launch.get("caches") or []
    if not caches:
        return None
    from runners.storage.blobs import BlobMissing, BlobStore, HashMismatch
    from runners.storage.nodecache import BlobWanted, CacheFull, FillFailed, NodeCache

    storage = json.loads(os.environ.get(STORAGE_VARIABLE) or "{}")
    if not storage.get("url"):
        return f"The node cache cannot be filled: the supervisor was given no blob store ({STORAGE_VARIABLE})."
    stores: dict[str, BlobStore] = {}
    fills = []
    for cache in caches:
        node_cache = NodeCache(cache["root"], cache["capacity_bytes"])
        found = {"node": cache["node"], "hits": 0, "misses": 0, "bytes_pulled": 0, "bytes": 0}
        started = time.monotonic()
        paths = {}
        for blob in cache["blobs"]:
            kind = blob["kind"]
            if kind not in stores:
                stores[kind] = BlobStore(storage["url"], kind, storage.get("options") or {})
            try:
                filled = node_cache.fill_view(stores[kind], [BlobWanted(blob["sha256"], blob["bytes"], kind)],
                                              holder=cache["holder"])[0]
            except CacheFull as exc:
                return f"Node {cache['node']}'s cache cannot hold the job's data: {exc}."
            except BlobMissing:
                return f"The {kind} blob {blob['sha256']} is not in the store; the data it belongs to is gone."
            except (HashMismatch, ValueError) as exc:
                return f"The {kind} blob {blob['sha256']} in the store is not what its key names; refused: {exc}"
            except (FillFailed, OSError) as exc:
                return f"Could not fill node {cache['node']}'s cache: {exc}"
            paths[blob["sha256"]] = filled.path
            found["hits" if filled.hit else "misses"] += 1
            found["bytes_pulled"] += filled.pulled_bytes
            found["bytes"] += filled.bytes
        found["seconds"] = round(time.monotonic() - started, 3)
        view = NodeCache.view_path(cache["root"], cache["holder"])
        view.mkdir(parents=True, exist_ok=True)  # a dataset of no shards still has its manifest
        manifest = {
            dataset["name"]: {"version": dataset["version"], "shards": [
                {"sha256": sha, "bytes": size, "path": paths[sha]} for sha, size in dataset["shards"]]}
            for dataset in cache.get("datasets") or []
        }
        _write_atomically(view / DATASETS_MANIFEST, json.dumps(manifest, indent=1))
        os.chmod(view / DATASETS_MANIFEST, 0o444)
        fills.append(found)
    _write_atomically(attempt_dir / CACHE_FILLS_FILE, json.dumps(fills))
    return None


def _prepare(attempt_dir: Path, launch: dict) -> str | None:
    """What must be done before a script job's replicas start (None: done; else why it failed)."""
    failure = fill_caches(attempt_dir, launch) or checkpoint_restore.restore_checkpoint(attempt_dir, launch)
    if failure:
        return failure
    box = launch.get("sandbox")
    if launch.get("environment"):
        try:
            failure = build_environment(launch["environment"], box, log_path(attempt_dir, launch["replicas"][0]["rank"]))
        except (OSError, subprocess.SubprocessError) as exc:
            failure = f"Could not build the job's Python environment: {exc}"
        if failure:
            return failure
    if box is not None:
        try:
            sandbox.private_network()
        except OSError as exc:
            return f"Could not make the sandbox's network: {exc}"
    return None


def _argv(replica: dict, launch: dict) -> list[str]:
    """A replica's command line: its own, or the sandbox's around it."""
    box = launch.get("sandbox")
    if box is None:
        return replica["argv"]
    # The replica's node cache: only its attempt's view (links to the blobs it pinned), read-only.
    view_of_cache = (replica["cache_view"],) if replica.get("cache_view") else ()
    view = sandbox.View(
        read_only=(*box["read_only"], *view_of_cache), writable=tuple(box["writable"]),
        read_only_over=tuple(box["read_only_over"]),
        writable_over=tuple((source, shown) for source, shown in box["writable_over"]),
        devices=tuple(replica.get("devices", ())), cwd=box["cwd"], hosts=box.get("hosts"),
        tmpfs_bytes=replica.get("memory_limit_bytes"),
    )
    return sandbox.bwrap_argv(view, replica["argv"], account=sandbox.Account(box["uid"], box["gid"]),
                              process_limit=box["process_limit"])


def _store_port(launch: dict) -> tuple[int, int] | None:
    """The port and the world size of the rendezvous store this supervisor hosts, or None: the ranks host
    their own (rank 0 does)."""
    env = launch["replicas"][0]["env"] if launch["replicas"] else {}
    if env.get(AGENT_STORE_VARIABLE) != "True":
        return None
    return int(env["MASTER_PORT"]), int(env["WORLD_SIZE"])


def _start_store(attempt_dir: Path, launch: dict) -> tuple[subprocess.Popen | None, str | None]:
    """Start the ranks' rendezvous store when they need one and wait until it listens: (its process, None),
    (None, None) when none is needed, or (None, why it did not start)."""
    store = _store_port(launch)
    if store is None:
        return None, None
    port, world_size = store
    argv = [sys.executable, "-I", "-c", STORE_HOST, str(port), str(world_size)]
    box = launch.get("sandbox")
    if box is not None:
        argv = sandbox.bwrap_argv(sandbox.View(), argv, account=sandbox.Account(box["uid"], box["gid"]),
                                  process_limit=box["process_limit"])
    log = attempt_dir / STORE_LOG_FILE
    with open(log, "ab") as errors:
        host = subprocess.Popen(
            argv, cwd="/", env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=errors, preexec_fn=_before_exec(None, sandboxed=box is not None),
        )
    said = b""
    deadline = time.monotonic() + STORE_START_TIMEOUT_S
    while STORE_READY not in said:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([host.stdout], [], [], left)[0]:
            why = f"it did not listen within {STORE_START_TIMEOUT_S} s"
            break
        chunk = os.read(host.stdout.fileno(), 4096)
        if not chunk:
            why = "it ended"
            break
        said += chunk
    else:
        host.stdout.close()
        return host, None
    _stop_store(host)
    output = log.read_text(errors="replace") + said.decode(errors="replace")
    return None, f"Could not start the ranks' rendezvous store on port {port}: {why}.\n{_last_lines(output)}".strip()


def _stop_store(host: subprocess.Popen) -> None:
    """End the store host: its stdin closed, then SIGKILL if it is still there after STORE_STOP_TIMEOUT_S."""
    for stream in (host.stdin, host.stdout):
        if stream is not None and not stream.closed:
            try:
                stream.close()
            except OSError:
                pass
    try:
        host.wait(timeout=STORE_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        host.kill()
        host.wait()


def supervise(attempt_dir: Path) -> int:
    launch = json.loads((attempt_dir / LAUNCH_FILE).read_text())
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # for the replicas; we keep waiting for them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    failure = _prepare(attempt_dir, launch)
    store = None
    if not failure:
        try:
            store, failure = _start_store(attempt_dir, launch)
        except OSError as exc:
            failure = f"Could not start the ranks' rendezvous store: {exc}"
    if failure:
        _write_atomically(attempt_dir / PREPARE_FAILED_FILE, failure)
        return 1
    try:
        return _run_replicas(attempt_dir, launch)
    finally:
        if store is not None:
            _stop_store(store)


def _run_replicas(attempt_dir: Path, launch: dict) -> int:
    """Start every replica, write each one's exit code as it ends, and return once all have ended."""
    children: dict[int, subprocess.Popen] = {}
    for replica in launch["replicas"]:
        rank = replica["rank"]
        with open(log_path(attempt_dir, rank), "ab") as log:
            children[rank] = subprocess.Popen(
                _argv(replica, launch), cwd=launch["cwd"], env=replica["env"], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_before_exec(replica.get("memory_limit_bytes"), sandboxed=launch.get("sandbox") is not None),
            )
    failure_grace_s = float(launch.get("failure_grace_s", 30))
    kill_at = None
    running = dict(children)
    while running:
        for rank, child in list(running.items()):
            code = child.poll()
            if code is None:
                continue
            del running[rank]
            _write_atomically(exit_path(attempt_dir, rank), str(code))
            if code not in EXIT_CODES_OK and kill_at is None:
                for other in running.values():
                    other.send_signal(signal.SIGTERM)
                kill_at = time.monotonic() + failure_grace_s
        if kill_at is not None and time.monotonic() >= kill_at:
            for other in running.values():
                other.kill()
        time.sleep(0.1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    attempt_dir = Path(argv[0]).resolve()
    if os.fork():
        return 0  # the launcher's child returns at once; the grandchild carries on
    os.setsid()
    if os.fork():
        os._exit(0)
    _write_atomically(attempt_dir / PID_FILE, f"{os.getpid()} {os.getpgid(0)}")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        supervise(attempt_dir)
    finally:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

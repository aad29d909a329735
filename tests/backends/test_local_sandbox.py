"""Script jobs on the local backend: the tenant's code in its bundle, its environment, and the sandbox.

Real supervisors, bwrap and pip, started through LocalBackend as the portal's launch does. The escape
test runs the same script with LOCAL_SANDBOX on and off: off, every escape works (so the test can fail,
and it is the sandbox that stops each one); on, every one fails.
"""

import dataclasses
import json
import logging
import os
import socket
import uuid
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import pytest
from gpuportal import bundle as bundles

from runners.backends.base import BundleRef, JobLaunch, PermanentBackendError, ReplicaPlacement, ServingSettings
from runners.backends.local import LocalBackend
from runners.backends.local_jobs import REPO_ROOT
from runners.nvidia import names
from runners.workloads import progress, sandbox, supervise
from tests.support.races import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox here: {sandbox.unavailable()}"),
]

# The fork bomb is bounded (it must end without the sandbox too); the sandbox's limit is far below it.
FORKS = 1500
PROCESS_LIMIT = 300

ESCAPES = r'''
import json, mmap, os, resource, socket, sys, time

targets = json.loads(os.environ["PORTAL_HYPERPARAMETERS"])
found = {"uid": os.getuid()}


def attempt(name, action):
    try:
        found[name] = {"escaped": True, "detail": str(action())[:200]}
    except Exception as exc:  # what stopped it
        found[name] = {"escaped": False, "detail": f"{type(exc).__name__}: {exc}"[:200]}


def read(path):
    with open(path, "rb") as stream:
        return stream.read(100)


def connect(port):
    with socket.create_connection(("127.0.0.1", port), timeout=3):
        return f"connected to {port}"


def write(path):
    with open(path, "w") as stream:
        stream.write("escaped")
    return path


def fork_bomb():
    children, (reader, writer) = [], os.pipe()
    try:
        for _ in range(targets["forks"]):
            pid = os.fork()
            if pid == 0:
                os.close(writer)
                os.read(reader, 1)  # held until the parent closes its end
                os._exit(0)
            children.append(pid)
    finally:
        os.close(writer)
        for pid in children:
            os.waitpid(pid, 0)
    return f"{len(children)} processes"


def memory(raise_limit):
    limit = resource.getrlimit(resource.RLIMIT_DATA)[1]
    if raise_limit:
        resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    size = limit + 512 * 1024 * 1024
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.close()
    return f"mapped {size} bytes"


attempt("list_postgres_sockets", lambda: [os.listdir(d) for d in targets["postgres_socket_dirs"]])
attempt("read_postgres_data", lambda: read(os.path.join(targets["postgres_data"], "PG_VERSION")))
attempt("read_portal_settings", lambda: read(targets["portal_settings"]))
attempt("read_backend_var", lambda: (os.listdir(targets["backend_var"]), read(targets["backend_state"])))
attempt("connect_postgres", lambda: connect(targets["postgres_port"]))
attempt("connect_redis", lambda: connect(targets["redis_port"]))
attempt("connect_host_listener", lambda: connect(targets["listener_port"]))
attempt("read_other_tenant", lambda: read(targets["other_tenant_file"]))
attempt("write_bundle", lambda: write(os.path.join(os.getcwd(), "planted")))
attempt("write_root", lambda: write(targets["root_file"]))
attempt("write_repo", lambda: write(targets["repo_file"]))
attempt("write_other_tenant", lambda: write(targets["other_tenant_planted"]))
attempt("fork_bomb", fork_bomb)
attempt("raise_memory_limit", lambda: memory(True))
attempt("allocate_past_limit", lambda: memory(False))
with open(os.path.join(os.environ["TRAIN_JOB_DIR"], "escapes.json"), "w") as stream:
    json.dump(found, stream)
'''

DDP = r'''
import gc, json, os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for step in range(5):
    inputs = torch.randn(8, 4) + rank
    loss = (model(inputs) - 1).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
weights = [p.detach().clone() for p in model.parameters()]
gathered = [[torch.zeros_like(w) for w in weights] for _ in range(world)]
for index, weight in enumerate(weights):
    parts = [torch.zeros_like(weight) for _ in range(world)]
    dist.all_gather(parts, weight)
    for r in range(world):
        gathered[r][index] = parts[r]
same = all(torch.equal(a, b) for r in range(world) for a, b in zip(gathered[0], gathered[r]))
with open(os.path.join(os.environ["TRAIN_JOB_DIR"], f"rank-{rank}.json"), "w") as stream:
    json.dump({"sum": total.item(), "world": world, "weights_agree": same, "losses": losses,
               "master": os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"]}, stream)
dist.barrier()
# The trainer's teardown: DDP's reducer holds the group; freed here, not by gloo's threads during interpreter
# shutdown, which now and then aborts a rank that finished cleanly (rc 134).
del model, optimizer, loss
gc.collect()
dist.destroy_process_group()
'''

USES_SIX = r'''
import json, os, sys
import numpy, six, torch
with open(os.path.join(os.environ["TRAIN_JOB_DIR"], "imports.json"), "w") as stream:
    json.dump({"six": six.__version__, "six_file": six.__file__, "numpy_file": numpy.__file__,
               "torch_file": torch.__file__, "python": sys.executable}, stream)
'''


def may_raise_limits() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE (what lets root raise a hard limit), as the kernel says."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


def make_backend(tmp_path, mode: str, *, process_limit: int | None = None) -> LocalBackend:
    """A local backend in `mode`; the sandbox account's process limit is the backend's own unless given.

    RLIMIT_NPROC counts every process and thread of the one sandbox account, so a low limit given to one
    test would also starve the torch threads of another test's job running at the same time."""
    backend = LocalBackend(workspace_dir=tmp_path / "workspaces", use_nvml=False, jobs_dir=tmp_path / "jobs",
                           sandbox=mode)
    if process_limit is not None:
        backend.jobs.sandbox_process_limit = process_limit
    return backend


def stored_bundle(tmp_path, files: dict[str, str]) -> BundleRef:
    """The files as a bundle packed by gpuportal, stored in a folder of the test (a file:// URL)."""
    folder = tmp_path / f"project-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    archive = bundles.pack(folder)
    digest = bundles.digest(archive)
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    (store / f"{digest}.tar.gz").write_bytes(archive)
    return BundleRef(sha256=digest, url=f"file://{store / digest}.tar.gz")


def script_launch(job_id: int, ref: BundleRef, command: tuple[str, ...], *, ranks: int = 1,
                  hyperparameters: dict | None = None, memory_mib: int = 512, tenant: str = "acme") -> JobLaunch:
    return JobLaunch(
        job_id=job_id, attempt=1, tenant_slug=tenant, namespace=f"{tenant}--train", name="script",
        template="script", replicas=tuple(ReplicaPlacement(rank, "sim-1", (rank,)) for rank in range(ranks)),
        gpu_resource=names.GPU_RESOURCE, gpus_per_replica=1, cpu_milli_per_replica=1000,
        memory_mib_per_replica=memory_mib, steps=10, checkpoint_every_steps=10, max_runtime_s=600,
        command=command, bundle=ref, hyperparameters_json=json.dumps(hyperparameters or {}),
    )


def ended(backend, launch, timeout=300.0):
    assert wait_until(lambda: backend.job_status(launch.job_id, launch.attempt).phase != "running", timeout_s=timeout), (
        f"job {launch.job_id} still runs: {logs(backend, launch)}")
    return backend.job_status(launch.job_id, launch.attempt)


def logs(backend, launch) -> str:
    return "\n".join(backend.job_logs(launch.job_id, launch.attempt, rank, tail=60) for rank in range(len(launch.replicas)))


@pytest.fixture
def postgres() -> dict:
    """Where this host's PostgreSQL keeps its data and its sockets, and its port, as the server says."""
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/portal")
    with psycopg.connect(url, dbname="postgres", connect_timeout=5) as conn:
        data = conn.execute("SHOW data_directory").fetchone()[0]
        sockets = conn.execute("SHOW unix_socket_directories").fetchone()[0]
    return {"data": data, "sockets": [d.strip() for d in sockets.split(",") if d.strip()],
            "port": urlparse(url).port or 5432}


@pytest.fixture
def listener():
    """A server on the host's loopback, as the portal's web server is."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.listen(8)
        yield server.getsockname()[1]


@pytest.fixture
def planted():
    """Files an escape would write outside its folders; removed after the test whatever happened."""
    token = uuid.uuid4().hex[:10]
    paths = {"root_file": Path(f"/escape-{token}"), "repo_file": REPO_ROOT / f".escape-{token}"}
    yield token, paths
    for path in paths.values():
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_each_escape_works_without_the_sandbox_and_fails_in_it(tmp_path, mode, postgres, listener, planted):
    token, paths = planted
    backend = make_backend(tmp_path, mode, process_limit=PROCESS_LIMIT)
    other = backend.jobs.job_dir(99)  # another tenant's job
    other.mkdir(parents=True)
    (other / "secret.txt").write_text("globex's weights")
    broker = urlparse(os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0"))
    targets = {
        "postgres_socket_dirs": postgres["sockets"], "postgres_data": postgres["data"],
        "postgres_port": postgres["port"], "redis_port": broker.port or 6379, "listener_port": listener,
        "portal_settings": str(REPO_ROOT / "portal" / "settings.py"),
        # The backend's own var folder: its cluster state, the other jobs, bundles and environments.
        "backend_var": str(backend.jobs.jobs_dir.parent), "backend_state": str(backend.state_file),
        "other_tenant_file": str(other / "secret.txt"), "other_tenant_planted": str(other / f"planted-{token}"),
        "root_file": str(paths["root_file"]), "repo_file": str(paths["repo_file"]), "forks": FORKS,
    }
    ref = stored_bundle(tmp_path, {"escape.py": ESCAPES})
    launch = script_launch(7, ref, ("python", "escape.py"), hyperparameters=targets)
    backend.launch_job(launch)
    status = ended(backend, launch)
    assert status.phase == "exited" and status.exit_codes == {0: 0}, logs(backend, launch)
    found = json.loads((backend.jobs.job_dir(7) / "escapes.json").read_text())
    escapes = {name: result for name, result in found.items() if name != "uid"}
    # Past RLIMIT_DATA as it is set, an allocation fails either way: that limit is older than the sandbox.
    assert not escapes.pop("allocate_past_limit")["escaped"]
    if mode == "off":
        assert found["uid"] == 0
        # Root raises its own memory limit where it holds CAP_SYS_RESOURCE (a container often drops it).
        assert escapes.pop("raise_memory_limit")["escaped"] == may_raise_limits()
        assert {name: result["escaped"] for name, result in escapes.items()} == dict.fromkeys(escapes, True), escapes
        assert escapes["fork_bomb"]["detail"] == f"{FORKS} processes"
    else:
        assert found["uid"] == sandbox.account().uid != 0
        assert {name: result["escaped"] for name, result in escapes.items()} == dict.fromkeys(escapes, False), escapes
        assert (other / "secret.txt").read_text() == "globex's weights"
        assert not any(path.exists() for path in paths.values())
        assert not (other / f"planted-{token}").exists()
        assert "Resource temporarily unavailable" in escapes["fork_bomb"]["detail"]
        assert "not allowed to raise maximum limit" in escapes["raise_memory_limit"]["detail"]


def test_two_ranks_train_with_gloo_inside_the_sandbox(tmp_path):
    backend = make_backend(tmp_path, "on")
    ref = stored_bundle(tmp_path, {"ddp.py": DDP})
    launch = script_launch(8, ref, ("python", "ddp.py"), ranks=2, memory_mib=3072)
    backend.launch_job(launch)
    record = json.loads((backend.jobs.attempt_dir(8, 1) / supervise.LAUNCH_FILE).read_text())
    assert record["sandbox"] is not None
    status = ended(backend, launch)
    assert status.phase == "exited" and status.exit_codes == {0: 0, 1: 0}, logs(backend, launch)
    for rank in (0, 1):
        result = json.loads((backend.jobs.job_dir(8) / f"rank-{rank}.json").read_text())
        assert result["sum"] == 3.0 and result["world"] == 2 and result["weights_agree"]
        assert result["master"].startswith("127.0.0.1:")
        assert len(result["losses"]) == 5


# Rank 0 leaves at once after its destroy; rank 1 waits, still reaches the store, then destroys its group.
EARLY_EXIT = (Path(__file__).parents[1] / "workloads" / "scripts" / "early_exit.py").read_text()


def test_rank_0_may_exit_first_the_supervisor_hosts_the_store(tmp_path):
    backend = make_backend(tmp_path, "on")
    ref = stored_bundle(tmp_path, {"early.py": EARLY_EXIT})
    launch = script_launch(25, ref, ("python", "early.py"), ranks=2, memory_mib=3072)
    backend.launch_job(launch)
    record = json.loads((backend.jobs.attempt_dir(25, 1) / supervise.LAUNCH_FILE).read_text())
    assert [replica["env"][supervise.AGENT_STORE_VARIABLE] for replica in record["replicas"]] == ["True", "True"]
    status = ended(backend, launch)
    assert status.phase == "exited" and status.exit_codes == {0: 0, 1: 0}, logs(backend, launch)
    result = json.loads((backend.jobs.job_dir(25) / "rank-1.json").read_text())
    assert result == {"sum": 3.0, "store": "still here"}


def test_a_single_rank_hosts_its_own_store(tmp_path):
    backend = make_backend(tmp_path, "on")
    ref = stored_bundle(tmp_path, {"one.py": "import torch.distributed as dist\n"
                                              "dist.init_process_group('gloo')\ndist.destroy_process_group()\n"})
    launch = script_launch(26, ref, ("python", "one.py"))
    backend.launch_job(launch)
    record = json.loads((backend.jobs.attempt_dir(26, 1) / supervise.LAUNCH_FILE).read_text())
    assert supervise.AGENT_STORE_VARIABLE not in record["replicas"][0]["env"]
    status = ended(backend, launch)
    assert status.phase == "exited" and status.exit_codes == {0: 0}, logs(backend, launch)
    assert not (backend.jobs.attempt_dir(26, 1) / supervise.STORE_LOG_FILE).exists()


def test_the_sdks_ddp_example_runs_two_ranks_in_the_sandbox(tmp_path):
    backend = make_backend(tmp_path, "on")
    example = REPO_ROOT / "sdk" / "examples" / "ddp" / "train.py"
    ref = stored_bundle(tmp_path, {"train.py": example.read_text()})
    launch = script_launch(27, ref, ("python", "train.py"), ranks=2, memory_mib=3072,
                           hyperparameters={"steps": 20, "checkpoint_every": 10})
    backend.launch_job(launch)
    status = ended(backend, launch)
    assert status.phase == "exited" and status.exit_codes == {0: 0, 1: 0}, logs(backend, launch)
    assert progress.latest_checkpoint_step(backend.jobs.job_dir(27)) == 20


def test_a_stop_reaches_the_script_inside_the_sandbox(tmp_path):
    backend = make_backend(tmp_path, "on")
    script = (
        "import os, signal, sys, time\n"
        "def stop(*_):\n"
        "    open(os.path.join(os.environ['TRAIN_JOB_DIR'], 'stopped'), 'w').write('checkpointed')\n"
        "    sys.exit(75)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "open(os.path.join(os.environ['TRAIN_JOB_DIR'], 'started'), 'w').write('yes')\n"
        "time.sleep(300)\n"
    )
    ref = stored_bundle(tmp_path, {"wait.py": script})
    launch = script_launch(9, ref, ("python", "wait.py"))
    backend.launch_job(launch)
    assert wait_until(lambda: (backend.jobs.job_dir(9) / "started").exists(), timeout_s=60), logs(backend, launch)
    backend.stop_job(9, 1, grace_period_s=30)
    status = ended(backend, launch, timeout=60)
    assert status.exit_codes == {0: 75}, logs(backend, launch)
    assert (backend.jobs.job_dir(9) / "stopped").read_text() == "checkpointed"


def test_requirements_build_one_environment_for_two_jobs_on_top_of_the_runtime(tmp_path):
    backend = make_backend(tmp_path, "on")
    ref = stored_bundle(tmp_path, {"main.py": USES_SIX, "requirements.txt": "six==1.16.0\n"})
    # Launched together: the launches return at once, and the two supervisors build the environment once.
    launches = [script_launch(job_id, ref, ("python", "main.py"), memory_mib=2048) for job_id in (11, 12)]
    for launch in launches:
        backend.launch_job(launch)
    for launch in launches:
        status = ended(backend, launch)
        assert status.phase == "exited" and status.exit_codes == {0: 0}, (status, logs(backend, launch))
    (env_dir,) = [path for path in backend.jobs.envs_dir.iterdir() if path.is_dir()]
    built = (env_dir / supervise.ENV_READY_FILE).read_text()
    builds = ["Building the job's Python environment" in logs(backend, launch) for launch in launches]
    assert sorted(builds) == [False, True], "one supervisor built it, the other waited for it and used it"
    found = [json.loads((backend.jobs.job_dir(launch.job_id) / "imports.json").read_text()) for launch in launches]
    assert found[0] == found[1]
    assert found[0]["six"] == "1.16.0" and found[0]["six_file"].startswith(str(env_dir))
    assert found[0]["python"] == str(env_dir / "bin" / "python")
    site_packages = sandbox.runtime_site_packages()
    assert found[0]["numpy_file"].startswith(site_packages) and found[0]["torch_file"].startswith(site_packages)

    later = script_launch(17, ref, ("python", "main.py"), memory_mib=2048)
    backend.launch_job(later)
    assert ended(backend, later).exit_codes == {0: 0}, logs(backend, later)
    assert (env_dir / supervise.ENV_READY_FILE).read_text() == built, "built once, used by every job"
    assert "Building the job's Python environment" not in logs(backend, later)


def test_a_requirement_pip_cannot_install_fails_the_job_with_pips_last_lines(tmp_path):
    backend = make_backend(tmp_path, "on")
    ref = stored_bundle(tmp_path, {"main.py": "print('never runs')\n", "requirements.txt": "no-such-package-xyz==1.0\n"})
    launch = script_launch(13, ref, ("python", "main.py"))
    backend.launch_job(launch)
    status = ended(backend, launch)
    assert status.phase == "lost" and status.exit_codes == {}
    assert status.reason.startswith("Could not build the job's Python environment from requirements.txt:")
    assert "No matching distribution found for no-such-package-xyz==1.0" in status.reason
    assert "never runs" not in logs(backend, launch)
    assert not [path for path in backend.jobs.envs_dir.iterdir() if path.is_dir()], "a failed build leaves nothing"


def test_a_requirement_that_is_not_a_registry_package_is_refused(tmp_path):
    backend = make_backend(tmp_path, "on")
    ref = stored_bundle(tmp_path, {"main.py": "print('never runs')\n",
                                   "requirements.txt": "six==1.16.0\n--index-url http://127.0.0.1:5432/simple\n"})
    launch = script_launch(14, ref, ("python", "main.py"))
    backend.launch_job(launch)
    status = ended(backend, launch)
    assert status.phase == "lost"
    assert "--index-url http://127.0.0.1:5432/simple" in status.reason


def test_a_bundle_whose_digest_differs_is_refused(tmp_path):
    backend = make_backend(tmp_path, "on")
    ref = stored_bundle(tmp_path, {"main.py": "print('hello')\n"})
    forged = BundleRef(sha256="0" * 64, url=ref.url)
    with pytest.raises(PermanentBackendError, match="not the one it names"):
        backend.launch_job(script_launch(15, forged, ("python", "main.py")))
    assert not (backend.jobs.bundles_dir / "acme" / ("0" * 64)).exists()


def test_a_progress_read_carries_the_stop_records_once(tmp_path):
    backend = make_backend(tmp_path, "on")
    job_dir = backend.jobs.job_dir(16)
    job_dir.mkdir(parents=True)
    stop = {"attempt": 1, "rank": 0, "reason": "SIGTERM received", "checkpoint_step": 40, "time": "t"}
    (job_dir / progress.STOPS_FILE).write_text(json.dumps(stop) + "\n" + '"not a record"\n' + '{"attempt": 2, "ra')
    first = backend.job_progress(16, 1, {})
    assert first.stops == [stop]
    assert first.cursor["stops"] == (job_dir / progress.STOPS_FILE).read_bytes().rindex(b"\n") + 1
    assert backend.job_progress(16, 1, first.cursor).stops == [], "each record once; a torn line waits"


SEES = r"""
import json, os
job_dir = os.environ["TRAIN_JOB_DIR"]
seen = {"cwd": os.getcwd(), "env": dict(os.environ), "uid": os.getuid()}
for name, path in {"bundle": os.path.join(os.getcwd(), "x"), "attempts": os.path.join(job_dir, "attempts", "x"),
                   "job_dir": os.path.join(job_dir, "x"), "home": os.path.join(os.environ["HOME"], "x"),
                   "tmp": "/tmp/x"}.items():
    try:
        open(path, "w").close()
        seen["wrote_" + name] = True
    except OSError:
        seen["wrote_" + name] = False
seen["repo_visible"] = os.path.exists(os.environ["REPO_PROBE"])
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
seen["no_new_privs"] = status["NoNewPrivs"].strip()
with open(os.path.join(job_dir, "seen.json"), "w") as stream:
    json.dump(seen, stream)
"""


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_replica_runs_its_command_in_its_bundle_with_the_launchers_variables(tmp_path, mode):
    backend = make_backend(tmp_path, mode)
    ref = stored_bundle(tmp_path, {"sees.py": SEES})
    launch = dataclasses.replace(
        script_launch(18, ref, ("python3", "sees.py"), ranks=2, hyperparameters={"lr": 0.1}),
        env=(("REPO_PROBE", str(REPO_ROOT / "portal" / "settings.py")),), resume_from_step=40,
    )
    backend.launch_job(launch)
    assert ended(backend, launch).exit_codes == {0: 0, 1: 0}, logs(backend, launch)
    seen = json.loads((backend.jobs.job_dir(18) / "seen.json").read_text())
    bundle_dir = backend.jobs.bundles_dir / "acme" / ref.sha256
    env = seen["env"]
    assert seen["cwd"] == str(bundle_dir)
    assert json.loads(env["PORTAL_HYPERPARAMETERS"]) == {"lr": 0.1}
    assert env["TRAIN_JOB_DIR"] == str(backend.jobs.job_dir(18)) and env["TRAIN_MAX_RUNTIME_S"] == "600"
    assert env["PORTAL_RESUME_FROM_STEP"] == "40", "no checkpoint in the folder: the portal's own record"
    assert env["WORLD_SIZE"] == "2" and env["RANK"] in ("0", "1") and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["PORTAL_JOB"] == "18" and env["REPO_PROBE"]
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True", "the supervisor hosts the rendezvous store"
    assert seen["wrote_job_dir"] and seen["wrote_home"] and seen["wrote_tmp"]
    if mode == "on":
        assert seen["uid"] == sandbox.account().uid
        assert not seen["wrote_attempts"], "the attempt's records are the portal's"
        assert not seen["wrote_bundle"] and not seen["repo_visible"]
        assert seen["no_new_privs"] == "1", "no set-user-ID program gives root back"
    else:  # as the portal's own user, root: what the sandbox is for
        assert seen["uid"] == 0 and seen["wrote_attempts"] and seen["wrote_bundle"] and seen["repo_visible"]


def test_forget_kills_a_sandboxed_script_and_what_it_started(tmp_path):
    backend = make_backend(tmp_path, "on")
    script = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "open(os.path.join(os.environ['TRAIN_JOB_DIR'], 'pids'), 'w').write(f'{os.getpid()} {child.pid}')\n"
        "time.sleep(300)\n"
    )
    ref = stored_bundle(tmp_path, {"wait.py": script})
    launch = script_launch(19, ref, ("python", "wait.py"))
    backend.launch_job(launch)
    assert wait_until(lambda: (backend.jobs.job_dir(19) / "pids").exists(), timeout_s=60), logs(backend, launch)
    account = sandbox.account()

    def sandboxed_processes() -> list[int]:
        found = []
        for entry in os.scandir("/proc"):
            try:
                if entry.name.isdigit() and os.stat(f"/proc/{entry.name}").st_uid == account.uid:
                    environ = Path(f"/proc/{entry.name}/environ").read_bytes()
                    if b"PORTAL_JOB=19\0" in environ:
                        found.append(int(entry.name))
            except OSError:
                continue
        return found

    assert len(sandboxed_processes()) == 2
    backend.forget_job(19, 1)
    assert wait_until(lambda: not sandboxed_processes(), timeout_s=30), sandboxed_processes()
    attempt_dir = backend.jobs.attempt_dir(19, 1)
    assert not (attempt_dir / "scratch").exists() and not (attempt_dir / "sandbox-attempt").exists()


def test_the_setting_decides_where_bwrap_is_missing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bwrap-here"))
    sandbox.unavailable.cache_clear()
    try:
        assert "bubblewrap (bwrap) is not installed" in sandbox.unavailable()
        ref = stored_bundle(tmp_path, {"main.py": "print('ran')\n"})
        with pytest.raises(PermanentBackendError, match="LOCAL_SANDBOX is on, and the sandbox cannot run here: bubblewrap"):
            make_backend(tmp_path / "on", "on").launch_job(script_launch(20, ref, ("python", "main.py")))
        auto = make_backend(tmp_path / "auto", "auto")
        with caplog.at_level(logging.WARNING, logger="runners.backends.local_jobs"):
            auto.launch_job(script_launch(21, ref, ("python", "main.py")))
        assert "WITHOUT the sandbox" in caplog.text
        record = json.loads((auto.jobs.attempt_dir(21, 1) / supervise.LAUNCH_FILE).read_text())
        assert record["sandbox"] is None
        assert ended(auto, script_launch(21, ref, ("python", "main.py"))).exit_codes == {0: 0}
    finally:
        sandbox.unavailable.cache_clear()


BUSY = r"""
import os, time
import gpuportal
context = gpuportal.init()
with context.busy():
    end = time.monotonic() + 60
    while time.monotonic() < end and not os.path.exists(os.path.join(os.environ["TRAIN_JOB_DIR"], "seen")):
        sum(range(10000))
"""


def test_a_sandboxed_script_reports_its_activity_through_the_sdk(tmp_path):
    backend = make_backend(tmp_path, "on")
    ref = stored_bundle(tmp_path, {"busy.py": BUSY})
    launch = script_launch(22, ref, ("python", "busy.py"), memory_mib=2048)
    backend.launch_job(launch)

    def busy():
        readings = backend.gpu_readings({(22, 1)}).get((22, 1), [])
        return readings if readings and readings[0].gpu_util_pct > 50 else None

    assert wait_until(busy, timeout_s=60), logs(backend, launch)
    (reading,) = busy()
    assert reading.source == "simulated" and reading.device == "sim-1/gpu0"
    (backend.jobs.job_dir(22) / "seen").touch()
    assert ended(backend, launch).exit_codes == {0: 0}, logs(backend, launch)
    assert not list(backend.jobs.attempt_dir(22, 1).glob("rank-*.activity.json")), "the portal's folder stays its own"


LINKS = r"""
import os
job_dir = os.environ["TRAIN_JOB_DIR"]
other = os.environ["OTHER_JOB"]
os.symlink(os.path.join(other, "metrics.jsonl"), os.path.join(job_dir, "metrics.jsonl"))
os.mkfifo(os.path.join(job_dir, "checkpoints.jsonl"))
os.makedirs(os.path.join(job_dir, "checkpoints"))
os.symlink(os.path.join(other, "checkpoints", "step-00000010.pt"), os.path.join(job_dir, "checkpoints", "step-00000010.pt"))
attempt = os.path.join(job_dir, "attempts", os.environ["PORTAL_ATTEMPT"])
os.symlink(os.path.join(other, "secret.json"), os.path.join(attempt, "rank-0.activity.json"))
"""


def test_the_portal_never_follows_a_link_or_reads_a_fifo_a_script_left_in_its_folder(tmp_path):
    backend = make_backend(tmp_path, "on")
    other = backend.jobs.job_dir(98)  # another tenant's job, with metrics, a checkpoint and an activity-shaped file
    (other / "checkpoints").mkdir(parents=True)
    metric = {"step": 1, "loss": 0.5, "samples_per_s": 1.0, "time": "t", "attempt": 1}
    (other / progress.METRICS_FILE).write_text(json.dumps(metric) + "\n")
    (other / "checkpoints" / "step-00000010.pt").write_bytes(b"globex's weights")
    (other / "secret.json").write_text(json.dumps({"at": 4e9, "busy_fraction": 1.0, "memory_used_mib": 1.0}))
    ref = stored_bundle(tmp_path, {"links.py": LINKS})
    launch = dataclasses.replace(script_launch(23, ref, ("python", "links.py")), env=(("OTHER_JOB", str(other)),))
    backend.launch_job(launch)
    assert ended(backend, launch).exit_codes == {0: 0}, logs(backend, launch)
    job_dir = backend.jobs.job_dir(23)
    assert (job_dir / progress.METRICS_FILE).is_symlink(), "the script did leave a link to the other job's file"

    read = backend.job_progress(23, 1, {})
    assert read.metrics == [] and read.checkpoints == [] and read.bytes_read == 0
    assert backend.gpu_readings({(23, 1)}) == {}
    serving = ServingSettings(endpoint_id=4, checkpoint="checkpoints/step-00000010.pt", source_job_id=23)
    serve = dataclasses.replace(script_launch(24, ref, ("python", "links.py")), template="pytorch-ddp", bundle=None,
                                command=None, serving=serving)
    with pytest.raises(PermanentBackendError, match="The checkpoint to serve cannot be read"):
        backend.launch_job(serve)
    assert not list((backend.jobs.jobs_dir / "endpoints").rglob("*.pt"))

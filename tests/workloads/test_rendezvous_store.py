"""The ranks' rendezvous store that an attempt's supervisor hosts, as torchrun's agent does.

Real supervisors (``python -m runners.workloads.supervise``) and real torch ranks, without the sandbox, so
these run wherever torch does; tests/backends/test_local_sandbox.py runs the same through the sandbox.
"""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runners.backends.local_jobs import REPO_ROOT, free_port
from runners.workloads import supervise
from tests.support.races import wait_until

pytestmark = pytest.mark.e2e

# Rank 0 leaves at once after its destroy; rank 1 waits, still reaches the store, then destroys its group.
EARLY_EXIT = (Path(__file__).parent / "scripts" / "early_exit.py").read_text()

STARTED = r'''
import os
open(os.path.join(os.environ["OUT_DIR"], "started-" + os.environ["RANK"]), "w").write("yes")
'''


@pytest.fixture
def tmp_path(tmp_path):
    """The test's folder; an attempt still running after it (a test that failed) is killed, its whole group
    (only while its supervisor runs: an ended group's id may be another's by then)."""
    yield tmp_path
    pid_file = tmp_path / "attempt" / supervise.PID_FILE
    if pid_file.exists() and not supervisor_ended(tmp_path / "attempt"):
        try:
            os.killpg(int(pid_file.read_text().split()[1]), signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_attempt(tmp_path: Path, script: str, port: int, *, ranks: int = 2) -> Path:
    """An attempt of `ranks` replicas of `script` with the agent store's variables, as the local backend
    writes a script job's, started through the supervisor's own command line."""
    attempt_dir = tmp_path / "attempt"
    attempt_dir.mkdir()
    (tmp_path / "main.py").write_text(script)
    replicas = [{
        "rank": rank, "argv": [sys.executable, str(tmp_path / "main.py")],
        "env": {"PATH": "/usr/bin:/bin", "OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
                "RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                supervise.AGENT_STORE_VARIABLE: "True"},
    } for rank in range(ranks)]
    (attempt_dir / supervise.LAUNCH_FILE).write_text(json.dumps({"replicas": replicas, "cwd": str(tmp_path)}))
    subprocess.run([sys.executable, "-m", "runners.workloads.supervise", str(attempt_dir)], cwd=REPO_ROOT,
                   check=True, timeout=30)
    return attempt_dir


def supervisor_ended(attempt_dir: Path) -> bool:
    """Whether the attempt's supervisor has ended (gone, or a zombie not reaped yet)."""
    pid_file = attempt_dir / supervise.PID_FILE
    if not pid_file.exists():
        return False
    pid = pid_file.read_text().split()[0]
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3):
            return True
    except OSError:
        return False


def rank_logs(attempt_dir: Path) -> str:
    return "\n".join(path.read_text(errors="replace") for path in sorted(attempt_dir.glob("*.log")))


def test_rank_0_may_exit_before_rank_1_is_done_with_the_store(tmp_path):
    port = free_port()
    attempt_dir = start_attempt(tmp_path, EARLY_EXIT, port)
    assert wait_until(lambda: supervisor_ended(attempt_dir), timeout_s=300), rank_logs(attempt_dir)
    exits = {rank: supervise.exit_path(attempt_dir, rank).read_text() for rank in (0, 1)}
    assert exits == {0: "0", 1: "0"}, rank_logs(attempt_dir)
    assert json.loads((tmp_path / "rank-1.json").read_text()) == {"sum": 3.0, "store": "still here"}
    # Stopped with the attempt: nothing listens on its port any more.
    assert not listening(port)


def test_a_store_that_cannot_listen_fails_the_attempt_before_any_rank_starts(tmp_path):
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        attempt_dir = start_attempt(tmp_path, STARTED, port)
        assert wait_until(lambda: supervisor_ended(attempt_dir), timeout_s=300)
    reason = (attempt_dir / supervise.PREPARE_FAILED_FILE).read_text()
    assert reason.startswith(f"Could not start the ranks' rendezvous store on port {port}: it ended."), reason
    assert not list(tmp_path.glob("started-*"))
    assert not list(attempt_dir.glob("rank-*.exit"))


def test_only_ranks_given_the_variable_get_the_supervisors_store():
    launch = {"replicas": [{"rank": 0, "argv": ["true"], "env": {"MASTER_PORT": "29500", "WORLD_SIZE": "2"}}]}
    assert supervise._store_port(launch) is None
    launch["replicas"][0]["env"][supervise.AGENT_STORE_VARIABLE] = "False"
    assert supervise._store_port(launch) is None
    launch["replicas"][0]["env"][supervise.AGENT_STORE_VARIABLE] = "True"
    assert supervise._store_port(launch) == (29500, 2)

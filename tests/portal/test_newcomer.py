"""A newcomer's first hour, as the README tells it: `make run` on a fresh checkout, then every persona.

The portal is started the way the README says (`make run`, which runs `manage.py up`) with no
DATABASE_URL, CELERY_BROKER_URL or CACHE_URL and an empty var/: so it starts this checkout's embedded
PostgreSQL and Redis itself, as it does on a machine with none installed. Then, over HTTP against that
running portal: alice makes an environment, trains a small job, serves its checkpoint and prompts it;
a second `make run` is refused; `manage.py shell` reaches the same database; and every persona (nobody,
the member bob, who views another tenant, the owners alice and carol, the staff admin) follows every
link they can click: no 5xx, no error page, no debug page. Ctrl-C stops everything, the embedded servers
too, and the data is still there afterwards.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests

from tests.support.crawl import DEBUG_MARKS, crawl
from tests.support.portal_up import kill_job_processes

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "portal-demo"
# Servers the test must not hand down: the portal has to find (or start) its own.
NAMED_SERVERS = ("DATABASE_URL", "CELERY_BROKER_URL", "CACHE_URL", "TEST_DATABASE_NAME", "API_LOGIN_RATE")
PERSONAS = [None, "bob", "alice", "carol", "admin"]


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(what: str, check, *, timeout_s: float, log: Path | None = None, pause_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(pause_s)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-80:]) if log else ""
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {last!r})\n{tail}")


class Portal:
    """`make run` in a fresh checkout's var/, in its own process group, as a terminal would run it."""

    def __init__(self, var_dir: Path, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.env = {k: v for k, v in os.environ.items() if k not in NAMED_SERVERS}
        self.env.update(PORTAL_VAR_DIR=str(var_dir), PYTHONUNBUFFERED="1", LOCAL_USE_NVML="false")

    def start(self) -> "Portal":
        self.process = self._make_run(self.port, self.log.open("ab"))
        _wait("the portal answers /readyz", self._ready, timeout_s=180, log=self.log)
        return self

    def _make_run(self, port: int, out) -> subprocess.Popen:
        return subprocess.Popen(
            ["make", "--no-print-directory", "run", f"PORT={port}", f"PYTHON={sys.executable}"],
            cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"make run exited with {self.process.returncode}:\n{self.log.read_text()[-5000:]}")
        try:
            return requests.get(f"{self.url}/readyz", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def shell(self, code: str) -> str:
        """`manage.py shell -c CODE` in the checkout, as a person would run it; its last line of output."""
        answer = subprocess.run([sys.executable, "manage.py", "shell", "--no-imports", "-c", code], cwd=REPO,
                                env=self.env, capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0, answer.stderr[-3000:]
        return answer.stdout.strip().splitlines()[-1]

    def ctrl_c(self) -> int:
        """What Ctrl-C in the terminal does: SIGINT to every process of the foreground group."""
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        subprocess.run([sys.executable, "-m", "portal.embedded", "stop"], cwd=REPO, env=self.env, timeout=60)


def _browser_session(base: str, username: str | None) -> requests.Session:
    """A session logged in through the login form, CSRF token and all, as a browser does."""
    session = requests.Session()
    if username is None:
        return session
    page = session.get(f"{base}/login/", timeout=30)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    answer = session.post(f"{base}/login/", data={"csrfmiddlewaretoken": token, "username": username,
                                                  "password": PASSWORD},
                          headers={"Referer": f"{base}/login/"}, allow_redirects=False, timeout=30)
    assert answer.status_code == 302, f"{username} could not log in: {answer.status_code} {answer.text[:300]}"
    return session


def _fetcher(base: str, session: requests.Session):
    def fetch(path: str) -> tuple[int, dict, str]:
        response = session.get(base + path, allow_redirects=False, timeout=60)
        return response.status_code, response.headers, response.text

    return fetch


def _api(base: str, username: str) -> requests.Session:
    session = requests.Session()
    answer = session.post(f"{base}/api/v1/auth/token/", json={"username": username, "password": PASSWORD}, timeout=30)
    assert answer.status_code == 201, answer.text
    session.headers["Authorization"] = f"Token {answer.json()['token']}"
    return session


@pytest.fixture
def portal(tmp_path):
    # var/ of its own outside pytest's temporary root, which pytest keeps private (0700) to root, while
    # the embedded PostgreSQL runs as an unprivileged user when the tests run as root.
    var_dir = Path(tempfile.mkdtemp(prefix="portal-newcomer-var-"))
    portal = Portal(var_dir, tmp_path / "make-run.log")
    yield portal
    portal.kill()
    # The local backend's job processes (the endpoint's replica) live in sessions of their own.
    kill_job_processes(var_dir / "jobs")
    shutil.rmtree(var_dir, ignore_errors=True)


def test_make_run_on_a_fresh_checkout_serves_every_page_to_every_persona(portal, tmp_path):
    portal.start()
    base = portal.url
    database = portal.shell("from django.conf import settings; print(settings.DATABASE_URL)")
    status = subprocess.run([sys.executable, "-m", "portal.embedded", "status"], cwd=REPO, env=portal.env,
                            capture_output=True, text=True, timeout=60).stdout
    assert f'"postgres": "{database}"' in status, "manage.py reached another database than the running portal's"

    # A second `make run` in the same checkout is refused and harms nothing.
    second = portal._make_run(_free_port(), (tmp_path / "second.log").open("wb"))
    assert second.wait(timeout=120) != 0
    assert "already runs from this checkout" in (tmp_path / "second.log").read_text()
    assert requests.get(f"{base}/readyz", timeout=10).status_code == 200

    # alice: an environment, a small job to the end, its checkpoint served and prompted.
    alice = _api(base, "alice")
    env = alice.post(f"{base}/api/v1/environments/", json={"tenant": "ml-research", "name": "first-try"}, timeout=30)
    assert env.status_code == 201, env.text
    env_id = env.json()["id"]
    _wait("the environment is ready", lambda: alice.get(f"{base}/api/v1/environments/{env_id}/", timeout=30)
          .json()["state"] == "ready", timeout_s=120, log=portal.log)
    job = alice.post(f"{base}/api/v1/jobs/", json={
        "tenant": "ml-research", "environment": env_id, "name": "first-job", "flavor": "h100-80gb",
        "replicas": 1, "steps": 30, "checkpoint_every_steps": 10,
        "hyperparameters": {"batch_size": 8, "seq_len": 32},
    }, timeout=30)
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    _wait("the job succeeds", lambda: alice.get(f"{base}/api/v1/jobs/{job_id}/", timeout=30)
          .json()["state"] in ("succeeded", "failed"), timeout_s=300, log=portal.log, pause_s=2)
    finished = alice.get(f"{base}/api/v1/jobs/{job_id}/", timeout=30).json()
    assert finished["state"] == "succeeded" and finished["checkpoints"], finished
    endpoint = alice.post(f"{base}/api/v1/endpoints/", json={
        "tenant": "ml-research", "environment": env_id, "name": "first-chat", "source": {"job": job_id},
        "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 1, "warm_replicas": 0,
    }, timeout=30)
    assert endpoint.status_code == 201, endpoint.text
    endpoint_id = endpoint.json()["id"]
    _wait("the endpoint is ready", lambda: alice.get(f"{base}/api/v1/endpoints/{endpoint_id}/", timeout=30)
          .json()["state"] == "ready", timeout_s=240, log=portal.log, pause_s=2)
    answer = alice.post(f"{base}/serve/ml-research/first-chat/v1/generate",
                        json={"prompt": "the ", "max_tokens": 8, "deadline_ms": 20000}, timeout=60)
    assert answer.status_code == 200 and answer.json()["tokens"], answer.text

    # Every persona follows every link: no 5xx, no error page, no debug page.
    must_see = {
        "alice": {"/tenants/ml-research/quota/", "/tenants/ml-research/usage/", f"/jobs/{job_id}/",
                  f"/endpoints/{endpoint_id}/", "/tenants/ml-research/jobs/", f"/environments/{env_id}/"},
        "admin": {"/cockpit/", "/queue/", "/usage/cluster/", "/audit/", "/quotas/", f"/jobs/{job_id}/"},
        "bob": {f"/jobs/{job_id}/", "/tenants/vision/"},
        "carol": {"/tenants/vision/quota/", "/tenants/vision/usage/"},
    }
    # The fragments the pages poll (no link leads there: the pages' scripts fetch them).
    polled = {
        "alice": [f"/jobs/{job_id}/live/", f"/endpoints/{endpoint_id}/live/", f"/environments/{env_id}/status/",
                  f"/environments/{env_id}/row/", f"/jobs/{job_id}/log/?rank=0"],
        "admin": ["/cockpit/live/", "/queue/live/", f"/jobs/{job_id}/live/", f"/endpoints/{endpoint_id}/live/"],
    }
    for username in PERSONAS:
        fetch = _fetcher(base, _browser_session(base, username))
        seen, problems = crawl(fetch, "/" if username else "/login/")
        for path in polled.get(username, []):
            status, _, text = fetch(path)
            seen[path] = status
            problems += [f"{path}: shows {mark!r}" for mark in DEBUG_MARKS if mark in text]
        must_see.setdefault(username, set()).update(polled.get(username, []))
        assert problems == [], f"{username}:\n" + "\n".join(problems)
        errors = {path: code for path, code in seen.items() if code >= 400 and code != 404}
        assert errors == {}, f"{username} reached error pages: {errors}"
        missing = {path for path in must_see.get(username, ()) if seen.get(path) != 200}
        assert missing == set(), f"{username} did not reach {missing} (seen: {sorted(seen)})"

    # The API as alice: usage in JSON and CSV (these answered 500 when make run had its own database engine).
    assert alice.get(f"{base}/api/v1/usage/?group_by=tenant,day", timeout=60).status_code == 200
    assert alice.get(f"{base}/api/v1/usage/?group_by=job&format=csv", timeout=60).status_code == 200

    # Ctrl-C stops the web server, worker, beat and the embedded servers; the data stays.
    assert portal.ctrl_c() in (0, 130, 2, -2), portal.log.read_text()[-3000:]
    after = subprocess.run([sys.executable, "-m", "portal.embedded", "status"], cwd=REPO, env=portal.env,
                           capture_output=True, text=True, timeout=60).stdout
    assert '"postgres": null' in after and '"redis": null' in after, after
    assert portal.shell(f"from runners.jobs.models import Job; print(Job.objects.get(id={job_id}).state)") == "succeeded"

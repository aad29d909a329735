"""Issue 34's newcomer run, end to end: the SDK's DDP example, run with one `portal run`, preempted by another
tenant's guarantee, resumed from its own checkpoint at the exact step, and ended `succeeded`.

A real portal as `make run` starts it (`manage.py up`: gunicorn, a Celery worker, beat, the demo data; the
local backend, script jobs in the sandbox wherever it can run: as root, with bubblewrap), on a database of
its own. alice (ml-research: 8 H100s guaranteed,
16 at most) copies sdk/examples/ddp/train.py into a folder and runs it with two replicas of 8 GPUs: all 16
H100s of the demo cluster, 8 of them borrowed. While `portal run` follows it, carol (vision: 4 guaranteed)
submits a job of 4 GPUs: the scheduler takes them back from alice's job, which checkpoints on the stop, waits
for carol's job to end and resumes from that checkpoint.
"""

import json
import re
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from runners.workloads import sandbox
from tests.cli.test_portal_command import PASSWORD, PORTAL, Cli
from tests.portal.test_newcomer import _browser_session
from tests.support.portal_up import fresh_database, started_portal

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "sdk" / "examples" / "ddp" / "train.py"
# Long enough that the preemption lands in the first attempt (it comes a few seconds after the first metrics
# line), short enough for every `make test`: on a 2-core machine loaded twentyfold (load average 21), the stop
# came at step 1047 of 2000. Every step is CPU that both ranks spend, in both attempts taken together.
STEPS = 2500
# The least a step lasts (the example's step_s), so the run takes 25 s or more however fast the machine: an idle
# one trained all 2500 steps in the ~10 s between the first metrics line the portal had and the preemption.
STEP_S = 0.01


def _wait(what: str, check, *, timeout_s: float, pause_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(pause_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _api(base: str, username: str) -> httpx.Client:
    token = httpx.post(f"{base}/api/v1/auth/token/", json={"username": username, "password": PASSWORD}, timeout=30)
    assert token.status_code == 201, token.text
    return httpx.Client(base_url=base, headers={"Authorization": f"Token {token.json()['token']}"}, timeout=30)


def _environment(api: httpx.Client, tenant: str) -> int:
    created = api.post("/api/v1/environments/", json={"tenant": tenant, "name": "train"})
    assert created.status_code == 201, created.text
    return created.json()["id"]


def _wait_ready(api: httpx.Client, env_id: int) -> None:
    _wait(f"environment {env_id} is ready", lambda: api.get(f"/api/v1/environments/{env_id}/").json()["state"]
          == "ready", timeout_s=120, pause_s=0.5)


@pytest.fixture
def portal(tmp_path):
    # The sandbox as `make run` has it where it can run (as root, with bubblewrap), on for sure.
    sandboxed = "on" if sandbox.unavailable() is None else "off"
    env = {"CELERY_BROKER_URL": settings.CELERY_BROKER_URL, "LOCAL_USE_NVML": "false", "LOCAL_SANDBOX": sandboxed}
    with fresh_database("newcomer_run") as database_url:
        with started_portal({**env, "DATABASE_URL": database_url}, tmp_path / "var") as url:
            yield url


def test_portal_run_of_the_ddp_example_is_preempted_resumes_at_the_exact_step_and_succeeds(portal, tmp_path):
    alice, carol = _api(portal, "alice"), _api(portal, "carol")
    alice_env, vision_env = _environment(alice, "ml-research"), _environment(carol, "vision")
    _wait_ready(alice, alice_env)
    _wait_ready(carol, vision_env)

    cli = Cli(tmp_path / "home")
    cli.home.mkdir()
    login = cli("login", portal, "--username", "alice", "--password-stdin", input=f"{PASSWORD}\n")
    assert login.returncode == 0, login.stderr
    folder = cli.home / "ddp-newcomer"
    folder.mkdir()
    shutil.copy(EXAMPLE, folder / "train.py")

    out, err = tmp_path / "run.out", tmp_path / "run.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        run = subprocess.Popen(
            [str(PORTAL), "run", "--replicas", "2", "--gpus", "8", "--flavor", "h100-80gb",
             "--hp", f"steps={STEPS}", "--hp", "checkpoint_every=50",
             "--hp", f"step_s={STEP_S}", "--", "python", "train.py"],
            cwd=folder, env=cli.env, stdout=stdout, stderr=stderr, text=True)
    try:
        job_id = int(_wait("portal run submits the job", lambda: re.search(r"Submitted job (\d+)", err.read_text()),
                           timeout_s=120).group(1))
        # Training: the portal has its first metrics line (so the SDK handles the stop signal by now).
        _wait("the first metrics line", lambda: alice.get(f"/api/v1/jobs/{job_id}/metrics/?points=1").json()["series"],
              timeout_s=120, pause_s=0.5)
        guarantee = carol.post("/api/v1/jobs/", json={
            "tenant": "vision", "environment": vision_env, "name": "vision-guarantee", "flavor": "h100-80gb",
            "replicas": 1, "gpus_per_replica": 4, "steps": 4, "hyperparameters": {"batch_size": 8, "seq_len": 8},
            "cpu_milli_per_replica": 1000,  # one thread: a few steps of the smallest batch
        })
        assert guarantee.status_code == 201, guarantee.text
        code = run.wait(timeout=400)
    finally:
        if run.poll() is None:
            run.kill()
    log, states = out.read_text(), err.read_text()
    assert code == 0, f"{states}\n{log}"
    assert f"job {job_id} succeeded" in states

    job = alice.get(f"/api/v1/jobs/{job_id}/").json()
    first, second = job["attempts"]
    assert (first["outcome"], first["exit_code"]) == ("preempted", 75), first
    assert "tenant vision" in first["reason"], first["reason"]
    stopped = second["resumed_from_step"]
    assert stopped is not None and 0 < stopped < STEPS, job
    assert (second["outcome"], second["exit_code"]) == ("succeeded", 0), second
    assert {stopped, STEPS} <= {checkpoint["step"] for checkpoint in job["checkpoints"]}
    # What `portal run` showed: the preemption and its reason, the wait, then the second attempt saying where it
    # resumed (the portal on stderr, the script in its log).
    assert f"job {job_id} preempted: Preempted for job vision-guarantee of tenant vision" in states, states
    assert re.search(rf"job {job_id} running: Running on .*\(resumed from step {stopped}\)", states), states
    resumed = log.index("--- attempt 2 ---")
    assert f"resuming after step {stopped}, from step-{stopped:08d}.pt" in log[resumed:], log[resumed:]

    # vision's job ran on the GPUs taken back, before alice's job could have its 16 again.
    vision = carol.get(f"/api/v1/jobs/{guarantee.json()['id']}/").json()
    assert vision["state"] == "succeeded", vision
    taken_back = vision["attempts"][0]
    assert _time(taken_back["started_at"]) >= _time(first["ended_at"])
    assert _time(second["started_at"]) >= _time(taken_back["ended_at"])

    # The loss curve goes on at the step after the checkpoint: each step once, attempt 1 up to the checkpoint's
    # step and attempt 2 from the next one (the newest attempt's record wins where a step was trained twice).
    around = alice.get(f"/api/v1/jobs/{job_id}/metrics/",
                       params={"first_step": max(1, stopped - 200), "last_step": stopped + 200}).json()
    by_step = {point["step"]: point["attempt"] for point in around["series"]}
    assert by_step[stopped] == 1 and by_step[stopped + 1] == 2, by_step
    assert all(attempt == (1 if step <= stopped else 2) for step, attempt in by_step.items()), by_step
    whole = alice.get(f"/api/v1/jobs/{job_id}/metrics/").json()
    assert (whole["first_step"], whole["last_step"]) == (1, STEPS)
    assert whole["series"][-1]["loss"] < whole["series"][0]["loss"] / 100, "it learned"

    # The job page, as alice's browser gets it, draws that curve.
    page = _browser_session(portal, "alice").get(f"{portal}/jobs/{job_id}/", timeout=60)
    assert page.status_code == 200
    assert 'data-testid="loss-chart"' in page.text and f"over steps 1 to {STEPS}" in page.text
    latest = re.search(r'data-testid="latest-step">([^<]*)<', page.text).group(1)
    assert re.fullmatch(rf"Step {STEPS}: loss \d+\.\d{{4}}", latest), latest  # a script's steps are its own
    assert json.loads(cli("status", str(job_id), "--json").stdout)["state"] == "succeeded"

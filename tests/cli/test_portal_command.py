"""The installed `portal` command against a real portal: `manage.py up` (gunicorn, a Celery worker, beat, the
demo data) on a database of its own, started once for this module.

The command runs as a person runs it, a subprocess with a config folder of its own: alice logs in, runs the
shipped trainer and follows it to its end, reads its log and downloads its checkpoint, serves the checkpoint of a
script that trains the shipped model through the SDK, cancels a second job, starts and stops a workspace,
and each kind of mistake gets its exit code and one line on stderr.
"""

import inspect
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from django.conf import settings

from runners.workloads.train import CHECKPOINT_FORMAT, VOCAB, CharModel
from tests.support.portal_up import free_port, fresh_database, ready_environment_through_api, started_portal

pytestmark = pytest.mark.e2e

PORTAL = Path(sys.executable).with_name("portal")
PASSWORD = "portal-demo"
ENVIRONMENT = "train"
# The shipped trainer, small: two checkpoints (steps 20 and 40), short sequences, one thread.
JOB_FILE = f"""
environment: {ENVIRONMENT}
name: cli-tiny
flavor: h100-80gb
template: pytorch-ddp
replicas: 1
cpu_milli_per_replica: 1000
steps: 40
checkpoint_every_steps: 20
hyperparameters:
  batch_size: 8
  seq_len: 8
"""


class Cli:
    """`portal` with a config folder of its own; no PORTAL_URL or PORTAL_TOKEN unless given."""

    def __init__(self, home: Path):
        self.home = home
        self.env = {key: value for key, value in os.environ.items() if key not in ("PORTAL_URL", "PORTAL_TOKEN")}
        self.env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), COLUMNS="200", NO_COLOR="1")

    @property
    def config_file(self) -> Path:
        return self.home / ".config" / "gpuportal" / "config.json"

    def __call__(self, *args: str, input: str | None = None, env: dict | None = None, cwd: Path | None = None,
                 timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(PORTAL), *args], input=input, env={**self.env, **(env or {})}, cwd=cwd or self.home,
                              capture_output=True, text=True, timeout=timeout)

    def json(self, *args: str, **kwargs):
        result = self(*args, "--json", **kwargs)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The command's error: exactly one line on stderr, starting with `portal: `."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("portal: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def portal(tmp_path_factory):
    env = {"CELERY_BROKER_URL": settings.CELERY_BROKER_URL, "LOCAL_USE_NVML": "false"}
    with fresh_database("cli", migrated=True) as database_url:
        with started_portal({**env, "DATABASE_URL": database_url}, tmp_path_factory.mktemp("var")) as url:
            yield url


@pytest.fixture(scope="module")
def cli(portal, tmp_path_factory):
    """alice, logged in with the command, and her environment made ready (as the Environments page makes it)."""
    run = Cli(tmp_path_factory.mktemp("home"))
    result = run("login", portal, "--username", "alice", "--password-stdin", input=f"{PASSWORD}\n")
    assert result.returncode == 0, result.stderr
    token = json.loads(run.config_file.read_text())["token"]
    ready_environment_through_api(portal, token, tenant="ml-research", name=ENVIRONMENT)
    return run


@pytest.fixture(scope="module")
def trained(cli):
    """`portal run -f job.yaml`: the shipped trainer, followed to its end. (the run's result, its job id)"""
    folder = cli.home / "project"
    folder.mkdir()
    (folder / "job.yaml").write_text(JOB_FILE)
    result = cli("run", "-f", "job.yaml", cwd=folder, timeout=600)
    submitted = re.search(r"Submitted job (\d+)", result.stderr)
    assert submitted, result.stderr
    return result, int(submitted.group(1))


def test_login_saves_the_token_for_its_owner_only_and_whoami_reads_it(cli, portal):
    assert stat.S_IMODE(cli.config_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(cli.config_file.parent.stat().st_mode) == 0o700
    saved = json.loads(cli.config_file.read_text())
    assert saved["url"] == portal and saved["username"] == "alice" and saved["token"]

    me = cli.json("whoami")
    assert me["user"] == "alice" and me["token"]["current"] is True
    assert [(tenant["slug"], tenant["my_role"]) for tenant in me["tenants"]] == [("ml-research", "owner")]
    text = cli("whoami")
    assert text.returncode == 0 and "alice" in text.stdout and "ml-research: owner" in text.stdout

    # PORTAL_URL and PORTAL_TOKEN go over the file: another user's token is that user.
    bob = httpx.post(f"{portal}/api/v1/auth/token/", json={"username": "bob", "password": PASSWORD}).json()["token"]
    assert cli.json("whoami", env={"PORTAL_TOKEN": bob})["user"] == "bob"


def test_a_wrong_password_is_exit_3_and_keeps_the_saved_login(cli, portal):
    before = cli.config_file.read_text()
    result = cli("login", portal, "-u", "alice", "--password-stdin", input="not-the-password\n")
    assert result.returncode == 3
    assert "Wrong username or password" in one_line_error(result)
    assert cli.config_file.read_text() == before


def test_logout_revokes_the_token_and_forgets_it(portal, tmp_path):
    bob = Cli(tmp_path)
    assert bob("login", portal, "-u", "bob", "--password-stdin", input=f"{PASSWORD}\n").returncode == 0
    token = json.loads(bob.config_file.read_text())["token"]
    result = bob("logout")
    assert result.returncode == 0, result.stderr
    assert "token" not in json.loads(bob.config_file.read_text())
    assert bob("whoami").returncode == 3
    revoked = bob("whoami", env={"PORTAL_URL": portal, "PORTAL_TOKEN": token})
    assert revoked.returncode == 3 and "portal login" in one_line_error(revoked)


def test_quota_lists_the_tenants_quotas(cli):
    quotas = {row["flavor"]: row for row in cli.json("quota")}
    assert (quotas["h100-80gb"]["guaranteed"], quotas["h100-80gb"]["max"]) == (8, 16)
    assert {row["tenant"] for row in quotas.values()} == {"ml-research"}
    assert "h100-80gb" in cli("quota").stdout


def test_run_follows_the_job_to_its_end_and_exits_with_its_status(cli, trained):
    result, job_id = trained
    assert result.returncode == 0, result.stderr
    assert f"job {job_id} succeeded" in result.stderr
    lines = result.stdout.splitlines()
    assert any("[rank 0/1]" in line for line in lines), result.stdout
    assert not any(line.startswith("PORTAL_") for line in lines), "progress lines are left out"
    assert len(lines) == len(set(lines)), "no line is printed twice"

    job = cli.json("status", str(job_id))
    assert (job["state"], job["name"], job["tenant"], job["flavor"]) == ("succeeded", "cli-tiny", "ml-research", "h100-80gb")
    assert job["spec"]["steps"] == 40 and job["spec"]["hyperparameters"]["batch_size"] == 8
    assert "succeeded" in cli("status", str(job_id)).stdout
    assert job_id in [row["id"] for row in cli.json("ls")]
    assert [row["id"] for row in cli.json("ls", "--state", "succeeded")] == [job_id]


def test_logs_checkpoints_and_the_steps_a_download_can_take(cli, trained):
    _, job_id = trained
    plain = cli("logs", str(job_id), "--rank", "0")
    assert plain.returncode == 0 and "[rank 0/1]" in plain.stdout and "PORTAL_METRIC" not in plain.stdout
    assert "PORTAL_METRIC" in cli("logs", str(job_id), "--progress").stdout
    assert cli.json("logs", str(job_id), "--tail", "5")["text"].count("\n") <= 5
    followed = cli("logs", "-f", str(job_id))
    assert followed.returncode == 0 and "[rank 0/1]" in followed.stdout

    steps = [row["step"] for row in cli.json("checkpoints", str(job_id))]
    assert steps == [20, 40]
    missing = cli("download", str(job_id), "--checkpoint", "7")
    assert missing.returncode == 4
    assert "steps 20, 40" in one_line_error(missing)


def test_download_saves_the_newest_checkpoint(cli, trained):
    _, job_id = trained
    result = cli("download", str(job_id), "-o", "newest.pt")
    assert result.returncode == 0, result.stderr
    newest = max(cli.json("checkpoints", str(job_id)), key=lambda row: row["step"])
    saved = cli.home / "newest.pt"
    assert saved.stat().st_size == newest["bytes"] > 0
    state = torch.load(saved, weights_only=True)  # the trainer's own checkpoint, byte for byte
    assert (state["format"], state["step"]) == (CHECKPOINT_FORMAT, newest["step"])


# A script that trains the shipped model through the SDK and checkpoints it in the format the shipped server
# loads. The model's code goes in the bundle (model.py, taken from the trainer's own source): the portal's
# runtime is not importable in the sandbox, only torch, numpy and gpuportal are.
SERVED_SCRIPT = """
import gpuportal
import torch
from model import CHECKPOINT_FORMAT, VOCAB, CharModel

ctx = gpuportal.init()
torch.set_num_threads(1)  # a 48-byte sequence: a second thread would only wait (spinning) for the first
torch.manual_seed(0)
model = CharModel()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
text = b"the cat sat on the mat. " * 2
data = torch.tensor(list(text))
for step in range(1, 31):
    logits = model(data[:-1].view(1, -1))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), data[1:])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ctx.report(step, loss=loss.item())
    if step % 15 == 0:
        ctx.checkpoint(step, {"format": CHECKPOINT_FORMAT, "step": step, "model": model.state_dict(),
                              "alphabet": torch.tensor(sorted(set(text)), dtype=torch.uint8)})
print("trained")
"""


@pytest.fixture(scope="module")
def script_trained(cli):
    """`portal run -- python train.py` of a folder whose script trains the shipped model: the script job's id."""
    folder = cli.home / "served-script"
    folder.mkdir()
    model_code = "\n".join(["import torch", "from torch import nn", "", f"VOCAB = {VOCAB}",
                             f"CHECKPOINT_FORMAT = {CHECKPOINT_FORMAT}", "", "", inspect.getsource(CharModel)])
    (folder / "model.py").write_text(model_code)
    (folder / "train.py").write_text(SERVED_SCRIPT)
    result = cli("run", "--flavor", "h100-80gb", "--", "python", "train.py", cwd=folder, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trained" in result.stdout
    return int(re.search(r"Submitted job (\d+)", result.stderr).group(1))


def test_a_script_jobs_checkpoint_downloads_and_serves_until_ready(cli, script_trained, portal):
    job_id = script_trained
    assert [row["step"] for row in cli.json("checkpoints", str(job_id))] == [15, 30]
    downloaded = cli("download", str(job_id), "-o", "script.pt")
    assert downloaded.returncode == 0, downloaded.stderr
    assert torch.load(cli.home / "script.pt", weights_only=True)["step"] == 30  # what the script saved, whole
    endpoint = cli.json("serve", str(job_id), "--name", "cli-chat", "--step", "30")
    assert (endpoint["state"], endpoint["name"], endpoint["source"]) == ("ready", "cli-chat", {"job": job_id, "step": 30})
    token = json.loads(cli.config_file.read_text())["token"]
    answer = httpx.post(f"{endpoint['url']}/v1/generate", headers={"Authorization": f"Token {token}"},
                        json={"prompt": "the ", "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200, answer.text
    again = cli("serve", str(job_id), "--name", "cli-chat")
    assert again.returncode == 2 and "cli-chat" in one_line_error(again)
    # Stopped: its replica would otherwise serve (and be probed) for the rest of the module.
    stopped = httpx.post(f"{portal}/api/v1/endpoints/{endpoint['id']}/stop/", headers={"Authorization": f"Token {token}"},
                         timeout=60)
    assert stopped.status_code in (200, 202), stopped.text


def test_a_repeated_submit_with_one_key_is_one_job_and_cancel_ends_it(cli, trained):
    folder = cli.home / "project"
    first = cli.json("run", "-f", "job.yaml", "--name", "cli-long", "--steps", "100000", "-d",
                     "--idempotency-key", "cli-test-key-1", cwd=folder)
    second = cli.json("run", "-f", "job.yaml", "--name", "cli-long", "--steps", "100000", "-d",
                      "--idempotency-key", "cli-test-key-1", cwd=folder)
    assert first["id"] == second["id"] and first["name"] == "cli-long"

    cancelled = cli.json("cancel", str(first["id"]))
    assert cancelled["state"] in ("cancelling", "cancelled")
    followed = cli("logs", "-f", str(first["id"]))
    assert followed.returncode == 1, followed.stderr
    assert f"job {first['id']} cancelled" in followed.stderr
    again = cli("cancel", str(first["id"]))
    assert again.returncode == 2
    one_line_error(again)


def test_usage_reads_a_month(cli, trained):
    rows = cli.json("usage", "--group-by", "tenant,kind")
    assert all(row["tenant"] == "ml-research" for row in rows)
    assert cli.json("usage", "--month", "2020-01") == []
    bad = cli("usage", "--month", "2026-13")
    assert bad.returncode == 2 and "YYYY-MM" in one_line_error(bad)


def test_kubeconfig_on_the_local_backend_is_refused_in_one_line(cli):
    result = cli("kubeconfig", ENVIRONMENT)
    assert result.returncode == 2
    assert "local backend" in one_line_error(result)
    unknown = cli("kubeconfig", "no-such-environment")
    assert unknown.returncode == 4 and "no environment named 'no-such-environment'" in one_line_error(unknown)


def test_exit_codes_say_what_went_wrong(cli, trained):
    _, job_id = trained
    # 4: no such job (or another tenant's).
    unknown = cli("status", "999999")
    assert unknown.returncode == 4
    one_line_error(unknown)
    # 3: a token the portal refuses, or no login at all.
    refused = cli("ls", env={"PORTAL_TOKEN": "not-a-token"})
    assert refused.returncode == 3 and "portal login" in one_line_error(refused)
    stranger = Cli(cli.home / "stranger")
    stranger.home.mkdir()
    nobody = stranger("ls")
    assert nobody.returncode == 3 and "portal login URL" in one_line_error(nobody)
    # 2: bad input, the command line's or the portal's 400 naming the field.
    flavor = cli("run", "-f", "job.yaml", "--flavor", "no-such-flavor", "-d", cwd=cli.home / "project")
    assert flavor.returncode == 2 and "flavor" in one_line_error(flavor)
    rank = cli("logs", str(job_id), "--rank", "5")
    assert rank.returncode == 2 and "rank" in one_line_error(rank)
    assert cli("status", "not-a-number").returncode == 2
    state = cli("ls", "--state", "sleeping")
    assert state.returncode == 2 and "state" in one_line_error(state)
    (cli.home / "broken.yaml").write_text("flavor: [h100\n")
    broken = cli("run", "-f", "broken.yaml")
    assert broken.returncode == 2 and "not valid YAML" in one_line_error(broken)
    # 5: nothing answers at the URL.
    down = cli("ls", env={"PORTAL_URL": f"http://127.0.0.1:{free_port()}"})
    assert down.returncode == 5 and "cannot reach" in one_line_error(down)


def test_models_promote_lists_and_shows_a_versions_lineage(cli, trained):
    _, job_id = trained
    promoted = cli("models", "promote", str(job_id), "40", "tiny")
    assert promoted.returncode == 0, promoted.stderr
    assert promoted.stdout.strip() == "tiny:1" and "kept in the model store" in promoted.stderr
    # Listed with any others of the tenant's (an endpoint served from a job's checkpoint promotes one too).
    assert ("tiny", 1) in [(m["name"], m["newest"]) for m in cli.json("models", "ls")]
    version = cli.json("models", "show", "tiny:1")
    assert (version["job"]["id"], version["step"], version["lineage"]["hyperparameters"]["batch_size"]) == (
        job_id, 40, 8)
    shown = cli("models", "show", "tiny:1")
    assert shown.returncode == 0 and "cli-tiny" in shown.stdout and version["weights"]["sha256"] in shown.stdout
    # 4: a model or version that does not exist, the field named.
    missing = cli("models", "show", "nope")
    assert missing.returncode == 4 and "model" in one_line_error(missing)
    missing = cli("models", "show", "tiny:9")
    assert missing.returncode == 4 and "version" in one_line_error(missing)


SCRIPT = """
import json, os, sys
print("files", sorted(os.listdir(".")))
print("argv", sys.argv[1:])
print("hyperparameters", json.loads(os.environ.get("PORTAL_HYPERPARAMETERS") or "{}"))
"""


def test_run_uploads_this_folder_once_and_runs_its_command_there(cli):
    folder = cli.home / "my-script"
    (folder / "data").mkdir(parents=True)
    (folder / "train.py").write_text(SCRIPT)
    (folder / "fail.py").write_text("import sys\nprint('giving up')\nsys.exit(3)\n")
    (folder / "data" / "big.bin").write_bytes(b"0" * 1000)
    (folder / "secret.txt").write_text("not for the portal\n")
    (folder / ".gitignore").write_text("data/\n")
    (folder / ".portalignore").write_text("secret.txt\n")

    result = cli("run", "--flavor", "h100-80gb", "--hp", "lr=0.01", "--", "python", "train.py", "--epochs", "3",
                 cwd=folder, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Uploaded my-script" in result.stderr
    assert "files ['.gitignore', '.portalignore', 'fail.py', 'train.py']" in result.stdout
    assert "argv ['--epochs', '3']" in result.stdout
    assert "'lr': 0.01" in result.stdout
    job_id = int(re.search(r"Submitted job (\d+)", result.stderr).group(1))
    job = cli.json("status", str(job_id))
    assert (job["name"], job["spec"]["template"], job["spec"]["command"]) == (
        "my-script", "script", ["python", "train.py", "--epochs", "3"])

    # With --json, stdout is the ended job's JSON alone and the log goes to stderr.
    failed = cli("run", "--flavor", "h100-80gb", "--name", "my-script-fails", "--json", "--", "python", "fail.py",
                 cwd=folder, timeout=600)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "The portal has this code already" in failed.stderr and "Uploaded" not in failed.stderr
    assert "giving up" in failed.stderr
    ended = json.loads(failed.stdout)
    assert (ended["name"], ended["state"]) == ("my-script-fails", "failed")
    assert ended["attempts"][-1]["exit_code"] == 3


def test_storage_shows_usage_previews_a_policy_and_saves_it(cli, trained):
    _, job_id = trained
    shown = cli.json("storage", "show")
    assert shown["tenant"] == "ml-research" and shown["used_bytes"] >= 0 and shown["can_set_retention"] is True
    preview = cli.json("storage", "preview", "--keep-newest", "1", "--job", str(job_id))
    # A finished job keeps only its newest: what it would delete is among its earlier steps, nothing is saved.
    assert all(item["job"] == job_id and 40 not in item["steps"] for item in preview["jobs"])
    assert cli.json("storage", "show")["retention"] == shown["retention"]
    saved = cli("storage", "set-retention", "--keep-every", "1000")
    assert saved.returncode == 0 and "every 1000" in saved.stderr, saved.stderr
    assert cli.json("storage", "show")["retention"]["keep_every"] == 1000
    assert "keep every 1000" in cli("storage", "show").stdout
    assert cli("storage", "set-retention").returncode == 0  # no rule: keep everything again
    assert cli("storage", "preview", "--keep-newest", "-1").returncode == 2


DATASET_SCRIPT = """\
import gpuportal

ctx = gpuportal.init()
data = ctx.dataset("corpus")
samples = size = 0
for sample in data.samples(rank=ctx.rank, world_size=ctx.world_size):
    samples += 1
    size += sum(len(value) for key, value in sample.items() if not key.startswith("__"))
print(f"read {samples} samples, {size} bytes of corpus version {data.version}", flush=True)
"""


def test_a_pushed_dataset_is_read_by_the_job_that_names_it(cli):
    """A newcomer's data path: `portal data push`, then `portal run --dataset`: the script reads every sample
    from its node's cache through ctx.dataset, and the portal records which version the job read."""
    data = cli.home / "corpus"
    data.mkdir()
    for n in range(30):
        (data / f"doc-{n:03}.txt").write_bytes(bytes([65 + n % 26]) * (50_000 + n))
    pushed = cli.json("data", "push", str(data), "corpus", "--shard-mb", "1")
    assert pushed["number"] == 1 and pushed["shards"] >= 2, pushed

    folder = cli.home / "reader"
    folder.mkdir()
    (folder / "read.py").write_text(DATASET_SCRIPT)
    result = cli("run", "--flavor", "h100-80gb", "--dataset", "corpus", "--", "python", "read.py", cwd=folder,
                 timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    expected = sum(50_000 + n for n in range(30))
    assert f"read 30 samples, {expected} bytes of corpus version 1" in result.stdout
    job = cli.json("status", re.search(r"Submitted job (\d+)", result.stderr).group(1))
    assert job["spec"]["datasets"] == [{"name": "corpus", "version": 1}]
    shown = cli("data", "show", "corpus:1")
    assert shown.returncode == 0 and "not read yet" not in shown.stdout, shown.stdout + shown.stderr


def test_a_workspace_starts_prints_its_url_which_answers_only_its_owner_and_stops(cli, portal):
    result = cli("workspace", "start", "--environment", ENVIRONMENT, "--flavor", "t4-shared", timeout=600)
    assert result.returncode == 0, result.stderr
    url = result.stdout.strip().splitlines()[-1]
    assert url.startswith(portal) and url.endswith("/lab"), result.stdout
    token = json.loads(cli.config_file.read_text())["token"]
    # JupyterLab through the edge of `manage.py up`, with alice's own credentials; nobody else's.
    page = httpx.get(url, headers={"Authorization": f"Token {token}"}, timeout=30)
    assert page.status_code == 200 and "JupyterLab" in page.text, page.text[:500]
    assert httpx.get(url, timeout=30).status_code == 404
    [workspace] = [w for w in cli.json("workspace", "ls") if w["name"] == "notebook"]
    assert workspace["state"] == "ready" and workspace["owner"] == "alice"
    again = cli("workspace", "start")  # it runs: the same workspace, its URL again
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == url, again.stderr
    stopped = cli("workspace", "stop", str(workspace["id"]))
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.split()[-1] in ("stopping", "stopped"), stopped.stdout
    missing = cli("workspace", "start", "--name", "nope")
    assert missing.returncode == 2 and "--environment and --flavor" in one_line_error(missing)

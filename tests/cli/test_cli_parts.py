"""The `portal` command's parts that need no portal: the job file and its flags, the config file, exit codes,
error lines, following a log's new lines, months, choosing a checkpoint and naming its file (against a portal
played by httpx's MockTransport), and the command line's own checks."""

import stat
from pathlib import Path

import httpx
import pytest
from gpuportal.cli import commands as cli_app
from gpuportal.cli import config as config_file
from gpuportal.cli import follow, jobfile
from gpuportal.client import Client, PortalError, error_message, exit_code_for_status

pytestmark = pytest.mark.unit


# --- The job file -------------------------------------------------------------


def test_a_job_file_holds_the_apis_fields(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("tenant: ml-research\nflavor: h100-80gb\nreplicas: 2\nhyperparameters:\n  lr: 0.001\n")
    assert jobfile.load(path) == {"tenant": "ml-research", "flavor": "h100-80gb", "replicas": 2,
                                  "hyperparameters": {"lr": 0.001}}
    path.write_text("")
    assert jobfile.load(path) == {}


@pytest.mark.parametrize("text, says", [
    ("- just\n- a list\n", "must be a mapping"),
    ("flavor: [h100\n", "line 2 is not valid YAML"),
    ("1: one\n", "must be a mapping"),
])
def test_a_job_file_of_another_shape_is_bad_input_naming_the_file(tmp_path, text, says):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(PortalError) as caught:
        jobfile.load(path)
    assert caught.value.exit_code == 2 and says in caught.value.message and str(path) in caught.value.message


def test_a_missing_job_file_is_bad_input(tmp_path):
    with pytest.raises(PortalError) as caught:
        jobfile.load(tmp_path / "nope.yaml")
    assert caught.value.exit_code == 2 and "nope.yaml" in caught.value.message


def test_flags_go_over_the_file_and_flags_not_given_leave_it():
    spec = jobfile.merge({"flavor": "t4-shared", "replicas": 4, "steps": 10},
                         {"flavor": "h100-80gb", "replicas": None, "gpus_per_replica": 2})
    assert spec == {"flavor": "h100-80gb", "replicas": 4, "steps": 10, "gpus_per_replica": 2}


def test_hyperparameters_and_env_merge_key_by_key():
    spec = jobfile.merge({"hyperparameters": {"lr": 0.1, "seed": 1}, "env": {"A": "1"}}, {},
                         hyperparameters={"lr": 0.01}, env={"B": "2"})
    assert spec["hyperparameters"] == {"lr": 0.01, "seed": 1} and spec["env"] == {"A": "1", "B": "2"}
    with pytest.raises(PortalError, match="hyperparameters: a mapping"):
        jobfile.merge({"hyperparameters": [1, 2]}, {}, hyperparameters={"lr": 1})


def test_a_command_makes_a_script_job_unless_a_template_is_named():
    assert jobfile.merge({}, {}, command=["python", "train.py"]) == {
        "command": ["python", "train.py"], "template": "script"}
    assert jobfile.merge({"command": ["python", "old.py"]}, {}, command=["python", "new.py"])["command"] == [
        "python", "new.py"]
    assert jobfile.merge({"template": "custom", "command": ["serve", 8080]}, {}) == {
        "template": "custom", "command": ["serve", "8080"]}
    assert "template" not in jobfile.merge({"flavor": "h100-80gb"}, {})


@pytest.mark.parametrize("command, says", [("python train.py", "never a shell string"), ([], "non-empty list")])
def test_a_command_is_a_list_of_arguments(command, says):
    with pytest.raises(PortalError) as caught:
        jobfile.merge({"command": command}, {})
    assert caught.value.exit_code == 2 and caught.value.message.startswith("command: ") and says in caught.value.message


def test_assignments_read_their_values_as_yaml():
    assert jobfile.parse_assignments(["lr=0.001", "name=run-1", "warm=true", "empty="], "--hp") == {
        "lr": 0.001, "name": "run-1", "warm": True, "empty": ""}
    assert jobfile.parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(PortalError, match="--hp 'lr': give KEY=VALUE"):
        jobfile.parse_assignments(["lr"], "--hp")
    with pytest.raises(PortalError, match="--env '=1'"):
        jobfile.parse_env(["=1"])


def test_datasets_are_named_with_an_optional_version():
    assert jobfile.parse_datasets(["images", "acme/text:3", "audio:latest"]) == [
        {"name": "images"}, {"name": "acme/text", "version": 3}, {"name": "audio"}]
    for wrong in ["", "images:", "images:0", "images:v2"]:
        with pytest.raises(PortalError, match="--dataset"):
            jobfile.parse_datasets([wrong])


@pytest.mark.parametrize("folder, name", [
    ("My Project_2", "my-project-2"), ("___", "job"), ("x" * 50, "x" * 40), ("a" * 39 + "-b", "a" * 39)])
def test_a_job_is_named_after_its_folder(tmp_path, folder, name):
    (tmp_path / folder).mkdir()
    assert jobfile.job_name(tmp_path / folder) == name


# --- The config file ----------------------------------------------------------


def test_the_config_file_is_its_owners_only_and_replaces_a_wider_one(tmp_path):
    path = tmp_path / "gpuportal" / "config.json"
    config_file.save(config_file.Config(url="http://portal", token="secret", username="alice"), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.chmod(0o644)
    config_file.save(config_file.Config(url="http://portal", token="other"), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert config_file.load(path) == config_file.Config(url="http://portal", token="other")
    assert [entry.name for entry in path.parent.iterdir()] == ["config.json"]


def test_the_config_file_is_found_in_the_xdg_config_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert config_file.config_path() == tmp_path / "gpuportal" / "config.json"


def test_portal_url_and_token_go_over_the_file(tmp_path):
    path = tmp_path / "config.json"
    config_file.save(config_file.Config(url="http://saved", token="saved-token", tenant="vision"), path)
    assert config_file.effective({}, path) == config_file.Config(url="http://saved", token="saved-token",
                                                                 tenant="vision")
    over = config_file.effective({"PORTAL_URL": "http://env", "PORTAL_TOKEN": "env-token"}, path)
    assert (over.url, over.token, over.tenant) == ("http://env", "env-token", "vision")


def test_a_broken_config_file_is_named_with_what_to_do(tmp_path):
    path = tmp_path / "config.json"
    assert config_file.load(path) == config_file.Config()
    path.write_text("{not json")
    with pytest.raises(PortalError) as caught:
        config_file.load(path)
    assert caught.value.exit_code == 2 and str(path) in caught.value.message and "portal login" in caught.value.message


def test_no_login_is_exit_3_saying_how_to_log_in():
    with pytest.raises(PortalError) as caught:
        config_file.require_login(config_file.Config())
    assert caught.value.exit_code == 3 and "portal login URL" in caught.value.message
    with pytest.raises(PortalError) as caught:
        config_file.require_login(config_file.Config(url="http://portal"))
    assert caught.value.exit_code == 3 and "portal login http://portal" in caught.value.message
    assert config_file.require_login(config_file.Config(url="http://portal", token="t")) == ("http://portal", "t")


# --- Exit codes and error lines -----------------------------------------------


@pytest.mark.parametrize("status, code", [
    (400, 2), (409, 2), (413, 2), (415, 2), (401, 3), (403, 3), (404, 4), (410, 4), (429, 5), (500, 5), (503, 5)])
def test_http_statuses_map_to_exit_codes(status, code):
    assert exit_code_for_status(status) == code


def _answer(status: int, body=None, headers=None, content: bytes | None = None) -> httpx.Response:
    request = httpx.Request("POST", "http://portal/api/v1/jobs/")
    if content is not None:
        return httpx.Response(status, content=content, headers=headers, request=request)
    return httpx.Response(status, json=body, headers=headers, request=request)


@pytest.mark.parametrize("answer, line", [
    (_answer(400, {"flavor": ["Tenant acme has no quota for flavor x."]}), "flavor: Tenant acme has no quota for flavor x."),
    (_answer(400, {"topology": {"level": ["Not a valid choice."]}}), "topology: level: Not a valid choice."),
    (_answer(409, {"detail": "Job 5 is already succeeded."}), "Job 5 is already succeeded."),
    (_answer(401, {"detail": "Invalid token."}),
     "Invalid token. (log in again with `portal login URL`, or set PORTAL_TOKEN)"),
    (_answer(503, {"detail": "The database is away."}, {"Retry-After": "5"}), "The database is away. (try again in 5 s)"),
    (_answer(502, content=b"<html>Bad gateway</html>"), "POST /api/v1/jobs/ answered 502 Bad Gateway"),
    (_answer(400, {"name": ["Line one.\nLine two."]}), "name: Line one. Line two."),
])
def test_an_error_answer_is_one_line_saying_what_and_what_to_do(answer, line):
    assert error_message(answer) == line


# --- Following a log ----------------------------------------------------------


@pytest.mark.parametrize("previous, current, whole, new", [
    ([], ["a", "b"], True, ["a", "b"]),
    (["a", "b"], ["a", "b", "c"], True, ["c"]),
    (["a", "b"], ["a", "b"], True, []),
    (["a", "b"], ["a", "bc", "d"], True, ["bc", "d"]),  # its last line grew: given again whole
    (["a", "b", "c"], ["b", "c", "d", "e"], False, ["d", "e"]),  # a window that moved on
    (["x", "x"], ["x", "x", "x"], True, ["x"]),  # the same line again is a new line
    (["a", "b"], ["c", "d"], False, None),  # more came than one answer holds
])
def test_new_lines_are_told_from_old_ones(previous, current, whole, new):
    assert follow.new_lines(previous, current, whole=whole) == new


def test_a_follower_prints_each_line_once_across_attempts_and_leaves_progress_lines_out():
    answers = iter([
        {"attempt": 1, "text": "start\nPORTAL_METRIC {\"step\": 1}\n"},
        {"attempt": 1, "text": "start\nPORTAL_METRIC {\"step\": 1}\nstep 1\n"},
        {"attempt": 2, "text": "resumed\n"},
        {"attempt": 2, "text": "resumed\n"},
    ])
    follower = follow.LogFollower(lambda tail: next(answers))
    assert follower.poll() == ["start"]
    assert follower.poll() == ["step 1"]
    assert follower.poll() == ["--- attempt 2 ---", "resumed"]
    assert follower.poll() == []


def test_a_follower_reads_more_when_the_short_answer_misses_lines():
    full = [f"line {n}" for n in range(follow.TAIL_LINES * 3)]
    asked = []

    def fetch(tail):
        asked.append(tail)
        lines = full[:follow.TAIL_LINES] if len(asked) == 1 else full
        return {"attempt": 1, "text": "\n".join(lines[-tail:]) + "\n"}

    follower = follow.LogFollower(fetch)
    assert follower.poll() == full[:follow.TAIL_LINES]
    assert follower.poll() == full[follow.TAIL_LINES:]
    assert asked == [follow.TAIL_LINES, follow.TAIL_LINES, follow.TAIL_LINES_MAX]


@pytest.mark.parametrize("state, code", [
    ("succeeded", 0), ("failed", 1), ("cancelled", 1), ("running", None), ("queued", None), ("cancelling", None)])
def test_a_jobs_state_is_its_exit_code_once_final(state, code):
    assert follow.exit_code(state) == code


# --- Months, checkpoints ------------------------------------------------------


@pytest.mark.parametrize("month, days", [
    ("2026-02", ("2026-02-01", "2026-02-28")), ("2028-02", ("2028-02-01", "2028-02-29")),
    ("2026-12", ("2026-12-01", "2026-12-31")), (None, ("2026-04-01", "2026-04-30"))])
def test_a_month_is_its_first_and_last_day(month, days):
    import datetime

    assert cli_app.month_range(month, today=datetime.date(2026, 4, 17)) == days


@pytest.mark.parametrize("month", ["2026-13", "April", "2026-4-1"])
def test_a_month_not_written_yyyy_mm_is_bad_input(month):
    with pytest.raises(PortalError) as caught:
        cli_app.month_range(month)
    assert caught.value.exit_code == 2 and caught.value.message.startswith(f"--month {month!r}")


def test_a_checkpoint_is_the_newest_unless_a_step_is_given():
    job = {"id": 7, "state": "succeeded", "checkpoints": [{"step": 20}, {"step": 40}, {"step": 30}]}
    assert cli_app.choose_checkpoint(job, None) == {"step": 40}
    assert cli_app.choose_checkpoint(job, 20) == {"step": 20}
    with pytest.raises(PortalError) as caught:
        cli_app.choose_checkpoint(job, 25)
    assert caught.value.exit_code == 4 and "steps 20, 40, 30" in caught.value.message
    with pytest.raises(PortalError) as caught:
        cli_app.choose_checkpoint({"id": 8, "state": "running", "checkpoints": []}, None)
    assert caught.value.exit_code == 4 and "job 8 has no checkpoint yet (it is running)" == caught.value.message


@pytest.mark.parametrize("disposition, name", [
    ('attachment; filename="tiny-7-step-40.tar.gz"', "tiny-7-step-40.tar.gz"),
    ("attachment; filename*=utf-8''caf%C3%A9-7-step-40.pt", "café-7-step-40.pt"),
    ('attachment; filename="../../.ssh/authorized_keys"', "authorized_keys"),
    ('attachment; filename="C:\\Users\\x\\step.pt"', "step.pt"),
    ('attachment; filename=".bashrc"', "bashrc"),
    ('attachment; filename=".."', None),
    ('attachment; filename="a/"', None),
    ("attachment", None),
    ("", None),
    (None, None),
])
def test_the_portals_file_name_is_taken_bare(disposition, name):
    assert cli_app.checkpoint_file_name(disposition) == name


ARCHIVE = b"\x1f\x8b a folder checkpoint, packed"
JOB = {"id": 7, "name": "tiny", "state": "succeeded"}
FOLDER_ROW = {"step": 40, "bytes": 4096, "uri": "file:///checkpoints/7/step-40.pt"}


def _portal_client(disposition: str | None, status: int = 200) -> Client:
    """A Client whose requests a MockTransport answers as the portal does a checkpoint download."""
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/jobs/7/checkpoints/40/download/"
        if status != 200:
            return httpx.Response(status, json={"detail": "Job tiny #7 deleted its checkpoint of step 40."})
        headers = {"Content-Disposition": disposition} if disposition is not None else {}
        return httpx.Response(200, content=ARCHIVE, headers={"Content-Type": "application/gzip", **headers})

    client = Client("http://portal.test", "token")
    client.http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(answer))
    return client


def test_a_folder_checkpoint_is_saved_under_the_portals_name_not_the_records_suffix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with _portal_client('attachment; filename="tiny-7-step-40.tar.gz"') as client:
        saved, size = cli_app.save_checkpoint(client, JOB, FOLDER_ROW, None)
        assert client.http.event_hooks["response"] == []  # the download's own hook is gone
    assert (saved, size) == (Path("tiny-7-step-40.tar.gz"), len(ARCHIVE))
    assert [path.name for path in tmp_path.iterdir()] == ["tiny-7-step-40.tar.gz"]
    assert (tmp_path / saved).read_bytes() == ARCHIVE


def test_o_names_the_file_or_the_folder_it_goes_in(tmp_path):
    with _portal_client('attachment; filename="tiny-7-step-40.tar.gz"') as client:
        saved, _ = cli_app.save_checkpoint(client, JOB, FOLDER_ROW, tmp_path / "mine.tgz")
        assert saved == tmp_path / "mine.tgz" and saved.read_bytes() == ARCHIVE
        (tmp_path / "into").mkdir()
        saved, _ = cli_app.save_checkpoint(client, JOB, FOLDER_ROW, tmp_path / "into")
        assert saved == tmp_path / "into" / "tiny-7-step-40.tar.gz" and saved.read_bytes() == ARCHIVE
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["into", "mine.tgz", "tiny-7-step-40.tar.gz"]


def test_a_name_with_folders_stays_in_the_folder_and_no_name_falls_back_to_the_records_suffix(tmp_path):
    (tmp_path / "into").mkdir()
    with _portal_client('attachment; filename="../escaped.tar.gz"') as client:
        saved, _ = cli_app.save_checkpoint(client, JOB, FOLDER_ROW, tmp_path / "into")
    assert saved == tmp_path / "into" / "escaped.tar.gz" and not (tmp_path / "escaped.tar.gz").exists()
    with _portal_client(None) as client:
        saved, _ = cli_app.save_checkpoint(client, JOB, FOLDER_ROW, tmp_path / "into")
    assert saved == tmp_path / "into" / "tiny-7-step-40.pt"


def test_a_refused_download_leaves_no_file(tmp_path):
    with _portal_client(None, status=404) as client, pytest.raises(PortalError) as caught:
        cli_app.save_checkpoint(client, JOB, FOLDER_ROW, tmp_path)
    assert caught.value.exit_code == 4 and "deleted its checkpoint of step 40" in caught.value.message
    assert list(tmp_path.iterdir()) == []


# --- The command line's own checks (nothing reaches a portal) -----------------


@pytest.fixture
def portal(tmp_path, monkeypatch, capsys):
    """`portal ARGS` in this process with an empty config folder: (exit code, stdout, stderr)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("PORTAL_URL", raising=False)
    monkeypatch.delenv("PORTAL_TOKEN", raising=False)

    def run(*args: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exited:
            cli_app.main(list(args))
        captured = capsys.readouterr()
        return exited.value.code, captured.out, captured.err

    return run


@pytest.mark.parametrize("args, code, says", [
    (["status", "not-a-number"], 2, "Invalid value for 'job_id'"),
    (["status", "0"], 2, "Invalid value for 'job_id'"),
    (["logs"], 2, "Missing argument 'job_id'. (see `portal logs --help`)"),
    (["no-such-command"], 2, "No such command 'no-such-command'"),
    (["logs", "-f", "--json", "5"], 2, "--follow: follows the newest attempt"),
    (["run", "--", "python", "train.py"], 2, "--flavor: which GPUs"),
    (["run", "--flavor", "h100-80gb", "--hp", "lr"], 2, "--hp 'lr': give KEY=VALUE"),
    (["login", "portal.example.com"], 2, "http:// or https://"),
    (["whoami"], 3, "run `portal login URL`"),
    (["ls"], 3, "run `portal login URL`"),
    (["usage", "--month", "May"], 2, "--month 'May'"),
])
def test_the_command_line_is_checked_before_anything_is_sent_and_errors_are_one_line(portal, args, code, says):
    exit_code, out, err = portal(*args)
    assert exit_code == code, err
    assert out == "" and err.count("\n") == 1 and err.startswith("portal: ")
    assert says in err


def test_every_command_has_help_and_completion_is_offered(portal):
    exit_code, out, _ = portal("--help")
    assert exit_code == 0
    for command in ("login", "whoami", "quota", "run", "ls", "status", "logs", "cancel", "checkpoints", "download",
                    "serve", "usage", "kubeconfig"):
        assert command in out
        assert portal(command, "--help")[0] == 0
    assert "--install-completion" in out

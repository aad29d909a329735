"""The API walk-through in docs/api.md, run line by line and as written against a portal started as `make run` starts it.

`manage.py up` (migrate, demo, gunicorn, a worker and beat) on a fresh database of its own, the test's Redis.
The database is a copy of the suite's migrated template, so `up`'s migrate finds nothing to do: what the block
needs is the running portal, and `up` migrating an empty database is shown by tests/cli/test_newcomer_run.py
and tests/portal/test_serving.py. The block runs in bash with `set -euo pipefail`, so the first line that fails (its curl answered 4xx or 5xx)
stops it and is named.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from tests.support.portal_up import REPO, fresh_database, started_portal

pytestmark = pytest.mark.e2e

API_DOCS = REPO / "docs" / "api.md"
# Run as a script: stop at the first failing line and name it; echo each line as it runs.
PREAMBLE = """set -euo pipefail
trap 'echo "FAILED (exit $?) at walk-through line $LINENO: $BASH_COMMAND" >&2' ERR
set -v
"""


def walkthrough() -> str:
    """The first sh block under the walk-through's heading, as written."""
    section = API_DOCS.read_text().split("## The walk-through", 1)[1]
    return re.search(r"^```sh\n(.*?)^```$", section, re.S | re.M).group(1)


def test_the_walkthrough_block_is_found_and_waits_the_way_a_user_would():
    block = walkthrough()
    assert block.startswith("PORTAL=")
    # Asynchronous work (an environment, a partition change, a job, an endpoint) is waited for in the block.
    assert len(re.findall(r"^until \[", block, re.M)) >= 4


def test_the_walkthrough_runs_as_written_against_a_portal_started_by_manage_py_up(tmp_path):
    block = walkthrough()
    work = tmp_path / "work"
    work.mkdir()
    # The block's `python3` (its `field` reads every answer; its waits poll once a second) is found first in the
    # folder of the interpreter running the tests: a version manager's shim on PATH (pyenv's runs bash scripts
    # to find the interpreter) costs more than the call itself.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env_overrides = {
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "LOCAL_USE_NVML": "false",  # the demo cluster only, whatever this machine holds
    }
    with fresh_database("walkthrough", migrated=True) as database_url:
        env_overrides["DATABASE_URL"] = database_url
        with started_portal(env_overrides, tmp_path / "var") as url:
            port = url.rsplit(":", 1)[1]
            try:
                result = subprocess.run(
                    ["bash", "-c", PREAMBLE + block], cwd=work, env={**os.environ, "PORT": port, "PATH": path},
                    capture_output=True, text=True, timeout=600,
                )
            except subprocess.TimeoutExpired as exc:
                output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
                pytest.fail(f"The walk-through did not finish in {exc.timeout} s; its output:\n{output[-20000:]}")
            assert result.returncode == 0, f"stdout:\n{result.stdout[-15000:]}\nstderr:\n{result.stderr[-15000:]}"
    # The job's log, downloaded by the block, holds the trainer's lines.
    (log,) = work.glob("job-*-rank-0.log")
    assert log.read_text().strip()

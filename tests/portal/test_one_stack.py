"""One database engine and one broker in the code, the tests and production: PostgreSQL and Redis.

No branch for another database (SQLite) or broker (kombu's filesystem transport, an in-process cache)
may come back: such a branch is code no test reaches, which is how `make run` once served 500s.
"""

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
OTHER_STACKS = re.compile(r"sqlite|filesystem://|locmem://|connection\.vendor|\.vendor\s*[!=]=", re.IGNORECASE)


def test_no_code_branches_on_another_database_or_broker():
    files = subprocess.run(["git", "ls-files", "*.py", "*.toml", "Makefile", "Dockerfile", "*.yaml", "*.yml"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in files:
        if name == "tests/portal/test_one_stack.py" or not (REPO / name).exists():
            continue
        for number, line in enumerate((REPO / name).read_text(errors="replace").splitlines(), 1):
            if OTHER_STACKS.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_settings_refuse_another_database_or_broker(tmp_path):
    import os
    import sys

    for variable, value in (("DATABASE_URL", f"sqlite:///{tmp_path}/x.sqlite3"), ("CELERY_BROKER_URL", "filesystem://")):
        env = {**os.environ, "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/portal",
               "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0", variable: value, "PORTAL_VAR_DIR": str(tmp_path)}
        answer = subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        assert answer.returncode != 0 and variable in answer.stderr, answer.stderr[-2000:]

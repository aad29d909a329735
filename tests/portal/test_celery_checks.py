"""Celery's workers and beat leave Django's system checks to `manage.py migrate`, which ran them on the same
settings first; an operator who sets CELERY_SKIP_CHECKS empty gets them in every worker again."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# What Celery's Django fixup does at a worker's or beat's start, after the app (`-A portal`) is loaded.
PROBE = """
import django.core.checks
ran = []
django.core.checks.run_checks = lambda *args, **kwargs: ran.append(1) or []
import portal.celery
from celery.fixups.django import DjangoWorkerFixup
DjangoWorkerFixup(portal.celery.app).validate_models()
print(len(ran))
"""


def _checks_run(**env) -> int:
    environment = {key: value for key, value in os.environ.items() if key != "CELERY_SKIP_CHECKS"}
    answer = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**environment, **env},
                            capture_output=True, text=True, timeout=120)
    assert answer.returncode == 0, answer.stderr
    return int(answer.stdout.split()[-1])


def test_a_worker_leaves_the_checks_to_migrate_unless_told_otherwise():
    assert _checks_run() == 0
    assert _checks_run(CELERY_SKIP_CHECKS="") == 1

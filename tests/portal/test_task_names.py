"""Celery tasks are found by the name their messages carry: every name is explicit, listed, and
still answered by a real worker after the apps inside runners/ were split out."""

import ast
import re
import time
from pathlib import Path

import pytest
from django.conf import settings

from portal.celery import app

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent.parent
NAMES_FILE = REPO / "tests" / "data" / "task_names.txt"


def _listed() -> list[str]:
    return sorted(line.strip() for line in NAMES_FILE.read_text().splitlines()
                  if line.strip() and not line.startswith("#"))


def _registered() -> list[str]:
    app.loader.import_default_modules()  # what a worker does at start: autodiscovery of every tasks module
    return sorted(name for name in app.tasks if not name.startswith("celery."))


def test_the_registered_task_names_are_the_checked_in_list():
    assert _registered() == _listed(), (
        "A task was added, removed or renamed: update tests/data/task_names.txt and say how messages "
        "queued under an old name are handled."
    )


def test_every_task_states_its_name_in_its_decorator():
    """A name left to Celery would follow the module path, and a move would silently rename it."""
    unnamed = []
    for path in sorted(REPO.glob("*/**/tasks.py")):
        if ".venv" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                call = decorator if isinstance(decorator, ast.Call) else None
                target = call.func if call else decorator
                if getattr(target, "id", getattr(target, "attr", None)) != "shared_task":
                    continue
                if call is None or not any(keyword.arg == "name" for keyword in call.keywords):
                    unnamed.append(f"{path.relative_to(REPO)}: {node.name}")
    assert not unnamed, unnamed


# Arguments that make each task do nothing harmful: ids that do not exist, an old kick time.
HARMLESS_ARGS = {
    "runners.tasks.environment_provision": [999_999],
    "runners.tasks.environment_sync": [999_999],
    "runners.tasks.environment_teardown": [999_999],
    "runners.tasks.job_launch": [999_999, 1],
    "runners.tasks.job_stop": [999_999],
    "runners.tasks.partition_apply": [999_999],
    "runners.tasks.scheduler_cycle": [0.0],
    "runners.tasks.workspace_home_delete": ["no-such-tenant/999999"],
}


@pytest.mark.django_db(transaction=True)
def test_a_message_of_every_name_sent_as_before_the_split_is_run_by_a_worker_after_it(celery_worker):
    """Each message is published by name, as the code before the split published it (its tasks were
    the functions of runners/tasks.py), and the worker of today's code must run it: an unknown name
    would be logged as an unregistered task and dropped."""
    from runners.scheduling.models import SchedulerCycle

    sent = {name: app.send_task(name, args=HARMLESS_ARGS.get(name, []), queue=settings.CELERY_TASK_DEFAULT_QUEUE).id
            for name in _listed()}
    deadline = time.monotonic() + 120
    ran: dict[str, str] = {}
    while time.monotonic() < deadline and len(ran) < len(sent):
        log = celery_worker.log_path.read_text()
        assert "unregistered task" not in log, log[-3000:]
        for name, message_id in sent.items():
            found = re.search(rf"Task {re.escape(name)}\[{message_id}\] (succeeded|raised|retry)", log)
            if found:
                ran[name] = found.group(1)
        time.sleep(0.3)
    assert sorted(ran) == sorted(sent), f"not run: {sorted(set(sent) - set(ran))}\n{log[-3000:]}"
    assert ran["runners.tasks.scheduler_cycle"] == "succeeded"
    assert SchedulerCycle.objects.get(id=1).runs >= 1, "the cycle sent by its old name did not run"

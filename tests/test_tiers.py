"""Every test file is in one tier, and says so honestly (the rules: tests/support/tiers.py)."""

from pathlib import Path

import pytest

from tests.support.tiers import declared_tiers, file_problems, fixture_violations

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent


def _test_files():
    return sorted(path for path in TESTS.rglob("test_*.py") if "__pycache__" not in path.parts)


def test_every_test_file_is_in_exactly_one_tier_and_keeps_to_it():
    problems = {}
    for path in _test_files():
        found = file_problems(path.read_text())
        if found:
            problems[str(path.relative_to(TESTS.parent))] = found
    assert not problems, "\n".join(f"{path}: {'; '.join(found)}" for path, found in problems.items())


def test_the_suite_has_all_three_tiers():
    tiers = {declared_tiers(path.read_text())[0][0] for path in _test_files() if declared_tiers(path.read_text())[0]}
    assert tiers == {"unit", "integration", "e2e"}


HEAD = "import pytest\n\n"


@pytest.mark.parametrize("source, says", [
    (HEAD + "def test_x():\n    pass\n", "declares 0 tiers (none)"),
    (HEAD + "pytestmark = [pytest.mark.unit, pytest.mark.e2e]\n", "declares 2 tiers (unit, e2e)"),
    (HEAD + "pytestmark = pytest.mark.django_db\n", "declares 0 tiers"),
    (HEAD + "pytestmark = pytest.mark.unit\n\n@pytest.mark.e2e\ndef test_x():\n    pass\n",
     "puts tier marks on classes or functions (e2e)"),
    (HEAD + "import subprocess\n\npytestmark = pytest.mark.integration\n", "is integration but imports subprocess"),
    (HEAD + "from tests.support.worker import WorkerProcess, wait_for\n\npytestmark = pytest.mark.unit\n",
     "is unit but imports tests.support.worker.WorkerProcess"),
    (HEAD + "sync = pytest.importorskip('playwright.sync_api')\npytestmark = [pytest.mark.integration]\n",
     "imports playwright.sync_api"),
    (HEAD + "from tests.support.k8s_standin import KubernetesStandIn\npytestmark = pytest.mark.integration\n",
     "imports tests.support.k8s_standin.KubernetesStandIn"),
    (HEAD + "pytestmark = [pytest.mark.unit, pytest.mark.django_db]\n", "is unit but uses the django_db mark"),
], ids=["no-tier", "two-tiers", "django_db-only", "tier-on-a-function", "integration-subprocess",
        "unit-worker-process", "integration-playwright", "integration-standin", "unit-django_db"])
def test_a_file_that_lies_about_its_tier_is_caught(source, says):
    assert says in "; ".join(file_problems(source))


@pytest.mark.parametrize("source", [
    HEAD + "pytestmark = pytest.mark.unit\n",
    HEAD + "from tests.support.worker import wait_for\n\npytestmark = [pytest.mark.integration, pytest.mark.django_db]\n",
    HEAD + "import subprocess\n\npytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]\n",
], ids=["unit", "integration-wait_for", "e2e-subprocess"])
def test_an_honest_file_passes(source):
    assert file_problems(source) == []


def test_fixture_closures_by_tier():
    assert fixture_violations("unit", ["settings", "tmp_path"], False) == []
    assert fixture_violations("unit", ["tenant", "db", "django_db_setup"], False) == [
        "uses the database (db, django_db_setup)"]
    assert fixture_violations("unit", ["settings"], True) == ["uses the database (the django_db mark)"]
    assert fixture_violations("integration", ["transactional_db", "live_server"], True) == []
    assert fixture_violations("integration", ["celery_worker", "celery_worker_factory", "db"], False) == [
        "uses process fixtures (celery_worker, celery_worker_factory)"]
    assert fixture_violations("integration", ["page", "browser", "live_server"], False) == [
        "uses process fixtures (browser, page)"]
    assert fixture_violations("e2e", ["celery_worker", "page", "kubernetes_cluster", "db"], True) == []

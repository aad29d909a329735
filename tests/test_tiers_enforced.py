"""A test that goes past its file's tier fails, saying why: a real pytest run over files that lie."""

import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent

FILES = {
    "conftest.py": """
        pytest_plugins = ["tests.support.tiers"]
        from tests.conftest import _fresh_queue, celery_worker, celery_worker_factory  # noqa: F401
    """,
    "test_unit_uses_db.py": """
        import pytest
        pytestmark = pytest.mark.unit
        def test_it(db):
            pass
    """,
    "test_unit_marked_django_db.py": """
        import pytest
        pytestmark = [pytest.mark.unit, pytest.mark.django_db]
        def test_it():
            pass
    """,
    "test_unit_talks_to_redis.py": """
        import pytest
        import redis
        from django.conf import settings
        pytestmark = pytest.mark.unit
        def test_it():
            redis.Redis.from_url(settings.CELERY_BROKER_URL).ping()
    """,
    "test_integration_starts_worker.py": """
        import pytest
        pytestmark = pytest.mark.integration
        def test_it(celery_worker):
            pass
    """,
    "test_integration_spawns.py": """
        import subprocess, sys
        import pytest
        pytestmark = pytest.mark.integration
        def test_it():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
    """,
    "test_no_tier.py": """
        def test_it():
            pass
    """,
    "test_honest.py": """
        import subprocess, sys
        import pytest
        pytestmark = pytest.mark.e2e
        def test_e2e_spawns():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
    """,
    "test_honest_unit.py": """
        import pytest
        pytestmark = pytest.mark.unit
        def test_unit_computes():
            assert sum(range(4)) == 6
    """,
}


def test_tests_that_lie_about_their_tier_fail_and_honest_ones_pass(tmp_path):
    for name, source in FILES.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "--ds", "portal.settings",
         "--rootdir", str(tmp_path), "-rA", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    out = run.stdout + run.stderr
    outcomes = defaultdict(set)
    for line in out.splitlines():
        if line.startswith(("PASSED ", "FAILED ", "ERROR ")):
            outcomes[line.split(" ")[1].split("::")[0]].add(line.split(" ")[0])
    expected = {
        "test_unit_uses_db.py": "is marked unit but uses the database (db, django_db_setup)",
        "test_unit_marked_django_db.py": "is marked unit but uses the database (the django_db mark)",
        "test_unit_talks_to_redis.py": "is marked unit but opened a connection to",
        "test_integration_starts_worker.py": "is marked integration but uses process fixtures (celery_worker",
        "test_integration_spawns.py": "is marked integration but started a process (subprocess.Popen",
        "test_no_tier.py": "has 0 tier marks (none)",
    }
    for name, says in expected.items():
        assert outcomes[name] & {"FAILED", "ERROR"}, f"{name} did not fail:\n{out}"
        assert says in out, f"{name}: no {says!r} in:\n{out}"
    assert outcomes["test_honest.py"] == {"PASSED"}, out
    assert outcomes["test_honest_unit.py"] == {"PASSED"}, out
    assert run.returncode == 1, out

"""Nothing in the project empties a whole Redis database.

Django's cache and the Celery broker share one Redis database unless CACHE_URL says otherwise, and the
suite's three test processes share it too. ``cache.clear()`` on Redis is FLUSHDB: it took every process's
queue, its unacknowledged messages and its exchange bindings with it, and a message a killed worker held was
then never handed to the next one (a test of another process, two files away, failed one full run in three).
Tests empty their own keys with tests.support.worker.clear_cache instead; a test that flushes a Redis server of
its own says so on the line (``# flush-ok: <why>``).
"""

import ast
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
SKIPPED = {"var", "node_modules", "__pycache__", "site"}  # with every hidden folder (.venv, .git)
FLUSHES = {"flushdb", "flushall"}


def python_files() -> list[Path]:
    """Every Python file of the checkout, whatever folder a new app lands in."""
    found = []
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith(".") and name not in SKIPPED)
        found += [Path(folder) / name for name in sorted(files) if name.endswith(".py")]
    return found


def database_flushes(source: str) -> list[int]:
    """Line numbers of ``<something named cache>.clear()``, ``.flushdb()`` and ``.flushall()`` calls, but for those
    whose line says ``# flush-ok:``."""
    text = source.splitlines()
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if node.func.attr.lower() in FLUSHES or (node.func.attr == "clear" and owner_name.endswith("cache")):
            if "# flush-ok:" not in text[node.lineno - 1]:
                lines.append(node.lineno)
    return lines


def test_no_code_flushes_the_shared_redis_database():
    found = [f"{path.relative_to(REPO)}:{line}" for path in python_files() for line in database_flushes(path.read_text())]
    assert found == [], f"These calls empty the Redis database the broker shares (use clear_cache): {found}"


def test_the_check_sees_each_way_of_flushing_and_lets_the_rest_be():
    source = "\n".join([
        "from django.core.cache import cache, caches",
        "cache.clear()",
        "caches['default'].clear()",  # a subscript: not named cache, not caught (no such call in the project)
        "self.cache.clear()",
        "client.flushdb()",
        "redis.Redis().FLUSHALL()",
        "get_backend.cache_clear()",
        "seen.clear()",
        "cache.delete('key')",
        "private.flushall()  # flush-ok: a Redis server of this test's own",
    ])
    assert database_flushes(source) == [2, 4, 5, 6]

"""The suite's tiers, enforced on every test as it runs (tests/conftest.py loads these hooks).

Each test file says its tier once: ``pytestmark = pytest.mark.unit`` (no database, no broker, no
process), ``pytest.mark.integration`` (the database and in-process code only) or ``pytest.mark.e2e``
(real workers, browsers, the Kubernetes stand-in, trainers, gunicorn, any subprocess). A test whose
fixtures or deeds go past its tier fails, saying why: at collection from its fixture closure and
marks, while it runs from what Python's audit hooks see it do (a process started, a socket opened).
tests/test_tiers.py checks the files themselves.
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
import threading
from contextlib import contextmanager

import pytest

TIERS = ("unit", "integration", "e2e")

# Fixtures that reach the database (pytest-django's; `django_db_setup` is under every one of them).
DATABASE_FIXTURES = frozenset({"db", "transactional_db", "django_db_setup", "django_db_reset_sequences",
                               "django_db_serialized_rollback", "live_server"})
# Fixtures that start a process or stand in for a cluster: end-to-end only.
PROCESS_FIXTURES = frozenset({"celery_worker", "celery_worker_factory", "shared_celery_worker", "browser",
                              "page", "kubernetes_cluster", "standin", "pytester"})

_PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.fork", "os.forkpty", "os.exec",
                             "os.spawn", "os.system", "pty.spawn"})
_SOCKET_EVENTS = frozenset({"socket.connect"})


def tier_of(item) -> list[str]:
    """The tier marks that apply to an item (one, for an honest file)."""
    return [mark.name for mark in item.iter_markers() if mark.name in TIERS]


def fixture_violations(tier: str, fixturenames, has_django_db_mark: bool) -> list[str]:
    """What a test's fixtures and marks do that its tier forbids."""
    found = []
    if tier == "unit":
        database = sorted(DATABASE_FIXTURES.intersection(fixturenames))
        if database or has_django_db_mark:
            found.append("uses the database (" + ", ".join(database or ["the django_db mark"]) + ")")
    if tier in ("unit", "integration"):
        processes = sorted(PROCESS_FIXTURES.intersection(fixturenames))
        if processes:
            found.append("uses process fixtures (" + ", ".join(processes) + ")")
    return found


def _advice(tier: str) -> str:
    return {"unit": "mark its file pytest.mark.integration or e2e", "integration": "mark its file pytest.mark.e2e"}.get(
        tier, "give its file exactly one tier mark")


_violations = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Check each collected test's tier against its fixture closure and marks, before -m deselects any."""
    for item in items:
        tiers = tier_of(item)
        if len(tiers) != 1:
            found = [f"has {len(tiers)} tier marks ({', '.join(tiers) or 'none'}); its file needs exactly one "
                     "module-level pytestmark of pytest.mark.unit, integration or e2e"]
        else:
            found = fixture_violations(tiers[0], getattr(item, "fixturenames", ()),
                                       item.get_closest_marker("django_db") is not None)
            found = [f"is marked {tiers[0]} but {what}: {_advice(tiers[0])}" for what in found]
        item.stash[_violations] = found


def pytest_ignore_collect(collection_path, config):
    """Under -m, skip importing a test file whose tier (read from its source) the expression rules out."""
    expression = config.getoption("markexpr", "")
    if not expression or not (collection_path.name.startswith("test_") and collection_path.suffix == ".py"):
        return None
    try:
        tiers = module_tiers(collection_path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    if len(tiers) != 1 or _could_select(expression, tiers[0]):
        return None
    return True


def _could_select(expression: str, tier: str) -> bool:
    """Whether `-m expression` selects some test of a file in `tier`, whatever its other marks."""
    from _pytest.mark.expression import Expression

    compiled = Expression.compile(expression)
    others = sorted(set(re.findall(r"[A-Za-z_][\w.]*", expression)) - {"and", "or", "not", *TIERS})
    for chosen in itertools.product((False, True), repeat=len(others)):
        marks = {name for name, on in zip(others, chosen) if on} | {tier}
        if compiled.evaluate(lambda name, **kwargs: name in marks):
            return True
    return False


class _Watch:
    """What the running unit or integration test does, as Python's audit hooks report it."""

    def __init__(self):
        self.tier: str | None = None
        self.old_threads: set[int] = set()
        self.seen: list[str] = []

    def __call__(self, event, args):
        if self.tier is None or (event not in _PROCESS_EVENTS and event not in _SOCKET_EVENTS):
            return
        # Threads a test inherited (a live server, a stand-in left by an earlier file) are not its doing.
        ident = threading.get_ident()
        if ident in self.old_threads and ident != threading.main_thread().ident:
            return
        if event in _PROCESS_EVENTS:
            self.seen.append(f"started a process ({event}: {_describe(args)})")
        elif self.tier == "unit" and _is_network(args):
            self.seen.append(f"opened a connection to {args[1]!r} (the database, the broker or a server)")


def _describe(args) -> str:
    try:
        executable, argv = args[0], args[1]
        words = list(argv) if isinstance(argv, (list, tuple)) else str(argv).split()
        return " ".join(str(word) for word in ([executable] if executable and not words else words)[:4])
    except (IndexError, TypeError):
        return str(args)[:80]


def _is_network(args) -> bool:
    address = args[1] if len(args) > 1 else None
    return isinstance(address, tuple)


_watch = _Watch()
sys.addaudithook(_watch)


@contextmanager
def not_the_tests_doing():
    """Work of the session's fixtures that the first test's setup happens to run (building the test
    database's template starts `manage.py migrate`) is not that test's doing."""
    tier, _watch.tier = _watch.tier, None
    try:
        yield
    finally:
        _watch.tier = tier


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    found = item.stash.get(_violations, [])
    if found:
        pytest.fail(f"{item.nodeid} " + "; ".join(found), pytrace=False)
    tiers = tier_of(item)
    _watch.seen = []
    _watch.old_threads = {thread.ident for thread in threading.enumerate()}
    _watch.tier = tiers[0] if tiers and tiers[0] != "e2e" else None


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    tier = _watch.tier
    if nextitem is None:
        # The last test's teardown also ends the session's fixtures (the test database, the queue).
        _watch.tier = None
    result = yield
    seen = list(dict.fromkeys(_watch.seen))
    _watch.tier, _watch.seen = None, []
    if tier and seen:
        pytest.fail(f"{item.nodeid} is marked {tier} but " + "; ".join(seen[:3]) + f": {_advice(tier)}", pytrace=False)
    return result


# --- What a test file says, read from its source (tests/test_tiers.py) ---------

# Names a file below e2e must not import: they start processes, browsers or the stand-in.
PROCESS_IMPORTS = ("subprocess", "playwright", "axe_playwright_python", "tests.support.k8s_standin.KubernetesStandIn",
                   "tests.support.worker.WorkerProcess", "tests.support.worker.worker_environment",
                   "tests.support.portal_up")


def _mark_name(node) -> str | None:
    """`X` for `pytest.mark.X` or `pytest.mark.X(...)`."""
    if isinstance(node, ast.Call):
        node = node.func
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest"):
        return node.attr
    return None


def module_tiers(source: str) -> list[str]:
    """The tiers a file's module-level pytestmark names (what -m needs to know before importing the file)."""
    return _module_level(ast.parse(source))[0]


def _module_level(tree: ast.Module) -> tuple[list[str], set[int]]:
    module_level, module_marks = [], set()
    for statement in tree.body:
        targets = statement.targets if isinstance(statement, ast.Assign) else (
            [statement.target] if isinstance(statement, ast.AnnAssign) else [])
        if any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in targets):
            values = statement.value.elts if isinstance(statement.value, (ast.List, ast.Tuple)) else [statement.value]
            for value in values:
                module_marks.add(id(value))
                if _mark_name(value) in TIERS:
                    module_level.append(_mark_name(value))
    return module_level, module_marks


def declared_tiers(source: str) -> tuple[list[str], list[str]]:
    """The tiers a file's module-level pytestmark names, and the tier marks it puts anywhere else."""
    tree = ast.parse(source)
    module_level, module_marks = _module_level(tree)
    elsewhere = []
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if (isinstance(node, (ast.Attribute, ast.Call)) and id(node) not in module_marks | called
                and _mark_name(node) in TIERS):
            elsewhere.append(_mark_name(node))
    return module_level, elsewhere


def imported_names(source: str) -> set[str]:
    """Every module and `module.name` a file imports, pytest.importorskip's included."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return names


def file_problems(source: str) -> list[str]:
    """Why a test file's source is not honestly in one tier (empty when it is)."""
    tiers, elsewhere = declared_tiers(source)
    if len(tiers) != 1:
        return [f"declares {len(tiers)} tiers ({', '.join(tiers) or 'none'}) in its module-level pytestmark; "
                "it needs exactly one of pytest.mark.unit, integration or e2e"]
    problems = []
    if elsewhere:
        problems.append(f"puts tier marks on classes or functions ({', '.join(elsewhere)}): one tier a file")
    tier = tiers[0]
    if tier in ("unit", "integration"):
        starts = sorted(name for name in imported_names(source)
                        if any(name == banned or name.startswith(banned + ".") for banned in PROCESS_IMPORTS))
        if starts:
            problems.append(f"is {tier} but imports {', '.join(starts)} (processes, browsers, the stand-in): "
                            f"{_advice(tier)}")
    if tier == "unit" and any(_mark_name(node) == "django_db" for node in ast.walk(ast.parse(source))):
        problems.append(f"is unit but uses the django_db mark: {_advice(tier)}")
    return problems

"""Longest files first, from the committed tests/durations.json (tests/conftest.py loads these hooks).

`make test` hands whole files to xdist's processes (`--dist loadfile --no-loadscope-reorder`) in the
order collected; starting the longest first keeps one long file from running alone at the end, and the
longest of all (SPLIT) go out in parts.
`pytest --write-durations` (what `make test-durations` runs) measures each file it ran, setup and
teardown included, and writes those seconds into the file, keeping the other files' figures.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parent.parent / "durations.json"


def pytest_addoption(parser):
    parser.addoption("--write-durations", action="store_true", default=False,
                     help="write the seconds each test file took into tests/durations.json (keeping other files')")


def read_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {str(name): float(seconds) for name, seconds in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def longest_first(items, durations: dict[str, float]):
    """Items regrouped by file, the longest file first; a file not in durations counts as the mean one."""
    default = sum(durations.values()) / len(durations) if durations else 0.0
    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(_file_of(item), index)
    return sorted(items, key=lambda item: (-durations.get(_file_of(item), default), first_seen[_file_of(item)]))


def _file_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


# Files too long to run whole in one process (a floor under the whole run's time): their tests are
# handed out in this many parts, each part a unit of its own (with its own module-scoped fixtures).
SPLIT = {"tests/portal/test_schemathesis.py": 4}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, but each file of SPLIT in parts."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileInParts(LoadFileScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            parts = SPLIT.get(scope)
            return f"{scope}#{zlib.crc32(nodeid.encode()) % parts}" if parts else scope

    return LoadFileInParts(config, log)


def repeated_ids(items) -> list[str]:
    """Node ids collected more than once: pytest-xdist schedules by id and would run one of each."""
    seen = Counter(item.nodeid for item in items)
    return sorted(nodeid for nodeid, count in seen.items() if count > 1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    repeated = repeated_ids(items)
    if repeated:
        # A generated test whose id leaves out what tells its items apart (schemathesis names an operation's
        # test by its label only when the test is parametrized) ran once under xdist, silently.
        raise pytest.UsageError(f"{len(repeated)} test ids are collected more than once, which pytest-xdist would "
                                f"run once each: {', '.join(repeated[:5])}")
    items[:] = longest_first(items, read_durations())


class _Recorder:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self, session):
        durations = read_durations() | {name: round(seconds, 2) for name, seconds in self.seconds.items()}
        DURATIONS.write_text(json.dumps(dict(sorted(durations.items())), indent=1) + "\n")


def pytest_configure(config):
    # Under xdist only the controller writes: it sees every process's reports.
    if config.getoption("write_durations", False) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(), "tier-durations-recorder")

"""Where the suite's CPU goes: `--cpu-report DIR` writes, for each pytest process, every test's CPU seconds.

The run is bound by CPU on two cores, and most of a test's CPU is not in the pytest process but in what it
starts (workers, trainers, servers, the browser). So each pytest process puts itself in a cgroup of its own
(cgroup v1 `cpuacct`, which every process it starts inherits) and reads the cgroup's total around each test:
DIR/cpu-<process>.json holds [node id, CPU seconds of the test and everything it started, wall seconds, CPU
seconds of the pytest process alone] a test. The databases' and Redis' servers are not counted.

It needs to write /sys/fs/cgroup/cpuacct (root, as in CI and this project's machines). Sum it by file with
`python -m tests.support.cpu_report DIR`:

    make test PYTEST_ARGS="--cpu-report var/cpu"
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

CGROUP_ROOT = Path("/sys/fs/cgroup/cpuacct")


def pytest_addoption(parser):
    parser.addoption("--cpu-report", metavar="DIR", default=None,
                     help="write each test's CPU seconds, its processes' included, into DIR (tests/support/cpu_report.py)")


class _Report:
    def __init__(self, out: Path):
        name = os.environ.get("PYTEST_XDIST_WORKER") or f"main{os.getpid()}"
        self.cgroup = CGROUP_ROOT / f"portal-tests-{name}-{os.getpid()}"
        try:
            self.cgroup.mkdir(exist_ok=True)
            (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as error:
            raise pytest.UsageError(f"--cpu-report needs to write {CGROUP_ROOT} (cgroup v1 cpuacct): {error}") from None
        self.out = out / f"cpu-{name}.json"
        self.rows: list = []

    def usage(self) -> float:
        return int((self.cgroup / "cpuacct.usage").read_text()) / 1e9

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        cpu, wall, own = self.usage(), time.monotonic(), sum(os.times()[:2])
        yield
        self.rows.append((item.nodeid, self.usage() - cpu, time.monotonic() - wall, sum(os.times()[:2]) - own))

    def pytest_unconfigure(self, config):
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps({"total": self.usage(), "rows": self.rows}))


def pytest_configure(config):
    out = config.getoption("cpu_report", None)
    # Only the processes that run tests: under xdist, the controller hands out files and runs none.
    controller = bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput")
    if out and not controller:
        config.pluginmanager.register(_Report(Path(out).resolve()), "cpu-report")


def main(folder: str) -> None:
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for path in Path(folder).glob("cpu-*.json"):
        for node_id, cpu, wall, own in json.loads(path.read_text())["rows"]:
            row = by_file[node_id.split("::", 1)[0]]
            row[0], row[1], row[2] = row[0] + cpu, row[1] + wall, row[2] + own
    print(f"{'cpu s':>8} {'own s':>8} {'wall s':>8}  file ({sum(r[0] for r in by_file.values()):.0f} CPU-s in all)")
    for name, (cpu, wall, own) in sorted(by_file.items(), key=lambda item: -item[1][0]):
        print(f"{cpu:8.1f} {own:8.1f} {wall:8.1f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "var/cpu")

"""A real Prometheus on loopback, and a stand-in for NVIDIA's DCGM exporter for it to scrape.

`running_prometheus` starts Debian's `/usr/bin/prometheus` (the test is skipped, saying so,
when it is not installed) on a free loopback port with its own storage folder, scraping the
given targets every second with `honor_labels: true` (as the real setups do, so the exporter's
`namespace`, `pod` and `container` labels are kept), waits until `/-/ready` answers, and stops
it afterwards.

`DcgmExporter` serves `/metrics` as dcgm-exporter does with the GPU Operator's default counters
(`dcp-metrics-included.csv`) and Kubernetes pod attribution on: the same metric names, HELP and
TYPE lines, and labels in the same order (`gpu`, `UUID`, `pci_bus_id`, `device`, `modelName`,
`GPU_I_PROFILE` and `GPU_I_ID` for a MIG instance, `Hostname`, the driver version, then
`container`, `namespace`, `pod` when a pod holds the device). Only the four families the portal
reads are served. The test sets the devices (`set`) and waits until Prometheus has taken them in
(`wait_scraped`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.error import URLError
from urllib.request import urlopen

import pytest

PROMETHEUS = "/usr/bin/prometheus"
DRIVER_VERSION = "550.90.07"

# (name, help) as the exporter's counters file gives them, in the order it serves them; all gauges.
FAMILIES = (
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active."),
)


@dataclass(frozen=True)
class DcgmDevice:
    """One GPU, or one MIG instance of it, as the exporter reports it; a figure left None is not served.

    A MIG instance has no DCGM_FI_DEV_GPU_UTIL (DCGM does not report it below the whole GPU), and
    its power is the GPU's, not the instance's; leave both None for one, as the exporter does.
    """

    uuid: str
    gpu: int
    hostname: str
    model_name: str = "NVIDIA H100 80GB HBM3"
    mig_profile: str | None = None
    mig_instance: int | None = None
    namespace: str = ""
    pod: str = ""
    container: str = ""
    gpu_util: float | None = None  # percent
    gr_engine_active: float | None = None  # ratio, 0..1
    fb_used_mib: float | None = None
    power_w: float | None = None

    def values(self) -> dict[str, float | None]:
        return {
            "DCGM_FI_DEV_POWER_USAGE": self.power_w,
            "DCGM_FI_DEV_GPU_UTIL": self.gpu_util,
            "DCGM_FI_DEV_FB_USED": self.fb_used_mib,
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": self.gr_engine_active,
        }

    def labels(self) -> str:
        parts = [
            f'gpu="{self.gpu}"', f'UUID="{self.uuid}"', f'pci_bus_id="00000000:{0x18 + self.gpu:02X}:00.0"',
            f'device="nvidia{self.gpu}"', f'modelName="{self.model_name}"',
        ]
        if self.mig_profile is not None:
            parts += [f'GPU_I_PROFILE="{self.mig_profile}"', f'GPU_I_ID="{self.mig_instance}"']
        parts += [f'Hostname="{self.hostname}"', f'DCGM_FI_DRIVER_VERSION="{DRIVER_VERSION}"']
        if self.pod:
            parts += [f'container="{self.container}"', f'namespace="{self.namespace}"', f'pod="{self.pod}"']
        return ",".join(parts)


def exposition(devices: list[DcgmDevice]) -> str:
    """The text format page the exporter serves for these devices."""
    lines = []
    for name, help_text in FAMILIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for device in devices:
            value = device.values()[name]
            if value is not None:
                lines.append(f"{name}{{{device.labels()}}} {_number(value)}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """Whole figures as integers (utilization, memory), the rest as Go's %f would print them."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6f}"


class DcgmExporter:
    """A threaded HTTP server on loopback serving the devices the test set, as dcgm-exporter does."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._page = exposition([])
        self._generation = 0
        # Scrapes served of the current generation: when the second arrives, Prometheus has
        # committed the first (one target's scrape loop appends before it scrapes again).
        self._served_current = 0
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = exporter._serve().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> DcgmExporter:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def target(self) -> str:
        """host:port, as a Prometheus static target."""
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def set(self, devices: list[DcgmDevice]) -> None:
        """Serve these devices from the next scrape on."""
        page = exposition(devices)
        with self._lock:
            self._page = page
            self._generation += 1
            self._served_current = 0

    def _serve(self) -> str:
        with self._lock:
            self._served_current += 1
            self._lock.notify_all()
            return self._page

    def wait_scraped(self, timeout_s: float = 15.0) -> None:
        """Wait until Prometheus has stored a scrape of what was set last (two scrapes of it served)."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._served_current >= 2, timeout=timeout_s):
                raise AssertionError(f"Prometheus did not scrape {self.target} twice within {timeout_s} s.")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Prometheus:
    """A running Prometheus: its base URL (http://127.0.0.1:<port>) and its process."""

    url: str
    process: subprocess.Popen

    def stop(self) -> None:
        """Stop the server (it answers nothing from here on)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def running_prometheus(targets: list[str], *, scrape_interval_s: float = 1.0,
                       ready_timeout_s: float = 30.0) -> Iterator[Prometheus]:
    """A real Prometheus scraping `targets` (host:port) every `scrape_interval_s`; skips the test without one."""
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.skip(f"Needs Debian's Prometheus at {PROMETHEUS} (apt-get install prometheus).")
    folder = Path(tempfile.mkdtemp(prefix="portal-prometheus-"))
    interval = f"{int(scrape_interval_s * 1000)}ms"
    (folder / "prometheus.yml").write_text(
        "global:\n"
        f"  scrape_interval: {interval}\n"
        f"  scrape_timeout: {interval}\n"
        "scrape_configs:\n"
        "  - job_name: dcgm-exporter\n"
        "    honor_labels: true\n"
        "    static_configs:\n"
        f"      - targets: [{', '.join(repr(target) for target in targets)}]\n"
    )
    port = free_port()
    log = open(folder / "prometheus.log", "wb")
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    server = Prometheus(url=f"http://127.0.0.1:{port}", process=process)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"Prometheus exited with {process.returncode}:\n{(folder / 'prometheus.log').read_text()}")
            try:
                with urlopen(f"{server.url}/-/ready", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except (URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus was not ready within {ready_timeout_s} s.")
            time.sleep(0.1)
        yield server
    finally:
        server.stop()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)

"""The edge as a real process for tests: ``python -m runners.edge`` on this run's database."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.worker import REPO, worker_environment


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EdgeProcess:
    """``python -m runners.edge`` on a free port; ``url`` is where it answers."""

    def __init__(self, log_path: Path, *, upstream: str | None = None, **env) -> None:
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.upstream = upstream
        self.env = worker_environment(**env)
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> EdgeProcess:
        self.log = open(self.log_path, "ab")
        argv = [sys.executable, "-m", "runners.edge", "--bind", f"127.0.0.1:{self.port}"]
        if self.upstream:
            argv += ["--upstream", self.upstream]
        self.process = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"the edge exited with {self.process.returncode}: {self.output()[-3000:]}")
            try:
                httpx.get(f"{self.url}/serve/-/-/v1/generate", timeout=1)
                return self
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the edge did not answer: {self.output()[-3000:]}") from None
                time.sleep(0.2)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> int | None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if getattr(self, "log", None):
            self.log.close()
        return self.process.returncode if self.process else None

    def post(self, path: str, body=None, *, token: str | None = None, content: bytes | None = None,
             headers: dict | None = None, timeout: float = 60) -> httpx.Response:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Token {token}"
        if content is None and body is not None:
            return httpx.post(self.url + path, json=body, headers=sent, timeout=timeout)
        return httpx.post(self.url + path, content=content, headers=sent, timeout=timeout)


# --- Requests for endpoints, as the Django test client sent them before the edge -------------------------

_running: list[EdgeProcess] = []


@contextlib.contextmanager
def running_edge(tmp_path: Path, **env):
    """The edge for this test: ``through_edge`` sends to it. Its table is read every 0.2 s here."""
    env.setdefault("EDGE_TABLE_REFRESH_S", "0.2")
    edge = EdgeProcess(tmp_path / "edge.log", **env).start()
    # One client (a pool of kept-alive connections) for every thread of the test, as callers keep theirs.
    edge.client = httpx.Client(timeout=90, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
    _running.append(edge)
    try:
        yield edge
    finally:
        _running.remove(edge)
        edge.client.close()
        edge.stop()


class EdgeAnswer:
    """An edge's answer read as a Django test response: status_code, content, json(), answer[header]."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status_code = response.status_code
        self.content = response.content

    def json(self):
        return self.response.json()

    def __getitem__(self, name: str) -> str:
        return self.response.headers[name]

    def get(self, name: str, default=None):
        return self.response.headers.get(name, default)


def through_edge(client, path: str, data: bytes, content_type: str = "application/json",
                 timeout: float = 90) -> EdgeAnswer:
    """POST ``data`` to the running edge with the API token of ``client`` (a DRF APIClient with credentials)."""
    [edge] = _running
    headers = {"Content-Type": content_type}
    authorization = getattr(client, "_credentials", {}).get("HTTP_AUTHORIZATION")
    if authorization:
        headers["Authorization"] = authorization
    return EdgeAnswer(edge.client.post(edge.url + path, content=data, headers=headers, timeout=timeout))

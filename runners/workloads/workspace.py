"""A workspace's server: JupyterLab, whose sign-in is the portal's.

    python -m runners.workloads.workspace --socket PATH --base-url /workspaces/<id>/ --home FOLDER

(with PORTAL_WORKSPACE_KEY in its environment). JupyterLab listens on a Unix socket (locally; a port on
Kubernetes, ``--port``) and answers only requests that carry ``X-Portal-Workspace-Key: <key>``: the portal's
edge adds it once the portal's own sign-in has said who asks and that they may (the owner, or the tenant's
members where the owner shares it). jupyter-server's own token and password are off; ``PortalIdentity`` below
is its identity provider, and names the person the edge says (``X-Portal-User``). Requests are not "token
authenticated" in Jupyter's sense, so its own cross-site checks (the ``_xsrf`` cookie, the Origin of
WebSockets) stay on.

A stop is SIGTERM, as for every replica (a preemption, the idle cull, its owner's stop). The person in the
workspace is warned first: a notice (``PORTAL_WORKSPACE_NOTICE``, a file in the runtime folder) that a small
IPython startup file of the workspace's (``NOTICE_STARTUP``, written into its home) prints into the notebook
of every running kernel, under the cell run last. While a kernel has a browser connected, JupyterLab keeps
serving for the grace period (``--grace-s``, less a few seconds), so they can save; then it shuts its kernels
and terminals down and exits 0. With nobody connected it stops at once; a second SIGTERM stops it at once too.
The home folder (notebooks, files, ``pip install --user``) is the workspace's, kept across stops.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import signal
import sys
import time

from jupyter_server.auth.identity import IdentityProvider, User

KEY_VARIABLE = "PORTAL_WORKSPACE_KEY"
NOTICE_VARIABLE = "PORTAL_WORKSPACE_NOTICE"
# Seconds of the grace period left unused: JupyterLab must be down before the backend's kill.
GRACE_MARGIN_S = 5
# The startup file every kernel of the workspace runs: a thread that prints the portal's notice once it is
# there. A thread's output goes under the cell run last (ipykernel's parent of record), where its person looks.
NOTICE_STARTUP_PATH = os.path.join(".ipython", "profile_default", "startup", "00-portal-notice.py")
NOTICE_STARTUP = '''# Written by the GPU portal at each start of this workspace: prints the portal's notices (a stop on its way).
def _portal_notices():
    import json, os, sys, threading, time
    path = os.environ.get("PORTAL_WORKSPACE_NOTICE")
    if not path:
        return

    def watch():
        seen = None
        while True:
            try:
                with open(path) as notice_file:
                    notice = json.load(notice_file)
            except (OSError, ValueError):
                notice = None
            if notice and notice.get("id") != seen:
                seen = notice.get("id")
                print(notice.get("message", ""), file=sys.stderr, flush=True)
            time.sleep(1)

    threading.Thread(target=watch, name="portal-notices", daemon=True).start()


_portal_notices()
del _portal_notices
'''

KEY_HEADER = "X-Portal-Workspace-Key"
USER_HEADER = "X-Portal-User"


class PortalIdentity(IdentityProvider):
    """A request is the person the portal's edge names, when it carries the workspace's key; else no one."""

    @property
    def auth_enabled(self) -> bool:
        return True

    @property
    def login_available(self) -> bool:
        return False  # there is no Jupyter sign-in: the portal's is the only one

    def get_user(self, handler) -> User | None:
        key = os.environ.get(KEY_VARIABLE, "")
        given = handler.request.headers.get(KEY_HEADER, "")
        if not key or not given or not hmac.compare_digest(given.encode(), key.encode()):
            return None
        name = handler.request.headers.get(USER_HEADER, "") or "portal"
        return User(username=name, name=name, display_name=name)

    def validate_security(self, app, ssl_options=None) -> None:
        if not os.environ.get(KEY_VARIABLE):
            raise SystemExit(f"{KEY_VARIABLE} is not set: a workspace never runs without its key.")


def _connected(serverapp) -> bool:
    """Whether a browser is connected to any kernel of the workspace."""
    manager = serverapp.kernel_manager
    return any(manager.kernel_model(kernel_id).get("connections", 0) for kernel_id in manager.list_kernel_ids())


def notice(path: str, message: str) -> None:
    """Write the notice the kernels' startup thread prints (a new id: printed once more)."""
    temp = f"{path}.tmp"
    with open(temp, "w") as out:
        json.dump({"id": f"{time.time():.6f}", "message": message}, out)
    os.replace(temp, path)


def _stop_with_notice(serverapp, grace_s: float) -> None:
    """SIGTERM: the notice first, then JupyterLab stops (after the grace while someone is connected)."""
    stopping = {"asked": False}
    loop = serverapp.io_loop  # set by initialize_server: the loop start() runs

    async def stop() -> None:
        stop_at = time.time() + max(0.0, grace_s - GRACE_MARGIN_S)
        path = os.environ.get(NOTICE_VARIABLE)
        if path:
            notice(path, f"\u26a0 The GPU portal is stopping this workspace (preempted by another tenant's guaranteed "
                         f"work, idle past its limit, or stopped by its owner). JupyterLab ends at "
                         f"{time.strftime('%H:%M:%S UTC', time.gmtime(stop_at))}: save your work now. Your files "
                         f"are kept for its next start.")
        while _connected(serverapp) and time.time() < stop_at:
            await asyncio.sleep(0.5)
        serverapp.stop(from_signal=False)

    def handler(sig, frame) -> None:
        if stopping["asked"]:  # a second SIGTERM: at once
            loop.add_callback_from_signal(serverapp.stop, from_signal=True)
            return
        stopping["asked"] = True
        loop.add_callback_from_signal(lambda: asyncio.ensure_future(stop()))

    signal.signal(signal.SIGTERM, handler)


def argv_for(*, socket: str | None, port: int | None, base_url: str, home: str) -> list[str]:
    """JupyterLab's command line flags for this workspace."""
    where = [f"--ServerApp.sock={socket}", "--ServerApp.sock_mode=0600"] if socket else [
        "--ServerApp.ip=0.0.0.0", f"--ServerApp.port={port}", "--ServerApp.port_retries=0"]
    return [
        *where,
        f"--ServerApp.base_url={base_url}",
        f"--ServerApp.root_dir={home}",
        f"--ServerApp.identity_provider_class={__name__}.PortalIdentity",

        # No Jupyter token at all: JupyterLab's pages then send no Authorization header of their own.
        "--IdentityProvider.token=",
        "--ServerApp.open_browser=False",
        # Requests come through the edge with the browser's Host (the portal's name): Jupyter's guard against
        # DNS rebinding of a server on localhost has nothing to guard here, where only the edge connects.
        "--ServerApp.allow_remote_access=True",
        "--ServerApp.allow_root=True",  # the sandbox runs it as its own account; unsandboxed, as the portal's
        "--ServerApp.terminals_enabled=True",
        # No network calls of its own (the sandbox has none): no news, no update checks, no extension manager.
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        "--ServerApp.log_level=WARN",
    ]


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", help="the Unix socket to listen on")
    parser.add_argument("--port", type=int, help="the port to listen on (on every address), instead of a socket")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--home", required=True)
    parser.add_argument("--grace-s", type=float, default=0.0, help="how long a stop may take (the launch's grace)")
    given = parser.parse_args(args)
    if not (given.socket or given.port):
        parser.error("--socket or --port")
    os.makedirs(given.home, exist_ok=True)
    os.chdir(given.home)
    runtime = os.environ.get("JUPYTER_RUNTIME_DIR") or os.path.join(given.home, ".local", "share", "jupyter", "runtime")
    os.makedirs(runtime, exist_ok=True)
    os.environ.setdefault(NOTICE_VARIABLE, os.path.join(runtime, "portal-notice.json"))
    startup = os.path.join(given.home, NOTICE_STARTUP_PATH)
    os.makedirs(os.path.dirname(startup), exist_ok=True)
    with open(startup, "w") as out:
        out.write(NOTICE_STARTUP)
    from jupyterlab.labapp import LabApp

    sys.argv = [sys.argv[0]]
    # LabApp.launch_instance, with SIGTERM ours once the server has set its own handlers: the notice first.
    serverapp = LabApp.initialize_server(argv=argv_for(socket=given.socket, port=given.port, base_url=given.base_url,
                                                       home=given.home))
    _stop_with_notice(serverapp, given.grace_s)
    serverapp.start()


if __name__ == "__main__":
    main()

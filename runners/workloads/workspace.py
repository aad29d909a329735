"""A workspace's server: JupyterLab, whose sign-in is the portal's.

    python -m runners.workloads.workspace --socket PATH --base-url /workspaces/<id>/ --home FOLDER

(with PORTAL_WORKSPACE_KEY in its environment). JupyterLab listens on a Unix socket (locally; a port on
Kubernetes, ``--port``) and answers only requests that carry ``X-Portal-Workspace-Key: <key>``: the portal's
edge adds it once the portal's own sign-in has said who asks and that they may (the owner, or the tenant's
members where the owner shares it). jupyter-server's own token and password are off; ``PortalIdentity`` below
is its identity provider, and names the person the edge says (``X-Portal-User``). Requests are not "token
authenticated" in Jupyter's sense, so its own cross-site checks (the ``_xsrf`` cookie, the Origin of
WebSockets) stay on.

A stop is SIGTERM, as for every replica: JupyterLab shuts its kernels and terminals down and exits 0. The
home folder (notebooks, files, ``pip install --user``) is the workspace's, kept across stops.
"""

from __future__ import annotations

import argparse
import hmac
import os
import sys

from jupyter_server.auth.identity import IdentityProvider, User

KEY_VARIABLE = "PORTAL_WORKSPACE_KEY"
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
    given = parser.parse_args(args)
    if not (given.socket or given.port):
        parser.error("--socket or --port")
    os.makedirs(given.home, exist_ok=True)
    os.chdir(given.home)
    from jupyterlab.labapp import LabApp

    sys.argv = [sys.argv[0]]
    LabApp.launch_instance(argv=argv_for(socket=given.socket, port=given.port, base_url=given.base_url,
                                         home=given.home))


if __name__ == "__main__":
    main()

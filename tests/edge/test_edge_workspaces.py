"""The edge in front of a workspace's server, against a small upstream on a Unix socket (as a local workspace's
JupyterLab listens): a workspace the portal has just marked ready is served at once, though the edge's table
was read before; a browser that opens one not ready yet gets a page that loads it again, not raw JSON."""

import re
import time

import httpx
import pytest
from django.test import Client

from runners.workspaces.models import Workspace, WorkspaceState
from tests.edge.upstream import Upstream
from tests.support.edge import EdgeProcess
from tests.support.jobs import demo_cluster_with_flavors, ready_environment

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

HTML = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


@pytest.fixture
def workspace(tenant, owner):
    flavor = demo_cluster_with_flavors()["t4-shared"]
    return Workspace.objects.create(tenant=tenant, environment=ready_environment(actor=owner, tenant=tenant),
                                    owner=owner, name="nb", flavor=flavor, state=WorkspaceState.STARTING)


def session_of(user, settings) -> dict:
    client = Client()
    client.force_login(user)
    return {settings.SESSION_COOKIE_NAME: client.cookies[settings.SESSION_COOKIE_NAME].value}


def test_a_workspace_just_ready_is_served_at_once_and_a_browser_waits_on_a_page_that_reloads(
        tmp_path, workspace, owner, outsider, settings):
    socket_path = str(tmp_path / "jupyter.sock")
    stopped = Workspace.objects.create(tenant=workspace.tenant, environment=workspace.environment, owner=owner,
                                       name="old", flavor=workspace.flavor, state=WorkspaceState.STOPPED)
    # The table is read at the edge's start and then not for a minute: only the edge's own read of the one
    # workspace can know it became ready.
    edge = EdgeProcess(tmp_path / "edge.log", EDGE_TABLE_REFRESH_S=60).start()
    cookies = session_of(owner, settings)
    url = f"{edge.url}/workspaces/{workspace.id}/lab"
    try:
        with Upstream(uds=socket_path):
            waiting = httpx.get(url, cookies=cookies, headers=HTML)
            assert waiting.status_code == 503 and waiting.headers["content-type"].startswith("text/html")
            assert waiting.headers["retry-after"] == "3" and waiting.headers["cache-control"] == "no-store"
            assert re.search(r'<meta http-equiv="refresh" content="3">', waiting.text)
            assert "The workspace is starting" in waiting.text
            # One that is stopped does not come up by itself: its page says so, and does not reload.
            idle = httpx.get(f"{edge.url}/workspaces/{stopped.id}/lab", cookies=cookies, headers=HTML)
            assert idle.status_code == 503 and "The workspace is stopped" in idle.text
            assert "refresh" not in idle.text and "retry-after" not in idle.headers
            # An API client (JupyterLab's own requests) gets the JSON refusal it can read.
            api = httpx.get(f"{edge.url}/workspaces/{workspace.id}/api/status", cookies=cookies)
            assert api.status_code == 503 and api.json()["detail"] == "The workspace is starting, not ready yet."

            Workspace.objects.filter(id=workspace.id).update(state=WorkspaceState.READY, address=f"unix:{socket_path}")
            time.sleep(0.3)  # past the edge's pause between two reads of one workspace
            ready = httpx.get(url, cookies=cookies, headers=HTML)
            assert ready.status_code == 200, ready.text
            seen = ready.json()
            assert seen["path"] == f"/workspaces/{workspace.id}/lab"
            assert seen["headers"]["x-portal-workspace-key"] == workspace.key
            assert seen["headers"]["x-portal-user"] == owner.username and "cookie" not in seen["headers"]

            # Someone else still gets the 404 of a workspace that does not exist, as does nobody signed in.
            assert httpx.get(url, cookies=session_of(outsider, settings), headers=HTML).status_code == 404
            assert httpx.get(url, headers=HTML).status_code == 404
            assert httpx.get(f"{edge.url}/workspaces/999999/lab", cookies=cookies).status_code == 404
    finally:
        edge.stop()

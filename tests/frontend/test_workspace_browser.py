"""A workspace in Chromium, on the stack `make run` starts (`manage.py up`: gunicorn behind the edge, a worker,
beat and the demo data, on a database of its own).

alice starts a workspace on a time-slice share from the Workspaces page, waits for it to be ready, opens
JupyterLab from the portal with no second sign-in, runs a cell that imports torch and trains three steps,
saves the notebook, opens a terminal and runs a command there; stops it, starts it again and finds her
notebook. carol (another tenant's), bob (her tenant's, the workspace not shared) and a browser that is not
signed in get 404 at its URL, over WebSocket too.
"""

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.frontend.conftest import _playwright
from tests.support.portal_up import fresh_database, ready_environment_through_api, started_portal

pytestmark = pytest.mark.e2e

PASSWORD = "portal-demo"  # the demo's logins

CELL = """import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(16, 4), torch.randn(16, 1)
for step in range(3):
    opt.zero_grad(); loss = torch.nn.functional.mse_loss(model(x), y); loss.backward(); opt.step()
    print(f"step {step} loss {loss.item():.4f}")
"""


@pytest.fixture(scope="module")
def portal(tmp_path_factory):
    env = {"CELERY_BROKER_URL": settings.CELERY_BROKER_URL, "LOCAL_USE_NVML": "false",
           "WORKSPACE_RECONCILE_INTERVAL_S": "1"}
    with fresh_database("workspace", migrated=True) as database_url:
        VAR["dir"] = tmp_path_factory.mktemp("var")
        with started_portal({**env, "DATABASE_URL": database_url}, VAR["dir"]) as url:
            login = httpx.post(f"{url}/api/v1/auth/token/", json={"username": "alice", "password": PASSWORD})
            assert login.status_code in (200, 201), login.text
            token = login.json()["token"]
            ready_environment_through_api(url, token, tenant="ml-research", name="notebooks")
            yield url


# The portal's var folder, where the local backend keeps each attempt's log (JupyterLab's, for a failure's note).
VAR: dict[str, Path] = {}


def _workspace_logs() -> str:
    return "\n".join(f"== {path}\n" + path.read_text(errors="replace")[-6000:]
                      for path in sorted(VAR["dir"].glob("jobs/*/attempts/*/rank-*.log")))


def log_in(page, url: str, username: str) -> None:
    page.goto(f"{url}/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    _playwright().expect(page.get_by_test_id("current-user")).to_have_text(username)


def wait_state(page, state: str, timeout_s: float = 180) -> None:
    """Reload the workspace's page until its badge says ``state``."""
    deadline = time.monotonic() + timeout_s
    while page.get_by_test_id("workspace-state").inner_text().strip() != state:
        assert time.monotonic() < deadline, (f"still {page.get_by_test_id('workspace-state').inner_text()}: "
                                             f"{page.get_by_test_id('workspace-reason').inner_text()}")
        time.sleep(1)
        page.reload()


def open_lab(page):
    """Click "Open JupyterLab" on the workspace's page: the tab it opens, once JupyterLab has drawn itself (its file
    browser: what the main area shows depends on the layout JupyterLab restores, a launcher, the notebook or a
    terminal that is gone)."""
    with page.context.expect_page() as opened:
        page.get_by_test_id("open-workspace").click()
    lab = opened.value
    seen = []
    lab.on("console", lambda message: seen.append(f"console {message.type}: {message.text}"))
    lab.on("response", lambda response: seen.append(f"{response.status} {response.url}") if response.status >= 400
           else None)
    lab.on("websocket", lambda socket: _watch_frames(socket, seen))
    lab.seen = seen
    try:
        lab.wait_for_selector(".jp-DirListing-content", timeout=120_000)
    except Exception as exc:
        raise AssertionError("JupyterLab did not draw itself:\n" + "\n".join(seen[-40:])) from exc
    return lab


def _watch_frames(socket, seen: list[str]) -> None:
    """Note each WebSocket frame's message type (Jupyter's messages) in ``seen``, for a failure's note."""
    def note(direction, payload):
        text = payload if isinstance(payload, str) else payload.decode("utf-8", "replace")
        found = re.search(r'"msg_type":\s*"(\w+)"', text)
        seen.append(f"{time.monotonic():.1f} ws {direction} {socket.url[-60:]} {found.group(1) if found else len(text)}")

    socket.on("framesent", lambda payload: note("sent", payload))
    socket.on("framereceived", lambda payload: note("got", payload))
    socket.on("close", lambda _: seen.append(f"{time.monotonic():.1f} ws closed {socket.url[-60:]}"))


def test_alice_works_in_jupyterlab_through_the_portal_and_nobody_else_gets_in(portal, browser):
    expect = _playwright().expect
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    page.set_default_timeout(60_000)
    log_in(page, portal, "alice")
    page.goto(f"{portal}/tenants/ml-research/workspaces/")
    form = page.get_by_test_id("start-workspace")
    form.get_by_label("Name", exact=True).fill("nb")
    form.get_by_label("Environment", exact=True).select_option(label="notebooks")
    form.get_by_label("Flavor", exact=True).select_option(value="t4-shared")
    form.get_by_role("button", name="Start").click()
    wait_state(page, "ready")
    workspace_path = re.search(r"/workspaces/(\d+)/$", page.url)
    assert workspace_path, page.url
    workspace_id = int(workspace_path.group(1))

    # JupyterLab, signed in by the portal's own session: no Jupyter token or password asked.
    lab = open_lab(page)
    assert lab.url.startswith(f"{portal}/workspaces/{workspace_id}/lab")
    lab.locator('.jp-LauncherCard[data-category="Notebook"]').first.click(timeout=60_000)
    notebook = lab.locator(".jp-NotebookPanel").first
    # The status bar's kernel status: a cell run while it still says "Initializing" is refused (a notification).
    expect(lab.get_by_role("contentinfo")).to_contain_text("| Idle", timeout=60_000)
    cell = lab.locator(".jp-Notebook .jp-Cell .cm-content").first
    cell.click()
    lab.keyboard.insert_text(CELL)
    # The toolbar's buttons, not keyboard shortcuts: JupyterLab loads its key bindings from its settings after
    # it has drawn itself, and a Shift+Enter pressed before that is a new line in the cell.
    notebook.locator('.jp-NotebookPanel-toolbar [data-command="notebook:run-cell-and-select-next"]').click()
    try:
        expect(lab.locator(".jp-OutputArea-output").filter(has_text="step 2 loss")).to_be_visible(timeout=120_000)
    except AssertionError as exc:
        raise AssertionError(f"the cell: {cell.inner_text()!r}; outputs: "
                             f"{lab.locator('.jp-OutputArea').all_inner_texts()}; kernel: "
                             f"{lab.locator('.jp-Notebook-ExecutionIndicator, .jp-KernelStatus').all_inner_texts()}\n"
                             + "\n".join(lab.seen[-80:]) + "\n" + _workspace_logs()) from exc
    notebook.locator('.jp-NotebookPanel-toolbar [data-command="docmanager:save"]').click()
    # A new notebook's first save asks for its name: the one it has is kept.
    accept = lab.locator(".jp-Dialog .jp-mod-accept")
    accept.wait_for(timeout=10_000)
    accept.click()
    expect(lab.locator(".jp-DirListing-item[title*='Untitled.ipynb']")).to_be_visible()

    # A terminal, from a new launcher: its command runs in the workspace (and writes into its home folder).
    lab.get_by_role("menuitem", name="File").click()
    lab.get_by_role("menuitem", name=re.compile(r"^New Launcher")).click()
    lab.locator('.jp-LauncherCard[title="Start a new terminal session"]').last.click()
    terminal = lab.locator(".jp-Terminal").first
    expect(terminal).to_be_visible()
    time.sleep(2)  # the shell's prompt
    terminal.click()
    lab.keyboard.type("echo $((6 * 7)) > from-terminal.txt\n")
    deadline = time.monotonic() + 30
    while True:
        answer = lab.request.get(f"{portal}/workspaces/{workspace_id}/api/contents/from-terminal.txt")
        if answer.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert answer.status == 200 and answer.json()["content"].strip() == "42"
    lab.close()

    # carol (another tenant's owner), bob (a member of alice's tenant: the workspace is not shared) and a browser
    # not signed in: a 404, the WebSocket handshake too.
    for who in ("carol", "bob", None):
        other = browser.new_context()
        other_page = other.new_page()
        if who:
            log_in(other_page, portal, who)
        response = other_page.goto(f"{portal}/workspaces/{workspace_id}/lab")
        assert response.status == 404, who
        jar = "; ".join(f"{c['name']}={c['value']}" for c in other.cookies())
        with pytest.raises(InvalidStatus) as refused:
            connect(portal.replace("http", "ws") + f"/workspaces/{workspace_id}/api/events/subscribe",
                    additional_headers={"Cookie": jar} if jar else {}, open_timeout=10)
        assert refused.value.response.status_code == 404, who
        other.close()

    # Stopped, then started again: the notebook is still there.
    page.get_by_test_id("stop-workspace").click()
    wait_state(page, "stopped")
    page.get_by_test_id("start-workspace").click()
    wait_state(page, "ready")
    lab = open_lab(page)
    expect(lab.locator(".jp-DirListing-item[title*='Untitled.ipynb']")).to_be_visible(timeout=60_000)
    listing = lab.request.get(f"{portal}/workspaces/{workspace_id}/api/contents/Untitled.ipynb").json()
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
               for c in listing["content"]["cells"]]
    assert any("torch.nn.Linear" in source for source in sources), json.dumps(listing)[:500]
    lab.close()
    page.get_by_test_id("stop-workspace").click()
    wait_state(page, "stopped")
    context.close()

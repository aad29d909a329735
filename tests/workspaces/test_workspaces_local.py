"""Workspaces end to end on the local backend: a member's JupyterLab scheduled as a job on a time-slice share,
run in the sandbox on a Unix socket, reached only through the edge (a real process) with the portal's
sign-in; its home folder kept across a stop and a start; everyone else a 404, over HTTP and WebSocket; the
idle cull stopping a workspace left idle (its owner told) and not one running a cell."""

import json
import time
import uuid

import httpx
import pytest
from django.core import mail
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from audit.models import AuditEntry
from quotas.models import ResourceFlavor
from runners.jobs import attempts
from runners.jobs import services as jobs
from runners.jobs.models import Job
from runners.notifications import services as notifications
from runners.notifications.models import Event, EventKind, Outbox
from runners.scheduling import services as scheduling
from runners.workspaces.models import Workspace, WorkspaceState
from runners.workspaces.reconcile import workspaces_reconcile_run
from tests.support.edge import EdgeProcess
from tests.support.endpoints import worker_passes
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment, submit

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def drive(workspace: Workspace, until, *, timeout_s: float = 90) -> Workspace:
    """Run the passes a worker would (cycle, launches, stops, the jobs' and the workspaces' reconciles)."""
    deadline = time.monotonic() + timeout_s
    while True:
        worker_passes(Job.Kind.WORKSPACE)
        workspaces_reconcile_run()
        workspace.refresh_from_db()
        if until(workspace):
            return workspace
        if time.monotonic() > deadline:
            job = workspace.job
            raise AssertionError(f"workspace {workspace.name} is {workspace.state} ({workspace.reason}); job "
                                 f"{job and job.state} ({job and job.reason})")
        time.sleep(0.3)


@pytest.fixture
def world(settings, tenant, owner, teammate, outsider, other_tenant, tmp_path):
    settings.PREEMPTION_GRACE_PERIOD_S = 10
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["t4-shared"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    edge = EdgeProcess(tmp_path / "edge.log", EDGE_TABLE_REFRESH_S=0.2, EDGE_AUTH_CACHE_S=1).start()
    yield {"environment": environment, "edge": edge}
    edge.stop()


def session_cookie(client_for, user) -> dict:
    from django.conf import settings
    from django.test import Client

    client = Client()
    client.force_login(user)
    return {settings.SESSION_COOKIE_NAME: client.cookies[settings.SESSION_COOKIE_NAME].value}


def start(client_for, owner, world, **fields) -> Workspace:
    api = client_for(owner)
    created = api.post("/api/v1/workspaces/", {"tenant": "acme", "environment": world["environment"].id,
                                                "name": "nb", "flavor": "t4-shared", "gpus": 1, **fields},
                       format="json")
    assert created.status_code == 201, created.content
    assert created.json()["url"].endswith(f"/workspaces/{created.json()['id']}/lab")
    return Workspace.objects.get(id=created.json()["id"])


def wait_edge_sees(edge, cookies, workspace, *, status=200, timeout_s=10) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        answer = httpx.get(f"{edge.url}/workspaces/{workspace.id}/api/status", cookies=cookies, timeout=10)
        if answer.status_code == status or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)


def run_cell(edge, cookies, workspace, code: str, *, timeout_s: float = 120) -> str:
    """Start a kernel through the edge (JupyterLab's own XSRF check passing as a browser's would), run
    ``code`` over the kernel's WebSocket, and return what it printed."""
    base = f"{edge.url}/workspaces/{workspace.id}"
    with httpx.Client(cookies=cookies, timeout=30) as browser:
        assert browser.get(f"{base}/lab").status_code == 200
        xsrf = browser.cookies.get("_xsrf")
        assert xsrf, "JupyterLab set its own _xsrf cookie through the edge"
        kernel = browser.post(f"{base}/api/kernels", json={"name": "python3"},
                              headers={"X-XSRFToken": xsrf, "Origin": edge.url})
        assert kernel.status_code == 201, kernel.text
        jar = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
    kernel_id = kernel.json()["id"]
    ws_url = edge.url.replace("http", "ws") + f"/workspaces/{workspace.id}/api/kernels/{kernel_id}/channels"
    message_id = uuid.uuid4().hex
    printed = []
    with connect(ws_url, additional_headers={"Cookie": jar, "Origin": edge.url}, open_timeout=30) as channel:
        channel.send(json.dumps({
            "header": {"msg_id": message_id, "username": "test", "session": uuid.uuid4().hex, "msg_type":
                       "execute_request", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = json.loads(channel.recv(timeout=timeout_s))
            if message.get("parent_header", {}).get("msg_id") != message_id:
                continue
            kind = message["msg_type"]
            if kind == "stream":
                printed.append(message["content"]["text"])
            elif kind == "error":
                raise AssertionError("\n".join(message["content"]["traceback"]))
            elif kind == "status" and message["content"]["execution_state"] == "idle":
                return "".join(printed)
    raise AssertionError(f"the cell did not finish; printed {printed}")


def test_a_members_workspace_runs_a_cell_keeps_its_files_and_is_nobody_elses(
        world, client_for, owner, teammate, outsider, settings):
    edge = world["edge"]
    workspace = start(client_for, owner, world)
    assert workspace.job.kind == Job.Kind.WORKSPACE and workspace.job.preemptible is False  # within the guarantee
    workspace = drive(workspace, lambda w: w.state == WorkspaceState.READY)
    assert workspace.address.startswith("unix:")
    alice = session_cookie(client_for, owner)
    assert wait_edge_sees(edge, alice, workspace).status_code == 200

    # A cell that trains three steps of a tiny model with torch, in the sandbox.
    printed = run_cell(edge, alice, workspace, (
        "import os, torch\n"
        "model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "x, y = torch.randn(16, 4), torch.randn(16, 1)\n"
        "for step in range(3):\n"
        "    opt.zero_grad(); loss = torch.nn.functional.mse_loss(model(x), y); loss.backward(); opt.step()\n"
        "    print('step', step, round(loss.item(), 4))\n"
        "open('notes.txt', 'w').write('kept')\n"
        "print('uid', os.getuid())\n"))
    assert [line.split()[1] for line in printed.splitlines() if line.startswith("step")] == ["0", "1", "2"]
    assert "uid 0" not in printed  # the sandbox's account, not the portal's

    # Everyone else: a 404 as for a workspace that does not exist, over HTTP and over WebSocket.
    others = {"bob (another tenant)": session_cookie(client_for, outsider),
              "a teammate (not shared)": session_cookie(client_for, teammate), "anonymous": {}}
    for who, cookies in others.items():
        for path in ("lab", "api/status", "api/contents/notes.txt"):
            answer = httpx.get(f"{edge.url}/workspaces/{workspace.id}/{path}", cookies=cookies, timeout=10)
            assert answer.status_code == 404, (who, path, answer.status_code)
        jar = "; ".join(f"{k}={v}" for k, v in cookies.items())
        with pytest.raises(InvalidStatus) as refused:
            connect(edge.url.replace("http", "ws") + f"/workspaces/{workspace.id}/api/events/subscribe",
                    additional_headers={"Cookie": jar} if jar else {}, open_timeout=10)
        assert refused.value.response.status_code == 404, who
    # A forged key header from the caller is dropped: the edge sends its own.
    forged = httpx.get(f"{edge.url}/workspaces/{workspace.id}/api/status", timeout=10,
                       headers={"X-Portal-Workspace-Key": workspace.key, "X-Portal-User": "alice"})
    assert forged.status_code == 404
    # A cross-site change is refused before it reaches JupyterLab.
    cross = httpx.post(f"{edge.url}/workspaces/{workspace.id}/api/kernels", cookies=alice, timeout=10,
                       headers={"Origin": "https://evil.example"}, json={})
    assert cross.status_code == 403

    # Stop, start again: the file is still there.
    stopped = client_for(owner).post(f"/api/v1/workspaces/{workspace.id}/stop/")
    assert stopped.status_code == 202, stopped.content
    workspace = drive(workspace, lambda w: w.state == WorkspaceState.STOPPED)
    assert wait_edge_sees(edge, alice, workspace, status=503).status_code == 503
    restarted = client_for(owner).post(f"/api/v1/workspaces/{workspace.id}/start/")
    assert restarted.status_code == 202, restarted.content
    workspace = drive(workspace, lambda w: w.state == WorkspaceState.READY)
    assert wait_edge_sees(edge, alice, workspace).status_code == 200
    kept = httpx.get(f"{edge.url}/workspaces/{workspace.id}/api/contents/notes.txt", cookies=alice, timeout=10)
    assert kept.status_code == 200 and kept.json()["content"] == "kept"
    assert AuditEntry.objects.filter(action__in=["workspace.created", "workspace.started", "workspace.stopped"]
                                     ).count() >= 3
    client_for(owner).post(f"/api/v1/workspaces/{workspace.id}/stop/")
    drive(workspace, lambda w: w.state == WorkspaceState.STOPPED)


def test_an_idle_workspace_is_stopped_after_its_window_and_a_busy_one_is_not(world, client_for, owner, teammate,
                                                                             settings):
    edge = world["edge"]
    for user in (owner, teammate):
        user.email = f"{user.username}@example.com"
        user.save()
    workspace = drive(start(client_for, owner, world), lambda w: w.state == WorkspaceState.READY)
    alice = session_cookie(client_for, owner)
    wait_edge_sees(edge, alice, workspace)
    settings.WORKSPACE_IDLE_MINUTES = 0.1  # six seconds
    # A cell that runs longer than the window: the workspace is busy, not idle, the whole time.
    import threading

    ran = {}
    cell = threading.Thread(target=lambda: ran.setdefault("out", run_cell(
        edge, alice, workspace, "import time\nfor i in range(12):\n    time.sleep(1)\nprint('done')\n")))
    cell.start()
    time.sleep(3)
    for _ in range(12):
        workspaces_reconcile_run()
        workspace.refresh_from_db()
        assert workspace.state == WorkspaceState.READY, workspace.reason
        time.sleep(0.6)
    cell.join(timeout=60)
    assert ran.get("out", "").strip() == "done"
    # Then nothing: stopped once the window has passed since its last activity, saying so.
    workspace = drive(workspace, lambda w: w.state in (WorkspaceState.STOPPING, WorkspaceState.STOPPED),
                      timeout_s=30)
    assert workspace.reason.startswith("Idle for"), workspace.reason
    assert AuditEntry.objects.filter(action="workspace.culled").exists()
    workspace = drive(workspace, lambda w: w.state == WorkspaceState.STOPPED)
    assert Job.objects.get(id=workspace.job_id).state == "cancelled"
    # Its owner is told, and only its owner (the teammate chose the same mails and gets none of this one).
    [row] = Outbox.objects.filter(source="workspace")
    notifications.outbox_process(row.id)
    [event] = Event.objects.filter(kind=EventKind.WORKSPACE_STOPPED)
    assert event.payload["object"]["owner"] == owner.username and event.payload["object"]["cause"] == "idle"
    assert event.payload["object"]["reason"].startswith("Idle for")
    assert [message.to for message in mail.outbox] == [[owner.email]]


def test_a_borrowed_workspace_is_preempted_by_a_guarantee_with_a_warning_first_and_keeps_its_files(
        world, client_for, owner, outsider, other_tenant, settings):
    edge = world["edge"]
    flavors = {flavor.name: flavor for flavor in ResourceFlavor.objects.all()}
    give_quota(world["environment"].tenant, flavors["h100-80gb"], guaranteed=0, max=8)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=16, max=16)
    other_environment = ready_environment(actor=outsider, tenant=other_tenant)
    workspace = start(client_for, owner, world, flavor="h100-80gb", gpus=8)
    assert workspace.job.preemptible is True and "borrows" in workspace.reason
    workspace = drive(workspace, lambda w: w.state == WorkspaceState.READY)
    alice = session_cookie(client_for, owner)
    wait_edge_sees(edge, alice, workspace)
    base = f"{edge.url}/workspaces/{workspace.id}"

    # alice has a notebook open: a kernel with a browser's connection, a cell run, a file written.
    with httpx.Client(cookies=alice, timeout=30) as browser:
        browser.get(f"{base}/lab")
        xsrf = browser.cookies.get("_xsrf")
        kernel = browser.post(f"{base}/api/kernels", json={"name": "python3"},
                              headers={"X-XSRFToken": xsrf, "Origin": edge.url}).json()
        jar = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
    with connect(edge.url.replace("http", "ws") + f"/workspaces/{workspace.id}/api/kernels/{kernel['id']}/channels",
                 additional_headers={"Cookie": jar, "Origin": edge.url}, open_timeout=30) as channel:
        message_id = uuid.uuid4().hex
        channel.send(json.dumps({
            "header": {"msg_id": message_id, "username": "alice", "session": uuid.uuid4().hex,
                       "msg_type": "execute_request", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": "open('kept.txt', 'w').write('mine')", "silent": False, "store_history": True,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}}))

        def printed(until, timeout_s=60) -> str:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                message = json.loads(channel.recv(timeout=timeout_s))
                if message.get("parent_header", {}).get("msg_id") != message_id:
                    continue
                text = message["content"].get("text", "") if message["msg_type"] == "stream" else ""
                if until(message, text):
                    return text
            raise AssertionError("nothing came")

        printed(lambda m, _: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle")

        # Another tenant's guaranteed gang needs the GPUs the workspace borrowed: the cycle preempts it.
        gang = submit(outsider, other_environment, name="guaranteed", replicas=2, gpus_per_replica=8,
                      preemptible=False, priority=50, topology={"level": "none", "mode": "preferred"})
        deadline = time.monotonic() + 60
        while Job.objects.get(id=workspace.job_id).state != "preempted":
            assert time.monotonic() < deadline, Job.objects.get(id=workspace.job_id).reason
            scheduling.cycle_run()
            time.sleep(0.3)
        attempts.job_stop_run(job_id=workspace.job_id)  # the stop the cycle sent: SIGTERM, the grace period on
        # The warning reaches alice's notebook, under the cell she ran last, while JupyterLab still serves her.
        warning = printed(lambda m, text: "stopping this workspace" in text, timeout_s=30)
        assert "save your work" in warning
        assert httpx.get(f"{base}/api/contents/kept.txt", cookies=alice, timeout=10).status_code == 200
    workspace = drive(workspace, lambda w: w.state in (WorkspaceState.STOPPING, WorkspaceState.QUEUED))
    workspace = drive(workspace, lambda w: w.state == WorkspaceState.QUEUED, timeout_s=60)
    assert workspace.reason.startswith("Preempted") or "preempt" in workspace.job.reason.lower()
    assert Outbox.objects.filter(source="workspace", key__startswith="preempted:").exists()

    # The gang is done with the GPUs: the workspace starts again by itself, its files as they were.
    jobs.job_cancel(actor=outsider, job=gang)
    workspace = drive(workspace, lambda w: w.state == WorkspaceState.READY, timeout_s=120)
    wait_edge_sees(edge, alice, workspace)
    kept = httpx.get(f"{base}/api/contents/kept.txt", cookies=alice, timeout=10)
    assert kept.status_code == 200 and kept.json()["content"] == "mine"
    client_for(owner).post(f"/api/v1/workspaces/{workspace.id}/stop/")
    drive(workspace, lambda w: w.state == WorkspaceState.STOPPED)

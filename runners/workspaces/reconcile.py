"""The workspaces' pass (a beat task): for each workspace with a job, where its server answers, whether it
answers, and what it says of its own activity; then ``services.observe`` writes it (and culls the idle).

JupyterLab is asked with the workspace's key, as the edge asks it: ``api/status`` (its last activity: any
request, kernel or terminal traffic) and ``api/kernels`` (a kernel running a cell is "busy"). Probes run
concurrently, a few at a time, each bounded by WORKSPACE_PROBE_TIMEOUT_S.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
from django.conf import settings
from django.db import close_old_connections

from runners.backends.base import WORKSPACE_KEY_HEADER
from runners.clusters.registry import get_backend
from runners.jobs.models import JobAttempt, JobState
from runners.workspaces import services
from runners.workspaces.models import Workspace, WorkspaceState

log = logging.getLogger(__name__)

PROBES_AT_ONCE = 8
QUIET = {"no_track_activity": "1"}


def client_for(address: str, timeout_s: float) -> tuple[httpx.Client, str]:
    """An HTTP client for a workspace's server and the base of its URLs: ``unix:/path`` (the local backend's
    socket) or ``http://host:port``."""
    if address.startswith("unix:"):
        return httpx.Client(transport=httpx.HTTPTransport(uds=address[len("unix:"):]), timeout=timeout_s), \
            "http://workspace"
    return httpx.Client(timeout=timeout_s), address.rstrip("/")


def probe(address: str, key: str, base_url: str) -> dict | None:
    """What the server says of itself, or None when it does not answer as JupyterLab with this key."""
    client, root = client_for(address, settings.WORKSPACE_PROBE_TIMEOUT_S)
    headers = {WORKSPACE_KEY_HEADER: key}
    try:
        with client:
            # Jupyter counts every API request as activity, unless it says not to: the probes must not keep
            # the workspace awake themselves.
            status = client.get(f"{root}{base_url}api/status", headers=headers, params=QUIET)
            kernels = client.get(f"{root}{base_url}api/kernels", headers=headers, params=QUIET)
    except httpx.HTTPError:
        return None
    if status.status_code != 200 or kernels.status_code != 200:
        return None
    try:
        last = status.json().get("last_activity")
        busy = any(kernel.get("execution_state") == "busy" for kernel in kernels.json())
    except (ValueError, AttributeError, TypeError):
        return None
    try:
        last_activity = datetime.fromisoformat(last.replace("Z", "+00:00")) if last else None
    except (ValueError, AttributeError):
        last_activity = None
    return {"last_activity": last_activity, "busy": busy}


def workspaces_reconcile_run() -> dict[str, int]:
    """One pass over every workspace that has a job not known to be over; returns how many ended in each state."""
    rows = list(Workspace.objects.exclude(job=None).exclude(
        state__in=[WorkspaceState.STOPPED, WorkspaceState.FAILED]).values_list(
        "id", "job_id", "job__state", "key", "environment__namespace"))
    numbers = dict(JobAttempt.objects.open().filter(job_id__in=[row[1] for row in rows]).values_list("job_id", "number"))
    backend = get_backend()

    def look(row):
        workspace_id, job_id, job_state, key, namespace = row
        address = status = None
        if job_state == JobState.RUNNING and job_id in numbers:
            try:
                address = backend.workspace_address(job_id, numbers[job_id], namespace=namespace)
            except Exception:  # the backend away a moment: not ready this pass
                log.exception("workspace %s: the backend could not say where its server answers", workspace_id)
            if address:
                status = probe(address, key, f"/workspaces/{workspace_id}/")
        return workspace_id, job_state, address, status

    with ThreadPoolExecutor(max_workers=PROBES_AT_ONCE) as pool:
        seen = list(pool.map(look, rows))
    close_old_connections()
    counts: dict[str, int] = {}
    for workspace_id, job_state, address, status in seen:
        state = services.observe(workspace_id, job_state=job_state, address=address, status=status)
        counts[state] = counts.get(state, 0) + 1
    return counts

"""What the edge knows from the database, read off the request path: the routing table and who callers are.

The routing table (live endpoints, their tenant, settings, and ready replicas with their addresses; every
workspace, who may open it and where it answers) is read whole every EDGE_TABLE_REFRESH_S by a background task; a
workspace the table holds as not ready is read again on its own when a signed-in caller asks for it (at most every
WORKSPACE_REREAD_S). Callers (an API token or a session cookie)
and their memberships are looked up once and kept EDGE_AUTH_CACHE_S. Every database read runs in one
worker thread (asgiref's sync_to_async, thread-sensitive): a request waiting on a replica holds no
database connection, and the edge as a whole holds one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from runners.backends import engines

log = logging.getLogger("runners.edge")

SHIPPED = engines.SHIPPED


@dataclass(frozen=True)
class Target:
    """One ready replica of an endpoint: where it answers and the route its health is asked on."""

    key: str  # the Replica's id, as text
    address: str  # http://host:port
    health_path: str


@dataclass
class Route:
    """A live endpoint as the edge serves it."""

    id: int
    tenant_id: int
    tenant_slug: str
    name: str
    default_deadline_ms: float
    queue_limit: int
    stopping: bool
    desired_replicas: int
    starting: bool
    engine: str  # runners.backends.engines: "shipped" (the portal's own server) or a foreign engine
    targets: list[Target] = field(default_factory=list)


@dataclass(frozen=True)
class WorkspaceRoute:
    """A workspace as the edge passes to it: who may open it, and where its server answers while ready."""

    id: int
    tenant_id: int
    owner_id: int
    shared: bool
    address: str  # unix:/path or http://host:port; "" while it is not ready
    key: str
    state: str


@dataclass(frozen=True)
class Caller:
    user_id: int
    username: str
    is_staff: bool
    # The tenants the caller belongs to, with the role in each.
    roles: dict[int, str]
    via_session: bool


def _read_table() -> dict[tuple[str, str], Route]:
    from runners.inference.models import EndpointState, InferenceEndpoint, Replica
    from runners.jobs.models import JobState

    close_old_connections()
    routes: dict[int, Route] = {}
    for row in InferenceEndpoint.objects.exclude(state=EndpointState.STOPPED).values(
            "id", "tenant_id", "tenant__slug", "name", "spec", "stop_requested_at", "desired_replicas", "state"):
        spec = row["spec"] or {}
        engine = str(spec.get("engine") or engines.SHIPPED)
        routes[row["id"]] = Route(
            id=row["id"], tenant_id=row["tenant_id"], tenant_slug=row["tenant__slug"], name=row["name"],
            default_deadline_ms=float(spec.get("default_deadline_ms") or 10_000),
            queue_limit=int(spec.get("queue_limit") or 64), stopping=row["stop_requested_at"] is not None,
            desired_replicas=row["desired_replicas"],
            starting=row["desired_replicas"] == 0 or row["state"] != EndpointState.READY, engine=engine)
    replicas = Replica.objects.filter(endpoint_id__in=list(routes), ready=True, retiring=False,
                                      job__state=JobState.RUNNING).exclude(address="")
    for replica_id, endpoint_id, address in replicas.order_by("id").values_list("id", "endpoint_id", "address"):
        route = routes[endpoint_id]
        try:
            health = engines.health_path(route.engine)
        except (KeyError, ValueError):
            health = "/readyz"
        route.targets.append(Target(str(replica_id), address.rstrip("/"), health))
    return {(route.tenant_slug, route.name): route for route in routes.values()}


WORKSPACE_COLUMNS = ("id", "tenant_id", "owner_id", "shared", "address", "key", "state")
# A workspace the table holds as missing or not ready is read again from the database at most this often: a
# workspace that has just become ready is served at once, and requests for one that is not cost a read at most
# this often each.
WORKSPACE_REREAD_S = 0.25


def _read_workspaces() -> dict[int, WorkspaceRoute]:
    from runners.workspaces.models import Workspace

    close_old_connections()
    return {row[0]: WorkspaceRoute(*row) for row in Workspace.objects.values_list(*WORKSPACE_COLUMNS)}


def _read_workspace(workspace_id: int) -> WorkspaceRoute | None:
    from runners.workspaces.models import Workspace

    close_old_connections()
    row = Workspace.objects.filter(id=workspace_id).values_list(*WORKSPACE_COLUMNS).first()
    return WorkspaceRoute(*row) if row else None


def _note_request(endpoint_id: int, wake: bool) -> None:
    from django.utils import timezone

    from runners.inference.models import InferenceEndpoint
    from runners.inference.services import kick_reconcile

    close_old_connections()
    InferenceEndpoint.objects.filter(id=endpoint_id).update(last_request_at=timezone.now())
    if wake:
        kick_reconcile()


def _caller_by_token(token: str) -> Caller | None:
    from rest_framework.exceptions import AuthenticationFailed

    from tenants.auth import TokenAuthentication

    close_old_connections()
    try:
        user, _ = TokenAuthentication().authenticate_credentials(token.encode())
    except AuthenticationFailed:
        return None
    return _caller(user, via_session=False)


def _caller_by_session(session_key: str) -> Caller | None:
    from importlib import import_module

    from django.conf import settings
    from django.contrib.auth import get_user
    from django.http import HttpRequest

    close_old_connections()
    request = HttpRequest()
    request.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key=session_key)
    user = get_user(request)
    if not user.is_authenticated:
        return None
    return _caller(user, via_session=True)


def _caller(user, *, via_session: bool) -> Caller | None:
    from tenants.models import Membership

    if not user.is_active:
        return None
    roles = dict(Membership.objects.filter(user=user).values_list("tenant_id", "role"))
    return Caller(user_id=user.id, username=user.get_username(), is_staff=user.is_staff, roles=roles,
                  via_session=via_session)


class Table:
    """The routing table and the callers' cache; ``start()`` begins the refresher, ``stop()`` ends it."""

    def __init__(self, *, refresh_s: float, auth_cache_s: float, note_every_s: float = 2.0) -> None:
        self.refresh_s = refresh_s
        self.auth_cache_s = auth_cache_s
        self.note_every_s = note_every_s
        self.routes: dict[tuple[str, str], Route] = {}
        self.workspaces: dict[int, WorkspaceRoute] = {}
        self.loaded = asyncio.Event()
        self.refreshed_at = 0.0
        self._callers: dict[str, tuple[float, Caller | None]] = {}
        # One lookup at a time per credential: when a cached caller expires under load, the requests that
        # arrive meanwhile wait for that lookup instead of each sending its own (a stampede on the database).
        self._looking_up: dict[str, asyncio.Future] = {}
        self._noted: dict[int, float] = {}
        self._reread: dict[int, float] = {}
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._db = sync_to_async(lambda fn, *args: fn(*args), thread_sensitive=True)
        self.changed = asyncio.Condition()

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresher())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._background):
            task.cancel()

    async def refresh(self) -> None:
        self.routes = await self._db(_read_table)
        self.workspaces = await self._db(_read_workspaces)
        self.refreshed_at = asyncio.get_running_loop().time()
        self.loaded.set()
        async with self.changed:
            self.changed.notify_all()

    async def _refresher(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # the database away a moment: serve from what was read last
                log.exception("the edge could not read its routing table; serving the last one read")

    async def wait_change(self, timeout: float) -> None:
        """Wait for the next refresh of the table (or ``timeout`` seconds)."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait(), timeout)
            except TimeoutError:
                pass

    def route(self, tenant: str, name: str) -> Route | None:
        return self.routes.get((tenant, name))

    def workspace(self, workspace_id: int) -> WorkspaceRoute | None:
        return self.workspaces.get(workspace_id)

    async def workspace_now(self, workspace_id: int) -> WorkspaceRoute | None:
        """The workspace as the table holds it, or, where that would refuse it (missing, or not ready), as the
        database has it now: the portal says "ready" the moment it writes so, and a person who opens it then must
        not get "not ready yet" from a table read a moment before. Read again at most every WORKSPACE_REREAD_S, and only one
        the table holds as not ready or one newer than any it holds."""
        known = self.workspaces.get(workspace_id)
        if known is not None and known.address:
            return known
        if known is None and workspace_id <= max(self.workspaces, default=0):
            return None  # not one made since the table was read: a wrong id costs no read
        now = time.monotonic()
        if self._reread.get(workspace_id, 0.0) > now:
            return known
        if len(self._reread) > 10_000:
            self._reread = {key: until for key, until in self._reread.items() if until > now}
        self._reread[workspace_id] = now + WORKSPACE_REREAD_S
        found = await self._db(_read_workspace, workspace_id)
        if found is None:
            self.workspaces.pop(workspace_id, None)
        else:
            self.workspaces[workspace_id] = found
        return found

    async def caller(self, *, token: str | None, session_key: str | None) -> Caller | None:
        """Who sends the request (None: the token or session is not valid); cached EDGE_AUTH_CACHE_S."""
        if token is not None:
            key, lookup, argument = "t:" + hashlib.sha256(token.encode()).hexdigest(), _caller_by_token, token
        else:
            key, lookup, argument = "s:" + hashlib.sha256(session_key.encode()).hexdigest(), _caller_by_session, session_key
        while True:
            now = time.monotonic()
            cached = self._callers.get(key)
            if cached is not None and cached[0] > now:
                return cached[1]
            pending = self._looking_up.get(key)
            if pending is None:
                break
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                if pending.cancelled():  # the request that looked it up went away: look again
                    continue
                raise
        pending = self._looking_up[key] = asyncio.get_running_loop().create_future()
        try:
            found = await self._db(lookup, argument)
        except asyncio.CancelledError:
            pending.cancel()
            raise
        except BaseException as error:
            pending.set_exception(error)
            pending.exception()  # marked retrieved: there may be nobody waiting for it
            raise
        else:
            pending.set_result(found)
        finally:
            del self._looking_up[key]
        if len(self._callers) > 10_000:
            self._callers = {k: v for k, v in self._callers.items() if v[0] > now}
        self._callers[key] = (now + self.auth_cache_s, found)
        return found

    def note_request(self, route: Route) -> None:
        """Note the request for the autoscaler's idle clock (at most every few seconds, each time while the
        endpoint is scaled to zero, when the note and a kicked reconcile wake it), off the request path."""
        now = time.monotonic()
        waking = route.desired_replicas == 0
        if not waking and now - self._noted.get(route.id, -1e9) < self.note_every_s:
            return
        if waking and now - self._noted.get(route.id, -1e9) < 0.25:
            return
        self._noted[route.id] = now
        task = asyncio.create_task(self._note(route.id, waking))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _note(self, endpoint_id: int, waking: bool) -> None:
        try:
            await self._db(_note_request, endpoint_id, waking)
        except Exception:
            log.exception("the edge could not note a request on endpoint %s", endpoint_id)

"""The edge: the asynchronous front that serves endpoints (``/serve/<tenant>/<endpoint>/v1/...``).

One Starlette app, run by uvicorn (``python -m runners.edge``). For each request it notes the arrival
time (the deadline's clock starts there), checks the caller against the portal's own API tokens and
session cookie (cached a few seconds), finds the endpoint and its ready replicas in a routing table
read from the database in the background, admits the request or refuses it at once (429 with
Retry-After: nothing waits unseen), and forwards it to a replica with ``X-Portal-Deadline-Ms``: what is
left of the deadline. The answer streams back as it comes. A replica that refuses the connection,
resets it, or times out before any byte of the answer is left for the next one within the deadline; so
is one the edge's own probes find silent (runners/edge/probes.py). A client that goes away closes the
replica's connection at once, so nothing is left computing for it. Every other path passes through to
the portal's web process (gunicorn) when the edge stands in front of it (``--upstream``), WebSockets too.

Nothing here holds a thread or a database connection while a replica works: the database is read by
the table's one background thread (runners/edge/table.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging
import math
from dataclasses import dataclass

import aiohttp
from starlette.applications import Starlette
from starlette.routing import Route as StarletteRoute
from starlette.routing import WebSocketRoute

from runners.backends.base import WORKSPACE_KEY_HEADER, WORKSPACE_USER_HEADER
from runners.edge import proxy
from runners.edge.probes import Prober, ReplicaState
from runners.edge.table import SHIPPED, Caller, Route, Table, WorkspaceRoute
from runners.workloads.serve_settings import DEADLINE_HEADER, REFUSED_HEADER

log = logging.getLogger("runners.edge")

try:  # replica choice by shared prompt prefix (runners/edge/prefix.py), else by load alone
    from runners.edge.prefix import PrefixRouter, ReplicaLoad
except ImportError:  # pragma: no cover - until the prefix router is in
    PrefixRouter = None

    @dataclass(frozen=True)
    class ReplicaLoad:
        key: str
        outstanding_tokens: int

# The routes an endpoint answers through the edge: the native one and the OpenAI ones.
ROUTES = ("v1/generate", "v1/completions", "v1/chat/completions")
# Headers of a replica's answer passed to the caller.
PASSED_HEADERS = ("content-type", "content-length", "retry-after", "x-time-to-first-token-ms", "cache-control",
                  "x-request-id")
# Headers of the caller's request passed to the replica (the caller's credentials never are).
FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "user-agent")


@dataclass
class EdgeConfig:
    max_body_bytes: int = 64 * 1024
    table_refresh_s: float = 0.5
    auth_cache_s: float = 5.0
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 0.5
    probe_failures: int = 2
    deadline_margin_ms: float = 50.0
    in_flight_per_replica: int = 0  # 0: twice the endpoint's queue_limit
    connect_timeout_s: float = 1.0
    max_deadline_ms: float = 120_000.0

    @classmethod
    def from_settings(cls) -> EdgeConfig:
        from django.conf import settings

        from runners.inference.services import max_deadline_ms

        return cls(
            max_body_bytes=settings.EDGE_MAX_BODY_BYTES,
            table_refresh_s=settings.EDGE_TABLE_REFRESH_S,
            auth_cache_s=settings.EDGE_AUTH_CACHE_S,
            probe_interval_s=settings.EDGE_PROBE_INTERVAL_S,
            probe_timeout_s=settings.EDGE_PROBE_TIMEOUT_S,
            probe_failures=settings.EDGE_PROBE_FAILURES,
            deadline_margin_ms=settings.EDGE_DEADLINE_MARGIN_MS,
            in_flight_per_replica=settings.EDGE_IN_FLIGHT_PER_REPLICA,
            connect_timeout_s=settings.EDGE_CONNECT_TIMEOUT_S,
            max_deadline_ms=float(max_deadline_ms()),
        )


class Refusal(Exception):
    def __init__(self, status: int, body: dict, headers: dict | None = None) -> None:
        self.status, self.body, self.headers = status, body, headers or {}


def _json(status: int, body: dict, headers: dict | None = None) -> tuple[int, list, bytes]:
    raw = [(b"Content-Type", b"application/json")]
    raw += [(name.encode(), str(value).encode()) for name, value in (headers or {}).items()]
    return status, raw, json.dumps(body).encode()


async def _answer(send, status: int, body: dict, headers: dict | None = None) -> None:
    status, raw, data = _json(status, body, headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _credentials(scope) -> tuple[str | None, str | None]:
    """(API token, session key) of the request: ``Authorization: Token <t>`` or ``Bearer <t>`` (the
    OpenAI client's), else the portal's session cookie."""
    authorization = _header(scope, b"authorization")
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() in ("token", "bearer") and token.strip():
            return token.strip(), None
        raise Refusal(401, {"detail": "Invalid token header."}, {"WWW-Authenticate": "Token"})
    return None, _session_key(scope)


def _session_key(scope) -> str | None:
    """The portal's session cookie of the request, if it has one."""
    from http.cookies import SimpleCookie

    from django.conf import settings

    cookie = _header(scope, b"cookie")
    if not cookie:
        return None
    jar = SimpleCookie()
    try:
        jar.load(cookie)
    except Exception:
        return None
    return jar[settings.SESSION_COOKIE_NAME].value if settings.SESSION_COOKIE_NAME in jar else None


def _csrf_refusal(scope, body: bytes) -> tuple[int, bytes] | None:
    """Django's own CSRF check for a request authenticated by its session cookie (as DRF checks one)."""
    import io

    from django.core.handlers.asgi import ASGIRequest
    from django.middleware.csrf import CsrfViewMiddleware

    request = ASGIRequest(dict(scope, path=scope["path"]), io.BytesIO(body))
    refusal = CsrfViewMiddleware(lambda request: None).process_view(request, None, (), {})
    if refusal is None:
        return None
    return 403, json.dumps({"detail": "CSRF Failed: the request lacks the page's CSRF token."}).encode()


def _checked_body(body: bytes, route_kind: str) -> dict:
    """The body read as the edge needs it (what it costs, its deadline, whether it streams); 400 naming the
    field for what it cannot read. Everything else is the replica's to judge."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise Refusal(400, {"body": ["Not UTF-8 text."]}) from None
    except ValueError as exc:
        raise Refusal(400, {"body": [f"Not JSON: {exc}."]}) from None
    if not isinstance(data, dict):
        raise Refusal(400, {"body": ["Must be a JSON object."]})
    if "deadline_ms" in data:
        deadline = data["deadline_ms"]
        finite = isinstance(deadline, (int, float)) and not isinstance(deadline, bool)
        if finite:
            try:
                finite = math.isfinite(deadline)
            except OverflowError:
                finite = False
        if not finite:
            raise Refusal(400, {"deadline_ms": ["A finite number of milliseconds."]})
        if deadline <= 0:
            raise Refusal(400, {"deadline_ms": ["Must be positive: the deadline is that long after the request "
                                                "arrives."]})
    if "stream" in data and not isinstance(data["stream"], bool):
        raise Refusal(400, {"stream": ["Must be true or false."]})
    if route_kind == "v1/chat/completions" and "messages" in data and not isinstance(data["messages"], list):
        raise Refusal(400, {"messages": ["Must be a list of messages."]})
    return data


def _cost(data: dict) -> tuple[int, str]:
    """(tokens the request may cost: prompt bytes plus max_tokens, the prompt text the prefix router reads)."""
    prompt = data.get("prompt")
    if isinstance(prompt, list):
        prompt = "".join(part for part in prompt if isinstance(part, str))
    if not isinstance(prompt, str):
        parts = []
        for message in data.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
        prompt = "\n".join(parts)
    tokens = data.get("max_tokens", data.get("max_completion_tokens"))
    tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 16
    return max(1, min(len(prompt.encode("utf-8", "replace")) + tokens, 1 << 30)), prompt


class Edge:
    """The edge's state: the table, the probes, the HTTP client, the counts in flight."""

    def __init__(self, *, config: EdgeConfig | None = None, upstream: str | None = None,
                 table: Table | None = None) -> None:
        self.config = config
        self.upstream = upstream.rstrip("/") if upstream else None
        self.given_table = table
        self.in_flight: dict[int, int] = {}
        self.router = None
        self.table: Table | None = None
        self.prober: Prober | None = None
        self.client: aiohttp.ClientSession | None = None
        self.passthrough: aiohttp.ClientSession | None = None
        # A pool per workspace server reached over a Unix socket (aiohttp's connector holds one path).
        self.workspace_sessions: dict[str, aiohttp.ClientSession] = {}
        self._sync_task: asyncio.Task | None = None

    async def startup(self) -> None:
        if self.config is None:
            self.config = await asyncio.to_thread(EdgeConfig.from_settings)
        c = self.config
        self.client = proxy.client_session(connect_timeout_s=c.connect_timeout_s)
        self.passthrough = proxy.client_session(connect_timeout_s=5.0)
        self.router = PrefixRouter() if PrefixRouter is not None else None
        self.prober = Prober(self.client, interval_s=c.probe_interval_s, timeout_s=c.probe_timeout_s,
                             failures=c.probe_failures)
        if self.router is not None:
            self.prober.on_gone = self.router.forget
        self.table = self.given_table or Table(refresh_s=c.table_refresh_s, auth_cache_s=c.auth_cache_s)
        await self.table.start()
        self._sync_probes()
        self._sync_task = asyncio.create_task(self._keep_probes())
        log.info("the edge serves %d endpoints%s", len(self.table.routes),
                 f"; everything else passes to {self.upstream}" if self.upstream else "")

    async def shutdown(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
        if self.table is not None:
            await self.table.stop()
        if self.prober is not None:
            await self.prober.stop()
        for client in (self.client, self.passthrough, *self.workspace_sessions.values()):
            if client is not None:
                await client.close()

    def _sync_probes(self) -> None:
        self.prober.sync([target for route in self.table.routes.values() for target in route.targets])

    async def _keep_probes(self) -> None:
        while True:
            await self.table.wait_change(self.config.table_refresh_s * 4)
            self._sync_probes()

    # --- the serving route ------------------------------------------------------------------------------

    async def serve(self, scope, receive, send) -> None:
        arrived = scope.get("edge.arrived") or asyncio.get_running_loop().time()
        params = scope["path_params"]
        try:
            await self._serve(scope, receive, send, arrived, params["tenant"], params["name"], params["route"])
        except Refusal as refusal:
            await _answer(send, refusal.status, refusal.body, refusal.headers)
        except proxy.ClientGone:
            return

    async def _identify(self, scope) -> Caller:
        token, session_key = _credentials(scope)
        if token is None and session_key is None:
            raise Refusal(401, {"detail": "Authentication credentials were not provided."},
                          {"WWW-Authenticate": "Token"})
        caller = await self.table.caller(token=token, session_key=session_key)
        if caller is None:
            if token is not None:
                raise Refusal(401, {"detail": "Invalid token."}, {"WWW-Authenticate": "Token"})
            raise Refusal(401, {"detail": "Authentication credentials were not provided."},
                          {"WWW-Authenticate": "Token"})
        return caller

    async def _serve(self, scope, receive, send, arrived: float, tenant: str, name: str, kind: str) -> None:
        from tenants.models import Role, role_at_least

        loop = asyncio.get_running_loop()
        c = self.config
        if scope["method"] != "POST":
            raise Refusal(405, {"detail": f'Method "{scope["method"]}" not allowed.'}, {"Allow": "POST"})
        caller = await self._identify(scope)
        route = self.table.route(tenant, name)
        role = caller.roles.get(route.tenant_id) if route is not None else None
        if route is None or not (caller.is_staff or role is not None):
            raise Refusal(404, {"detail": "No such endpoint."})
        if not (caller.is_staff or role_at_least(role, Role.MEMBER)):
            raise Refusal(403, {"detail": "Viewers read endpoints; generating takes a member of the tenant."})
        # Before the body is read: the cheapest refusal there is.
        self._open(route, [state for state in map(self.prober.state, route.targets) if not state.out])
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > c.max_body_bytes:
            raise Refusal(413, {"body": [f"The body is over {c.max_body_bytes} bytes."]})
        body = await proxy.read_body(receive, c.max_body_bytes)
        if body is None:
            raise Refusal(413, {"body": [f"The body is over {c.max_body_bytes} bytes."]})
        if caller.via_session:
            refusal = _csrf_refusal(scope, body)
            if refusal is not None:
                raise Refusal(403, json.loads(refusal[1]))
        if route.stopping:
            raise Refusal(503, {"detail": f"Endpoint {route.name} is stopping."}, {"Retry-After": 30})
        data = _checked_body(body, kind)
        deadline_ms = float(data.get("deadline_ms") or route.default_deadline_ms)
        # Never longer than any request may ask (a drain must be able to answer it); the replica refuses more.
        deadline_ms = min(deadline_ms, c.max_deadline_ms)
        give_up_at = arrived + deadline_ms / 1000.0
        cost, prompt = _cost(data)

        limit = max(1, len(route.targets)) * (c.in_flight_per_replica or 2 * route.queue_limit)
        if self.in_flight.get(route.id, 0) >= limit:
            raise Refusal(429, {"detail": f"Endpoint {route.name} has {limit} requests in flight; try again."},
                          {"Retry-After": 1})
        self.table.note_request(route)
        self.in_flight[route.id] = self.in_flight.get(route.id, 0) + 1
        try:
            await self._forward(scope, receive, send, route, kind, body, data, cost, prompt, give_up_at, loop)
        finally:
            left = self.in_flight.get(route.id, 1) - 1
            if left > 0:
                self.in_flight[route.id] = left
            else:
                self.in_flight.pop(route.id, None)

    def _replica_cap(self, route: Route) -> int:
        return self.config.in_flight_per_replica or 2 * route.queue_limit

    def _open(self, route: Route, states: list[ReplicaState], *, refuse: bool = True) -> list[ReplicaState]:
        """Those of ``states`` (replicas in rotation) below their limit; when there are some and none is, and
        ``refuse``, the request is refused here, at once (429 with Retry-After), as the replicas would refuse it."""
        cap = self._replica_cap(route)
        open_states = [state for state in states if state.admits(cap)]
        if refuse and states and not open_states:
            raise Refusal(429, {"detail": f"Endpoint {route.name} is at capacity; try again."}, {"Retry-After": 1})
        return open_states

    def _choices(self, route: Route, tried: set[str], prompt: str) -> list[ReplicaState]:
        states = [self.prober.state(target) for target in route.targets]
        states = [state for state in states if not state.out and state.target.key not in tried]
        # After a replica's refusal: the others below their limit, or none (that refusal is then the answer).
        states = self._open(route, states, refuse=not tried)
        if len(states) <= 1 or self.router is None:
            return sorted(states, key=lambda state: (state.outstanding, int(state.target.key)
                                                     if state.target.key.isdigit() else 0))
        by_key = {state.target.key: state for state in states}
        order = self.router.order(prompt, [ReplicaLoad(state.target.key, state.outstanding) for state in states])
        return [by_key[key] for key in order if key in by_key]

    async def _forward(self, scope, receive, send, route: Route, kind: str, body: bytes, data: dict, cost: int,
                       prompt: str, give_up_at: float, loop) -> None:
        c = self.config
        margin = c.deadline_margin_ms / 1000.0
        tried: set[str] = set()
        last_refusal: tuple[int, list, bytes] | None = None
        waited = False
        headers = [(name, value) for name, value in proxy.request_headers(scope)
                   if name.lower() in FORWARDED_HEADERS]
        # One watch on the client for the whole request: its leaving ends whatever is under way for it.
        gone = asyncio.ensure_future(proxy.until_disconnect(receive))
        try:
            while True:
                if gone.done():
                    raise proxy.ClientGone()
                choices = self._choices(route, tried, prompt)
                if not choices:
                    if last_refusal is not None:
                        await self._pass_refusal(send, last_refusal)
                        return
                    if tried:
                        raise Refusal(503, {"detail": "Every ready replica refused, reset or stopped answering; try "
                                                      "again."}, {"Retry-After": 2})
                    # Cold start (or every replica out of rotation): wait for one within the deadline.
                    if loop.time() + 0.05 >= give_up_at:
                        raise Refusal(503, {"detail": "No replica is ready yet (starting); try again."
                                            if route.starting else "No replica is ready."}, {"Retry-After": 5})
                    self.table.note_request(route)
                    await self.table.wait_change(min(c.table_refresh_s, max(0.01, give_up_at - loop.time())))
                    route = self.table.route(route.tenant_slug, route.name) or route
                    waited = True
                    continue
                state = choices[0]
                left_ms = (give_up_at - loop.time()) * 1000.0
                if left_ms < 1:
                    if not tried and not waited:  # too short to be met at all: refused at once, as a replica would
                        raise Refusal(429, {"detail": "The deadline is too short to be met; give a longer "
                                                      "deadline_ms."}, {"Retry-After": 1})
                    raise Refusal(504, {"detail": "The deadline passed before a replica could take the request."})
                content = body
                asked = data.get("deadline_ms")
                if route.engine == SHIPPED and (waited or asked is not None and asked > c.max_deadline_ms):
                    # The shipped server counts a body's deadline from when the request reaches it.
                    content = json.dumps(dict(data, deadline_ms=round(left_ms, 1))).encode()
                out_headers = headers + [(DEADLINE_HEADER, f"{left_ms:.1f}")]
                state.outstanding += cost
                state.in_flight += 1
                if self.router is not None:
                    # Noted as it is sent, as SGLang's router does: the next request with this prefix follows it at
                    # once, not only after this one's answer (bench/prefix_routing.py: 58 % hits against 46 %).
                    self.router.record(state.target.key, prompt)
                try:
                    ended, refusal = await self._exchange(send, gone, route, state, f"{state.target.address}/{kind}",
                                                          out_headers, content, give_up_at + margin,
                                                          alternatives=len(choices) > 1, loop=loop)
                finally:
                    state.outstanding = max(0, state.outstanding - cost)
                    state.in_flight = max(0, state.in_flight - 1)
                if ended:
                    return
                # Not taken there: the next replica, with what is left of the deadline.
                last_refusal = refusal or last_refusal
                tried.add(state.target.key)
                waited = True
        finally:
            gone.cancel()
            if gone.done() and not gone.cancelled():
                gone.exception()  # retrieved, whatever ended the watch

    async def _exchange(self, send, gone: asyncio.Future, route: Route, state: ReplicaState, url: str, headers,
                        content: bytes, give_up_at: float, *, alternatives: bool, loop,
                        ) -> tuple[bool, tuple[int, list, bytes] | None]:
        """One try at one replica: (True, None) once its answer has been passed to the client, whole or cut at
        the deadline; (False, its refusal or None) when the next replica should have the request: it refused
        (429/503) and there is another, it did not take the request (refused the connection, reset it), or
        the probes found it hung before its answer began. Raises Refusal(504) when the deadline passes before
        the answer begins, and ClientGone when the client leaves.

        The try runs as one task that three things may stop: the deadline (a timer), the client leaving (the
        request's watch) and the probes finding the replica hung (`ReplicaState.waiting`, until the answer
        begins). Nothing else is created for it: no task per chunk, no waiting on several things at once."""
        cap = self._replica_cap(route)
        started: list = []
        why: list[str] = []

        async def exchange() -> tuple[bool, tuple[int, list, bytes] | None]:
            response = await proxy.open_upstream(self.client, "POST", url, headers, content)
            if response.status == 429 and response.headers.get(REFUSED_HEADER) != "deadline":
                state.refused(loop.time(), cap)
            elif response.status < 400:
                state.answered(cap)
            if response.status in (429, 503) and alternatives:
                # Full or draining: the next replica may answer within the deadline.
                try:
                    refused = await response.read()  # read to its end: the connection is back in the pool
                except proxy.UPSTREAM_ERRORS:
                    refused = b""
                    proxy.let_go(response, whole=False)
                return False, (response.status, proxy.answer_headers(response, keep=PASSED_HEADERS), refused)
            state.waiting.pop(task, None)  # from here, a replica that hangs is the deadline's to end
            answer_headers = proxy.answer_headers(response, keep=PASSED_HEADERS)
            answer_headers.append((b"X-Portal-Replica", state.target.key.encode()))
            await proxy.pump(send, response, answer_headers, started)
            return True, None

        def stop(reason: str) -> None:
            if not why and not task.done():
                why.append(reason)
                task.cancel()

        def client_left(_) -> None:
            stop("client-gone")

        task = asyncio.ensure_future(exchange())
        timer = loop.call_at(give_up_at, stop, "deadline")
        gone.add_done_callback(client_left)
        state.waiting[task] = stop
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not why or (current is not None and current.cancelling()):
                raise  # not one of ours: the edge itself is stopping
            if why[0] == "client-gone":
                raise proxy.ClientGone() from None
            if started:  # the deadline passed mid-answer: the answer is cut where it stands
                with contextlib.suppress(OSError):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return True, None
            if why[0] == "hung":
                log.warning("replica %s stopped answering; its request goes to the next one", state.target.key)
                return False, None
            raise Refusal(504, {"detail": "The deadline passed before the answer."}) from None
        except proxy.UPSTREAM_ERRORS as exc:
            log.info("replica %s did not take the request (%s); trying the next", state.target.key,
                     type(exc).__name__)
            return False, None
        finally:
            timer.cancel()
            gone.remove_done_callback(client_left)
            state.waiting.pop(task, None)

    async def _pass_refusal(self, send, refusal: tuple[int, list, bytes]) -> None:
        status, headers, body = refusal
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    # --- workspaces: JupyterLab behind the portal's sign-in ----------------------------------------------------

    async def _workspace_for(self, scope) -> tuple[WorkspaceRoute, Caller]:
        """The workspace the path names and who asks, when they may open it: its owner, or a member of its
        tenant where the owner shares it. Anyone else, signed in or not, gets the 404 of a workspace that
        does not exist."""
        from tenants.models import Role, role_at_least

        missing = Refusal(404, {"detail": "No such workspace."})
        try:
            token, session_key = _credentials(scope)
        except Refusal:
            raise missing from None
        if token is not None and session_key is None:
            # JupyterLab's pages may send an Authorization header of Jupyter's own: the portal's session, when
            # the browser has one, is who asks.
            session_key = _session_key(scope)
            if session_key is not None:
                token = None
        caller = await self.table.caller(token=token, session_key=session_key) if token or session_key else None
        if caller is None:
            raise missing
        workspace = await self.table.workspace_now(scope["path_params"]["id"])
        if workspace is None:
            raise missing
        if caller.user_id != workspace.owner_id and not (
                workspace.shared and role_at_least(caller.roles.get(workspace.tenant_id), Role.MEMBER)):
            raise missing
        return workspace, caller

    def _workspace_headers(self, scope, workspace: WorkspaceRoute, caller: Caller) -> list[tuple[str, str]]:
        """What the edge adds: the workspace's key and who asks. The caller's own credentials (the portal's
        session and CSRF cookies, an API token) never reach the workspace, where its member's code runs;
        JupyterLab's own cookies pass."""
        from django.conf import settings

        headers = [(WORKSPACE_KEY_HEADER, workspace.key), (WORKSPACE_USER_HEADER, caller.username)]
        cookie = _header(scope, b"cookie")
        if cookie:
            portal = {settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME}
            kept = [part.strip() for part in cookie.split(";")
                    if part.strip() and part.strip().split("=", 1)[0].strip() not in portal]
            if kept:
                headers.append(("cookie", "; ".join(kept)))
        return headers

    def _workspace_session(self, address: str) -> tuple[aiohttp.ClientSession, str, str | None]:
        """(pool, base URL, Unix socket) for a workspace's server."""
        if address.startswith("unix:"):
            path = address[len("unix:"):]
            session = self.workspace_sessions.get(path)
            if session is None:
                if len(self.workspace_sessions) >= 256:  # servers long gone: their pools go too
                    live = {w.address[len("unix:"):] for w in self.table.workspaces.values() if w.address}
                    for gone in [p for p in self.workspace_sessions if p not in live]:
                        asyncio.ensure_future(self.workspace_sessions.pop(gone).close())
                session = self.workspace_sessions[path] = proxy.unix_session(
                    path, connect_timeout_s=self.config.connect_timeout_s)
            return session, "http://workspace", path
        return self.passthrough, address.rstrip("/"), None

    async def serve_workspace(self, scope, receive, send) -> None:
        try:
            workspace, caller = await self._workspace_for(scope)
            if scope["method"] not in ("GET", "HEAD", "OPTIONS") and not _same_origin(scope):
                raise Refusal(403, {"detail": "A workspace takes changes from its own pages only (the Origin "
                                              "differs from the Host)."})
            if not workspace.address:
                if scope["method"] == "GET" and "text/html" in (_header(scope, b"accept") or ""):
                    await _answer_waiting(send, workspace)
                    return
                raise Refusal(503, {"detail": f"The workspace is {workspace.state}, not ready yet."},
                              {"Retry-After": WORKSPACE_RETRY_S})
        except Refusal as refusal:
            await _answer(send, refusal.status, refusal.body, refusal.headers)
            return
        session, base, _ = self._workspace_session(workspace.address)
        await proxy.forward_http(scope, receive, send, session, base,
                                 extra_headers=self._workspace_headers(scope, workspace, caller),
                                 drop=WORKSPACE_DROPPED, unreachable="The workspace did not answer")

    async def workspace_websocket(self, scope, receive, send) -> None:
        try:
            workspace, caller = await self._workspace_for(scope)
            if not _same_origin(scope):
                raise Refusal(403, {"detail": "The Origin differs from the Host."})
            if not workspace.address:
                raise Refusal(503, {"detail": f"The workspace is {workspace.state}, not ready yet."})
        except Refusal as refusal:
            await _refuse_websocket(scope, send, refusal)
            return
        _, base, socket_path = self._workspace_session(workspace.address)
        query = scope.get("query_string", b"").decode("latin-1")
        host = _header(scope, b"host") or "workspace"
        where = f"ws://{host}" if socket_path else "ws" + base[len("http"):]
        url = where + scope.get("raw_path", scope["path"].encode()).decode("latin-1") + (f"?{query}" if query else "")
        headers = [(name, value) for name, value in proxy.request_headers(scope, drop=(
            "host", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
            "sec-websocket-protocol", *WORKSPACE_DROPPED))]
        await proxy.forward_websocket(scope, receive, send, url, unix_socket=socket_path,
                                      extra_headers=headers + self._workspace_headers(scope, workspace, caller),
                                      open_timeout_s=WORKSPACE_OPEN_TIMEOUT_S)

    # --- everything else: passed to the portal's web process ------------------------------------------------

    async def pass_http(self, scope, receive, send) -> None:
        if self.upstream is None:
            # Alone (Kubernetes: the ingress sends only /serve/ here), the edge answers its own probes:
            # alive while its loop runs, ready while its routing table is fresh.
            if scope["path"] == "/healthz":
                await _answer(send, 200, {"status": "ok"})
            elif scope["path"] == "/readyz":
                age = asyncio.get_running_loop().time() - self.table.refreshed_at
                fresh = age < max(10.0, 10 * self.config.table_refresh_s)
                await _answer(send, 200 if fresh else 503, {"status": "ok" if fresh else "unavailable",
                                                            "table_age_s": round(age, 1)})
            else:
                await _answer(send, 404, {"detail": "Not found."})
            return
        await proxy.forward_http(scope, receive, send, self.passthrough, self.upstream)

    async def pass_websocket(self, scope, receive, send) -> None:
        if self.upstream is None:
            await send({"type": "websocket.close", "code": 1000})
            return
        query = scope.get("query_string", b"").decode("latin-1")
        url = "ws" + self.upstream[len("http"):] + scope["path"] + (f"?{query}" if query else "")
        headers = [(name, value) for name, value in proxy.request_headers(scope, drop=(
            "host", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
            "sec-websocket-protocol"))]
        await proxy.forward_websocket(scope, receive, send, url, extra_headers=headers)


# How long a WebSocket to a workspace may take to open: JupyterLab holds a kernel's first channel until the
# kernel answers (its kernel_info_timeout, 60 s), and a kernel still starting must not fail the page's channel.
WORKSPACE_OPEN_TIMEOUT_S = 65
# How soon a request to a workspace that is not ready may try again (Retry-After; the waiting page's reload).
WORKSPACE_RETRY_S = 3

# The states in which a workspace becomes ready by itself: its waiting page reloads; in the others (stopping,
# stopped, failed) someone has to start it again, and the page says so once.
COMING_UP = ("queued", "starting")
WAITING_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">{refresh}
<title>Workspace not ready</title></head>
<body><main><h1>The workspace is {state}</h1>
<p>{what}</p><p><a href="/">Back to the portal</a></p></main></body>
</html>
"""


async def _answer_waiting(send, workspace: WorkspaceRoute) -> None:
    """A browser's page of a workspace that is not ready: a 503 page (a JSON refusal would leave the person
    before raw JSON), which reloads itself until the workspace is ready where it is on its way."""
    coming = workspace.state in COMING_UP
    body = WAITING_PAGE.format(
        state=html.escape(workspace.state),
        refresh=f'<meta http-equiv="refresh" content="{WORKSPACE_RETRY_S}">' if coming else "",
        what=(f"This page loads it again every {WORKSPACE_RETRY_S} seconds, and shows JupyterLab once the workspace "
              "is ready." if coming else "Start it again from its page in the portal."),
    ).encode()
    headers = [(b"Content-Type", b"text/html; charset=utf-8"), (b"Cache-Control", b"no-store")]
    if coming:
        headers.append((b"Retry-After", str(WORKSPACE_RETRY_S).encode()))
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# What a request to a workspace never carries on: the caller's credentials (the edge adds its own headers).
WORKSPACE_DROPPED = ("cookie", "authorization", WORKSPACE_KEY_HEADER.lower(), WORKSPACE_USER_HEADER.lower())


def _same_origin(scope) -> bool:
    """No Origin (not a browser's cross-site request), or one whose host is the Host the request came to."""
    from urllib.parse import urlsplit

    origin = _header(scope, b"origin")
    if origin is None:
        return True
    return urlsplit(origin).netloc.lower() == (_header(scope, b"host") or "").lower()


async def _refuse_websocket(scope, send, refusal: Refusal) -> None:
    """Refuse a WebSocket's handshake with the refusal's HTTP status where the server can (the ASGI
    denial-response extension), else by closing it before it opens (a 403)."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        status, raw, data = _json(refusal.status, refusal.body, refusal.headers)
        await send({"type": "websocket.http.response.start", "status": status, "headers": raw})
        await send({"type": "websocket.http.response.body", "body": data})
    else:
        await send({"type": "websocket.close", "code": 1008})


class _Asgi:
    """A raw ASGI endpoint for Starlette's router (a class instance is called as an ASGI app)."""

    def __init__(self, handler) -> None:
        self.handler = handler

    async def __call__(self, scope, receive, send) -> None:
        await self.handler(scope, receive, send)


def build(*, upstream: str | None = None, config: EdgeConfig | None = None, table: Table | None = None):
    """The edge's ASGI app. ``upstream``: the web process every other request passes to (none: 404);
    ``table``: where routes and callers come from (the database's, read in the background, unless given)."""

    edge = Edge(config=config, upstream=upstream, table=table)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await edge.startup()
        try:
            yield
        finally:
            await edge.shutdown()

    routes = [
        StarletteRoute("/serve/{tenant}/{name}/{route:path}", _Asgi(edge.serve), methods=None),
        StarletteRoute("/workspaces/{id:int}/{rest:path}", _Asgi(edge.serve_workspace), methods=None),
        WebSocketRoute("/workspaces/{id:int}/{rest:path}", _Asgi(edge.workspace_websocket)),
        StarletteRoute("/{rest:path}", _Asgi(edge.pass_http), methods=None),
        WebSocketRoute("/{rest:path}", _Asgi(edge.pass_websocket)),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.edge = edge

    async def stamped(scope, receive, send):
        """Notes each request's arrival (the deadline's clock) before anything else runs."""
        if scope["type"] in ("http", "websocket"):
            scope["edge.arrived"] = asyncio.get_running_loop().time()
            if scope["type"] == "http" and scope["path"].startswith("/serve/"):
                parts = scope["path"].split("/", 4)
                if len(parts) == 5 and parts[4] not in ROUTES:
                    await _answer(send, 404, {"detail": "No such route; an endpoint answers /v1/generate, "
                                                        "/v1/completions and /v1/chat/completions."})
                    return
                if len(parts) == 5 and parts[2] and parts[3]:
                    # The serving route straight to its handler: Starlette's router and middleware would match
                    # what was just split, at a tenth of the edge's CPU per request under load.
                    scope["path_params"] = {"tenant": parts[2], "name": parts[3], "route": parts[4]}
                    await edge.serve(scope, receive, send)
                    return
        await app(scope, receive, send)

    stamped.edge = edge
    stamped.app = app
    return stamped

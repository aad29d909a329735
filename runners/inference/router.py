"""The router: ``POST /serve/<tenant>/<endpoint>/v1/generate`` in the portal's own processes.

It checks the caller (a member of the endpoint's tenant, by API token or session; anyone else
gets 404, as for every tenant-owned object), picks the ready replica with the fewest outstanding
tokens (prompt bytes plus max_tokens of the requests it has sent there and not yet had answered),
and passes the request and the server's answer through unchanged: the server checks the body and
names the bad field, sheds with 429 / 503 and ``Retry-After``, and answers within the deadline.

An endpoint scaled to zero is woken by its first request: the request waits for a replica to be
ready within its own deadline, or gets a 503 with ``Retry-After``. A replica that refuses the
connection (it is draining and has closed its port) is skipped for the next one. So is one that
hangs: while a replica has not answered, the router asks its /readyz every HUNG_CHECK_S, and one
that answers neither (MISSES_BEFORE_NOT_READY times in a row) is left for another ready replica,
the request sent again with what is left of its deadline. With no other replica it waits on, up
to the deadline (and the server's margin), then answers 504.

The outstanding counts are per portal process: with several gunicorn workers each spreads its
own requests, which evens out over many requests.
"""

from __future__ import annotations

import http.client
import json
import math
import select
import threading
import time
from urllib.parse import urlsplit

from django.db import connection
from django.http import HttpResponse, JsonResponse
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.parsers import BaseParser
from rest_framework.views import APIView

from runners.inference.models import EndpointState, InferenceEndpoint, Replica
from runners.inference.reconcile import MISSES_BEFORE_NOT_READY
from runners.inference.selectors import endpoint_serving
from runners.inference.services import kick_reconcile, max_deadline_ms
from runners.jobs.models import JobState
from tenants.models import Role
from tenants.selectors import user_has_role

# How often the router notes a request on the endpoint's row (the autoscaler's idle clock).
NOTE_REQUEST_EVERY_S = 2.0
# How often a request waiting for a cold start looks for a ready replica.
COLD_START_POLL_S = 0.25
# Headers of the server's answer passed through to the caller.
PASSED_HEADERS = ("Retry-After", "X-Time-To-First-Token-Ms")
MAX_BODY_BYTES = 64 * 1024
# While a replica has not answered a request, its /readyz is asked this often (each with this timeout).
HUNG_CHECK_S = 1.0
# How long past the request's deadline the router waits for the server's own answer (its 504) before its own.
ANSWER_GRACE_S = 5.0

_outstanding: dict[int, int] = {}
_lock = threading.Lock()


class RawBody(BaseParser):
    """Takes any body as bytes: the server behind checks it (and its content type) itself."""

    media_type = "*/*"

    def parse(self, stream, media_type=None, parser_context=None):
        return stream.read(MAX_BODY_BYTES + 1) if stream is not None else b""


def _cost(body: bytes) -> tuple[int, float | None]:
    """(tokens the request may cost, its deadline in ms if it gave one), read leniently: the server judges the body."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return 1, None
    if not isinstance(data, dict):
        return 1, None
    prompt = data.get("prompt")
    tokens = data.get("max_tokens")
    deadline = data.get("deadline_ms")
    cost = (len(prompt.encode()) if isinstance(prompt, str) else 0) + (tokens if isinstance(tokens, int) else 16)
    try:
        deadline = float(deadline) if isinstance(deadline, (int, float)) and not isinstance(deadline, bool) else None
    except OverflowError:
        deadline = None
    if deadline is None or not math.isfinite(deadline) or deadline <= 0:
        deadline = None  # the server answers a bad one with a 400 naming it; the router waits no longer than its cap
    return max(1, min(cost, 1 << 30)), deadline


def _with_deadline(body: bytes, left_ms: float) -> bytes | None:
    """The body with deadline_ms set to what is left of the caller's deadline after waiting for a cold start
    (the server counts a deadline from when the request reaches it); None when nothing is left."""
    if left_ms < 1:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body  # the server names what is wrong with it
    if not isinstance(data, dict):
        return body
    data["deadline_ms"] = round(left_ms, 1)
    return json.dumps(data).encode()


def _ready_replicas(endpoint: InferenceEndpoint) -> list[tuple[int, str]]:
    return list(
        Replica.objects.filter(endpoint=endpoint, ready=True, retiring=False, job__state=JobState.RUNNING)
        .exclude(address="").values_list("id", "address")
    )


def _note_request(endpoint: InferenceEndpoint) -> None:
    """Note the request for the autoscaler's idle clock: at most every few seconds, and every time while the
    endpoint is scaled to zero, when the note (and a kicked reconcile) is what wakes it."""
    now = timezone.now()
    waking = endpoint.desired_replicas == 0
    if waking or endpoint.last_request_at is None or (
            now - endpoint.last_request_at).total_seconds() >= NOTE_REQUEST_EVERY_S:
        InferenceEndpoint.objects.filter(id=endpoint.id).update(last_request_at=now)
        endpoint.last_request_at = now
        if waking:
            kick_reconcile()


class Hung(OSError):
    """The replica stopped answering: neither the request nor its /readyz."""


def _answers(address: str) -> bool:
    """Whether the server answers /readyz at all (any status: a draining one still answers what it admitted)."""
    parts = urlsplit(address)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=HUNG_CHECK_S)
    try:
        connection.request("GET", "/readyz")
        connection.getresponse().read()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def _forward(address: str, body: bytes, content_type: str, give_up_at: float, *, may_leave: bool):
    """(status, headers, body) from one replica; raises OSError when it cannot be reached or answers too late,
    and Hung when `may_leave` (another replica could answer) and it stopped answering altogether."""
    parts = urlsplit(address)
    connection = http.client.HTTPConnection(parts.hostname, parts.port,
                                             timeout=max(0.1, give_up_at + ANSWER_GRACE_S - time.monotonic()))
    try:
        connection.request("POST", "/v1/generate", body=body, headers={"Content-Type": content_type})
        misses = 0
        waiting = select.poll()  # not select(): a busy process's descriptors may be past FD_SETSIZE
        waiting.register(connection.sock, select.POLLIN)
        while True:
            left_s = give_up_at + ANSWER_GRACE_S - time.monotonic()
            if left_s <= 0:
                raise TimeoutError("no answer by the deadline")
            if waiting.poll(1000 * min(HUNG_CHECK_S, left_s)):
                break  # the answer is coming (or the connection closed: getresponse says which)
            if may_leave:
                misses = 0 if _answers(address) else misses + 1
                if misses >= MISSES_BEFORE_NOT_READY:
                    raise Hung(f"{address} answers neither the request nor /readyz")
        connection.sock.settimeout(max(0.1, give_up_at + ANSWER_GRACE_S - time.monotonic()))
        answer = connection.getresponse()
        return answer.status, {name: answer.getheader(name) for name in PASSED_HEADERS}, answer.read()
    finally:
        connection.close()


def _unavailable(detail: str, retry_after: int = 2) -> JsonResponse:
    response = JsonResponse({"detail": detail}, status=503)
    response["Retry-After"] = str(retry_after)
    return response


class GenerateView(APIView):
    """Generate tokens from an endpoint: the body goes to one of its ready replicas as it is."""

    parser_classes = [RawBody]
    throttle_classes = []

    @extend_schema(
        operation_id="endpoint_generate",
        request={"application/json": {"type": "object", "properties": {
            "prompt": {"type": "string"}, "max_tokens": {"type": "integer"}, "deadline_ms": {"type": "number"}},
            "required": ["prompt"]}},
        responses={
            200: OpenApiResponse(description='{"text", "tokens", "queue_ms", "compute_ms"}'),
            400: OpenApiResponse(description="A bad field, named."),
            404: OpenApiResponse(description="No such endpoint for this caller."),
            429: OpenApiResponse(description="Over the queue limit, or the deadline cannot be met: Retry-After."),
            503: OpenApiResponse(description="No replica ready (cold start past the deadline) or draining: Retry-After."),
            504: OpenApiResponse(description="The deadline passed before the answer."),
        },
    )
    def post(self, request, tenant: str, name: str):
        endpoint = endpoint_serving(user=request.user, tenant_slug=tenant, name=name)
        if endpoint is None:
            return JsonResponse({"detail": "No such endpoint."}, status=404)
        if not user_has_role(user=request.user, tenant=endpoint.tenant, at_least=Role.MEMBER):
            return JsonResponse({"detail": "Viewers read endpoints; generating takes a member of the tenant."},
                                status=403)
        if endpoint.stop_requested_at is not None:
            return _unavailable(f"Endpoint {endpoint.name} is stopping.", retry_after=30)
        # The body as RawBody read it: session authentication's CSRF check may have read the stream already.
        body = request.data if isinstance(request.data, bytes) else b""
        if len(body) > MAX_BODY_BYTES:
            return JsonResponse({"prompt": [f"The body is over {MAX_BODY_BYTES} bytes."]}, status=413)
        _note_request(endpoint)
        cost, deadline_ms = _cost(body)
        # Never wait longer than any request may ask (a drain must be able to answer it): the server refuses more.
        deadline_ms = min(deadline_ms or float(endpoint.spec["default_deadline_ms"]), float(max_deadline_ms()))
        give_up_at = time.monotonic() + deadline_ms / 1000.0
        content_type = request.META.get("CONTENT_TYPE", "")
        tried: set[int] = set()
        waited = False
        while True:
            choices = [(rid, address) for rid, address in _ready_replicas(endpoint) if rid not in tried]
            if not choices:
                if tried:
                    return _unavailable("Every ready replica is draining or refused the connection; try again.")
                if time.monotonic() + COLD_START_POLL_S >= give_up_at:
                    starting = endpoint.desired_replicas == 0 or endpoint.state != EndpointState.READY
                    return _unavailable(
                        "No replica is ready yet (starting); try again." if starting else "No replica is ready.",
                        retry_after=5,
                    )
                _note_request(endpoint)
                time.sleep(COLD_START_POLL_S)
                waited = True
                endpoint.refresh_from_db(fields=["desired_replicas", "state"])
                continue
            if waited:
                body = _with_deadline(body, (give_up_at - time.monotonic()) * 1000.0)
                waited = False
                if body is None:
                    return _unavailable("Waiting for a replica took the whole deadline; try again.", retry_after=1)
            with _lock:
                replica_id, address = min(choices, key=lambda choice: (_outstanding.get(choice[0], 0), choice[0]))
                _outstanding[replica_id] = _outstanding.get(replica_id, 0) + cost
            if not connection.in_atomic_block:
                # Waiting on a replica needs no database: a request in flight must not hold a connection,
                # or the connection budget, not the replicas, would bound how many are in flight.
                connection.close()
            try:
                status, headers, answer = _forward(address, body, content_type, give_up_at, may_leave=len(choices) > 1)
            except (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected):
                tried.add(replica_id)
                continue
            except Hung:
                tried.add(replica_id)
                waited = True  # the next one is sent what is left of the deadline
                continue
            except OSError as exc:
                return JsonResponse({"detail": f"The replica did not answer in time: {exc}."}, status=504)
            finally:
                with _lock:
                    left = _outstanding.get(replica_id, 0) - cost
                    if left > 0:
                        _outstanding[replica_id] = left
                    else:
                        _outstanding.pop(replica_id, None)
            if status == 503 and len(choices) > 1:
                tried.add(replica_id)  # draining (told to stop since it was chosen): the next one answers
                continue
            response = HttpResponse(answer, status=status, content_type="application/json")
            for header, value in headers.items():
                if value is not None:
                    response[header] = value
            response["X-Portal-Replica"] = str(replica_id)
            return response


"""Request hygiene before any view or query runs, and the degraded-send header.

PostgreSQL refuses text holding NUL, so a NUL that reaches a query is a 500
(``DataError``); control characters are never valid in this portal's paths,
query values or header values either. ``RequestHygieneMiddleware`` refuses them
first, naming the place: a 401 for the Authorization header, a 400 otherwise.
It runs before the session middleware, which would look a cookie up.

Before it, ``RequestIdMiddleware`` names the request (X-Request-ID, in every log
line) and writes its access line, and ``BodySizeLimitMiddleware`` refuses a body
over REQUEST_MAX_BODY_BYTES unread.
"""

import io
import re
import time

import structlog
from django.conf import settings
from django.core.handlers.wsgi import LimitedStream
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import render

from common import dispatch
from common.errors import Conflict, NotFound, TooMany
from portal import logs

# C0 controls but tab, and DEL: what no path segment, query value or header value here may hold.
CONTROL_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
DEGRADED_HEADER = "X-Portal-Degraded"


def _describe(value: str) -> str:
    match = CONTROL_RE.search(value)
    assert match is not None
    char = match.group()
    return "a NUL character" if char == "\x00" else f"a control character (U+{ord(char):04X})"


def _header_name(meta_key: str) -> str:
    name = meta_key[5:] if meta_key.startswith("HTTP_") else meta_key
    return "-".join(part.capitalize() for part in name.split("_"))


class RequestIdMiddleware:
    """Gives every request an id, in every log line written while serving it, in the tasks it enqueues
    (``portal.logs``) and in the X-Request-ID answer header; writes the request's access line.

    A valid incoming X-Request-ID (a proxy's, or a client's own) is kept; one that is missing, too
    long or holds other characters than ``portal.logs.REQUEST_ID_RE`` allows is replaced by a new one.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.monotonic()
        request_id = logs.valid_request_id(request.META.get("HTTP_X_REQUEST_ID")) or logs.new_request_id()
        request.request_id = request_id
        # Bound until the response is closed (portal.logs clears it on request_finished), so Django's own
        # line about a 4xx or 5xx, written once the middleware is done, carries it too.
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        response = self.get_response(request)
        response[logs.REQUEST_ID_HEADER] = request_id
        logs.log_request(request, response, started)
        return response


class BodySizeLimitMiddleware:
    """Refuses a request whose Content-Length is over REQUEST_MAX_BODY_BYTES with a 413, before anything
    reads the body: JSON under /api/, a short text otherwise. (Django's DATA_UPLOAD_MAX_MEMORY_SIZE,
    set to the same bound, stops one that reads more than it says; the API's parser has its own,
    API_MAX_BODY_BYTES, never larger.)

    A chunked body (Transfer-Encoding: chunked, no Content-Length; gunicorn decodes the chunks)
    would be read by Django as empty, since it reads by Content-Length: it is read here, at most
    one byte over the bound, a 413 when over, else handed on with its length."""

    def __init__(self, get_response):
        self.get_response = get_response
        self.limit = settings.REQUEST_MAX_BODY_BYTES
        # Views that bound their bodies themselves (settings.REQUEST_BODY_BOUNDED_BY_VIEW: bundle uploads).
        self.bounded_by_view = [re.compile(pattern) for pattern in getattr(settings, "REQUEST_BODY_BOUNDED_BY_VIEW", [])]

    def __call__(self, request):
        if any(pattern.match(request.path_info) for pattern in self.bounded_by_view):
            return self.get_response(request)
        raw = request.META.get("CONTENT_LENGTH") or ""
        if not raw and "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower() and "wsgi.input" in request.META:
            return self._chunked(request)
        try:
            length = int(raw or "0")
        except ValueError:
            length = 0  # not a number: Django reads no body at all
        if length > self.limit:
            return self._too_large(request)
        return self.get_response(request)

    def _chunked(self, request):
        stream, parts, size = request.META["wsgi.input"], [], 0
        while size <= self.limit:
            part = stream.read(min(self.limit + 1 - size, 64 * 1024))
            if not part:
                break
            parts.append(part)
            size += len(part)
        if size > self.limit:
            return self._too_large(request)
        body = b"".join(parts)
        request.META["CONTENT_LENGTH"] = str(len(body))
        request._stream = LimitedStream(io.BytesIO(body), len(body))
        return self.get_response(request)

    def _too_large(self, request):
        return short_answer(request, f"The body is larger than {self.limit} bytes.", 413)


def short_answer(request, message: str, status: int) -> HttpResponse:
    """An answer given before any view: ``{"detail": message}`` under /api/, as the API's errors are;
    the message as plain text elsewhere."""
    if request.path_info.startswith("/api/"):
        return JsonResponse({"detail": message}, status=status)
    return HttpResponse(message, status=status, content_type="text/plain; charset=utf-8")


class RequestHygieneMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        refusal = self.refusal(request)
        if refusal is not None:
            return refusal
        return self.get_response(request)

    def refusal(self, request) -> HttpResponse | None:
        api = request.path_info.startswith("/api/")
        for key, value in request.META.items():
            if not (key.startswith("HTTP_") or key in ("CONTENT_TYPE", "CONTENT_LENGTH")):
                continue
            if isinstance(value, str) and CONTROL_RE.search(value):
                header = _header_name(key)
                message = f"The {header} header holds {_describe(value)}."
                status = 401 if key == "HTTP_AUTHORIZATION" else 400
                return self._answer(api, status, {"detail": message})
        if CONTROL_RE.search(request.path_info):
            return self._answer(api, 400, {"detail": f"The path holds {_describe(request.path_info)}."})
        for name, values in request.GET.lists():
            if CONTROL_RE.search(name):
                return self._answer(api, 400, {"detail": f"A query parameter name holds {_describe(name)}."})
            for value in values:
                if CONTROL_RE.search(value):
                    return self._answer(api, 400, {name: [f"The query parameter {name!r} holds {_describe(value)}."]})
        return None

    @staticmethod
    def _answer(api: bool, status: int, body: dict) -> HttpResponse:
        if api:
            response = JsonResponse(body, status=status)
            if status == 401:
                response["WWW-Authenticate"] = "Token"
            return response
        text = next(iter(body.values()))
        text = text[0] if isinstance(text, list) else text
        return HttpResponse(text, status=status, content_type="text/plain; charset=utf-8")


class DegradedSendMiddleware:
    """Says in a header when a write committed but its task could not reach the broker."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        token = dispatch.begin_request()
        try:
            response = self.get_response(request)
        finally:
            failed = dispatch.end_request(token)
        if failed:
            response[DEGRADED_HEADER] = (
                "broker-unreachable; saved, and the work starts once the broker is back: " + ", ".join(sorted(set(failed)))
            )
        return response


class ContentSecurityPolicyMiddleware:
    """Every answer carries CONTENT_SECURITY_POLICY (empty: none): scripts from the portal's own files only.

    No page has an inline script or an event-handler attribute (the Chromium crawl fails on any
    refusal the browser reports), so an injected script would not run.
    """

    def __init__(self, get_response):
        self.get_response = get_response
        self.policy = settings.CONTENT_SECURITY_POLICY

    def __call__(self, request):
        response = self.get_response(request)
        if self.policy and "Content-Security-Policy" not in response:
            response["Content-Security-Policy"] = self.policy
        return response


FRIENDLY_PAGES = {
    403: ("You can't open this page", "Your role does not allow it. An owner or admin of the tenant can change that."),
    404: ("Page not found", "It does not exist, or it belongs to a tenant you are not a member of."),
    "csrf": ("The form had expired", "Reload the page and send it again (the form is only good in the page that made it)."),
}


def csrf_failure(request, reason=""):
    """CSRF_FAILURE_VIEW: the friendly page, saying what happened, not "your role does not allow it"."""
    title, text = FRIENDLY_PAGES["csrf"]
    response = render(request, "frontend/error.html", {"status": 403, "title": title, "text": text}, status=403)
    response.portal_friendly = True
    return response


class PortalErrorMiddleware:
    """Answer the portal's own exceptions (common.errors) raised under a page view, and give every
    page a person can reach a friendly 403, 404 or 500, in every mode: never Django's debug pages
    (the URL list, a traceback), which `make run` would otherwise show. The API keeps its JSON
    answers, and a 500 there is JSON too, whatever DEBUG is; a 500's traceback still goes to the log,
    and the answer names the request id its log lines carry."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if (
            response.status_code == 500
            and request.path.startswith(("/api/", "/serve/"))
            and not response.get("Content-Type", "").startswith("application/json")
        ):
            return JsonResponse(
                {"detail": "Server error: it has been logged.", "request_id": getattr(request, "request_id", "")},
                status=500,
            )
        if (
            response.status_code in (403, 404, 500)
            and not getattr(response, "portal_friendly", False)
            and not request.path.startswith(("/api/", "/static/"))
            and response.get("Content-Type", "").startswith("text/html")
        ):
            return self.friendly(request, response.status_code)
        return response

    @staticmethod
    def friendly(request, status: int) -> HttpResponse:
        if status == 500:
            # Standalone: no query, no session, nothing that may be what failed.
            return render(request, "frontend/500.html", {"request_id": getattr(request, "request_id", "")}, status=500)
        title, text = FRIENDLY_PAGES[status]
        try:
            return render(request, "frontend/error.html", {"status": status, "title": title, "text": text}, status=status)
        except Exception:  # the page itself failed (the database is down, say): the plain one
            return render(request, "frontend/500.html", {"request_id": getattr(request, "request_id", "")},
                          status=status)

    def process_exception(self, request, exception):
        if isinstance(exception, NotFound):
            raise Http404(str(exception)) from exception
        if isinstance(exception, Conflict):
            return HttpResponse(str(exception), status=409, content_type="text/plain; charset=utf-8")
        if isinstance(exception, TooMany):
            return HttpResponse(str(exception), status=429, content_type="text/plain; charset=utf-8")
        return None

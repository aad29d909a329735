"""Request hygiene before any view or query runs, and the degraded-send header.

PostgreSQL refuses text holding NUL, so a NUL that reaches a query is a 500
(``DataError``); control characters are never valid in this portal's paths,
query values or header values either. ``RequestHygieneMiddleware`` refuses them
first, naming the place: a 401 for the Authorization header, a 400 otherwise.
It runs before the session middleware, which would look a cookie up.
"""

import re

from django.http import Http404, HttpResponse, JsonResponse

from common import dispatch
from common.errors import Conflict, NotFound, TooMany

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


class PortalErrorMiddleware:
    """Answer the portal's own exceptions (common.errors) raised under a page view."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if isinstance(exception, NotFound):
            raise Http404(str(exception)) from exception
        if isinstance(exception, Conflict):
            return HttpResponse(str(exception), status=409, content_type="text/plain; charset=utf-8")
        if isinstance(exception, TooMany):
            return HttpResponse(str(exception), status=429, content_type="text/plain; charset=utf-8")
        return None

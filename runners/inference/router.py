"""Where ``/serve/<tenant>/<endpoint>/v1/...`` used to be answered: now a pointer to the edge.

Endpoints are served by the edge (``runners/edge/``, an asynchronous front run by uvicorn): it checks the
caller, picks a replica, forwards with what is left of the deadline and streams the answer, holding no
thread and no database connection while a replica works. ``manage.py up`` runs it in front of gunicorn on
the portal's port, and the Kubernetes ingress sends /serve/ to it, so a request for an endpoint never
reaches this process. What stays here documents the routes in the API's schema, and answers a request
that reached the web process directly with a 421 saying where endpoints are served.
"""

from __future__ import annotations

from django.http import JsonResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.parsers import BaseParser
from rest_framework.permissions import AllowAny
from rest_framework.views import APIView

_RESPONSES = {
    200: OpenApiResponse(description="The replica's answer, passed through as it comes (SSE when `stream` is true)."),
    400: OpenApiResponse(description="A bad field, named (the edge's own checks: body, deadline_ms, stream; "
                                     "then the replica's)."),
    401: OpenApiResponse(description="No credentials, or an invalid token."),
    403: OpenApiResponse(description="A viewer of the tenant (generating takes a member)."),
    404: OpenApiResponse(description="No such endpoint for this caller."),
    413: OpenApiResponse(description="The body is over the edge's limit."),
    429: OpenApiResponse(description="Over the endpoint's limit in flight, or the deadline cannot be met: Retry-After."),
    503: OpenApiResponse(description="No replica ready (cold start past the deadline) or draining: Retry-After."),
    504: OpenApiResponse(description="The deadline passed before the answer."),
    421: OpenApiResponse(description="The request reached the portal's web process, not the edge in front of it "
                                     "(a deployment that routes /serve/ to gunicorn): it says where to send it."),
}


class _AnyBody(BaseParser):
    media_type = "*/*"

    def parse(self, stream, media_type=None, parser_context=None):
        return b""


class _ServedByTheEdge(APIView):
    parser_classes = [_AnyBody]
    permission_classes = [AllowAny]
    authentication_classes = []
    throttle_classes = []

    def post(self, request, tenant: str, name: str):
        return JsonResponse({"detail": "Endpoints are served by the edge (python -m runners.edge), in front of "
                                       "this web process; send the request to the portal's address."}, status=421)


class GenerateView(_ServedByTheEdge):
    @extend_schema(operation_id="endpoint_generate", responses=_RESPONSES, request={"application/json": {
        "type": "object", "properties": {"prompt": {"type": "string"}, "max_tokens": {"type": "integer"},
                                         "deadline_ms": {"type": "number"}}, "required": ["prompt"]}})
    def post(self, request, tenant: str, name: str):
        return super().post(request, tenant, name)


class CompletionsView(_ServedByTheEdge):
    @extend_schema(operation_id="endpoint_completions", responses=_RESPONSES, request={"application/json": {
        "type": "object", "description": "OpenAI's completions request (`deadline_ms` an extension)."}})
    def post(self, request, tenant: str, name: str):
        return super().post(request, tenant, name)


class ChatCompletionsView(_ServedByTheEdge):
    @extend_schema(operation_id="endpoint_chat_completions", responses=_RESPONSES, request={"application/json": {
        "type": "object", "description": "OpenAI's chat completions request (`deadline_ms` an extension)."}})
    def post(self, request, tenant: str, name: str):
        return super().post(request, tenant, name)

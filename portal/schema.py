"""The OpenAPI schema says what the API really answers (``DEFAULT_SCHEMA_CLASS``).

drf-spectacular documents the success answer of each operation and nothing
else. ``PortalAutoSchema`` adds, to every operation, the error answers that it
can give, each with the body it has:

- **400** everywhere: a field, a query parameter or the JSON body was refused
  (the body names each field with its errors), or a header held a control
  character (``portal.middleware.RequestHygieneMiddleware``, on every path).
- **401** everywhere: no token, a wrong or expired one, or a header that cannot
  be one; on the token endpoint also a wrong username or password.
- **403** where signing in is required: signed in, but not allowed.
- **404** on every operation with a path parameter (the object does not exist
  or is not visible to the caller), on every paginated list (a page past the
  last one), and where a view's query parameters name objects (its
  ``not_found_when`` says when).
- **415** on every operation that takes a body: only ``application/json`` is read.
- **413** on every operation that takes a body: one over ``REQUEST_MAX_BODY_BYTES``
  (``portal.middleware.BodySizeLimitMiddleware``), refused before it is read.
- **429** where attempts are rate-limited: DRF throttles, and the login throttle
  of the token endpoint (``tenants/login_throttle.py``).
- **503** everywhere: the database connection was lost while serving the request
  (``portal.db_errors``); nothing was saved, and ``Retry-After`` says when to try again.

And for request fields: a ``CharField`` that trims surrounding whitespace and
refuses a blank value refuses a value that is *only* whitespace, so its schema
says so with a ``pattern`` that requires one character that trimming keeps. A
``DecimalField`` takes a string or a JSON number, so its request schema is
either: a string whose pattern states the digits, places, sign and (for a
minimum of one step, like 0.01) "not zero"; or a number with its range.
"""

import sys
from decimal import Decimal

from drf_spectacular.contrib.django_filters import DjangoFilterExtension
from drf_spectacular.contrib.knox_auth_token import KnoxTokenScheme
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent, force_instance
from rest_framework import serializers

# The portal has no geometry fields. Without this, the first filtered list's schema asks whether a
# field is a GIS one by importing django.contrib.gis, whose GDAL loader runs ldconfig and gcc to find
# a library this portal never uses (seconds, and processes started by a web request).
DjangoFilterExtension._has_gis = False

# Exactly the characters Python's str.strip() removes, spelled out: ECMA, Python's
# `re` and the Rust regex engine read `\s` differently, these escapes all alike.
_STRIPPED = [c for c in range(sys.maxunicode + 1) if chr(c).isspace()]


def _char_class(codes: list[int]) -> str:
    ranges: list[tuple[int, int]] = []
    for code in codes:
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1] = (ranges[-1][0], code)
        else:
            ranges.append((code, code))

    def escape(code: int) -> str:
        return f"\\u{code:04x}"

    return "".join(escape(a) if a == b else f"{escape(a)}-{escape(b)}" for a, b in ranges)


# Unanchored: the value holds at least one character that trimming keeps.
NON_BLANK_PATTERN = f"[^{_char_class(_STRIPPED)}]"

# Views whose rate limit is not a DRF throttle: (path, method).
HAND_THROTTLED = {("/api/v1/auth/token/", "POST")}

_ERROR_DETAIL = {
    "type": "object",
    "description": "What went wrong, in one sentence.",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
_FIELD_ERRORS = {
    "type": "object",
    "description": (
        "Each refused field (or query parameter) with its errors; `non_field_errors` for errors of the input as a "
        "whole; `detail` when the body or a header could not be read at all. A list field's errors are keyed by "
        "the item's index."
    ),
    "minProperties": 1,
    "additionalProperties": {
        "anyOf": [
            {"type": "array", "items": {"type": "string"}},
            {"type": "string"},
            {"type": "object", "additionalProperties": {}},
        ]
    },
}


_OUTER_KEYS = {"default", "description", "title", "nullable", "readOnly", "writeOnly", "deprecated"}


def trims_and_forbids_blank(field) -> bool:
    return (
        isinstance(field, serializers.CharField)
        and not isinstance(field, serializers.RegexField)  # its own pattern already governs
        and field.trim_whitespace
        and not field.allow_blank
        and not field.read_only
    )


def request_decimal(field: serializers.DecimalField, schema: dict) -> dict:
    """A decimal as a request takes it: a string of digits, or a JSON number."""
    outer = {key: schema.pop(key) for key in list(schema) if key in _OUTER_KEYS}
    places = field.decimal_places
    whole = None if field.max_digits is None or places is None else field.max_digits - places
    sign = "" if field.min_value is not None and field.min_value >= 0 else "-?"
    digits = "\\d+" if whole is None else ("0" if whole <= 0 else f"\\d{{1,{whole}}}")
    fraction = "\\d*" if places is None else f"\\d{{0,{places}}}"
    some_fraction = "\\d+" if places is None else f"\\d{{1,{places}}}"
    pattern = f"^{sign}(?:{digits}(?:\\.{fraction})?|\\.{some_fraction})$"
    text = {"type": "string", "format": "decimal", "pattern": pattern}
    if places == 0:
        text["pattern"] = f"^{sign}{digits}$"
    step = Decimal(1).scaleb(-places) if places else None
    if field.min_value is not None and 0 < field.min_value <= (step or 0) and whole:
        # A positive minimum no larger than the smallest step (0.01 for two places) means "not zero":
        # some digit is 1-9, in the whole part or in the fraction (spelled out, no lookahead).
        # A larger minimum is not expressible as a pattern; the number branch still states it.
        nonzero_whole = f"0{{0,{whole}}}[1-9]\\d{{0,{max(whole - 1, 0)}}}(?:\\.{fraction})?"
        nonzero_fraction = "|".join(f"\\d{{{k}}}[1-9]\\d{{0,{places - k - 1}}}" for k in range(places))
        text["pattern"] = f"^(?:{nonzero_whole}|0{{0,{whole}}}\\.(?:{nonzero_fraction}))$"
    number: dict = {"type": "number"}
    if field.min_value is not None:
        number["minimum"] = float(field.min_value)
    if field.max_value is not None:
        number["maximum"] = float(field.max_value)
    if whole is not None and "maximum" not in number:
        number["maximum"] = 10**whole
        number["exclusiveMaximum"] = True
    return {"anyOf": [text, number], **outer}


class PortalTokenScheme(KnoxTokenScheme):
    """The portal's token authentication is knox's (it also notes when a token was last used):
    documented as the same `Authorization: Token ...` scheme."""

    target_class = "tenants.auth.TokenAuthentication"


class PortalAutoSchema(AutoSchema):
    def get_operation(self, path, path_regex, path_prefix, method, registry):
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        for code, response in self._error_responses(path, operation).items():
            operation["responses"].setdefault(code, response)
        return operation

    # --- Error answers --------------------------------------------------------

    def _error_responses(self, path: str, operation: dict) -> dict:
        parameters = operation.get("parameters", [])
        in_path = any(p.get("in") == "path" for p in parameters)
        paginated = self.method == "GET" and self._is_list_view() and self._get_paginator() is not None
        takes_body = "requestBody" in operation
        security = operation.get("security")
        signed_in_only = bool(security) and {} not in security

        responses = {
            "400": self._error(
                "400",
                "Refused: the body names each refused field, query parameter or header "
                "with its errors.",
                "ValidationError",
                _FIELD_ERRORS,
            ),
            "401": self._error(
                "401",
                "Wrong username or password, or an Authorization header that is not a valid token."
                if not signed_in_only and takes_body
                else "Not signed in: no token, or a wrong or expired one.",
            ),
        }
        if signed_in_only:
            responses["403"] = self._error("403", "Signed in, but this account may not do this.")
        # A view whose query parameters name objects says when it answers 404 (``not_found_when``).
        named_in_query = getattr(self.view, "not_found_when", None)
        if in_path or paginated or named_in_query:
            reasons = [named_in_query] if named_in_query else []
            if in_path:
                reasons.append("there is no such object, or it is not visible to this account")
            if paginated:
                reasons.append("the page is past the last one")
            responses["404"] = self._error("404", "Not found: " + "; or ".join(reasons) + ".")
            if in_path:
                # A path parameter outside its pattern matches no route, and Django answers with its own page.
                responses["404"]["content"]["text/html"] = {"schema": {"type": "string"}}
                responses["404"]["description"] += " A path parameter outside its pattern matches no route: text/html."
        if takes_body:
            responses["413"] = self._error("413", "The body is larger than this portal takes (REQUEST_MAX_BODY_BYTES).")
            responses["415"] = self._error("415", "The body is not application/json, the only type read.")
        if self.view.throttle_classes or (path, self.method) in HAND_THROTTLED:
            responses["429"] = self._error(
                "429",
                "Too many attempts; try again after the number of seconds in Retry-After.",
                headers={"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait."}},
            )
        responses["503"] = self._error(
            "503",
            "The database connection was lost while serving this request; nothing was saved by it. "
            "Try again after the number of seconds in Retry-After.",
            headers={"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait."}},
        )
        return responses

    def _error(self, code: str, description: str, name: str = "ErrorDetail", schema=None, headers=None) -> dict:
        component = ResolvedComponent(
            name=name, type=ResolvedComponent.SCHEMA, object=f"portal.schema.{name}", schema=schema or _ERROR_DETAIL
        )
        self.registry.register_on_missing(component)
        response = {
            "content": {"application/json": {"schema": component.ref}},
            "description": description,
        }
        if headers:
            response["headers"] = headers
        return response

    # --- Request fields -------------------------------------------------------

    def _map_basic_serializer(self, serializer, direction):
        schema = super()._map_basic_serializer(serializer, direction)
        if direction != "request":
            return schema
        properties = schema.get("properties", {})
        for name, field in force_instance(serializer).fields.items():
            prop = properties.get(name)
            if prop is None:
                continue
            if trims_and_forbids_blank(field):
                prop.setdefault("pattern", NON_BLANK_PATTERN)
            if isinstance(field, serializers.DecimalField):
                properties[name] = request_decimal(field, prop)
            child = getattr(field, "child", None)
            if isinstance(field, serializers.ListField) and trims_and_forbids_blank(child) and "items" in prop:
                prop["items"].setdefault("pattern", NON_BLANK_PATTERN)
        return schema

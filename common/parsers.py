"""The API's one body parser: JSON, with its size and nesting bounded and its strings checked.

Python's json module recurses per nesting level, so a small body of a thousand
nested lists raises RecursionError deep in the parser; the depth is counted
first, without parsing. Strings holding NUL (which PostgreSQL refuses) or lone
surrogates (which cannot be encoded) are refused with a 400 naming the field.

The size bound is API_MAX_BODY_BYTES, never more than REQUEST_MAX_BODY_BYTES (settings refuse
that): a body whose Content-Length is over the latter never reaches a parser, it is a 413
(portal.middleware.BodySizeLimitMiddleware); the parser holds the API to its own bound where
that is the smaller one.
"""

import json
import re

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

# Strings are taken out before brackets are counted; escapes are skipped whole.
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS_RE = re.compile(r"[\[\]{}]")
_SURROGATE_RE = re.compile(r"[\ud800-\udfff]")
NULL_MESSAGE = "Null characters are not allowed."
SURROGATE_MESSAGE = "Surrogate characters are not allowed."


def nesting_depth(text: str) -> int:
    depth = deepest = 0
    for bracket in _BRACKETS_RE.findall(_STRING_RE.sub('""', text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def bad_string(value, path: str = "") -> tuple[str, str] | None:
    """The first string (key or value) that holds NUL or a lone surrogate: (its path, the message)."""
    if isinstance(value, str):
        if "\x00" in value:
            return path or "non_field_errors", NULL_MESSAGE
        if _SURROGATE_RE.search(value):
            return path or "non_field_errors", SURROGATE_MESSAGE
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = bad_string(key, where) or bad_string(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = bad_string(item, f"{path}.{index}" if path else str(index))
            if found:
                return found
    return None


class BoundedJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.API_MAX_BODY_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise ParseError(f"The body is larger than {limit} bytes.")
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            text = raw.decode(encoding)
        except (UnicodeDecodeError, LookupError):
            raise ParseError(f"The body is not valid {encoding}.") from None
        depth = nesting_depth(text)
        if depth > settings.API_MAX_JSON_DEPTH:
            raise ParseError(f"The JSON body nests {depth} levels deep; at most {settings.API_MAX_JSON_DEPTH} are allowed.")
        try:
            data = json.loads(text, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        found = bad_string(data)
        if found:
            field, message = found
            raise ParseError({field: [message]})
        return data


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")

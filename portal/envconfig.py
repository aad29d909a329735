"""Typed readers for environment variables that refuse malformed values.

Every reader names the variable in its error, so a typo in a deployment stops
start-up with a message that says what to fix instead of a traceback from deep
inside Django.
"""

import json
import os
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from urllib.parse import urlparse

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def env_str(name: str, default: str) -> str:
    value = _raw(name)
    return default if value is None else value


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean: use one of true/false, 1/0, yes/no, on/off.")


def _number(name: str, default, parse: Callable, kind: str, minimum, maximum=None):
    value = _raw(name)
    if value is None:
        return default
    try:
        number = parse(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not {kind}.") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={value!r} must be at least {minimum}.")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name}={value!r} must be at most {maximum}.")
    return number


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    return _number(name, default, int, "a whole number", minimum)


def env_float(name: str, default: float, *, minimum: float | None = None, maximum: float | None = None) -> float:
    return _number(name, default, float, "a number", minimum, maximum)


def env_decimal(name: str, default: str, *, minimum: str | None = None) -> Decimal:
    """A money figure: exact, never a float."""

    def parse(text: str) -> Decimal:
        try:
            number = Decimal(text)
        except InvalidOperation:
            raise ValueError(text) from None
        if not number.is_finite():
            raise ValueError(text)
        return number

    return _number(name, Decimal(default), parse, "a decimal number", Decimal(minimum) if minimum is not None else None)


def env_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env_str(name, default)
    if value not in choices:
        raise ImproperlyConfigured(f"{name}={value!r} is not one of: {', '.join(choices)}.")
    return value


def env_url(name: str, default: str, *, schemes: tuple[str, ...]) -> str:
    value = env_str(name, default)
    parsed = urlparse(value)
    if parsed.scheme not in schemes:
        raise ImproperlyConfigured(
            f"{name}={value!r} must be a URL starting with one of: {', '.join(s + '://' for s in schemes)}."
        )
    return value


def env_json_object(name: str, example: str) -> dict:
    """A JSON object (fsspec's options for a store, say); `example` shows one in the error."""
    value = env_str(name, "{}")
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ImproperlyConfigured(f"{name} must be a JSON object, e.g. {example}.")
    return parsed

"""One login throttle for the API token endpoint, the login page and the admin's login.

Counters live in the shared cache (``CACHE_URL``) as the times of recent
events, a sliding window of the ``API_LOGIN_RATE`` period, and are shared by
all three doors, so using another one buys no extra guesses.

- **Per address**, every attempt counts: more than the rate from one address
  is refused (429) until the window ends.
- **Per username**, only failures count, and reaching the rate puts the username
  in a *cool-down* that binds only addresses that have themselves failed
  recently. A stranger hammering ``alice`` from their own address locks out
  only that address; alice, signing in from an address that has not been
  failing, gets in. A guesser spread over many addresses gets one guess per
  address per window once the cool-down is on.
"""

import hashlib
import math
import time

from django.conf import settings
from django.core.cache import cache

_PERIODS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hour": 3600, "d": 86400, "day": 86400}


def rate() -> tuple[int, int]:
    """(attempts, window in seconds) from API_LOGIN_RATE, e.g. 30/min -> (30, 60)."""
    count, period = settings.API_LOGIN_RATE.split("/")
    return int(count), _PERIODS[period]


def client_address(request) -> str:
    """The caller's address; behind NUM_PROXIES proxies, the one they saw in X-Forwarded-For."""
    remote = request.META.get("REMOTE_ADDR", "")
    proxies = settings.REST_FRAMEWORK.get("NUM_PROXIES") or 0
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if proxies and forwarded:
        hops = [hop.strip() for hop in forwarded.split(",") if hop.strip()]
        if hops:
            return hops[-min(proxies, len(hops))]
    return remote


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _keys(request, username: str | None) -> dict[str, str]:
    address = _digest(client_address(request))
    keys = {"attempts": f"login:attempts:addr:{address}", "address_failures": f"login:failures:addr:{address}"}
    if username:
        keys["user_failures"] = f"login:failures:user:{_digest(username.strip().lower()[:150])}"
    return keys


def _recent(histories: dict, key: str, now: float) -> list[float]:
    """The times of the events under a key within the last window, oldest first (a sliding window)."""
    _limit, window = rate()
    return [at for at in histories.get(key, []) if at > now - window]


def _wait_s(history: list[float], now: float) -> int:
    _limit, window = rate()
    return max(1, math.ceil(history[0] + window - now)) if history else 1


def _append(key: str, history: list[float], now: float) -> None:
    limit, window = rate()
    cache.set(key, [*history, now][-limit:], timeout=window + 1)


def attempt(request, username: str | None) -> int | None:
    """Count one login attempt; the seconds to wait when it must be refused, else None."""
    limit, _window = rate()
    now = time.time()
    keys = _keys(request, username)
    histories = cache.get_many(list(keys.values()))
    attempts = _recent(histories, keys["attempts"], now)
    if len(attempts) >= limit:
        return _wait_s(attempts[-limit:], now)
    if "user_failures" in keys:
        user_failures = _recent(histories, keys["user_failures"], now)
        if len(user_failures) >= limit and _recent(histories, keys["address_failures"], now):
            return _wait_s(user_failures[-limit:], now)
    _append(keys["attempts"], attempts, now)
    return None


def failed(request, username: str | None) -> None:
    """Record a wrong password (or unknown user) for the address and the username."""
    now = time.time()
    keys = _keys(request, username)
    histories = cache.get_many(list(keys.values()))
    for name in ("address_failures", "user_failures"):
        if name in keys:
            _append(keys[name], _recent(histories, keys[name], now), now)


def throttled_message(wait_s: int) -> str:
    return f"Too many login attempts. Try again in {wait_s} seconds."

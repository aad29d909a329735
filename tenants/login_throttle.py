"""One login throttle for the API token endpoint, the login page and the admin's login.

Counters live in the shared cache's Redis (``CACHE_URL``, the broker's by default:
one store for every web process) as the times of recent events, a sliding
window of the ``API_LOGIN_RATE`` period, checked and counted in one atomic step
(attempts in flight together in several processes each count), and are shared
by all three doors, so using another one buys no extra guesses.

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
import secrets
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


# One attempt, atomically in Redis (so attempts in flight together in several processes each count):
# drop the events older than the window, refuse (the seconds to wait) when the address has made
# `limit` attempts, or when the username has `limit` failures and the address has failed too;
# otherwise record the attempt and answer -1. KEYS: attempts, address failures[, user failures].
_ATTEMPT_LUA = """
local now, window, limit, member = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
for _, key in ipairs(KEYS) do redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window) end
local function wait_s(key)
  local oldest = redis.call('ZRANGE', key, -limit, -limit, 'WITHSCORES')[2]
  return math.max(1, math.ceil(tonumber(oldest) + window - now))
end
if redis.call('ZCARD', KEYS[1]) >= limit then return wait_s(KEYS[1]) end
if KEYS[3] and redis.call('ZCARD', KEYS[3]) >= limit and redis.call('ZCARD', KEYS[2]) > 0 then
  return wait_s(KEYS[3])
end
redis.call('ZADD', KEYS[1], now, member)
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -limit - 1)
redis.call('PEXPIRE', KEYS[1], math.ceil((window + 1) * 1000))
return -1
"""


def _redis(keys: list[str]):
    """The shared cache's Redis client, and the keys as the cache names them (its prefix and version)."""
    names = [cache.make_and_validate_key(key) for key in keys]
    return cache._cache.get_client(names[0], write=True), names


def _member(now: float) -> str:
    return f"{now:.6f}:{secrets.token_hex(4)}"


def attempt(request, username: str | None) -> int | None:
    """Count one login attempt; the seconds to wait when it must be refused, else None."""
    limit, window = rate()
    now = time.time()
    keys = _keys(request, username)
    order = [keys["attempts"], keys["address_failures"], *([keys["user_failures"]] if "user_failures" in keys else [])]
    client, names = _redis(order)
    wait_s = int(client.eval(_ATTEMPT_LUA, len(names), *names, now, window, limit, _member(now)))
    return None if wait_s < 0 else wait_s


def failed(request, username: str | None) -> None:
    """Record a wrong password (or unknown user) for the address and the username."""
    limit, window = rate()
    now = time.time()
    keys = _keys(request, username)
    client, names = _redis([keys[name] for name in ("address_failures", "user_failures") if name in keys])
    with client.pipeline(transaction=True) as pipe:
        for name in names:
            pipe.zremrangebyscore(name, "-inf", now - window)
            pipe.zadd(name, {_member(now): now})
            pipe.zremrangebyrank(name, 0, -limit - 1)
            pipe.pexpire(name, math.ceil((window + 1) * 1000))
        pipe.execute()


def throttled_message(wait_s: int) -> str:
    return f"Too many login attempts. Try again in {wait_s} seconds."

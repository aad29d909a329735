"""The edge's proxy core: HTTP and WebSocket pass-through to an upstream address, as raw ASGI.

Nothing here knows endpoints or Django. The serving route (``runners.edge.app``) opens its upstream
request with ``open_upstream`` (a replica it chose) and streams the answer back with ``stream_back``;
the pass-through to the portal's web process uses ``forward_http``; a workspace's JupyterLab (its pages,
kernels and terminals) uses ``forward_http`` and ``forward_websocket`` to the address the routing table
holds for it, a Unix socket locally (``unix_session``). Each watches the client: a client that goes away closes the upstream connection at once.

The upstream side is aiohttp's client. httpx's (httpcore's pool) looked at every pooled connection, with a
socket poll each, whenever a request took or gave back a connection: with the hundred or so kept-alive
connections a busy replica needs, that was most of the edge's CPU and held it to about 50 requests/s in front
of a replica that answers 400 (bench/README.md). aiohttp's pool hands out a kept-alive connection per host
from a list.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterable

import aiohttp

# Hop-by-hop headers (RFC 9110 7.6.1) are never passed on; neither is the upstream's own framing.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "proxy-connection",
})


class ClientGone(Exception):
    """The client closed its connection."""


def request_headers(scope: dict, *, drop: Iterable[str] = (), keep_length: bool = False) -> list[tuple[str, str]]:
    """The client's request headers less hop-by-hop ones (and ``drop``), plus X-Forwarded-For/-Proto.
    ``keep_length``: the body passes as it came, so its Content-Length does too (a WSGI server may not
    take a chunked body)."""
    dropped = HOP_BY_HOP | {"x-forwarded-for", "x-forwarded-proto"} | {name.lower() for name in drop}
    if not keep_length:
        dropped |= {"content-length"}
    headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]
               if name.decode("latin-1").lower() not in dropped]
    client = scope.get("client")
    if client:
        headers.append(("x-forwarded-for", client[0]))
    headers.append(("x-forwarded-proto", scope.get("scheme", "http")))
    return headers


# What the upstream hop may raise: aiohttp's errors (refused, reset, cut mid-answer) and its connect timeout.
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def unix_session(path: str, *, connect_timeout_s: float) -> aiohttp.ClientSession:
    """``client_session``'s pool, to the one Unix socket ``path`` (a local workspace's server)."""
    return aiohttp.ClientSession(
        connector=aiohttp.UnixConnector(path=path, limit=0),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout_s),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
    )


def client_session(*, connect_timeout_s: float, keepalive_s: float = 30) -> aiohttp.ClientSession:
    """A pool of kept-alive connections to upstreams, with no limit of its own (the callers bound what is in
    flight), no timeout but the connect one (callers bound the rest by their deadlines), and nothing added to
    what passes: no headers of its own, bodies neither decompressed nor re-encoded, redirects passed back.

    No cookie jar: aiohttp's default one keeps what an upstream named by a host name sets (a session cookie at
    a sign-in, JupyterLab's _xsrf) and sends it with every later request on the pool, whoever makes it.
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout_s),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
    )


def answer_headers(response: aiohttp.ClientResponse, *,
                   keep: Iterable[str] | None = None) -> list[tuple[bytes, bytes]]:
    """The upstream answer's headers to pass to the client: all but hop-by-hop ones, or only ``keep``."""
    wanted = {name.lower() for name in keep} if keep is not None else None
    out = []
    for name, value in response.raw_headers:
        lowered = name.decode("latin-1").lower()
        if lowered in HOP_BY_HOP or lowered == "content-length" and response.headers.get("content-encoding"):
            continue
        if wanted is not None and lowered not in wanted:
            continue
        out.append((name, value))  # as the upstream spelled it: some clients read headers case-sensitively
    return out


async def read_body(receive: Callable[[], Awaitable[dict]], limit: int | None) -> bytes | None:
    """The whole request body, or None once it passes ``limit`` bytes (chunked bodies included)."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client has gone (call only once the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def open_upstream(client: aiohttp.ClientSession, method: str, url: str, headers,
                        content) -> aiohttp.ClientResponse:
    """Send the request and return once the answer's status and headers are in (its body still to stream)."""
    return await client.request(method, url, headers=headers, data=content, allow_redirects=False)


def let_go(response: aiohttp.ClientResponse, *, whole: bool) -> None:
    """Done with an upstream answer: its connection goes back to the pool when the answer was read to its end
    (``whole``), else it is closed, so the upstream sees its client leave and stops computing for it."""
    if whole:
        response.release()
    else:
        response.close()


async def pump(send, response: aiohttp.ClientResponse, headers: list[tuple[bytes, bytes]], started: list) -> str:
    """Pass the upstream answer to the client as it comes, with nothing watching: the caller runs this in a task
    it cancels when the client leaves or a deadline passes (the serving route). ``started`` gets True once the
    answer's head is sent. Returns "done" or "upstream-broke" (the upstream broke mid-answer: the client's
    answer is cut where it stands); a client gone mid-answer raises ClientGone. The upstream connection goes
    back to the pool when the answer was read to its end, and is closed however else it ends."""
    whole = False
    try:
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        started.append(True)
        while True:
            try:
                chunk = await response.content.readany()
            except UPSTREAM_ERRORS:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return "upstream-broke"
            if not chunk:  # the answer's end
                whole = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return "done"
            try:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except OSError:
                raise ClientGone() from None
    finally:
        let_go(response, whole=whole)


async def stream_back(send, receive, response: aiohttp.ClientResponse, *, headers: list[tuple[bytes, bytes]]) -> str:
    """``pump`` watched: the answer passed to the client as it comes, ended early when the client leaves.

    Returns "done", "upstream-broke" or "client-gone" (the client closed: the upstream connection is closed at
    once, so the upstream stops computing for it)."""
    work = asyncio.ensure_future(pump(send, response, headers, []))
    gone = asyncio.ensure_future(until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            try:
                return work.result()
            except ClientGone:
                return "client-gone"
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        return "client-gone"
    finally:
        gone.cancel()
        work.cancel()


async def forward_http(scope, receive, send, client: aiohttp.ClientSession, base_url: str, *,
                       extra_headers: Iterable[tuple[str, str]] = (), drop: Iterable[str] = (),
                       unreachable: str = "The portal's web process did not answer") -> str:
    """Pass one HTTP request through to ``base_url`` (same path and query), body and answer streamed; the
    client's headers named in ``drop`` stay behind."""
    query = scope.get("query_string", b"").decode("latin-1")
    url = base_url.rstrip("/") + scope.get("raw_path", scope["path"].encode()).decode("latin-1") + (
        f"?{query}" if query else "")

    gone = False

    async def body():
        nonlocal gone
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone = True
                raise ClientGone()
            if message.get("body"):
                yield message["body"]
            if not message.get("more_body", False):
                return

    headers = request_headers(scope, keep_length=True, drop=drop) + list(extra_headers)
    sends_body = any(name in (b"content-length", b"transfer-encoding") for name, _ in scope["headers"])
    try:
        response = await open_upstream(client, scope["method"], url, headers, body() if sends_body else None)
    except ClientGone:
        return "client-gone"
    except UPSTREAM_ERRORS as exc:
        if gone:
            return "client-gone"
        message = json.dumps({"detail": f"{unreachable}: {type(exc).__name__}."}).encode()
        await send({"type": "http.response.start", "status": 502,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": message})
        return "upstream-unreachable"
    return await stream_back(send, receive, response, headers=answer_headers(response))


async def forward_websocket(scope, receive, send, upstream_url: str, *,
                            extra_headers: Iterable[tuple[str, str]] = (), unix_socket: str | None = None,
                            open_timeout_s: float = 10) -> str:
    """Pass a WebSocket through to ``upstream_url`` (ws://...; over ``unix_socket`` when given, the URL's host
    then only its Host header): accepted once the upstream accepts (within ``open_timeout_s``), then every
    message both ways until either side closes (the other side is closed with the same code)."""
    from websockets.asyncio.client import connect, unix_connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

    message = await receive()
    if message["type"] != "websocket.connect":
        return "client-gone"
    subprotocols = scope.get("subprotocols") or None
    try:
        if unix_socket is not None:
            upstream = await unix_connect(unix_socket, upstream_url, additional_headers=list(extra_headers),
                                          subprotocols=subprotocols, open_timeout=open_timeout_s, max_size=None)
        else:
            upstream = await connect(upstream_url, additional_headers=list(extra_headers),
                                     subprotocols=subprotocols, open_timeout=open_timeout_s, max_size=None)
    except (OSError, InvalidHandshake, InvalidStatus, asyncio.TimeoutError):
        await send({"type": "websocket.close", "code": 1011})
        return "upstream-unreachable"
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

    async def client_to_upstream():
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close(code=message.get("code", 1000))
                return "client-closed"
            if message.get("bytes") is not None:
                await upstream.send(message["bytes"])
            elif message.get("text") is not None:
                await upstream.send(message["text"])

    async def upstream_to_client():
        try:
            async for data in upstream:
                if isinstance(data, bytes):
                    await send({"type": "websocket.send", "bytes": data})
                else:
                    await send({"type": "websocket.send", "text": data})
        except ConnectionClosed:
            pass
        code = upstream.close_code or 1000
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": code if code != 1005 else 1000})
        return "upstream-closed"

    tasks = [asyncio.ensure_future(client_to_upstream()), asyncio.ensure_future(upstream_to_client())]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await upstream.close()
    return next(iter(done)).result() if done else "closed"

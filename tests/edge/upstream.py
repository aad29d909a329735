"""A small upstream for the edge's tests, served by uvicorn in a thread: a slow event stream that notes
when its client goes away, a page that echoes what reached it, a sign-in that sets a cookie, and a WebSocket echo."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect


class Upstream:
    EVENTS = 400
    EVERY_S = 0.025

    def __init__(self, *, uds: str | None = None) -> None:
        """On a free loopback port, or on the Unix socket ``uds`` (as a local workspace's server listens)."""
        self.sent = 0
        self.closed = threading.Event()  # the stream's connection closed before its last event
        self.finished = threading.Event()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[
            Route("/readyz", lambda request: JSONResponse({"status": "ready"})),
            Route("/health", lambda request: JSONResponse({})),
            Route("/v1/completions", self.stream, methods=["POST"]),
            Route("/echo/{rest:path}", self.echo, methods=["GET", "POST"]),
            Route("/sign-in", self.sign_in, methods=["POST"]),
            Route("/workspaces/{rest:path}", self.echo, methods=["GET", "POST"]),
            WebSocketRoute("/ws/echo", self.ws_echo),
        ])
        where = {"uds": uds} if uds else {"host": "127.0.0.1", "port": self.port}
        self.server = uvicorn.Server(uvicorn.Config(app, **where, log_level="warning", lifespan="off",
                                                    ws="websockets-sansio"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Upstream:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    async def stream(self, request: Request):
        self.deadline_header = request.headers.get("x-portal-deadline-ms")

        async def events():
            try:
                for n in range(self.EVENTS):
                    self.sent = n + 1
                    yield f"data: {json.dumps({'n': n})}\n\n".encode()
                    await asyncio.sleep(self.EVERY_S)
                yield b"data: [DONE]\n\n"
                self.finished.set()
            except (asyncio.CancelledError, GeneratorExit):
                self.closed.set()
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    async def echo(self, request: Request):
        return JSONResponse({"path": request.url.path, "query": request.url.query, "method": request.method,
                             "body": (await request.body()).decode(), "headers": dict(request.headers)})

    async def sign_in(self, request: Request):
        """A sign-in's answer: a session cookie for the one client that asked."""
        response = JSONResponse({})
        response.set_cookie("sessionid", "alices-session", path="/", httponly=True)
        return response

    async def ws_echo(self, websocket: WebSocket):
        await websocket.accept()
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("text") is not None:
                    if message["text"] == "bye":
                        await websocket.close(code=4001)
                        return
                    await websocket.send_text("echo:" + message["text"])
                else:
                    await websocket.send_bytes(b"echo:" + message["bytes"])
        except WebSocketDisconnect:
            return

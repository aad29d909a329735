"""A webhook receiver on loopback for the notification tests: records every POST, and can fail the first ones;
and a raw TCP server that answers whatever it is given (garbage, or a slow drip), for the sender's limits."""

import hashlib
import hmac
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    at: float
    headers: dict
    body: bytes
    answered: int


@dataclass
class HookReceiver:
    """``with HookReceiver(fail_first=2) as hook``: POST ``hook.url``; the first ``fail_first`` get ``fail_status``."""

    fail_first: int = 0
    fail_status: int = 500
    # hold_first: the first POST is held (not answered, not recorded) until `release` is set; `held` says it came.
    hold_first: bool = False
    received: list[Received] = field(default_factory=list)
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> "HookReceiver":
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if receiver.hold_first and not receiver.held.is_set():
                    receiver.held.set()
                    receiver.release.wait(60)
                    return  # the sender is gone by now: nothing to answer
                status = receiver.fail_status if len(receiver.received) < receiver.fail_first else 204
                receiver.received.append(Received(time.monotonic(), dict(self.headers), body, status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/portal"

    def delivered(self) -> list[Received]:
        return [item for item in self.received if item.answered < 300]


def signed_by(secret: str, item: Received, max_age_s: float = 300) -> bool:
    """Whether the delivery's signature is the HMAC-SHA256 of "<X-Portal-Timestamp>." + its raw body with this
    secret, and the timestamp is recent (what a receiver checks against replays)."""
    timestamp = item.headers.get("X-Portal-Timestamp", "")
    if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > max_age_s:
        return False
    expected = "sha256=" + hmac.new(secret.encode(), f"{timestamp}.".encode() + item.body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, item.headers.get("X-Portal-Signature", ""))


class RawServer:
    """``with RawServer(b"SSH-2.0-OpenSSH\\r\\n") as server``: every connection gets `answer` (one byte every
    `drip_s` seconds when set), then is closed; `connections` counts them."""

    def __init__(self, answer: bytes, drip_s: float = 0.0):
        self.answer, self.drip_s, self.connections = answer, drip_s, 0

    def __enter__(self) -> "RawServer":
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return self

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(1)
                try:
                    conn.recv(65536)  # the request (or its start)
                except OSError:
                    pass
                if not self.drip_s:
                    conn.sendall(self.answer)
                    return
                for byte in self.answer:
                    if self.stopping.is_set():
                        return
                    conn.sendall(bytes([byte]))
                    time.sleep(self.drip_s)
            except OSError:
                pass  # the sender hung up

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join(5)
        self.sock.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/hooks/portal"


class SmtpReceiver:
    """``with SmtpReceiver(hold_first=True) as smtp``: a small SMTP server on loopback that keeps every message
    (its recipients and data) in `messages`; with hold_first the first connection is held, never greeted,
    until `release` is set (`held` says it came): a sender stuck between its claim and the mail."""

    def __init__(self, hold_first: bool = False):
        self.hold_first, self.messages = hold_first, []
        self.held, self.release = threading.Event(), threading.Event()

    def __enter__(self) -> "SmtpReceiver":
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return self

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            if self.hold_first and not self.held.is_set():
                self.held.set()
                threading.Thread(target=self._hold, args=(conn,), daemon=True).start()
                continue
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with conn:
            self.release.wait(120)

    def _talk(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            conn.sendall(b"220 test ESMTP\r\n")
            recipients: list[str] = []
            while True:
                line = reader.readline()
                if not line:
                    return
                command = line.decode().strip().upper()
                if command.startswith(("EHLO", "HELO")):
                    conn.sendall(b"250 test\r\n")
                elif command.startswith("RCPT TO:"):
                    recipients.append(line.decode().strip()[8:].strip("<> "))
                    conn.sendall(b"250 OK\r\n")
                elif command == "DATA":
                    conn.sendall(b"354 go on\r\n")
                    data = b""
                    while not data.endswith(b"\r\n.\r\n"):
                        chunk = reader.readline()
                        if not chunk:
                            return
                        data += chunk
                    self.messages.append((recipients, data))
                    recipients = []
                    conn.sendall(b"250 queued\r\n")
                elif command == "QUIT":
                    conn.sendall(b"221 bye\r\n")
                    return
                else:  # MAIL FROM, RSET, NOOP
                    conn.sendall(b"250 OK\r\n")

    def __exit__(self, *exc):
        self.release.set()
        self.stopping.set()
        self.thread.join(5)
        self.sock.close()

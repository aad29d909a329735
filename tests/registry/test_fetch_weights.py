"""The init container's fetch of a model version's weights (runners.workloads.fetch_weights), against a small HTTP
server in this process: only the asked-for bytes land, nothing partial stays, and a 4xx is not tried again."""

import hashlib
import http.server
import threading

import pytest

from runners.workloads import fetch_weights

pytestmark = pytest.mark.integration


@pytest.fixture
def server():
    served = {"body": b"", "status": 200, "hits": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the standard library's name)
            served["hits"] += 1
            self.send_response(served["status"])
            self.send_header("Content-Length", str(len(served["body"])))
            self.end_headers()
            self.wfile.write(served["body"])

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    served["url"] = f"http://127.0.0.1:{httpd.server_address[1]}/models/fetch/t/"
    yield served
    httpd.shutdown()
    httpd.server_close()


def test_the_fetch_keeps_only_the_asked_for_bytes_and_skips_a_download_it_already_holds(server, tmp_path):
    weights = b"weights " * 1000
    sha256 = hashlib.sha256(weights).hexdigest()
    server["body"] = weights
    dest = tmp_path / "w" / sha256
    assert fetch_weights.fetch(server["url"], dest, sha256=sha256, size=len(weights)) is True
    assert dest.read_bytes() == weights
    assert fetch_weights.fetch(server["url"], dest, sha256=sha256, size=len(weights)) is False
    assert server["hits"] == 1
    other = tmp_path / "other"
    server["body"] = b"x" * len(weights)  # the right size, not the right bytes
    with pytest.raises(fetch_weights.FetchError, match="sha256"):
        fetch_weights.fetch(server["url"], other, sha256=sha256, size=len(weights), first_wait_s=0)
    server["body"] = weights + b"more"
    with pytest.raises(fetch_weights.FetchError, match="larger than"):
        fetch_weights.fetch(server["url"], other, sha256=sha256, size=len(weights), first_wait_s=0)
    assert not other.exists() and list(tmp_path.iterdir()) == [tmp_path / "w"]  # no partial file left


def test_an_expired_or_forged_url_is_not_tried_again(server, tmp_path):
    server["status"], server["body"] = 410, b"This weights URL has expired"
    with pytest.raises(fetch_weights.FetchError, match="410"):
        fetch_weights.fetch(server["url"], tmp_path / "w", sha256="cd" * 32, size=5, first_wait_s=0)
    assert server["hits"] == 1
    assert fetch_weights.main([server["url"], str(tmp_path / "w"), "--sha256", "cd" * 32, "--bytes", "5"]) == 1

"""The inference server's OpenAI routes, its deadline header and its callers that go away, on a real replica
serving the shipped trainer's CharModel; the real `openai` client among the callers."""

import http.client
import json
import socket
import time

import openai
import pytest

from tests.workloads.test_serve import ServerProcess, write_checkpoint

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = ServerProcess(write_checkpoint(tmp_path_factory.mktemp("openai")), "--max-prompt-bytes", 256,
                           "--max-tokens", 64)
    yield server
    server.stop()


def post(server, path, body, headers=None):
    """(status, headers, raw body) of a POST; `body` a dict, or bytes sent as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    answer = conn.getresponse()
    result = answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    conn.close()
    return result


def events(raw: bytes) -> list:
    """The `data:` payloads of a server-sent event stream, decoded; [DONE] kept as the string."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


def test_a_completion_answers_the_openai_shape_with_the_native_routes_text(served):
    status, _, raw = post(served, "/v1/completions", {"model": "char", "prompt": "The GPU ", "max_tokens": 20})
    assert status == 200
    answer = json.loads(raw)
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-") and answer["model"] == "char"
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert answer["usage"] == {"prompt_tokens": 8, "completion_tokens": 20, "total_tokens": 28}
    native = served.generate({"prompt": "The GPU ", "max_tokens": 20})[2]
    assert choice["text"] == native["text"]  # greedy: the same text on either route


def test_a_stop_string_cuts_the_answer_before_it(served):
    full = served.generate({"prompt": "Once upon ", "max_tokens": 40})[2]["text"]
    stop = full[10:13]
    status, _, raw = post(served, "/v1/completions", {"prompt": "Once upon ", "max_tokens": 40, "stop": [stop, "\x7f"]})
    choice = json.loads(raw)["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop"
    assert choice["text"] == full[: full.index(stop)]


def test_a_stream_is_server_sent_events_ending_with_done_and_the_usage_when_asked(served):
    body = {"prompt": "The GPU ", "max_tokens": 20, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, raw = post(served, "/v1/completions", body)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    chunks = events(raw)
    assert chunks[-1] == "[DONE]"
    *texts, last, usage = chunks[:-1]
    assert all(c["choices"][0]["finish_reason"] is None for c in texts) and len(texts) >= 2
    assert last["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20
    whole = json.loads(post(served, "/v1/completions", {"prompt": "The GPU ", "max_tokens": 20})[2])
    assert "".join(c["choices"][0]["text"] for c in texts) == whole["choices"][0]["text"]


def test_the_openai_client_completes_chats_and_completions_streamed_or_not(served):
    c = client(served)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a GPU?"}]
    chat = c.chat.completions.create(model="char", messages=messages, max_tokens=12)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    # The CharModel has no chat template: the plain "role: content" lines, then "assistant:".
    rendered = "system: Be brief.\nuser: What is a GPU?\nassistant:"
    assert chat.usage.prompt_tokens == len(rendered)
    assert chat.choices[0].message.content == served.generate({"prompt": rendered, "max_tokens": 12})[2]["text"]
    stream = c.chat.completions.create(model="char", messages=messages, max_tokens=12, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == chat.choices[0].message.content
    done = c.completions.create(model="char", prompt="Hello", max_tokens=5, temperature=0.8, seed=3)
    again = c.completions.create(model="char", prompt="Hello", max_tokens=5, temperature=0.8, seed=3)
    assert done.choices[0].text == again.choices[0].text and done.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError) as error:
        c.completions.create(model="char", prompt="Hello", max_tokens=5, temperature=7)
    assert error.value.body["param"] == "temperature"


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "max_tokens": 4, "stream": "yes"}, "stream"),
    ({"prompt": "hi", "max_tokens": 4, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "hi", "max_tokens": 4, "stream": True, "stream_options": ["include_usage"]}, "stream_options"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 65}, "max_tokens"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": ["a", "b"], "max_tokens": 4}, "prompt"),
    ({"prompt": "na\u00efve", "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "seed": "s"}, "seed"),
    ({"prompt": "hi", "deadline_ms": 0}, "deadline_ms"),
    ({"prompt": "hi", "deadline_ms": 10**400}, "deadline_ms"),
    ({"prompt": "hi", "logit_bias": {}}, "logit_bias"),
    ({"prompt": "hi", "messages": []}, "messages"),
])
def test_bad_completions_are_a_400_in_openais_error_shape_naming_the_field(served, body, param):
    status, _, raw = post(served, "/v1/completions", body)
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": 3}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}, "max_completion_tokens"),
    ({"prompt": "hi"}, "prompt"),
])
def test_bad_chats_are_a_400_naming_the_field(served, body, param):
    status, _, raw = post(served, "/v1/chat/completions", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == param, raw


def test_malformed_bodies_and_a_deadline_of_1e400_are_400s(served):
    for raw_body, param in ((b'{"prompt": "hi", "stream": tru', "body"), (b'{"prompt": "hi", "deadline_ms": 1e400}', "deadline_ms"),
                            (b"[1, 2]", "body")):
        status, _, raw = post(served, "/v1/completions", raw_body)
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw
    status, _, raw = post(served, "/v1/chat/completions", b"{}", {"Content-Type": "text/plain"})
    assert status == 415 and json.loads(raw)["error"]["param"] == "Content-Type"


def test_the_deadline_header_is_the_smaller_deadline_and_a_bad_one_is_refused(served):
    body = {"prompt": "The GPU ", "max_tokens": 64}
    assert post(served, "/v1/completions", body, {"X-Portal-Deadline-Ms": "60000"})[0] == 200
    # Nothing can be computed in a microsecond: the header, not the body's 10 s default, decides.
    status, headers, raw = post(served, "/v1/completions", body, {"X-Portal-Deadline-Ms": "0.001"})
    assert status == 429 and int(headers["retry-after"]) >= 1, raw
    assert json.loads(raw)["error"]["code"] == 429
    status, _, raw = post(served, "/v1/generate", {**body, "deadline_ms": 0.001}, {"X-Portal-Deadline-Ms": "60000"})
    assert status == 429, raw  # the body's own deadline is the smaller here
    for value, expected in (("0", 504), ("-5", 504), ("1e400", 400), ("soon", 400), ("nan", 400)):
        status, _, raw = post(served, "/v1/completions", body, {"X-Portal-Deadline-Ms": value})
        assert status == expected, (value, raw)
        if expected == 400:
            assert json.loads(raw)["error"]["param"] == "X-Portal-Deadline-Ms"
    status, _, raw = post(served, "/v1/generate", body, {"X-Portal-Deadline-Ms": "soon"})
    assert status == 400 and json.loads(raw) == {"X-Portal-Deadline-Ms": ["a number of milliseconds left"]}
    assert served.generate({"prompt": "hi", "max_tokens": 4})[0] == 200  # and it keeps serving


# --- callers that go away -------------------------------------------------------------------------


def wait_for(condition, what, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


@pytest.fixture
def long_server(tmp_path):
    # Long answers: a request of 20000 tokens computes for seconds, so its caller can leave midway.
    server = ServerProcess(write_checkpoint(tmp_path), "--max-tokens", 20000, "--batch-token-budget", 20040,
                           "--max-batch-wait-ms", 0)
    yield server
    server.stop()


def raw_request(server, path, body) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_a_stream_the_caller_drops_halfway_stops_computing_and_frees_its_budget(long_server):
    server = long_server
    sock = raw_request(server, "/v1/completions", {"prompt": "Once", "max_tokens": 20000, "stream": True,
                                                   "deadline_ms": 120_000})
    head = b""
    while head.count(b"data: ") < 2:  # the headers and some tokens came: it is computing
        head += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    assert server.metric("serve_running_sequences") == 1
    sock.close()
    wait_for(lambda: server.metric("serve_running_sequences") == 0, "the dropped stream left the batch")
    assert server.metric('serve_requests_total{outcome="cancelled"}') == 1
    assert server.metric("serve_callers_gone_total") == 1
    generated = server.metric("serve_generated_tokens_total")
    assert generated < 20000  # it stopped midway
    # Its whole budget is free again: a request needing all of it is admitted and answered.
    status, _, answer = server.generate({"prompt": "Once", "max_tokens": 30, "deadline_ms": 60_000})
    assert status == 200 and answer["tokens"] == 30
    assert server.metric("serve_generated_tokens_total") == generated + 30


def test_callers_that_leave_before_their_answer_cancel_it_running_or_waiting(long_server):
    server = long_server
    running = raw_request(server, "/v1/generate", {"prompt": "Once", "max_tokens": 20000, "deadline_ms": 120_000})
    wait_for(lambda: server.metric("serve_running_sequences") == 1, "the long request runs")
    # Over the budget while the first runs: it waits in the queue.
    waiting = raw_request(server, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20000, "deadline_ms": 120_000})
    wait_for(lambda: server.metric("serve_queue_depth") == 1, "the second request waits")
    waiting.close()
    wait_for(lambda: server.metric("serve_queue_depth") == 0, "the waiting request left the queue")
    assert server.metric("serve_running_sequences") == 1
    running.close()
    wait_for(lambda: server.metric("serve_running_sequences") == 0, "the running request left the batch")
    assert server.metric('serve_requests_total{outcome="cancelled"}') == 2
    assert server.metric('serve_requests_total{outcome="answered"}') == 0
    assert server.generate({"prompt": "hi", "max_tokens": 4})[0] == 200

"""The inference server: its engine in this process, and the server as a real process on loopback."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import torch

from runners.workloads.progress import read_checkpoints
from runners.workloads.serve import LISTENING_TAG, Settings, check_request
from runners.workloads.serve_engine import CharRunner, Engine, PrefixCache, Refused, load_model
from runners.workloads.train import DEFAULT_CORPUS, CharModel, save_checkpoint

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PRINTABLE = bytes(range(32, 127)) + b"\n"
SYSTEM = b"You are the portal's assistant. Answer briefly and kindly. "  # 59 bytes, shared by many prompts


def model(seed=0) -> CharModel:
    torch.manual_seed(seed)
    return CharModel().eval()


def engine(settings=None, *, start=True, seed=0) -> Engine:
    e = Engine(model(seed), PRINTABLE, settings or Settings())
    if start:
        e.start()
    return e


def finish(seq, timeout=30):
    assert seq.done.wait(timeout), "no answer"
    return seq


# --- the engine -----------------------------------------------------------------------------------


def test_the_prefix_cache_changes_nothing_but_the_work_done():
    prompts = [SYSTEM + f"Question {i}: what is a GPU?".encode() for i in range(12)]
    outputs = {}
    for mib in (0, 8):
        e = engine(Settings(prefix_cache_mib=mib, prefix_block=16))
        seqs = []
        for p in prompts:
            seqs.append(e.submit(p, 12, 20_000))
            finish(seqs[-1])  # one at a time, so each can find what the one before left
        outputs[mib] = [bytes(s.out) for s in seqs]
        assert all(s.status == 200 and len(s.out) == 12 for s in seqs)
        if mib:
            # Every prompt after the first starts from the state after the shared 48 aligned bytes at least.
            assert e.cache.lookups == 12 and e.cache.hits == 11
            assert e.cache.tokens_saved >= 11 * 48
        else:
            assert e.cache.hits == 0 and not e.cache.entries
    assert outputs[0] == outputs[8]


def test_the_prefix_cache_is_bounded_and_drops_the_least_recently_used():
    cache = PrefixCache(limit_bytes=4000, block=8)
    states = torch.zeros(64, 64)
    for i in range(40):
        cache.store(bytes([65 + i % 26]) * 8 + str(i).encode() * 8, 0, states)
        assert cache.bytes <= 4000
    assert len(cache.entries) < 40 * 2
    # The one used most recently survives what comes after it; the oldest went.
    cache.store(b"K" * 16 + b"tail", 0, states)
    kept = b"K" * 16
    for i in range(10):
        assert cache.longest(kept + b"?")[0] == 16
        cache.store(bytes([97 + i]) * 16, 0, states)
    assert kept in cache.entries
    assert b"A" * 8 not in cache.entries
    assert cache.bytes == sum(len(k) + 64 * 4 + PrefixCache.ENTRY_OVERHEAD for k in cache.entries)


def test_a_short_request_is_not_held_behind_a_long_one_and_a_waiting_one_joins_when_one_leaves():
    long_cost, short_cost = 10 + 256, 10 + 4
    e = engine(Settings(batch_token_budget=long_cost + short_cost, max_batch_wait_ms=0, max_tokens=256))
    long = e.submit(b"long story", 256, 30_000)
    while long.joined is None:
        time.sleep(0.001)
    first = e.submit(b"short one!", 4, 30_000)
    second = e.submit(b"short two!", 4, 30_000)  # over the budget until the first leaves
    for seq in (long, first, second):
        finish(seq)
    assert [s.status for s in (long, first, second)] == [200, 200, 200]
    assert first.finished < second.joined < long.finished
    assert second.finished < long.finished
    assert e.peak_batch_tokens <= long_cost + short_cost


def test_the_batch_never_holds_more_tokens_than_its_budget():
    e = engine(Settings(batch_token_budget=200, max_batch_wait_ms=5))
    seqs = [e.submit(b"x" * (10 + i), 20 + 3 * i, 60_000) for i in range(30)]
    for seq in seqs:
        assert finish(seq).status == 200
    assert 150 < e.peak_batch_tokens <= 200


def test_earliest_deadline_first_not_first_come():
    e = engine(Settings(batch_token_budget=20, max_batch_wait_ms=0), start=False)
    late = e.submit(b"abc", 10, 9_000)
    soon = e.submit(b"abc", 10, 3_000)
    middle = e.submit(b"abc", 10, 6_000)
    e.start()
    for seq in (late, soon, middle):
        finish(seq)
    assert soon.joined < middle.joined < late.joined


def test_a_request_whose_deadline_passed_in_the_queue_is_dropped_before_it_costs_compute():
    e = engine(start=False)
    doomed = e.submit(b"hello there", 5, 30)
    kept = e.submit(b"hello there", 5, 20_000)
    time.sleep(0.05)
    e.start()
    finish(doomed), finish(kept)
    assert doomed.status == 504 and "waited" in doomed.detail
    assert doomed.out == [] and doomed.compute_s == 0 and doomed.joined is None
    assert kept.status == 200
    assert e.metrics.outcomes.labels("expired")._value.get() == 1


class DescheduledRunner(CharRunner):
    """The CharModel, but the process is taken off the core for 20 ms at each decode step (a contended core)."""

    def step(self, last):
        time.sleep(0.02)  # wall time passes, the engine computes nothing
        return super().step(last)


def test_the_step_estimate_counts_only_time_the_engine_computed():
    m = model()
    e = Engine(DescheduledRunner(m, PRINTABLE, torch.device("cpu"), PrefixCache(0, 16)), None, Settings())
    e.start()
    seq = finish(e.submit(b"a prompt", 60, 60_000))
    assert seq.status == 200 and seq.compute_s >= 60 * 0.02
    # Wall time would have put the estimate near 20 ms a step, and refused what the engine could serve.
    assert e.step_s < 0.005, e.step_s


def test_a_full_queue_and_an_impossible_deadline_are_refused_at_once_with_retry_after():
    e = engine(Settings(queue_limit=2, batch_token_budget=300, max_tokens=256), start=False)
    e.submit(b"a" * 40, 256, 60_000)
    e.submit(b"b" * 40, 256, 60_000)
    started = time.monotonic()
    with pytest.raises(Refused) as full:
        e.submit(b"c", 1, 60_000)
    assert full.value.status == 429 and "full" in full.value.detail and full.value.retry_after >= 1
    assert full.value.reason is None, "a full replica: the edge's limit for it learns from this refusal"
    assert time.monotonic() - started < 0.1

    e = engine(Settings(batch_token_budget=300, max_tokens=256), start=False)
    e.step_s = 0.01  # as if each decode step took 10 ms here
    e.submit(b"a" * 40, 256, 3_000)  # ahead by its deadline, and holds the whole budget for 256 steps: 2.6 s
    with pytest.raises(Refused) as hopeless:
        e.submit(b"b" * 40, 100, 3_500)  # 2.6 s of waiting, then 1 s of its own
    assert hopeless.value.status == 429 and "deadline" in hopeless.value.detail
    assert hopeless.value.reason == "deadline", "this request's deadline alone: marked so the edge's limit stays"
    assert hopeless.value.retry_after >= 2
    assert len(e.queue) == 1
    e.submit(b"b" * 40, 100, 10_000)  # the same request with time enough is admitted


def test_draining_refuses_new_work_with_503_and_answers_what_was_admitted():
    e = engine(Settings(batch_token_budget=100), start=False)
    admitted = [e.submit(b"abc", 40, 30_000) for _ in range(5)]
    e.drain()
    with pytest.raises(Refused) as refused:
        e.submit(b"abc", 4, 30_000)
    assert refused.value.status == 503 and refused.value.retry_after >= 1
    e.start()
    assert e.wait_idle(30)
    assert [s.status for s in admitted] == [200] * 5


def test_the_checks_name_the_field():
    settings = Settings(max_prompt_bytes=32, max_tokens=64, batch_token_budget=80, max_deadline_ms=60_000)

    def check(body):
        return check_request(body, settings, frozenset(PRINTABLE))

    good = {"prompt": "hi", "max_tokens": 4}
    cases = [
        ([1], "non_field_errors"),
        ({**good, "temperature": 0.5}, "temperature"),
        ({"max_tokens": 4}, "prompt"),
        ({**good, "prompt": ""}, "prompt"),
        ({**good, "prompt": 7}, "prompt"),
        ({**good, "prompt": "x" * 33}, "prompt"),
        ({**good, "prompt": "caf\u00e9"}, "prompt"),
        ({**good, "prompt": "tab\there"}, "prompt"),
        ({**good, "prompt": "\ud800"}, "prompt"),
        ({"prompt": "hi"}, "max_tokens"),
        ({**good, "max_tokens": 0}, "max_tokens"),
        ({**good, "max_tokens": 65}, "max_tokens"),
        ({**good, "max_tokens": True}, "max_tokens"),
        ({**good, "max_tokens": 4.0}, "max_tokens"),
        ({**good, "prompt": "x" * 30, "max_tokens": 60}, "max_tokens"),
        ({**good, "deadline_ms": -5}, "deadline_ms"),
        ({**good, "deadline_ms": 0}, "deadline_ms"),
        ({**good, "deadline_ms": "soon"}, "deadline_ms"),
        ({**good, "deadline_ms": float("nan")}, "deadline_ms"),
        ({**good, "deadline_ms": 60_001}, "deadline_ms"),
        ({**good, "deadline_ms": 10**400}, "deadline_ms"),  # too big for a float: a 400, never an exception
    ]
    for body, name in cases:
        with pytest.raises(ValueError) as error:
            check(body)
        assert list(error.value.args[0]) == [name], body
    assert check(good) == (b"hi", 4, Settings().default_deadline_ms)
    with pytest.raises(ValueError) as error:
        check({**good, "prompt": "na\u00efve caf\u00e9"})
    assert "\u00e9" in error.value.args[0]["prompt"] and "\u00ef" in error.value.args[0]["prompt"]


# --- a trained checkpoint, served by a real process ------------------------------------------------


def train_checkpoint(tmp_path: Path) -> Path:
    job = tmp_path / "job"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_")}
    env.update(OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    subprocess.run(
        [sys.executable, "-m", "runners.workloads.train", "--job-dir", str(job), "--steps", "20", "--checkpoint-every", "10"],
        cwd=REPO, env=env, check=True, capture_output=True, timeout=240,
    )
    assert [c["step"] for c in read_checkpoints(job)] == [10, 20]
    return job


def write_checkpoint(tmp_path: Path, alphabet=PRINTABLE) -> Path:
    job = tmp_path / "job"
    m = model()
    save_checkpoint(job, 1, m, torch.optim.Adam(m.parameters()), keep=3, world_size=1, attempt=0, alphabet=alphabet)
    return job


class ServerProcess:
    def __init__(self, checkpoint: Path, *args):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
        env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runners.workloads.serve", "--checkpoint", str(checkpoint), "--port", "0", *map(str, args)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        line = self.proc.stdout.readline()
        assert line.startswith(LISTENING_TAG), line + self.proc.stdout.read()
        self.port = json.loads(line.split(" ", 1)[1])["port"]

    def request(self, method, path, body=None, *, content_type="application/json", timeout=60):
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, method=method, headers={"Content-Type": content_type}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as answer:
                return answer.status, dict(answer.headers), answer.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def generate(self, body, **kw):
        status, headers, data = self.request("POST", "/v1/generate", body, **kw)
        return status, headers, json.loads(data)

    def metric(self, name) -> float:
        text = self.request("GET", "/metrics")[2].decode()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{"))
        )

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def served(tmp_path):
    server = ServerProcess(write_checkpoint(tmp_path), "--max-prompt-bytes", 64, "--max-tokens", 32)
    yield server
    server.stop()


def test_a_trained_checkpoint_is_served_and_answers_in_its_corpus_alphabet(tmp_path):
    job = train_checkpoint(tmp_path)
    _model, alphabet = load_model(job, torch.device("cpu"))
    assert alphabet == bytes(sorted(set(DEFAULT_CORPUS.read_bytes())))
    server = ServerProcess(job)  # the folder: its newest checkpoint, step 20
    try:
        status, _, answer = server.generate({"prompt": "The cluster", "max_tokens": 40, "deadline_ms": 20_000})
        assert status == 200, answer
        assert set(answer) == {"text", "tokens", "queue_ms", "compute_ms"}
        assert answer["tokens"] == 40 and set(answer["text"].encode()) <= set(alphabet)
        assert answer["compute_ms"] > 0 and answer["queue_ms"] >= 0
        # Torch is the engine's alone: the front's process maps none of its libraries, its engine's process
        # does (its other child is multiprocessing's resource tracker).
        assert not maps_torch(server.proc.pid)
        assert [maps_torch(pid) for pid in children(server.proc.pid)].count(True) == 1
    finally:
        server.stop()


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def maps_torch(pid: int) -> bool:
    return any("/torch/" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def test_bad_input_is_a_4xx_naming_the_field_and_the_server_keeps_serving(served):
    for body, name in [
        ({"prompt": "", "max_tokens": 4}, "prompt"),
        ({"prompt": "x" * 65, "max_tokens": 4}, "prompt"),
        ({"prompt": "\u00fcber", "max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "max_tokens": 33}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 4, "deadline_ms": -1}, "deadline_ms"),
        ({"prompt": "hi", "max_tokens": 4, "stream": True}, "stream"),
    ]:
        status, _, answer = served.generate(body)
        assert (status, list(answer)) == (400, [name]), (body, answer)
    assert served.request("POST", "/v1/generate", b"{not json")[0] == 400
    status, _, answer = served.generate({"prompt": "hi", "max_tokens": 4}, content_type="text/plain")
    assert (status, list(answer)) == (415, ["Content-Type"])
    assert served.request("POST", "/v1/generate", b"x" * 70_000)[0] == 413
    status, _, answer = served.generate({"prompt": "hi", "max_tokens": 4})
    assert status == 200 and answer["tokens"] == 4
    assert served.metric('serve_front_refused_total{reason="invalid"}') == 9
    assert served.metric('serve_requests_total{outcome="answered"}') == 1
    assert served.request("GET", "/healthz")[0] == 200 and served.request("GET", "/readyz")[0] == 200


def test_sigterm_under_load_answers_every_admitted_request_then_exits_0(tmp_path):
    # One sequence at a time, 48 of 200 tokens each: seconds of work still queued when SIGTERM comes.
    server = ServerProcess(write_checkpoint(tmp_path), "--batch-token-budget", 220, "--queue-limit", 100, "--max-tokens", 200)
    results = []

    def client(i):
        try:
            results.append(server.generate({"prompt": f"request {i:02d}", "max_tokens": 200, "deadline_ms": 120_000}))
        except Exception as error:  # a refused connection or a reset: what a drain must never cause
            results.append((repr(error), {}, {}))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(48)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        arrived = 0
        while arrived < 48 and time.monotonic() < deadline:
            arrived = server.metric("serve_requests_received_total")
            time.sleep(0.005)
        assert arrived == 48
        server.proc.send_signal(signal.SIGTERM)
        until = time.monotonic() + 5  # the signal reaches the server's main thread a moment later
        while (ready := server.request("GET", "/readyz"))[0] == 200 and time.monotonic() < until:
            time.sleep(0.01)
        assert ready[0] == 503 and json.loads(ready[2])["draining"] is True
        status, headers, answer = server.generate({"prompt": "late", "max_tokens": 4})
        assert status == 503 and int(headers["Retry-After"]) >= 1
        # The portal repeats a stop until the replica is gone: a second SIGTERM must not cut the drain short.
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    assert Counter(r[0] for r in results) == {200: 48}
    assert all(r[2]["tokens"] == 200 for r in results)
    assert "drained: 48 answered" in server.proc.stdout.read()


async def _post_all(port: int, bodies: list[dict], spacing_s: float) -> list[tuple[int, float, bytes]]:
    """Send each body `spacing_s` after the one before (open loop); (status, seconds to the answer, the answer's
    head in lower case) each."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(i, body):
        await asyncio.sleep(max(0.0, start + i * spacing_s - loop.time()))
        sent = loop.time()
        data = json.dumps(body).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode() + data
        )
        raw = await asyncio.wait_for(reader.read(), 120)
        writer.close()
        return int(raw.split(b" ", 2)[1]), loop.time() - sent, raw.partition(b"\r\n\r\n")[0].lower()

    return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


def test_overload_is_answered_in_time_shed_or_expired_never_left_waiting(tmp_path):
    # Two sequences at a time and 200 tokens each: the 300 requests of this burst are seconds of
    # work, and the queue could hold them all. Without refusing what can't meet its deadline, and
    # expiring what no longer can, most would be answered seconds past their deadline.
    server = ServerProcess(write_checkpoint(tmp_path), "--batch-token-budget", 450, "--max-tokens", 200,
                           "--queue-limit", 1000)
    try:
        bodies = [{"prompt": f"burst {i}", "max_tokens": 200, "deadline_ms": 500} for i in range(300)]
        answers = asyncio.run(_post_all(server.port, bodies, 0.003))
    finally:
        server.stop()
    statuses = Counter(status for status, _, _ in answers)
    assert set(statuses) <= {200, 429, 504}, statuses
    assert statuses[200] > 0 and statuses[429] > 0
    # The queue never fills here (1,000): each 429 refused its request's deadline, and says so to the edge.
    assert all(b"\r\nx-portal-refused: deadline" in head for status, _, head in answers if status == 429)
    # Every caller had its answer close to its deadline at the latest; the slack is for a busy test machine.
    assert max(seconds for _, seconds, _ in answers) < 0.5 + 1.5, sorted(s for _, s, _ in answers)[-5:]


def test_the_engine_process_killed_mid_load_answers_every_waiting_caller_and_the_replica_exits_1(tmp_path):
    server = ServerProcess(write_checkpoint(tmp_path), "--batch-token-budget", 220, "--max-tokens", 200)
    results = []

    def client(i):
        try:
            results.append(server.generate({"prompt": f"request {i}", "max_tokens": 200, "deadline_ms": 60_000})[0])
        except Exception as error:
            results.append(repr(error))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(20)]
    try:
        for t in threads:
            t.start()
        until = time.monotonic() + 30
        while server.metric("serve_requests_received_total") < 20 and time.monotonic() < until:
            time.sleep(0.005)
        engine = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(engine) >= 1
        for pid in engine:
            os.kill(int(pid), signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert server.proc.wait(30) == 1
    finally:
        server.stop()
    # Each caller had an answer: served before the kill, or told at once that the engine stopped.
    assert len(results) == 20 and set(results) <= {200, 503}, results
    assert 503 in results
    assert "the engine's process stopped" in server.proc.stdout.read()


def test_settings_come_from_flags_over_variables_over_defaults_and_bad_ones_exit_2():
    from runners.workloads.serve import parse_args, settings_from

    args = parse_args(["--checkpoint", "x", "--queue-limit", "7"], {"SERVE_QUEUE_LIMIT": "9", "SERVE_PREFIX_BLOCK": "32"})
    assert settings_from(args) == Settings(queue_limit=7, prefix_block=32)
    for bad in (["--queue-limit", "0"], ["--max-batch-wait-ms", "-1"], ["--default-deadline-ms", "999999999"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--checkpoint", "x", *bad], {})
        assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        parse_args([], {})  # no checkpoint


def test_a_checkpoint_that_does_not_load_exits_1_saying_why(tmp_path):
    (tmp_path / "not-a-checkpoint.pt").write_bytes(b"hello")
    done = subprocess.run(
        [sys.executable, "-m", "runners.workloads.serve", "--checkpoint", str(tmp_path / "not-a-checkpoint.pt"),
         "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1
    assert "the engine did not start" in done.stderr and LISTENING_TAG not in done.stdout

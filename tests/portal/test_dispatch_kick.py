"""A kick (`send_task_at_most_every`) asked again within its window is not dropped.

The kick sent at once on the first ask, and dropped every other ask of the window: when the first
message's run had already started (the worker takes it in milliseconds), what the second ask was
for waited for the beat. Now the window's first dropped ask sends one more message, to run when
the window ends, saying "a run that started after the window's end" (its first argument), so no
run that started before the last ask it covers stands in for it. A burst still costs two messages.
What reaches the broker is read from this run's queue in Redis.
"""

import base64
import json
import time

import pytest
import redis
from django.conf import settings
from django.core.cache import cache

from common import dispatch

pytestmark = pytest.mark.integration

NAME = "runners.tasks.scheduler_cycle"
WINDOW_S = 1


def _queued() -> list[dict]:
    """The messages in this run's queue, oldest first: their args and ETA (None: at once)."""
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    messages = []
    for raw in reversed(client.lrange(settings.CELERY_TASK_DEFAULT_QUEUE, 0, -1)):  # kombu pushes on the left
        message = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        messages.append({"task": message["headers"]["task"], "args": args, "eta": message["headers"].get("eta")})
    return messages


@pytest.fixture
def empty_queue(own_queue):
    """An empty queue of the test's own (tests/conftest.py), and the kick's memory of earlier asks forgotten."""
    cache.delete_many([f"portal:dispatch:once:{NAME}", f"portal:dispatch:once:{NAME}:trailing"])
    yield


def _eta_s(message: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(message["eta"]).timestamp()


def test_an_ask_within_the_window_gets_a_message_that_runs_after_it(empty_queue):
    first_at = time.time()
    assert dispatch.send_task_at_most_every(WINDOW_S, NAME, first_at) is True
    second_at = time.time()
    dispatch.send_task_at_most_every(WINDOW_S, NAME, second_at)
    third_at = time.time()
    dispatch.send_task_at_most_every(WINDOW_S, NAME, third_at)

    messages = _queued()
    assert [message["task"] for message in messages] == [NAME, NAME], messages
    leading, trailing = messages
    assert leading["args"] == [first_at] and leading["eta"] is None
    # The trailing one runs after every ask it stands for, and only a run started after them all replaces it.
    assert trailing["eta"] is not None and _eta_s(trailing) >= third_at, trailing
    assert trailing["args"][0] >= third_at, trailing


def test_asks_a_window_apart_each_send_at_once(empty_queue):
    dispatch.send_task_at_most_every(WINDOW_S, NAME, time.time())
    time.sleep(WINDOW_S + 0.2)
    later_at = time.time()
    dispatch.send_task_at_most_every(WINDOW_S, NAME, later_at)

    messages = _queued()
    assert len(messages) == 2 and all(message["eta"] is None for message in messages), messages
    assert messages[1]["args"] == [later_at]

"""The login throttle holds when several gunicorn workers serve the portal, as `make run` does.

Its counters live in Django's cache; when that was a per-process memory cache (the default then) each worker
process counted alone, and wrong passwords spread over the workers were never throttled. The
gunicorn here runs with CACHE_URL unset, as `make run` does, so the default is what is tested: the
cache is the broker's Redis (a Redis of the test's own), one store for every worker.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from tests.faults import support

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LIMIT = 5
WORKERS = 3
BURSTS = 5


@pytest.fixture(scope="module")
def served(django_db_setup, django_db_blocker, tmp_path_factory):
    """One Redis and one gunicorn for the module: booting them is most of what these tests cost."""
    logs = tmp_path_factory.mktemp("throttle")
    broker = support.PrivateRedis(logs / "redis.log").start()
    server = support.Gunicorn(logs / "web.log", workers=WORKERS, CELERY_BROKER_URL=broker.url,
                              API_LOGIN_RATE=f"{LIMIT}/min", NUM_PROXIES=1)
    server.env.pop("CACHE_URL", None)  # the default, as `make run` serves
    server.start()
    yield server, broker
    with django_db_blocker.unblock():  # the stop waits for the server's database connections to end
        server.stop()
    broker.kill()


@pytest.fixture
def web(served):
    """The module's gunicorn, its Redis emptied: each test's attempts are counted from zero."""
    server, broker = served
    redis.Redis.from_url(broker.url).flushall()  # flush-ok: the module's own Redis server
    return server


def test_wrong_passwords_spread_over_workers_are_throttled(web, owner):
    answers = []
    for _ in range(4 * LIMIT):
        response = requests.post(f"{web.url}/api/v1/auth/token/", json={"username": owner.username, "password": "wrong"},
                                 timeout=30)
        answers.append(response.status_code)
    assert all(status in (400, 401, 429) for status in answers), answers
    assert 429 not in answers[:LIMIT], answers
    assert answers[LIMIT:] == [429] * (3 * LIMIT), f"every attempt after the {LIMIT}th is refused: {answers}"
    assert len(web.worker_pids()) == WORKERS


def test_wrong_passwords_sent_at_once_are_each_counted(web, owner):
    """Attempts in flight together in several workers each count: no more than the rate get through.

    (Read, then written back, the counters lost the attempts made in between.) Several bursts, each
    from an address of its own (NUM_PROXIES=1: the address is X-Forwarded-For's).
    """

    def attempt(address):
        return requests.post(f"{web.url}/api/v1/auth/token/", json={"username": owner.username, "password": "wrong"},
                             headers={"X-Forwarded-For": address}, timeout=30).status_code

    with ThreadPoolExecutor(WORKERS * 3) as pool:
        for burst in range(BURSTS):
            answers = list(pool.map(attempt, [f"10.0.0.{burst + 1}"] * (4 * LIMIT)))
            assert sum(1 for status in answers if status != 429) <= LIMIT, (burst, answers)

"""What the benches that measure the portal in their own process share: a scratch database, and timing
requests (Django's test client runs the same middleware and views gunicorn would)."""

import contextlib
import statistics
import time


@contextlib.contextmanager
def scratch_database():
    """A PostgreSQL database of the bench's own (DATABASE_URL's server), created here and dropped after."""
    from django.conf import settings
    from django.db import connection

    if not settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        raise SystemExit("The bench needs PostgreSQL: set DATABASE_URL.")
    settings.ALLOWED_HOSTS = ["*"]
    original = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        yield
    finally:
        connection.creation.destroy_test_db(original, verbosity=0)


def needs_postgres_and_redis() -> str | None:
    """What is missing for a bench that runs the portal's processes: PostgreSQL and a Redis broker; None if neither."""
    from django.conf import settings

    if not settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        return "The bench needs PostgreSQL: set DATABASE_URL."
    if not settings.CELERY_BROKER_URL.startswith("redis"):
        return "The bench needs Redis as the broker: set CELERY_BROKER_URL."
    return None


def timed(call, count: int) -> tuple[float, float]:
    """`call()` made `count` times, each answering 200: the median and p99 in milliseconds."""
    took = []
    for _ in range(count):
        start = time.perf_counter()
        response = call()
        took.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200, (response.status_code, response.content[:300])
    took.sort()
    return statistics.median(took), took[min(len(took) - 1, round(0.99 * (len(took) - 1)))]

"""Timing what the benches ask of the portal in their own process (Django's test client, as gunicorn would run it)."""

import statistics
import time


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

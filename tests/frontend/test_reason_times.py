"""The time beside a reason, as the pages write it: how far off, then the clock in the portal's time zone."""

from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest

from frontend.templatetags.reasons import moment

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 4, 13, 45, tzinfo=dt_timezone.utc)


@pytest.mark.parametrize(
    ("later", "text"),
    [
        (timedelta(seconds=20), "in under a minute, at 13:45 UTC"),
        (timedelta(minutes=20), "in about 20 minutes, at 14:05 UTC"),
        (timedelta(minutes=1, seconds=10), "in about 1 minute, at 13:46 UTC"),
        (timedelta(hours=3, minutes=10), "in about 3 hours, at 16:55 UTC"),
        (timedelta(hours=12), "in about 12 hours, at Dec 5, 01:45 UTC"),
        (timedelta(days=3), "in about 3 days, at Dec 7, 13:45 UTC"),
        (timedelta(minutes=-5), "any moment now (due at 13:40 UTC)"),
    ],
)
def test_a_time_reads_as_how_far_off_and_the_local_clock(later, text):
    assert moment(NOW + later, NOW) == text


def test_the_clock_is_the_portals_time_zone(settings):
    settings.TIME_ZONE = "Europe/Berlin"
    from django.utils import timezone

    timezone.deactivate()
    assert moment(NOW + timedelta(minutes=20), NOW) == "in about 20 minutes, at 15:05 CET"


def test_no_time_reads_as_nothing():
    assert moment(None) == ""

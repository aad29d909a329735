"""PORTAL_GC_THRESHOLDS: the collector's thresholds every portal process sets (portal/collector.py)."""

import gc
import os

import pytest
from django.core.exceptions import ImproperlyConfigured

from portal.collector import DEFAULT_THRESHOLDS, thresholds_from

pytestmark = pytest.mark.unit


def test_empty_means_the_portal_default_and_python_means_cpythons_own():
    assert thresholds_from(None) == thresholds_from("  ") == DEFAULT_THRESHOLDS
    assert thresholds_from("python") == (700, 10, 10)
    assert thresholds_from(" 10000, 10 ,10") == (10000, 10, 10)


@pytest.mark.parametrize("value", ["1,2", "1,2,3,4", "a,b,c", "0,10,10", "100,-1,10", "1.5,2,3"])
def test_a_malformed_value_names_the_variable(value):
    with pytest.raises(ImproperlyConfigured, match="PORTAL_GC_THRESHOLDS"):
        thresholds_from(value)


def test_this_process_runs_under_the_thresholds_the_portal_set():
    # The test runner imported the portal (pytest-django read its settings) and so runs under them too.
    assert gc.get_threshold() == thresholds_from(os.environ.get("PORTAL_GC_THRESHOLDS"))


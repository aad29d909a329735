"""pytest-xdist hands out tests by id: every collected id must be unique, or it runs one of each, silently."""

from types import SimpleNamespace

import pytest

from tests.support.durations import pytest_collection_modifyitems, repeated_ids

pytestmark = pytest.mark.unit


def _items(*ids):
    return [SimpleNamespace(nodeid=nodeid) for nodeid in ids]


def test_ids_collected_twice_are_found():
    items = _items("t.py::a[GET /x][member]", "t.py::a", "t.py::a", "t.py::b", "t.py::b", "t.py::c")
    assert repeated_ids(items) == ["t.py::a", "t.py::b"]
    assert repeated_ids(_items("t.py::a[GET /x]", "t.py::a[GET /y]")) == []


def test_a_collection_with_a_repeated_id_stops_the_run_naming_it():
    with pytest.raises(pytest.UsageError, match=r"1 test ids are collected more than once.*t\.py::a"):
        pytest_collection_modifyitems(None, None, _items("t.py::a", "t.py::a", "t.py::b"))

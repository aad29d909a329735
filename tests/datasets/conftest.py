"""Every dataset test keeps its blobs in a store folder of its own (DATA_STORAGE_URL), never var/store."""

import pytest


@pytest.fixture(autouse=True)
def data_store(settings, tmp_path):
    """The blob store folder of this test (file://), empty at the start."""
    folder = tmp_path / "store"
    settings.DATA_STORAGE_URL = f"file://{folder}"
    settings.DATA_STORAGE_OPTIONS = {}
    return folder

"""Every bundle test stores into a folder of its own (BUNDLE_STORAGE_URL), never var/bundles."""

import pytest


@pytest.fixture(autouse=True)
def bundle_storage(settings, tmp_path):
    """The bundle storage folder of this test (file://), empty at the start."""
    folder = tmp_path / "bundle-storage"
    settings.BUNDLE_STORAGE_URL = f"file://{folder}"
    settings.BUNDLE_STORAGE_OPTIONS = {}
    return folder


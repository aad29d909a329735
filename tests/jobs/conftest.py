"""Fixtures the job tests share."""

import pytest

from tests.support.jobs import give_quota, ready_environment


@pytest.fixture
def script_environment(flavors, tenant, owner, settings, tmp_path):
    """A ready environment of the tenant, with room for a few 1-GPU script jobs, bundles stored in a folder
    of the test's own and a 30 s grace period for a stop."""
    settings.BUNDLE_STORAGE_URL = f"file://{tmp_path / 'bundle-storage'}"
    settings.BUNDLE_STORAGE_OPTIONS = {}
    settings.PREEMPTION_GRACE_PERIOD_S = 30
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    return ready_environment(actor=owner, tenant=tenant)

"""A tenant's storage page: the store's bytes against the quota, the retention policy previewed (what it would
delete and free) before it is saved, saved by an owner only, the quota by staff; another tenant's a 404."""

from datetime import UTC, datetime

import pytest

from audit.models import AuditEntry
from quotas.models import TenantStorage
from runners.jobs.models import Checkpoint, Job

pytestmark = pytest.mark.integration

MB = 10**6


@pytest.fixture
def stored(tenant, acme_env, flavors):
    """A finished job with three stored checkpoints of 2 MB each, no chunk shared."""
    job = Job.objects.create(tenant=tenant, environment=acme_env, name="pretrain", flavor=flavors["h100-80gb"],
                             replicas=1, gpus_per_replica=1, state="succeeded", spec={"template": "pytorch-ddp"})
    for step in (1, 2, 3):
        chunks = [[f"{step}{part}".ljust(64, "0"), MB] for part in "ab"]
        Checkpoint.objects.create(job=job, step=step, uri=f"file:///{step}", bytes=5 * MB,
                                  created_at=datetime(2026, 11, 2, step, tzinfo=UTC), store_state="durable",
                                  durable_at=datetime(2026, 11, 2, step, tzinfo=UTC), stored_bytes=2 * MB,
                                  manifest={"version": 1, "sha256": "f" * 64, "bytes": 5 * MB, "chunks": chunks})
    return job


def _page(client, user, tenant, data=None):
    client.force_login(user)
    url = f"/tenants/{tenant.slug}/storage/"
    return client.post(url, data) if data is not None else client.get(url)


def test_an_owner_previews_a_policy_then_saves_it(client, owner, tenant, stored):
    page = _page(client, owner, tenant)
    assert page.status_code == 200
    assert "6.0\xa0MB" in page.content.decode() and "keep everything" in page.content.decode()

    preview = _page(client, owner, tenant, {"action": "preview", "keep_newest": "1", "keep_best": "", "keep_every": ""})
    assert preview.status_code == 200
    shown = preview.content.decode()
    assert 'data-testid="retention-preview"' in shown and "1, 2" in shown
    assert "4.0\xa0MB" in shown and "10.0\xa0MB as files" in shown  # two checkpoints: 4 MB of store, 10 MB of files
    assert not TenantStorage.objects.filter(tenant=tenant).exists()  # a preview saves nothing

    saved = _page(client, owner, tenant, {"action": "save", "keep_newest": "1", "keep_best": "", "keep_every": ""})
    assert saved.status_code == 302
    assert TenantStorage.objects.get(tenant=tenant).retention["keep_newest"] == 1
    assert AuditEntry.objects.filter(action="storage.updated", actor=owner).count() == 1


def test_a_viewer_previews_but_cannot_save_and_bad_input_names_the_field(client, viewer, tenant, stored):
    page = _page(client, viewer, tenant)
    assert "Save policy" not in page.content.decode()
    refused = _page(client, viewer, tenant, {"action": "save", "keep_newest": "1"})
    assert refused.status_code == 400 and "admins and owners" in refused.content.decode()
    bad = _page(client, viewer, tenant, {"action": "preview", "keep_every": "0"})
    assert bad.status_code == 400 and 'id="id_keep_every_error"' in bad.content.decode()
    assert not TenantStorage.objects.filter(tenant=tenant).exists()


def test_staff_set_the_quota_and_an_outsider_gets_404(client, staff, outsider, tenant):
    assert _page(client, staff, tenant, {"action": "quota", "quota_gb": "1.5"}).status_code == 302
    assert str(TenantStorage.objects.get(tenant=tenant).quota_gb) == "1.500"
    assert _page(client, staff, tenant).content.decode().count("1.5\xa0GB") == 1
    assert _page(client, outsider, tenant).status_code == 404

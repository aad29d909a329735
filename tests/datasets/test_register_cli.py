"""`portal data register URL NAME` against a live portal over HTTP: the dataset made when missing, the version
registered and packed by the worker's code, the wait ending sealed, or exit 1 with the reason when it failed or
is still packed, and a URL outside the portal's sources exit 2 naming it."""

import json

import pytest
from gpuportal.cli import app, data
from gpuportal.client import Client, PortalError
from typer.testing import CliRunner

from runners.datasets import services
from runners.datasets.models import DatasetVersion, VersionState
from tenants.services import token_create

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def portal(live_server, owner, settings, tmp_path):
    settings.DATASET_SOURCE_URLS = [f"file://{tmp_path}/incoming/{{tenant}}/"]
    settings.DATASET_REGISTER_SHARD_BYTES = 16 * 1024
    _, token = token_create(user=owner, name="register")
    with Client(live_server.url, token) as client:
        yield client, {"PORTAL_URL": live_server.url, "PORTAL_TOKEN": token}


def test_register_makes_the_dataset_and_waits_for_the_version_sealed_or_failed(portal, tenant, tmp_path):
    client, env = portal
    source = tmp_path / "incoming" / "acme" / "frames"
    source.mkdir(parents=True)
    for index in range(40):
        (source / f"{index:03d}.bin").write_bytes(bytes([index]) * 2000)
    runner = CliRunner()

    answer = runner.invoke(app, ["data", "register", f"file://{source}", "frames", "--no-wait", "--json"], env=env)
    assert answer.exit_code == 0, answer.output
    opened = json.loads(answer.stdout)
    assert opened["state"] == "open" and opened["source"] == f"file://{source}/"
    # The worker's part (sent by name after the commit; run here as the worker runs it).
    assert services.version_register_run(DatasetVersion.objects.get().id) == VersionState.SEALED
    sealed = data.registered(client, "acme", "frames", opened["number"], timeout_s=10, poll_s=0.1)
    assert sealed["state"] == "sealed" and sealed["files"] == 40

    empty = tmp_path / "incoming" / "acme" / "empty"
    empty.mkdir()
    second = data.register(client, "acme", f"file://{empty}", "frames")
    # Still open, and the wait runs out: exit 1, saying how to learn more later.
    waited = runner.invoke(app, ["data", "register", f"file://{empty}", "frames", "--timeout", "0"], env=env)
    assert waited.exit_code == 1 and "still being packed" in waited.output
    assert services.version_register_run(DatasetVersion.objects.get(number=second["number"]).id) == VersionState.FAILED
    with pytest.raises(PortalError) as failed:
        data.registered(client, "acme", "frames", second["number"], timeout_s=10, poll_s=0.1)
    assert failed.value.exit_code == 1 and "holds no files" in str(failed.value)

    outside = runner.invoke(app, ["data", "register", "file:///etc/", "frames"], env=env)
    assert outside.exit_code == 2 and "url" in outside.output

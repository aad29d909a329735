"""The staff cockpit, the cross-tenant queue, and the tenant, flavor and price card pages, through Django's test client."""

import re
from decimal import Decimal

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from quotas.models import PriceCard, ResourceFlavor
from runners.clusters.models import NodePool, PartitionChange, PartitionProfile
from runners.environments.models import EnvironmentState
from runners.jobs.models import Job, JobEvent
from runners.scheduling import services as scheduling
from tenants.models import Tenant
from tests.support.jobs import give_quota, play_launch, submit

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

STAFF_PAGES = ["/cockpit/", "/cockpit/live/", "/queue/", "/queue/live/", "/cockpit/tenants/new/", "/flavors/"]


@pytest.fixture
def staff_client(client, staff):
    client.force_login(staff)
    return client




def _field_error(html: str, field: str) -> str:
    """The error text the form shows under one field ("" if none)."""
    found = re.search(rf'id="id_{field}-errors">(.*?)</ul>', html, re.S)
    if not found:
        return ""
    text = re.sub(r'<span class="visually-hidden">.*?</span>', "", found.group(1))  # a screen reader's "Error: "
    return re.sub(r"<[^>]+>", "", text).replace("&#x27;", "'").strip()


def _cell(html: str, row_attrs: str, testid: str) -> str:
    """The text of one cell: the row found by its data attributes, the cell by its data-testid."""
    row = re.search(rf"<tr {row_attrs}>(.*?)</tr>", html, re.S)
    assert row, f"no row {row_attrs}"
    cell = re.search(rf'data-testid="{testid}"[^>]*>(.*?)</td>', row.group(1), re.S)
    assert cell, f"no {testid} in row {row_attrs}"
    return re.sub(r"<[^>]+>", "", cell.group(1)).strip()


@pytest.fixture
def borrowing_world(flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env):
    """acme borrows all 16 H100s and runs; globex's guarantee waits for them; acme has a job waiting too."""
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    borrower = submit(owner, acme_env, name="borrower", replicas=2, gpus_per_replica=8,
                       topology={"level": "none", "mode": "preferred"})
    scheduling.cycle_run()
    play_launch(borrower)
    return {"borrower": borrower}


# --- The cockpit ---------------------------------------------------------------------


def test_staff_see_capacity_allocation_every_gpu_and_borrowing_on_the_cockpit(staff_client, borrowing_world, flavors):
    html = staff_client.get("/cockpit/").content.decode()
    h100 = flavors["h100-80gb"]
    assert _cell(html, f'data-flavor="{h100.name}"', "capacity") == "16"
    assert _cell(html, f'data-flavor="{h100.name}"', "allocated") == "16"
    assert _cell(html, f'data-flavor="{h100.name}"', "free") == "0"
    # acme holds 16 with no guarantee: every unit is borrowed.
    assert _cell(html, f'data-tenant="acme" data-flavor="{h100.name}"', "held") == "16"
    assert _cell(html, f'data-tenant="acme" data-flavor="{h100.name}"', "borrowed") == "16"
    assert _cell(html, f'data-tenant="globex" data-flavor="{h100.name}"', "borrowed") == "0"
    # Every GPU is drawn; the 16 H100s are busy with the borrower, the rest free.
    pool = html[html.index('data-pool="h100-pool"'):html.index('data-pool="t4-pool"')]
    assert pool.count('data-busy="true"') == 16 and 'data-busy="false"' not in pool
    assert pool.count(f'data-job="{borrowing_world["borrower"].id}"') == 16
    assert 'data-testid="gpu-drawing"' in pool
    t4 = html[html.index('data-pool="t4-pool"'):]
    assert 'data-busy="true"' not in t4
    assert re.search(r'data-testid="queue-length"[^>]*><a [^>]*>0</a>', html)


def test_the_cockpit_shows_partition_changes_in_flight_and_failing_environments_with_their_reason(
    staff_client, flavors, acme_env, staff
):
    pool = NodePool.objects.get(name="t4-pool")
    profile = PartitionProfile.objects.create(name="t4-share-8", gpu_model="T4", kind="timeslice", replicas=8)
    PartitionChange.objects.create(pool=pool, profile=profile, state=PartitionChange.State.DRAINING,
                                   message="waiting for 1 job to stop", created_by=staff)
    acme_env.state, acme_env.status_message = EnvironmentState.FAILED, "namespace quota refused: exceeded"
    acme_env.save()
    html = staff_client.get("/cockpit/").content.decode()
    partitions = html[html.index('data-testid="cockpit-partitions"'):html.index('data-testid="cockpit-failing"')]
    assert "t4-pool" in partitions and "t4-share-8" in partitions and "waiting for 1 job to stop" in partitions
    failing = html[html.index('data-testid="cockpit-failing"'):]
    assert "acme/train" in failing and "namespace quota refused: exceeded" in failing


def test_the_cockpit_costs_the_same_queries_with_one_job_or_many(staff_client, flavors, tenant, owner, acme_env):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=16, max=16)
    submit(owner, acme_env, name="one", replicas=1, gpus_per_replica=1, topology={"level": "none"})
    scheduling.cycle_run()
    with CaptureQueriesContext(connection) as few:
        assert staff_client.get("/cockpit/").status_code == 200
    for index in range(6):
        submit(owner, acme_env, name=f"more-{index}", replicas=2, gpus_per_replica=1, topology={"level": "none"})
    scheduling.cycle_run()
    with CaptureQueriesContext(connection) as many:
        assert staff_client.get("/cockpit/").status_code == 200
    assert len(many) == len(few), "the cockpit reads a fixed number of queries, not one per job"


def test_the_staff_dashboard_leads_to_the_cockpit_and_a_members_does_not(client, staff, teammate, borrowing_world):
    client.force_login(staff)
    html = client.get("/").content.decode()
    assert 'data-testid="cockpit-banner"' in html and 'href="/cockpit/"' in html
    assert re.search(r'data-testid="summary-holding"><a [^>]*>1</a>', html)
    assert "Your tenants" in html, "the dashboard itself is still there, under the banner"
    client.force_login(teammate)
    html = client.get("/").content.decode()
    assert "cockpit" not in html.lower()


# --- Who may see them ----------------------------------------------------------------


def test_a_member_gets_the_friendly_404_for_every_staff_page_and_cannot_cancel_from_the_queue(
    client, teammate, borrowing_world
):
    client.force_login(teammate)
    for path in STAFF_PAGES:
        response = client.get(path)
        assert response.status_code == 404, path
        assert "Page not found" in response.content.decode(), path
    borrower = borrowing_world["borrower"]
    for path, data in [(f"/queue/{borrower.id}/cancel/", {}), ("/cockpit/tenants/new/", {"slug": "x", "name": "X"}),
                       ("/flavors/new/", {"name": "x"}), ("/flavors/prices/new/", {"flavor": "h100-80gb"})]:
        assert client.post(path, data).status_code == 404, path
    borrower.refresh_from_db()
    assert borrower.state == "running"
    assert not Tenant.objects.filter(slug="x").exists()
    anonymous = Client()
    assert anonymous.get("/cockpit/").status_code == 302


# --- The queue -----------------------------------------------------------------------


def test_the_queue_lists_every_tenants_work_waiting_ones_first_in_the_cycles_order(
    staff_client, borrowing_world, outsider, owner, globex_env, acme_env
):
    owed = submit(outsider, globex_env, name="owed", replicas=1, gpus_per_replica=8, priority=50)
    extra = submit(owner, acme_env, name="extra", replicas=1, gpus_per_replica=4, topology={"level": "none"})
    scheduling.cycle_run()
    owed.refresh_from_db(), extra.refresh_from_db()
    html = staff_client.get("/queue/").content.decode()
    order = [int(job_id) for job_id in re.findall(r'<tr data-job="(\d+)"', html)]
    borrower = borrowing_world["borrower"]
    waiting = sorted([owed, extra], key=lambda job: job.queue_position)
    assert order == [waiting[0].id, waiting[1].id, borrower.id]
    assert _cell(html, f'data-job="{waiting[0].id}" data-state="queued" data-tenant="{waiting[0].tenant.slug}"',
                 "place") == "1"
    # The borrower is preempted for globex's guarantee; its reason says so, and it borrows all it holds.
    borrower_row = f'data-job="{borrower.id}" data-state="preempted" data-tenant="acme"'
    reason = _cell(html, borrower_row, "reason")
    assert reason.startswith("Preempted for job") and "globex" in reason
    assert _cell(html, borrower_row, "borrowing") == "borrowing 16"
    assert _cell(html, f'data-job="{owed.id}" data-state="queued" data-tenant="globex"', "borrowing") == "within guarantee"
    assert '<td class="nowrap">h100-80gb</td>' in html

    globex_only = staff_client.get("/queue/?tenant=globex").content.decode()
    assert re.findall(r'<tr data-job="(\d+)"', globex_only) == [str(owed.id)]
    preempted_only = staff_client.get("/queue/?state=preempted").content.decode()
    assert re.findall(r'<tr data-job="(\d+)"', preempted_only) == [str(borrower.id)]
    live = staff_client.get("/queue/live/?tenant=globex").content.decode()
    assert 'data-poll-url="/queue/live/?tenant=globex"' in live


def test_a_bad_queue_filter_is_a_400_naming_it(staff_client, borrowing_world):
    response = staff_client.get("/queue/?state=exploded&tenant=nobody")
    assert response.status_code == 400
    html = response.content.decode()
    assert "exploded is not one of the available choices" in _field_error(html, "state")
    assert _field_error(html, "tenant"), "the unknown tenant is named too"


def test_cancel_from_the_queue_cancels_through_the_jobs_app_and_never_deletes(
    staff_client, borrowing_world, owner, acme_env
):
    waiting = submit(owner, acme_env, name="waiting", replicas=1, gpus_per_replica=8)
    scheduling.cycle_run()
    response = staff_client.post(f"/queue/{waiting.id}/cancel/", {"next": "/queue/?tenant=acme"}, follow=True)
    assert response.redirect_chain[-1][0] == "/queue/?tenant=acme"
    assert f"Cancelling acme/waiting (job {waiting.id})." in response.content.decode()
    waiting.refresh_from_db()
    assert waiting.state == "cancelled" and waiting.reason == "Cancelled by sam."
    assert list(JobEvent.objects.filter(job=waiting).values_list("to_state", flat=True)) == ["queued", "cancelled"]

    borrower = borrowing_world["borrower"]
    staff_client.post(f"/queue/{borrower.id}/cancel/")
    borrower.refresh_from_db()
    assert borrower.state == "cancelling" and borrower.stop_deadline is not None, "a running job stops with its grace"
    assert Job.objects.filter(id__in=[waiting.id, borrower.id]).count() == 2, "nothing is deleted"

    again = staff_client.post(f"/queue/{waiting.id}/cancel/", follow=True).content.decode()
    assert "has already cancelled" in again
    assert staff_client.post("/queue/999999/cancel/").status_code == 404


def test_the_queues_cancel_needs_the_csrf_token(staff, borrowing_world):
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff)
    borrower = borrowing_world["borrower"]
    assert client.post(f"/queue/{borrower.id}/cancel/").status_code == 403
    html = client.get("/queue/").content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html).group(1)
    client.post(f"/queue/{borrower.id}/cancel/", {"csrfmiddlewaretoken": token})
    borrower.refresh_from_db()
    assert borrower.state == "cancelling"


# --- Tenants, flavors and price cards ------------------------------------------------


def test_staff_create_a_tenant_and_a_bad_or_taken_slug_is_named(staff_client, tenant):
    response = staff_client.post("/cockpit/tenants/new/", {"slug": "Bad Slug!", "name": ""})
    assert response.status_code == 400
    html = response.content.decode()
    assert 'id="id_slug-errors"' in html and 'id="id_name-errors"' in html, "both bad fields in one round"
    response = staff_client.post("/cockpit/tenants/new/", {"slug": "acme", "name": "Another Acme"})
    assert response.status_code == 400
    assert _field_error(response.content.decode(), "slug") == "A tenant with slug 'acme' already exists."

    response = staff_client.post("/cockpit/tenants/new/", {"slug": "new-lab", "name": "New Lab"}, follow=True)
    assert response.redirect_chain[-1][0] == "/tenants/new-lab/"
    assert "Created tenant New Lab." in response.content.decode()
    assert Tenant.objects.get(slug="new-lab").name == "New Lab"


def test_the_flavors_page_lists_units_and_price_cards(staff_client, borrowing_world, flavors):
    h100 = flavors["h100-80gb"]
    PriceCard.objects.create(flavor=h100, price_per_hour=Decimal("4.2"), effective_from="2026-01-01T00:00Z")
    PriceCard.objects.create(flavor=h100, price_per_hour=Decimal("3.9"), effective_from="2099-01-01T00:00Z")
    html = staff_client.get("/flavors/").content.decode()
    row = f'id="flavor-{h100.name}" data-flavor="{h100.name}"'
    assert _cell(html, row, "capacity") == "16" and _cell(html, row, "allocated") == "16"
    cards = _cell(html, row, "price-cards")
    assert "USD 4.2000/h from 2026-01-01 00:00 UTC" in cards and "in force" in cards
    assert "USD 3.9000/h from 2099-01-01 00:00 UTC" in cards and "upcoming" in cards
    t4 = next(name for name in flavors if name.startswith("t4"))
    assert "no price yet" in _cell(html, f'id="flavor-{t4}" data-flavor="{t4}"', "price-cards")


def test_staff_create_a_flavor_and_bad_fields_are_named(staff_client, flavors):
    response = staff_client.post("/flavors/new/", {"name": "Bad Name", "kind": "bogus", "gpu_model": "H100-80GB"})
    assert response.status_code == 400
    html = response.content.decode()
    assert _field_error(html, "name").startswith("Use lowercase letters")
    assert "bogus is not one of the available choices" in _field_error(html, "kind"), "both bad fields in one round"
    # The service's own check, named: a MIG profile the GPU does not have.
    response = staff_client.post("/flavors/new/", {"name": "h100-9g", "kind": "mig", "gpu_model": "H100-80GB",
                                                   "mig_profile": "9g.99gb"})
    assert response.status_code == 400
    assert "'9g.99gb' is not a MIG profile of H100-80GB" in _field_error(response.content.decode(), "mig_profile")
    response = staff_client.post("/flavors/new/", {"name": "h100-1g", "kind": "mig", "gpu_model": "H100-80GB",
                                                   "mig_profile": "1g.10gb", "description": "small slices"}, follow=True)
    assert response.redirect_chain[-1][0] == "/flavors/#flavor-h100-1g"
    flavor = ResourceFlavor.objects.get(name="h100-1g")
    assert (flavor.kind, flavor.mig_profile, flavor.description) == ("mig", "1g.10gb", "small slices")
    assert flavor.capacity == 0, "no H100 is cut into 1g.10gb slices in the demo cluster"


def test_staff_add_a_price_card_and_bad_fields_are_named(staff_client, flavors):
    h100 = flavors["h100-80gb"]
    response = staff_client.post("/flavors/prices/new/", {"flavor": "h100-80gb", "price_per_hour": "-1", "currency": "US"})
    assert response.status_code == 400
    html = response.content.decode()
    assert "greater than or equal to 0" in _field_error(html, "price_per_hour")
    assert _field_error(html, "currency") == "Use a 3-letter ISO 4217 code.", "both bad fields in one round"
    assert not PriceCard.objects.exists()

    data = {"flavor": "h100-80gb", "price_per_hour": "4.25", "currency": "eur", "effective_from": "2026-03-01 00:00"}
    response = staff_client.post("/flavors/prices/new/", data, follow=True)
    assert response.redirect_chain[-1][0] == "/flavors/#flavor-h100-80gb"
    assert "h100-80gb: 4.2500 EUR per hour from 2026-03-01 00:00 UTC." in response.content.decode()
    card = PriceCard.objects.get(flavor=h100)
    assert (card.price_per_hour, card.currency) == (Decimal("4.25"), "EUR")
    # The same start again: the service refuses it, naming the field.
    response = staff_client.post("/flavors/prices/new/", data)
    assert response.status_code == 400
    assert "already has a price starting at that moment" in _field_error(response.content.decode(), "effective_from")
    assert PriceCard.objects.count() == 1
    response = staff_client.post("/flavors/prices/new/", {**data, "flavor": "no-such-flavor"})
    assert response.status_code == 400 and _field_error(response.content.decode(), "flavor")


def test_an_endpoint_replica_is_in_the_queue_as_the_jobs_app_has_it(staff_client, flavors, tenant, owner, acme_env):
    from runners.inference import reconcile as endpoint_reconcile
    from runners.inference import services as endpoints
    from tests.support.endpoints import trained_job

    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    source = trained_job(actor=owner, environment=acme_env, name="tiny-lm")
    endpoint = endpoints.endpoint_deploy(actor=owner, data={
        "tenant": "acme", "environment": acme_env.id, "name": "chat", "source": {"job": source.id},
        "flavor": "h100-80gb", "min_replicas": 1, "max_replicas": 1})
    endpoint_reconcile.endpoints_reconcile_run()
    replica = Job.objects.get(kind="serving")
    html = staff_client.get("/queue/").content.decode()
    row = re.search(rf'<tr data-job="{replica.id}" data-state="(\w+)".*?</tr>', html, re.S)
    assert row and f'replica of <a href="/endpoints/{endpoint.id}/">chat</a>' in row.group(0)
    assert str(source.id) not in re.findall(r'<tr data-job="(\d+)"', html), "a cancelled job is not in the queue"


def test_staff_describe_a_flavor_on_the_page_and_a_long_description_is_named(staff_client, flavors, teammate):
    response = staff_client.post("/flavors/describe/", {"flavor": "h100-80gb", "description": "x" * 201})
    assert response.status_code == 400
    assert _field_error(response.content.decode(), "description")
    response = staff_client.post("/flavors/describe/", {"flavor": "h100-80gb", "description": "  NVLink, 80 GB  "},
                                 follow=True)
    assert response.redirect_chain[-1][0] == "/flavors/#flavor-h100-80gb"
    assert ResourceFlavor.objects.get(name="h100-80gb").description == "NVLink, 80 GB"
    assert "NVLink, 80 GB" in response.content.decode()

    member = Client()
    member.force_login(teammate)
    assert member.post("/flavors/describe/", {"flavor": "h100-80gb", "description": "mine"}).status_code == 404
    assert ResourceFlavor.objects.get(name="h100-80gb").description == "NVLink, 80 GB"


def test_the_api_changes_a_flavors_description_only(client_for, staff, teammate, flavors):
    api = client_for(staff)
    response = api.patch("/api/v1/flavors/h100-80gb/", {"description": "80 GB HBM3"}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["description"] == "80 GB HBM3"
    response = api.patch("/api/v1/flavors/h100-80gb/", {"description": "y", "gpu_model": "A100"}, format="json")
    assert response.status_code == 400 and set(response.json()) == {"gpu_model"}
    response = api.patch("/api/v1/flavors/h100-80gb/", {"description": "z" * 201}, format="json")
    assert response.status_code == 400 and "description" in response.json()
    assert client_for(teammate).patch("/api/v1/flavors/h100-80gb/", {"description": "mine"},
                                      format="json").status_code == 403
    assert ResourceFlavor.objects.get(name="h100-80gb").description == "80 GB HBM3"

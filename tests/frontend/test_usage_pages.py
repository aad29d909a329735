"""The usage pages through Django's test client, against a scenario whose figures are known.

Tenant acme, on 2026-11-02 (UTC): job "pretrain", 2 whole H100s from 08:00 to 14:00 at 2.00/h
(cloud reference 6.00/h): 12 GPU-hours, 24.00, cloud 72.00, a saving of 48.00; its two GPUs read
every 10 minutes, rank 0 at 80% and rank 1 at 40% (simulated): 60% on average. Tenant globex: job
"tiles", one T4 share from 13:00 to 19:00 at 0.25/h (1.50), its GPU at 5%. Every figure a page
shows is compared with `usage_rows`, the rows the API and the CSV give.
"""

import csv
import io
import re
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from quotas.models import PriceCard
from runners.inference import reconcile as endpoint_reconcile
from runners.inference import services as endpoints
from runners.inference.models import EndpointSample
from runners.jobs import services as jobs
from runners.jobs.models import Job, JobAttempt
from runners.scheduling import services as scheduling
from runners.usage import pages
from runners.usage.models import BudgetAlert, CapacityChange, CloudPrice, UtilizationSample
from runners.usage.selectors import usage_rows
from tenants.models import Membership
from tests.support.endpoints import trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

DAY = datetime(2026, 11, 2, tzinfo=UTC)
NOVEMBER = {"start": date(2026, 11, 1), "end": date(2026, 11, 30)}
RANGE = "?start=2026-11-01&end=2026-11-30"


def at(hours: float) -> datetime:
    return DAY + timedelta(hours=hours)


def finished_job(environment, name, flavor, replicas, start, end) -> Job:
    job = Job.objects.create(tenant=environment.tenant, environment=environment, name=name,
                             spec={"template": "pytorch-ddp"}, flavor=flavor, replicas=replicas, gpus_per_replica=1,
                             state="succeeded")
    attempt = JobAttempt.objects.create(job=job, number=1, placement=[])
    JobAttempt.objects.filter(id=attempt.id).update(admitted_at=start, started_at=start, ended_at=end,
                                                    outcome="succeeded")
    Job.objects.filter(id=job.id).update(submitted_at=start - timedelta(minutes=5))
    job.refresh_from_db()
    return job


def readings(job, rank, util, start, end, *, every=timedelta(minutes=10), attempt=1) -> None:
    moments = []
    while start < end:
        moments.append(start)
        start += every
    UtilizationSample.objects.bulk_create([
        UtilizationSample(tenant_id=job.tenant_id, job=job, attempt=attempt, rank=rank, device=f"GPU-{rank}", at=moment,
                          source="simulated", gpu_util_pct=util, memory_used_mib=30 * 1024, power_w=300)
        for moment in moments
    ])


@pytest.fixture
def scenario(tenant, other_tenant, owner, outsider):
    flavors = demo_cluster_with_flavors()
    h100, t4 = flavors["h100-80gb"], flavors["t4-shared"]
    PriceCard.objects.create(flavor=h100, price_per_hour=Decimal("2.00"), effective_from=DAY - timedelta(days=30))
    PriceCard.objects.create(flavor=t4, price_per_hour=Decimal("0.25"), effective_from=DAY - timedelta(days=30))
    CloudPrice.objects.create(flavor=h100, price_per_hour=Decimal("6.00"), effective_from=DAY - timedelta(days=30))
    acme = ready_environment(actor=owner, tenant=tenant)
    globex = ready_environment(actor=outsider, tenant=other_tenant, name="vision")
    pretrain = finished_job(acme, "pretrain", h100, 2, at(8), at(14))
    tiles = finished_job(globex, "tiles", t4, 1, at(13), at(19))
    readings(pretrain, 0, 80.0, at(8), at(14))
    readings(pretrain, 1, 40.0, at(8), at(14))
    readings(tiles, 0, 5.0, at(13), at(19))
    return {"pretrain": pretrain, "tiles": tiles, "flavors": flavors, "acme": acme}


def _text(html: str, testid: str) -> str:
    """The text of the first element with this test id, up to its tag's closing (tags stripped, spaces squeezed)."""
    match = re.search(rf'<(\w+)[^>]*data-testid="{testid}"[^>]*>(.*?)</\1>', html, re.S)
    assert match, f"no {testid}"
    return " ".join(re.sub(r"<[^>]+>", " ", match.group(2)).split())


def _row(html: str, marker: str) -> str:
    return html.split(marker, 1)[1].split("</tr>", 1)[0]


def test_the_usage_page_shows_the_ledgers_figures_for_a_viewer(client, scenario, tenant, make_user):
    viewer = make_user("vic")
    Membership.objects.create(user=viewer, tenant=tenant, role="viewer")
    client.force_login(viewer)
    html = client.get(f"/tenants/acme/usage/{RANGE}").content.decode()

    rows = usage_rows(**NOVEMBER, group_by=("job", "kind"), tenants=[tenant])
    pretrain = next(row for row in rows if row["job"] == scenario["pretrain"].id)
    assert (pretrain["gpu_hours"], pretrain["cost"], pretrain["cloud_cost"]) == ("12.0000", "24.00", "72.00")
    row = _row(html, f'data-item="job-{scenario["pretrain"].id}"')
    assert f'href="/jobs/{scenario["pretrain"].id}/"' in row and ">pretrain<" in row
    assert _text(row, "item-gpu-hours") == "12.0000" and _text(row, "item-cost") == "USD 24.00"
    assert _text(row, "item-cloud") == "72.00" and _text(row, "item-saving") == "48.00"
    total = usage_rows(**NOVEMBER, group_by=("tenant",), tenants=[tenant])[0]
    assert _text(html, "total-cost") == f"USD {total['cost']}" == "USD 24.00"
    assert _text(html, "total-saving") == "USD 48.00"
    assert _text(html, "total-gpu-hours") == total["gpu_hours"]

    # The utilization chart: acme's two GPUs only (globex's at 5% would pull the mean down).
    chart = re.search(r'<svg class="chart" data-testid="utilization-chart" data-points="(\d+)"', html)
    assert chart and int(chart.group(1)) > 0
    assert _text(html, "mean-utilization") == "60.0%" and 'data-testid="simulated">simulated<' in html
    for testid in ("hours-chart", "cost-chart"):
        svg = html.split(f'data-testid="{testid}"', 1)[1].split("</svg>", 1)[0]
        assert int(re.search(r'data-points="(\d+)"', svg).group(1)) > 0 and "<rect" in svg
    assert "h100-80gb: 12.00 GPU-h" in html

    # Nothing of globex's: not its job, its flavor's cost, nor its numbers.
    assert "tiles" not in html and "t4-shared" not in html and "1.50" not in html
    # A viewer reads; stopping is for members.
    assert 'data-testid="stop-idle"' not in html


def test_the_csv_link_downloads_the_apis_rows_for_the_range(client, scenario, owner, tenant):
    client.force_login(owner)
    html = client.get(f"/tenants/acme/usage/{RANGE}").content.decode()
    href = re.search(r'href="([^"]+)" data-testid="download-csv"', html).group(1).replace("&amp;", "&")
    assert href == "/api/v1/usage/?start=2026-11-01&end=2026-11-30&group_by=job%2Cday&tenant=acme&format=csv"
    answer = client.get(href)
    assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv")
    parsed = list(csv.DictReader(io.StringIO(answer.content.decode())))
    expected = usage_rows(**NOVEMBER, group_by=("job", "day"), tenants=[tenant])
    assert [(row["job"], row["day"], row["cost"]) for row in parsed] == [
        (str(row["job"] or ""), row["day"], row["cost"]) for row in expected
    ]


def test_the_range_defaults_to_this_month_and_a_bad_one_is_a_400_at_its_field(client, scenario, owner):
    client.force_login(owner)
    first, last = pages.this_month(timezone.now())
    html = client.get("/tenants/acme/usage/").content.decode()
    assert f'value="{first.isoformat()}"' in html and f'value="{last.isoformat()}"' in html
    assert "pretrain" not in html  # November is not this month
    response = client.get("/tenants/acme/usage/?start=2026-11-30&end=2026-11-01")
    assert response.status_code == 400 and "The start is after the end." in response.content.decode()
    assert client.get("/tenants/acme/usage/?start=2025-01-01&end=2026-11-30").status_code == 400


def test_another_tenants_member_gets_a_404_and_staff_see_any_tenant(client, scenario, outsider, staff):
    client.force_login(outsider)
    assert client.get(f"/tenants/acme/usage/{RANGE}").status_code == 404
    assert client.get(f"/jobs/{scenario['pretrain'].id}/").status_code == 404
    client.force_login(staff)
    html = client.get(f"/tenants/acme/usage/{RANGE}").content.decode()
    assert "pretrain" in html and "tiles" not in html


def test_the_tenant_page_links_the_usage_page_and_shows_the_budget_banner(client, scenario, owner, tenant):
    client.force_login(owner)
    html = client.get("/tenants/acme/").content.decode()
    assert 'href="/tenants/acme/usage/"' in html and 'data-testid="budget-banner"' not in html
    BudgetAlert.objects.create(tenant=tenant, month=timezone.now().date().replace(day=1), threshold=80,
                               spent=Decimal("41.10"), budget=Decimal("50.00"), currency="USD")
    for path in ("/tenants/acme/", "/tenants/acme/usage/", "/tenants/acme/quota/"):
        html = client.get(path).content.decode()
        assert "has used 80% of its" in _text(html, "budget-banner") and "USD 41.10 of 50.00" in html, path


@pytest.fixture
def idle_job(scenario, tenant, owner):
    """A job on a T4 share, running for two hours, its GPU under 3% for the last half hour."""
    give_quota(tenant, scenario["flavors"]["t4-shared"], guaranteed=1, max=2)
    job = jobs.job_submit(actor=owner, data=job_data(scenario["acme"], name="forgotten", flavor="t4-shared",
                                                     replicas=1, topology={"level": "none"}))
    scheduling.cycle_run()
    started = timezone.now() - timedelta(hours=2)
    JobAttempt.objects.filter(job=job).update(admitted_at=started, started_at=started)
    Job.objects.filter(id=job.id).update(state="running", started_at=started)
    readings(job, 0, 2.5, timezone.now() - timedelta(minutes=25), timezone.now(), every=timedelta(minutes=5))
    return job


def test_an_idle_allocation_is_listed_and_its_stop_button_cancels_the_job(client, idle_job, owner):
    client.force_login(owner)
    html = client.get("/tenants/acme/usage/").content.decode()
    row = _row(html, f'<tr data-job="{idle_job.id}">')
    assert ">forgotten<" in row and "2.5% / 2.5%" in row
    assert f'action="/jobs/{idle_job.id}/cancel/"' in row and 'name="next" value="/tenants/acme/usage/"' in row
    # A threshold under its utilization finds nothing.
    assert 'data-testid="no-idle"' in client.get("/tenants/acme/usage/?threshold_pct=2").content.decode()

    response = client.post(f"/jobs/{idle_job.id}/cancel/", {"next": "/tenants/acme/usage/"})
    assert response.status_code == 302 and response["Location"] == "/tenants/acme/usage/"
    idle_job.refresh_from_db()
    assert idle_job.state == "cancelling"
    # Another site is never where the button sends you back to.
    assert client.post(f"/jobs/{idle_job.id}/cancel/", {"next": "https://evil.test/"})["Location"] == \
        f"/jobs/{idle_job.id}/"


def test_the_quota_page_says_what_is_in_use_now_and_this_month(client, scenario, idle_job, owner, tenant):
    h100 = scenario["flavors"]["h100-80gb"]
    give_quota(tenant, h100, guaranteed=2, max=4)
    finished_job(scenario["acme"], "this-month", h100, 2, timezone.now() - timedelta(hours=3),
                 timezone.now() - timedelta(hours=2))
    client.force_login(owner)
    html = client.get("/tenants/acme/quota/").content.decode()
    t4_row, h100_row = _row(html, 'data-flavor="t4-shared"'), _row(html, 'data-flavor="h100-80gb"')
    assert _text(t4_row, "in-use") == "1" and _text(h100_row, "in-use") == "0"
    first, last = pages.this_month(timezone.now())
    month = next(row for row in usage_rows(start=first, end=last, group_by=("flavor",), tenants=[tenant])
                 if row["flavor"] == "h100-80gb")
    assert month["cost"] == "4.00"
    assert _text(h100_row, "month") == f"{Decimal(month['gpu_hours']):.2f} GPU-h USD 4.00"


def test_the_job_page_charts_each_replicas_gpu_and_shows_the_cost_so_far(client, scenario, owner, tenant):
    job = scenario["pretrain"]
    client.force_login(owner)
    html = client.get(f"/jobs/{job.id}/").content.decode()
    svg = html.split('data-testid="gpu-utilization-chart"', 1)[1].split("</svg>", 1)[0]
    assert int(re.search(r'data-points="(\d+)"', svg).group(1)) > 0
    assert svg.count("<polyline") == 2 and 'data-series="replica 0"' in svg and 'data-series="replica 1"' in svg
    assert 'data-testid="gpu-memory-chart"' in html and 'data-testid="readings-simulated">simulated<' in html

    rows = usage_rows(start=date(2026, 11, 2), end=timezone.now().date(), group_by=("job",), tenants=[tenant])
    cost = next(row for row in rows if row["job"] == job.id)
    cost_card = html.split('data-testid="job-cost"', 1)[1].split("</section>", 1)[0]
    assert _text(cost_card, "cost") == f"USD {cost['cost']}" == "USD 24.00"
    assert _text(cost_card, "cloud-cost") == "USD 72.00" and _text(cost_card, "saving") == "USD 48.00"
    assert "no step yet" in cost_card  # this job never reported a step

    # The live fragment carries the same, and another tenant's job page is a 404 (its readings never shown).
    assert 'data-testid="gpu-utilization-chart"' in client.get(f"/jobs/{job.id}/live/").content.decode()
    assert client.get(f"/jobs/{scenario['tiles'].id}/live/").status_code == 404


@pytest.fixture
def endpoint(scenario, tenant, owner):
    """An endpoint whose one replica held an H100 from 09:00 to 11:00 (4.00) and answered 10 requests/s for 2 minutes."""
    give_quota(tenant, scenario["flavors"]["h100-80gb"], guaranteed=2, max=4)
    source = trained_job(actor=owner, environment=scenario["acme"], name="tiny-lm", step=10)
    endpoint = endpoints.endpoint_deploy(actor=owner, data={
        "tenant": "acme", "environment": scenario["acme"].id, "name": "chat", "source": {"job": source.id},
        "flavor": "h100-80gb", "min_replicas": 1, "max_replicas": 1})
    endpoint_reconcile.endpoints_reconcile_run()
    scheduling.cycle_run()
    replica = endpoint.replicas.get()
    EndpointSample.objects.filter(endpoint=endpoint).delete()  # the reconcile's own, before any request
    JobAttempt.objects.filter(job=replica.job).update(admitted_at=at(9), started_at=at(9), ended_at=at(11))
    type(endpoint).objects.filter(id=endpoint.id).update(created_at=at(8))
    for seconds in (0, 60, 120):
        EndpointSample.objects.create(endpoint=endpoint, at=at(10) + timedelta(seconds=seconds), ready_replicas=1,
                                      queue_depth=0, running=1, requests_per_s=10.0, shed_per_s=0, expired_per_s=0)
    now = timezone.now()
    readings(replica.job, 0, 70.0, now - timedelta(minutes=30), now, every=timedelta(minutes=2))
    endpoint.refresh_from_db()
    return endpoint


def test_the_endpoint_page_shows_its_replicas_gpus_cost_so_far_and_per_thousand_requests(client, endpoint, owner,
                                                                                          tenant, outsider):
    client.force_login(owner)
    html = client.get(f"/endpoints/{endpoint.id}/").content.decode()
    svg = html.split('data-testid="gpu-utilization-chart"', 1)[1].split("</svg>", 1)[0]
    assert int(re.search(r'data-points="(\d+)"', svg).group(1)) > 0 and svg.count("<polyline") == 1
    rows = usage_rows(start=date(2026, 11, 2), end=timezone.now().date(), group_by=("job",), tenants=[tenant])
    cost = next(row for row in rows if row["endpoint"] == endpoint.id)
    card = html.split('data-testid="endpoint-cost"', 1)[1].split("</section>", 1)[0]
    assert _text(card, "cost") == f"USD {cost['cost']}" == "USD 4.00"
    # 1,200 requests over two minutes of one H100 at 2.00/h: 0.0667 for them, 0.0556 per 1,000.
    assert _text(card, "cost-per-thousand") == "USD 0.0556" and "1200 requests" in card
    # Neither the page nor its readings are another tenant's to see.
    client.force_login(outsider)
    assert client.get(f"/endpoints/{endpoint.id}/live/").status_code == 404
    assert client.get(f"/api/v1/utilization/?endpoint={endpoint.id}").status_code == 404


def test_the_cluster_page_is_for_staff_and_matches_the_ledger(client, scenario, owner, staff):
    h100 = scenario["flavors"]["h100-80gb"]
    CapacityChange.objects.create(flavor=h100, capacity=16, at=DAY)
    client.force_login(owner)
    assert client.get(f"/usage/cluster/{RANGE}").status_code == 404
    assert 'href="/usage/cluster/"' not in client.get("/").content.decode()

    client.force_login(staff)
    assert 'href="/usage/cluster/"' in client.get("/").content.decode()
    html = client.get(f"/usage/cluster/{RANGE}").content.decode()
    rows = usage_rows(**NOVEMBER, group_by=("tenant", "kind"), tenants=None, include_idle=True)
    idle = next(row for row in rows if row["kind"] == "idle")
    allocated = sum(Decimal(row["gpu_hours"]) for row in rows if row["kind"] == "gpu")
    assert allocated == Decimal(18)  # 12 H100 hours and 6 T4 share-hours
    capacity = allocated + Decimal(idle["gpu_hours"])
    assert _text(html, "allocation") == f"{allocated * 100 / capacity:.1f}%"
    assert _text(html, "idle-hours") == f"{Decimal(idle['gpu_hours']):.1f} unit-hours"
    assert f"USD {idle['cost']}" in _text(html, "idle-cost")
    # 36 readings at 80% and 36 at 40% (acme), 36 at 5% (globex): 4500 / 108.
    assert _text(html, "utilization") == "41.7%"
    assert _text(html, "fragmentation").endswith("%")
    per_tenant = {row["tenant"]: row["cost"] for row in usage_rows(**NOVEMBER, group_by=("tenant",), tenants=None)}
    assert _text(_row(html, 'data-tenant="acme"'), "tenant-cost") == f"USD {per_tenant['acme']}" == "USD 24.00"
    assert _text(_row(html, 'data-tenant="globex"'), "tenant-cost") == f"USD {per_tenant['globex']}" == "USD 1.50"
    assert _text(_row(html, 'data-tenant="acme"'), "tenant-utilization") == "60.0%"
    useful = allocated * Decimal("41.6667") / 100
    spent = Decimal(per_tenant["acme"]) + Decimal(per_tenant["globex"]) + Decimal(idle["cost"])
    assert _text(html, "per-useful-hour") == f"USD {(spent / useful).quantize(Decimal('0.01'))}"


def finished_workspace_start(workspace, start, end) -> Job:
    """One start of ``workspace`` that ran from ``start`` to ``end`` (a job of kind workspace, as the service makes)."""
    job = finished_job(workspace.environment, f"workspace-{workspace.name}", workspace.flavor, 1, start, end)
    Job.objects.filter(id=job.id).update(kind=Job.Kind.WORKSPACE, spec={"workspace": {"workspace_id": workspace.id}})
    return job


def test_workspaces_are_listed_beside_jobs_and_endpoints_with_their_cost_and_idle_time(
        client, scenario, tenant, owner, teammate):
    from runners.workspaces.models import Workspace, WorkspaceState

    t4 = scenario["flavors"]["t4-shared"]
    notebook = Workspace.objects.create(tenant=tenant, environment=scenario["acme"], owner=owner, name="notebook",
                                        flavor=t4, state=WorkspaceState.READY, idle_minutes=45,
                                        ready_at=timezone.now() - timedelta(hours=2),
                                        last_activity_at=timezone.now() - timedelta(minutes=25))
    scratch = Workspace.objects.create(tenant=tenant, environment=scenario["acme"], owner=owner, name="scratch",
                                       flavor=t4, state=WorkspaceState.STOPPED)
    starts = [finished_workspace_start(notebook, at(1), at(3)),
              finished_workspace_start(notebook, at(20), at(22)),  # two starts: one line, 4 GPU-hours at 0.25
              finished_workspace_start(scratch, at(2), at(3))]

    client.force_login(owner)
    html = client.get(f"/tenants/acme/usage/{RANGE}").content.decode()
    row = _row(html, f'data-item="workspace-{notebook.id}"')
    assert f'href="/tenants/acme/workspaces/{notebook.id}/"' in row and ">notebook<" in row and "workspace" in row
    assert _text(row, "item-gpu-hours") == "4.0000" and _text(row, "item-cost") == "USD 1.00"
    assert not any(f'data-item="job-{job.id}"' in html for job in starts)  # counted under their workspace only
    listed = html.split('data-testid="usage-workspaces"', 1)[1].split("</table>", 1)[0]
    ready = _row(listed, f'data-workspace="{notebook.id}"')
    assert _text(ready, "workspace-cost") == "USD 1.00" and _text(ready, "workspace-gpu-hours") == "4.0000"
    assert re.fullmatch(r"2[45]m \d\ds", _text(ready, "workspace-idle")), _text(ready, "workspace-idle")
    assert "45m 00s idle" in ready
    stopped = _row(listed, f'data-workspace="{scratch.id}"')
    assert _text(stopped, "workspace-idle") == "not running" and _text(stopped, "workspace-cost") == "USD 0.25"

    # A member who does not own them: their cost counts in the tenant's figures, their names are not shown.
    client.force_login(teammate)
    html = client.get(f"/tenants/acme/usage/{RANGE}").content.decode()
    row = _row(html, f'data-item="workspace-{notebook.id}"')
    assert "another member's" in row and "notebook" not in row and _text(row, "item-cost") == "USD 1.00"
    assert 'data-testid="usage-workspaces"' not in html and "No workspace of this tenant that you may see." in html

    # A deleted workspace keeps its cost, under a name that says so.
    Job.objects.filter(id__in=[job.id for job in starts[2:]]).update(spec={"workspace": {"workspace_id": 999_999}})
    client.force_login(owner)
    html = client.get(f"/tenants/acme/usage/{RANGE}").content.decode()
    assert "a deleted workspace" in _row(html, 'data-item="workspace-999999"')

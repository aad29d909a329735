"""The endpoint pages through Django's test client: what they show, errors at their fields, scoping, roles."""

from datetime import timedelta

import pytest
from django.utils import timezone

from runners.inference import reconcile as endpoint_reconcile
from runners.inference import services as endpoints
from runners.inference.models import EndpointSample, EndpointState, InferenceEndpoint
from runners.scheduling import services as scheduling
from tests.support.endpoints import trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def world(tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = trained_job(actor=owner, environment=environment, name="tiny-lm", step=10)
    return {"environment": environment, "job": job}


def _form(world, **fields):
    data = {"name": "chat", "environment": world["environment"].id, "job": world["job"].id, "step": "",
            "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 2, "warm_replicas": 0,
            "queue_limit": 64, "batch_token_budget": 4096, "max_batch_wait_ms": 5, "default_deadline_ms": 10000}
    data.update(fields)
    return data


def _errors(html: str, field_id: str) -> str:
    return html.split(f'id="{field_id}-errors"', 1)[1].split("</ul>", 1)[0].replace("&#x27;", "'")


@pytest.fixture
def endpoint(world, owner):
    return endpoints.endpoint_deploy(actor=owner, data={
        "tenant": "acme", "environment": world["environment"].id, "name": "chat", "source": {"job": world["job"].id},
        "flavor": "h100-80gb", "min_replicas": 1, "max_replicas": 2})


def test_a_deploy_goes_to_the_endpoint_page_which_shows_its_state_url_and_scale_event(client, owner, world):
    client.force_login(owner)
    html = client.get("/tenants/acme/endpoints/new/").content.decode()
    assert 'data-testid="deploy-endpoint"' in html and "tiny-lm #" in html and "newest checkpoint step 10" in html
    response = client.post("/tenants/acme/endpoints/new/", _form(world))
    endpoint = InferenceEndpoint.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/endpoints/{endpoint.id}/"
    assert endpoint.checkpoint_step == 10 and endpoint.spec["batch_token_budget"] == 4096

    html = client.get(f"/endpoints/{endpoint.id}/").content.decode()
    assert 'data-testid="endpoint-state">deploying<' in html
    # The message says what the badge says: live.js drops it once the badge shows another state.
    assert '<div class="message message-success" data-message data-state="deploying">' in html
    assert 'data-testid="endpoint-url">http://testserver/serve/acme/chat/v1/generate<' in html
    assert f'data-poll-url="/endpoints/{endpoint.id}/live/"' in html
    assert "Deployed by olivia." in html and "0 → 1" in html
    assert 'data-testid="try-it"' in html and 'action="/serve/acme/chat/v1/generate"' in html
    assert 'data-testid="chart-requests-empty"' in html  # no sample yet
    listing = client.get("/tenants/acme/endpoints/").content.decode()
    assert 'data-endpoint="chat"' in listing and "tiny-lm step 10" in listing
    assert 'href="/tenants/acme/endpoints/"' in client.get("/tenants/acme/").content.decode()


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"min_replicas": 3, "max_replicas": 4}, "min_replicas", "past tenant acme's guarantee of 2"),
        ({"max_replicas": 5}, "max_replicas", "past tenant acme's max of 4"),
        ({"name": "Not_A_Name"}, "name", "Lowercase letters"),
        ({"step": 7}, "step", "has no checkpoint at step 7"),
        ({"warm_replicas": 3}, "warm_replicas", "At most max_replicas (2)"),
        ({"default_deadline_ms": 50}, "default_deadline_ms", "Must be between 100"),
    ],
)
def test_a_refused_deploy_shows_the_services_message_at_its_field(client, owner, world, fields, field, message):
    client.force_login(owner)
    response = client.post("/tenants/acme/endpoints/new/", _form(world, **fields))
    assert response.status_code == 400
    errors = _errors(response.content.decode(), f"id_{field}")
    assert message in errors, errors
    assert not InferenceEndpoint.objects.exists()


def test_a_live_name_is_refused_at_the_name_field(client, owner, world, endpoint):
    client.force_login(owner)
    response = client.post("/tenants/acme/endpoints/new/", _form(world))
    assert response.status_code == 400
    assert "already has a live endpoint chat" in _errors(response.content.decode(), "id_name")


def test_the_job_page_offers_to_serve_its_newest_checkpoint_and_the_form_comes_filled_in(client, owner, world):
    job = world["job"]
    client.force_login(owner)
    html = client.get(f"/jobs/{job.id}/").content.decode()
    link = f'href="/tenants/acme/endpoints/new/?job={job.id}&amp;step=10" data-testid="serve-checkpoint"'
    assert link in html and "Serve this checkpoint" in html
    html = client.get(f"/tenants/acme/endpoints/new/?job={job.id}&step=10").content.decode()
    assert f'<option value="{job.id}" selected>' in html
    assert 'name="step" value="10"' in html and 'name="name" value="tiny-lm"' in html
    assert f'<option value="{world["environment"].id}" selected>' in html
    # Nonsense in the query string is ignored, never an error.
    assert client.get("/tenants/acme/endpoints/new/?job=abc&step=-1").status_code == 200


def test_replicas_their_placement_and_the_charts_are_drawn(client, owner, endpoint):
    endpoint_reconcile.endpoints_reconcile_run()  # starts the replica's job
    scheduling.cycle_run()  # admits and places it
    endpoint.samples.all().delete()  # the reconcile's own (nothing ready yet): these instead
    now = timezone.now()
    for i in range(10):
        EndpointSample.objects.create(
            endpoint=endpoint, at=now - timedelta(seconds=2 * (10 - i)), ready_replicas=1, queue_depth=i % 3,
            running=1, requests_per_s=float(i), shed_per_s=0.5 if i == 5 else 0.0, expired_per_s=0.0,
            p50_ms=20.0 + i, p99_ms=80.0 + i)
    client.force_login(owner)
    html = client.get(f"/endpoints/{endpoint.id}/live/").content.decode()
    replica = endpoint.replicas.get()
    row = html.split(f'data-replica="{replica.id}"', 1)[1].split("</tr>", 1)[0]
    assert "chat-g1-r0" in row and f'href="/jobs/{replica.job_id}/"' in row and "<code>" in row  # its node
    assert "not preemptible" in row and "not yet" in row
    for test_id in ("chart-requests", "chart-latency", "chart-queue", "chart-shed"):
        assert f'data-testid="{test_id}" data-points="10"' in html, test_id
    assert 'data-series="p50_ms"' in html and 'data-series="p99_ms"' in html
    assert "Request rate over the last hour, in requests/s: peak 9; latest requests/s 9" in html


def test_scale_and_rollout_refusals_show_at_their_fields_and_stop_drains(client, owner, world, endpoint):
    client.force_login(owner)
    response = client.post(f"/endpoints/{endpoint.id}/scale/", {
        "scale-min_replicas": 3, "scale-max_replicas": 4, "scale-warm_replicas": 0})
    assert response.status_code == 400
    assert "guarantee of 2" in _errors(response.content.decode(), "id_scale-min_replicas")
    response = client.post(f"/endpoints/{endpoint.id}/rollout/", {"rollout-job": world["job"].id, "rollout-step": 3})
    assert response.status_code == 400
    assert "no checkpoint at step 3" in _errors(response.content.decode(), "id_rollout-step")

    response = client.post(f"/endpoints/{endpoint.id}/scale/", {
        "scale-min_replicas": 1, "scale-max_replicas": 3, "scale-warm_replicas": 1})
    assert response.status_code == 302
    endpoint.refresh_from_db()
    assert (endpoint.max_replicas, endpoint.warm_replicas) == (3, 1)
    response = client.post(f"/endpoints/{endpoint.id}/rollout/", {"rollout-job": world["job"].id, "rollout-step": ""})
    assert response.status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.generation == 2

    assert client.post(f"/endpoints/{endpoint.id}/stop/").status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.state == EndpointState.DRAINING
    html = client.get(f"/endpoints/{endpoint.id}/").content.decode()
    assert 'data-testid="scale-endpoint"' not in html and 'data-testid="try-it"' not in html
    assert "Stopped by olivia." in html
    assert '<div class="message message-success" data-message data-state="draining">' in html


def test_a_viewer_sees_the_endpoint_but_no_forms_and_cannot_change_it(client, owner, viewer, world, endpoint):
    client.force_login(viewer)
    html = client.get(f"/endpoints/{endpoint.id}/").content.decode()
    assert 'data-testid="endpoint-state"' in html
    for form in ("scale-endpoint", "rollout-endpoint", "stop-endpoint"):
        assert f'data-testid="{form}"' not in html, form
    assert 'data-testid="deploy-link"' not in client.get("/tenants/acme/endpoints/").content.decode()
    assert 'data-testid="deploy-endpoint"' not in client.get("/tenants/acme/endpoints/new/").content.decode()
    assert 'data-testid="serve-checkpoint"' not in client.get(f"/jobs/{world['job'].id}/").content.decode()

    client.post(f"/endpoints/{endpoint.id}/stop/")
    client.post(f"/endpoints/{endpoint.id}/scale/", {
        "scale-min_replicas": 0, "scale-max_replicas": 1, "scale-warm_replicas": 0})
    client.post("/tenants/acme/endpoints/new/", _form(world, name="mine"))
    endpoint.refresh_from_db()
    assert endpoint.state == EndpointState.DEPLOYING and endpoint.max_replicas == 2
    assert list(InferenceEndpoint.objects.values_list("name", flat=True)) == ["chat"]


def test_another_tenants_endpoints_are_404(client, outsider, world, endpoint):
    client.force_login(outsider)
    for path in ("/tenants/acme/endpoints/", "/tenants/acme/endpoints/new/", f"/endpoints/{endpoint.id}/",
                 f"/endpoints/{endpoint.id}/live/"):
        assert client.get(path).status_code == 404, path
    for path in ("/tenants/acme/endpoints/new/", f"/endpoints/{endpoint.id}/scale/",
                 f"/endpoints/{endpoint.id}/rollout/", f"/endpoints/{endpoint.id}/stop/"):
        assert client.post(path, {}).status_code == 404, path
    endpoint.refresh_from_db()
    assert endpoint.stop_requested_at is None
    assert client.get("/endpoints/999999/").status_code == 404

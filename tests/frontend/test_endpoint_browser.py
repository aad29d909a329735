"""The done-point of inference endpoints, in Chromium: a member trains the shipped model for real, serves its
checkpoint from the job page, watches the endpoint become ready and generates text from the page's "try it" box.

Everything is real: a Celery worker with beat runs the scheduler cycle, the jobs' and the endpoints' reconcile;
the trainer and the server run as processes on the local backend; the edge stands in front of the live server
as `make run` runs it in front of gunicorn, and answers the "try it" box's requests."""

import pytest

from runners.inference.models import InferenceEndpoint
from runners.jobs import services as jobs
from runners.jobs.models import Job
from tenants.models import Membership
from tests.frontend.conftest import assert_not_reloaded, log_in, mark_loaded, snap
from tests.support.edge import running_edge
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment
from tests.support.worker import wait_for

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

TRAIN_TIMEOUT_S = 180
READY_TIMEOUT_MS = 120_000


@pytest.fixture
def front(live_server, tmp_path):
    """The edge in front of the live server: the pages pass through it, endpoints are answered by it."""
    with running_edge(tmp_path, upstream=live_server.url) as edge:
        yield edge


def test_a_member_serves_a_checkpoint_she_trained_and_generates_text_from_the_endpoint_page(
    page, front, celery_worker_factory, tenant, owner, make_user, screenshot_dir
):
    alice = make_user("alice")
    Membership.objects.create(user=alice, tenant=tenant, role="member")
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    celery_worker_factory(beat=True, SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1,
                          ENDPOINT_RECONCILE_INTERVAL_S=1)

    # The shipped trainer, for real and briefly: a few steps, a checkpoint every twenty.
    job = jobs.job_submit(actor=alice, data=job_data(
        environment, name="tiny-lm", replicas=1, topology={"level": "none"}, steps=60, checkpoint_every_steps=20,
        priority=0, max_retries=0))
    wait_for(lambda: Job.objects.get(id=job.id).state in ("succeeded", "failed", "cancelled"), timeout_s=TRAIN_TIMEOUT_S,
             interval_s=0.5, message="the training job to finish")
    job.refresh_from_db()
    assert job.state == "succeeded", job.reason
    newest = job.checkpoints.newest_first().first()
    assert newest is not None and newest.step == 60

    log_in(page, front, "alice")
    page.goto(f"{front.url}/jobs/{job.id}/")
    serve = page.get_by_role("link", name="Serve this checkpoint")
    expect(serve).to_be_visible()
    serve.click()

    # The deploy form comes filled in with the job, its newest checkpoint and a name from the job's.
    form = page.get_by_test_id("deploy-endpoint")
    expect(form.get_by_label("Name", exact=True)).to_have_value("tiny-lm")
    expect(form.get_by_label("Source job")).to_have_value(str(job.id))
    expect(form.get_by_label("Checkpoint step")).to_have_value("60")
    expect(form.get_by_label("Environment")).to_have_value(str(environment.id))
    form.get_by_label("Name", exact=True).fill("tiny-chat")
    form.get_by_label("Min replicas").fill("1")
    form.get_by_label("Max replicas").fill("1")
    snap(page, screenshot_dir / "endpoint-deploy.png")
    form.get_by_role("button", name="Deploy endpoint").click()

    expect(page.get_by_role("heading", name="tiny-chat")).to_be_visible()
    endpoint = InferenceEndpoint.objects.get(name="tiny-chat")
    assert (endpoint.source_job_id, endpoint.checkpoint_step) == (job.id, 60)
    mark_loaded(page)
    live = page.get_by_test_id("endpoint-live")
    try:
        expect(live.get_by_test_id("endpoint-state")).to_have_text("ready", timeout=READY_TIMEOUT_MS)
    except AssertionError:
        endpoint.refresh_from_db()
        replicas = [(r.job.state, r.job.reason) for r in endpoint.replicas.select_related("job")]
        raise AssertionError(f"endpoint {endpoint.state}: {endpoint.reason}; replicas {replicas}") from None
    expect(live.get_by_test_id("ready-count")).to_have_text("1 of 1 replica ready")
    replica = live.get_by_test_id("replicas").locator("tbody tr")
    expect(replica).to_have_count(1)
    expect(replica.get_by_test_id("replica-ready")).to_have_text("ready")
    expect(replica.locator("code")).not_to_be_empty()  # the node it runs on
    assert_not_reloaded(page)
    expect(page.get_by_test_id("endpoint-url")).to_have_text(f"{front.url}/serve/acme/tiny-chat/v1/generate")

    # Try it: the prompt goes to the edge with the session and its CSRF token; the text comes back.
    try_it = page.get_by_test_id("try-it")
    try_it.get_by_label("Prompt").fill("The model says")
    try_it.get_by_label("Max tokens").fill("24")
    try_it.get_by_role("button", name="Generate").click()
    output = page.get_by_test_id("try-output")
    expect(output).to_be_visible(timeout=30_000)
    expect(page.get_by_test_id("try-meta")).to_contain_text("24 tokens")
    # One byte a token (a briefly trained model may well answer in spaces, which is text all the same).
    assert len(output.text_content()) == 24, repr(output.text_content())
    expect(page.get_by_test_id("try-error")).to_be_hidden()
    assert_not_reloaded(page)
    snap(page, screenshot_dir / "endpoint-ready.png")

    # The server's refusal comes back naming the field.
    try_it.get_by_label("Prompt").fill("")
    try_it.get_by_role("button", name="Generate").click()
    error = page.get_by_test_id("try-error")
    expect(error).to_be_visible(timeout=30_000)
    expect(error).to_contain_text("HTTP 400")
    expect(error).to_contain_text("prompt")
    expect(output).to_be_hidden()

    # The samples the reconcile took while it served are drawn.
    expect(live.get_by_test_id("chart-requests")).to_be_visible(timeout=30_000)

    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_test_id("stop-endpoint").get_by_role("button", name="Stop endpoint").click()
    expect(page.get_by_test_id("endpoint-live").get_by_test_id("endpoint-state")).to_have_text(
        "stopped", timeout=READY_TIMEOUT_MS)

"""The job pages through Django's test client: what the form offers, errors at their fields, scoping."""

import pytest

from runners.jobs.models import Job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def environment(tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8, max_priority=20)
    return ready_environment(actor=owner, tenant=tenant)


def _form(environment, **fields):
    data = {"environment": environment.id, "name": "llm", "flavor": "h100-80gb", "replicas": 2, "gpus_per_replica": 2,
            "cpu_milli_per_replica": 2000, "memory_mib_per_replica": 4096, "topology_level": "node",
            "topology_mode": "required", "priority": 0, "preemptible": "on", "steps": 50, "checkpoint_every_steps": 10,
            "max_runtime_s": 600, "max_retries": 1}
    data.update(fields)
    return data


def test_the_form_offers_only_flavors_with_quota_and_says_what_is_left(client, owner, environment):
    client.force_login(owner)
    html = client.get("/tenants/acme/jobs/").content.decode()
    assert 'value="h100-80gb"' in html and "8 of 8 left" in html
    assert 'value="t4-16gb-shared"' not in html and "a100-40gb-mig" not in html


def test_a_submit_goes_to_the_job_page(client, owner, environment):
    client.force_login(owner)
    response = client.post("/tenants/acme/jobs/new/", _form(environment))
    job = Job.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.id}/"
    html = client.get(f"/jobs/{job.id}/").content.decode()
    assert 'data-testid="job-state">queued<' in html and f'data-poll-url="/jobs/{job.id}/live/"' in html


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"gpus_per_replica": 8}, "gpus_per_replica", "past tenant acme's max of 8"),
        ({"priority": 21}, "priority", "At most 20"),
        ({"topology_level": "nvlink", "checkpoint_every_steps": 51}, "checkpoint_every_steps", "between 0 and 50"),
    ],
)
def test_a_refused_submit_shows_the_services_message_at_its_field(client, owner, environment, fields, field, message):
    client.force_login(owner)
    response = client.post("/tenants/acme/jobs/new/", _form(environment, **fields))
    assert response.status_code == 400
    html = response.content.decode()
    errors = html.split(f'id="id_{field}-errors"', 1)[1].split("</ul>", 1)[0].replace("&#x27;", "'")
    assert message in errors, errors
    assert not Job.objects.exists()


def test_a_viewer_sees_jobs_but_no_form_and_cannot_cancel(client, owner, viewer, environment):
    from runners.jobs import services as jobs

    job = jobs.job_submit(actor=owner, data=job_data(environment))
    client.force_login(viewer)
    html = client.get("/tenants/acme/jobs/").content.decode()
    assert 'data-job="llm-pretrain"' in html and 'data-testid="submit-job"' not in html
    assert 'data-testid="cancel-job"' not in client.get(f"/jobs/{job.id}/").content.decode()
    client.post(f"/jobs/{job.id}/cancel/")
    assert Job.objects.get().state == "queued"


def test_another_tenants_jobs_are_404(client, owner, outsider, environment):
    from runners.jobs import services as jobs

    job = jobs.job_submit(actor=owner, data=job_data(environment))
    client.force_login(outsider)
    assert client.get("/tenants/acme/jobs/").status_code == 404
    for path in (f"/jobs/{job.id}/", f"/jobs/{job.id}/live/"):
        assert client.get(path).status_code == 404
    assert client.post(f"/jobs/{job.id}/cancel/").status_code == 404


@pytest.fixture
def admitted(owner, environment):
    from runners.jobs import services as jobs
    from runners.scheduling import services as scheduling

    job = jobs.job_submit(actor=owner, data=job_data(environment, replicas=1))
    scheduling.cycle_run()
    job.refresh_from_db()
    assert job.state == "admitted"
    return job


def test_placement_is_drawn_only_while_the_attempt_holds_its_gpus(client, owner, admitted):
    from django.utils import timezone

    client.force_login(owner)
    html = client.get(f"/jobs/{admitted.id}/live/").content.decode()
    assert "gpu-slot taken" in html and "attempt 1" in html

    # Preempted and requeued: the attempt ended, and its GPUs may be another job's now.
    admitted.attempts.update(ended_at=timezone.now(), outcome="preempted")
    Job.objects.filter(id=admitted.id).update(state="queued")
    html = client.get(f"/jobs/{admitted.id}/live/").content.decode()
    assert "gpu-slot taken" not in html and "attempt 1" not in html.split("<h2>Loss</h2>")[0]
    assert 'data-testid="not-placed">Holds no GPUs now.' in html


def test_cancel_is_not_offered_once_cancelling(client, owner, admitted):
    client.force_login(owner)
    assert 'data-testid="cancel-job"' in client.get(f"/jobs/{admitted.id}/").content.decode()
    Job.objects.filter(id=admitted.id).update(state="cancelling")
    assert 'data-testid="cancel-job"' not in client.get(f"/jobs/{admitted.id}/").content.decode()


def test_the_newest_checkpoints_are_shown_and_the_rest_behind_a_toggle(client, owner, admitted):
    from django.utils import timezone

    from runners.jobs.models import Checkpoint

    for step in range(10, 90, 10):
        Checkpoint.objects.create(job=admitted, step=step, uri=f"step-{step}.pt", bytes=1000, created_at=timezone.now())
    client.force_login(owner)
    html = client.get(f"/jobs/{admitted.id}/live/").content.decode()
    table, older = html.split('data-testid="checkpoints"', 1)[1].split('data-testid="older-checkpoints"', 1)
    assert [f"<td>{s}</td>" in table for s in (80, 70, 60, 50, 40)] == [True] * 5 and "<td>30</td>" not in table
    assert "3 older" in older and all(f"<td>{s}</td>" in older for s in (30, 20, 10))


def test_the_log_leaves_out_the_trainers_progress_lines():
    from runners.jobs.selectors import without_progress_lines

    text = 'step 1 loss 2.0\nPORTAL_METRIC {"step": 1}\nPORTAL_CHECKPOINT {"step": 1}\nsaved checkpoint step-1.pt\n'
    assert without_progress_lines(text) == ["step 1 loss 2.0", "saved checkpoint step-1.pt"]

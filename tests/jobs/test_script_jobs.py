"""The `script` template: a job runs the tenant's command in one of its bundles.

The spec check (each bad input a 400 naming the field, nothing stored), the API's 201, what a launch
is handed (the bundle, the command, the hyperparameters), the signed URL a pod fetches the bundle from,
the delete check, and the stop rule: ranks exiting 0 after the SDK's stop record of that attempt count
as the trainer's 75 (checkpointed on a stop), without one as done.
"""

import json

import pytest
from django.utils import timezone

from audit.models import AuditEntry
from common.errors import Conflict
from runners.backends.base import AttemptStatus, ProgressRead
from runners.backends.local import LocalBackend
from runners.bundles import services as bundles
from runners.bundles.models import Bundle
from runners.clusters.registry import local_backend_options
from runners.jobs import attempts
from runners.jobs import services as jobs
from runners.jobs.models import Job, JobEvent
from runners.scheduling import services as scheduling
from tests.support.jobs import give_quota, job_data, play_launch, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

SHA = "ab" * 32
OTHER_SHA = "cd" * 32


def _bundle(tenant, sha256=SHA, **fields):
    """A bundle row as the bundle store leaves it once its archive is stored (the archive is not read here)."""
    return Bundle.objects.create(tenant=tenant, sha256=sha256, size_bytes=2048, unpacked_bytes=8192, files=3,
                                 **fields)


def script_data(environment, /, **overrides) -> dict:
    data = job_data(environment, template="script", bundle=SHA, command=["python", "train.py", "--epochs", "3"],
                    hyperparameters={"lr": 0.1, "layers": [64, 64], "schedule": {"warmup": 10}})
    data.update(overrides)
    return data


@pytest.fixture
def environment(flavors, tenant, owner):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8, max_priority=50)
    return ready_environment(actor=owner, tenant=tenant)


@pytest.fixture
def bundle(tenant):
    return _bundle(tenant)


def _post(client, data):
    return client.post("/api/v1/jobs/", data, format="json")


def test_a_script_job_is_submitted_with_its_bundle_command_and_own_hyperparameters(
    client_for, owner, environment, bundle
):
    response = _post(client_for(owner), script_data(environment))
    assert response.status_code == 201, response.json()
    job = Job.objects.get(id=response.json()["id"])
    assert job.bundle == bundle
    assert job.spec["template"] == "script" and job.spec["bundle"] == SHA
    assert job.spec["command"] == ["python", "train.py", "--epochs", "3"]
    # A script's hyperparameters are its own: kept as given, not the trainer's four.
    assert job.spec["hyperparameters"] == {"lr": 0.1, "layers": [64, 64], "schedule": {"warmup": 10}}
    assert response.json()["spec"]["bundle"] == SHA
    entry = AuditEntry.objects.get(action="job.submitted", object_id=str(job.id))
    assert (entry.after["bundle"], entry.after["command"]) == (SHA, job.spec["command"])


def test_a_script_job_runs_on_the_local_backend_too(owner, environment, bundle, settings):
    settings.CLUSTER_BACKEND = "local"
    job = jobs.job_submit(actor=owner, data=script_data(environment))
    assert job.spec["template"] == "script"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"command": "python train.py --epochs 3"}, "command", "list of arguments"),
        ({"command": []}, "command", "non-empty list"),
        ({"command": None}, "command", "gives its command"),
        ({"command": ["python", ""]}, "command", "Argument 1"),
        ({"command": ["python", 3]}, "command", "Argument 1"),
        ({"command": ["python", "x" * (jobs.COMMAND_ARG_MAX + 1)]}, "command", "at most"),
        ({"command": ["x"] * (jobs.COMMAND_MAX_ARGS + 1)}, "command", "At most"),
        ({"bundle": None}, "bundle", "names its bundle"),
        ({"bundle": "ab" * 31}, "bundle", "64 lowercase hex"),
        ({"bundle": "AB" * 32}, "bundle", "64 lowercase hex"),
        ({"hyperparameters": [1, 2]}, "hyperparameters", "JSON object"),
        ({"hyperparameters": {"blob": "x" * jobs.SCRIPT_HYPERPARAMETERS_MAX_BYTES}}, "hyperparameters", "bytes"),
        ({"image": "nvcr.io/nvidia/pytorch:24.01-py3"}, "image", "Kubernetes"),
        ({"template": "pytorch-ddp", "command": None, "hyperparameters": {}}, "bundle", "Only script jobs"),
    ],
)
def test_each_bad_script_field_is_a_400_naming_it_and_stores_nothing(
    client_for, owner, environment, bundle, change, field, words
):
    response = _post(client_for(owner), script_data(environment, **change))
    assert response.status_code == 400, response.json()
    assert field in response.json(), response.json()
    assert words in " ".join(response.json()[field]), response.json()
    assert not Job.objects.exists() and not JobEvent.objects.exists()
    assert not AuditEntry.objects.filter(action="job.submitted").exists()


def test_another_tenants_bundle_reads_exactly_as_one_that_does_not_exist(
    client_for, owner, environment, other_tenant
):
    _bundle(other_tenant, SHA)  # Globex has this very digest; Acme does not
    theirs = _post(client_for(owner), script_data(environment))
    missing = _post(client_for(owner), script_data(environment, bundle=OTHER_SHA))
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["bundle"] == [f"Tenant acme has no bundle {SHA}."]
    assert missing.json()["bundle"] == [f"Tenant acme has no bundle {OTHER_SHA}."]
    assert not Job.objects.exists() and not JobEvent.objects.exists()


def test_a_deleted_bundle_cannot_be_submitted(client_for, owner, environment, tenant):
    _bundle(tenant, deleted_at=timezone.now())
    response = _post(client_for(owner), script_data(environment))
    assert response.status_code == 404
    assert response.json() == {"bundle": [f"Tenant acme has no bundle {SHA}."]}
    assert not Job.objects.exists() and not JobEvent.objects.exists()


def test_a_script_image_on_kubernetes_comes_from_the_allowed_registries(
    client_for, owner, environment, bundle, settings
):
    settings.CLUSTER_BACKEND = "kubernetes"
    settings.ALLOWED_IMAGE_REGISTRIES = ["nvcr.io/nvidia"]
    refused = _post(client_for(owner), script_data(environment, image="docker.io/evil/miner:latest"))
    assert refused.status_code == 400 and "image" in refused.json()
    taken = _post(client_for(owner), script_data(environment, image="nvcr.io/nvidia/pytorch:24.01-py3"))
    assert taken.status_code == 201, taken.json()
    assert Job.objects.get().spec["image"] == "nvcr.io/nvidia/pytorch:24.01-py3"


def test_a_bundle_a_job_still_uses_cannot_be_deleted_until_the_job_is_over(owner, environment, bundle):
    waiting = jobs.job_submit(actor=owner, data=script_data(environment, name="one"))
    done = jobs.job_submit(actor=owner, data=script_data(environment, name="two"))
    jobs.job_cancel(actor=owner, job=done)
    with pytest.raises(Conflict) as refused:
        bundles.delete(bundle, actor=owner)
    assert f"job one #{waiting.id} (queued)" in str(refused.value) and "two" not in str(refused.value)
    assert Bundle.objects.get(id=bundle.id).deleted_at is None
    jobs.job_cancel(actor=owner, job=waiting)
    bundles.delete(bundle, actor=owner)
    assert Bundle.objects.get(id=bundle.id).deleted_at is not None
    # The jobs that ran it still name it.
    assert set(Job.objects.values_list("bundle_id", flat=True)) == {bundle.id}


# --- The launch ---------------------------------------------------------------------


def _admitted(job):
    scheduling.cycle_run()
    job.refresh_from_db()
    assert job.state == "admitted", job.reason
    return job.attempts.get(ended_at__isnull=True)


def test_a_launch_carries_the_bundle_the_command_and_the_hyperparameters_as_json(owner, environment, bundle, settings):
    settings.PORTAL_PUBLIC_URL = "https://portal.example.com"
    job = jobs.job_submit(actor=owner, data=script_data(environment))
    attempt = _admitted(job)
    launch = attempts.job_launch_spec(Job.objects.select_related("bundle").get(id=job.id), attempt)
    assert launch.template == "script"
    assert launch.command == ("python", "train.py", "--epochs", "3")
    assert json.loads(launch.hyperparameters_json) == {"lr": 0.1, "layers": [64, 64], "schedule": {"warmup": 10}}
    assert launch.bundle.sha256 == SHA
    assert launch.bundle.url.endswith(f"/acme/{SHA}.tar.gz") and launch.bundle.url.startswith("file://")
    assert launch.bundle.fetch_url.startswith("https://portal.example.com/bundles/fetch/")
    # The same attempt gets the same URL (a launch applied again must not change its pods' spec).
    again = attempts.job_launch_spec(Job.objects.get(id=job.id), attempt)
    assert again.bundle.fetch_url == launch.bundle.fetch_url
    # The shipped trainer's settings stay at their defaults: the script's hyperparameters are not theirs.
    assert launch.trainer.lr == jobs.HYPERPARAMETERS["lr"][3]


def test_a_launch_of_a_job_whose_bundle_went_fails_the_attempt_saying_so(owner, environment, bundle):
    job = jobs.job_submit(actor=owner, data=script_data(environment, max_retries=0))
    attempt = _admitted(job)
    Bundle.objects.filter(id=bundle.id).update(deleted_at=timezone.now())
    assert attempts.job_launch_run(job_id=job.id, attempt_number=attempt.number) == "failed"
    attempt.refresh_from_db()
    assert attempt.outcome == "failed" and f"bundle {SHA} was deleted" in attempt.reason


# --- Stopped on request: exit 0 after a stop record ---------------------------------


class RecordsRead(LocalBackend):
    """The local backend, except that a progress read hands back the records the test put in ``records``
    (this test is about what the portal does with them; reading them is each backend's, tested with it)."""

    records = ProgressRead()

    def job_progress(self, job_id, attempt, cursor):
        return RecordsRead.records


def _running(owner, environment, **overrides):
    job = jobs.job_submit(actor=owner, data=script_data(environment, **overrides))
    _admitted(job)
    return job, play_launch(job)


def _read(job, attempt, *, stops=(), checkpoints=()):
    RecordsRead.records = ProgressRead(stops=list(stops), checkpoints=list(checkpoints), cursor={"read": 1},
                                       bytes_read=1)
    attempts.progress_record(Job.objects.get(id=job.id), attempt, RecordsRead(**local_backend_options()))


CHECKPOINT = {"step": 30, "path": "checkpoints/step-00000030.pt", "bytes": 1024,
              "created_at": "2026-12-05T10:00:00+00:00", "attempt": 1}


def _preempt(job):
    from django.db import transaction

    with transaction.atomic():
        locked = Job.objects.select_for_update().get(id=job.id)
        assert attempts.job_preempt_locked(locked, "Preempted for globex's guarantee.") == "stopping"


def test_ranks_exiting_0_after_the_stop_record_are_preempted_and_requeued_resuming_from_the_checkpoint(
    owner, environment, bundle
):
    job, attempt = _running(owner, environment)
    _preempt(job)
    _read(job, attempt, checkpoints=[CHECKPOINT],
          stops=[{"attempt": 1, "rank": 0, "reason": "SIGTERM received", "checkpoint_step": 30}])
    assert attempts.attempt_end(job.id, attempt.id, status=AttemptStatus("exited", {0: 0, 1: 0}))
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert (attempt.outcome, attempt.exit_code) == ("preempted", 75)
    assert job.state == "queued" and "resumes from step 30" in job.reason
    assert job.failures == 0  # a preemption is not a failure
    # The next attempt is told where it resumes from.
    second = _admitted(job)
    assert attempts.job_launch_spec(Job.objects.get(id=job.id), second).resume_from_step == 30


def test_ranks_exiting_0_without_a_stop_record_have_finished(owner, environment, bundle):
    job, attempt = _running(owner, environment)
    _read(job, attempt, checkpoints=[CHECKPOINT])
    assert attempts.attempt_end(job.id, attempt.id, status=AttemptStatus("exited", {0: 0, 1: 0}))
    job.refresh_from_db()
    assert job.state == "succeeded" and job.attempts.get().outcome == "succeeded"
    assert job.reason == "Every replica exited 0."  # not the trainer's "Finished all 40 steps."


def test_a_stop_record_of_another_attempt_does_not_count_for_this_one(owner, environment, bundle):
    job, attempt = _running(owner, environment)
    _read(job, attempt, stops=[{"attempt": 2, "rank": 0}, {"attempt": "1", "rank": 0}, {"rank": 0}])
    assert attempts.attempt_end(job.id, attempt.id, status=AttemptStatus("exited", {0: 0, 1: 0}))
    job.refresh_from_db()
    assert job.state == "succeeded"


def test_a_rank_that_failed_still_fails_the_attempt_after_a_stop_record(owner, environment, bundle):
    job, attempt = _running(owner, environment, max_retries=0)
    _read(job, attempt, stops=[{"attempt": 1, "rank": 0}])
    assert attempts.attempt_end(job.id, attempt.id, status=AttemptStatus("exited", {0: 0, 1: 1}))
    job.refresh_from_db()
    assert job.state == "failed" and "Replica 1 exited with 1" in job.reason


def test_a_stop_at_the_end_of_max_runtime_fails_the_job_as_a_75_does(owner, environment, bundle):
    job, attempt = _running(owner, environment, max_runtime_s=60)
    # Its first step was two minutes ago: the 60 s the job may run are used up.
    type(attempt).objects.filter(id=attempt.id).update(first_step_at=timezone.now() - timezone.timedelta(seconds=120))
    _read(job, attempt, stops=[{"attempt": 1, "rank": 0, "reason": "max runtime"}])
    assert attempts.attempt_end(job.id, attempt.id, status=AttemptStatus("exited", {0: 0, 1: 0}))
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.state == "failed" and "max_runtime_s" in job.reason
    assert attempt.exit_code == 75


def test_a_cancelled_script_that_stopped_ends_cancelled(owner, environment, bundle):
    job, attempt = _running(owner, environment)
    jobs.job_cancel(actor=owner, job=Job.objects.get(id=job.id))
    _read(job, attempt, stops=[{"attempt": 1, "rank": 0}])
    assert attempts.attempt_end(job.id, attempt.id, status=AttemptStatus("exited", {0: 0, 1: 0}))
    job.refresh_from_db()
    assert job.state == "cancelled" and job.attempts.get().outcome == "cancelled"

"""Submitting jobs through the API: exactly the documented shape, tenant scoping, roles, and nothing created on a 400."""

import pytest

from runners.jobs.models import Job, JobEvent
from tests.support.jobs import give_quota, job_data, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def environment(flavors, tenant, owner):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8, max_priority=50)
    return ready_environment(actor=owner, tenant=tenant)


def _post(client, data):
    return client.post("/api/v1/jobs/", data, format="json")


def test_the_documented_shape_is_accepted_and_queued_with_its_event(client_for, owner, environment, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        response = _post(client_for(owner), job_data(environment))
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["state"], body["tenant"], body["flavor"], body["replicas"]) == ("queued", "acme", "h100-80gb", 2)
    for key in ("id", "reason", "queue_position", "attempts", "checkpoints", "events"):
        assert key in body
    assert body["events"][0]["to_state"] == "queued"
    assert len(callbacks) == 1, "the scheduler cycle is kicked after commit"
    job = Job.objects.get()
    assert job.spec["topology"] == {"level": "node", "mode": "required"} and job.units == 2


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"privileged": True}, "privileged"),
        ({"hostPath": "/"}, "hostPath"),
        ({"hostNetwork": True}, "hostNetwork"),
        ({"hostPID": True}, "hostPID"),
        ({"runAsUser": 0}, "runAsUser"),
        ({"securityContext": {"runAsUser": 0}}, "securityContext"),
        ({"capabilities": {"add": ["SYS_ADMIN"]}}, "capabilities"),
        ({"nodeSelector": {"kubernetes.io/hostname": "h100-node-1"}}, "nodeSelector"),
        ({"tolerations": [{"operator": "Exists"}]}, "tolerations"),
        ({"schedulerName": "default-scheduler"}, "schedulerName"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env"),
        ({"env": {"NVIDIA_VISIBLE_DEVICES": "all"}}, "env"),
        ({"env": {"MASTER_ADDR": "10.0.0.1"}}, "env"),
        ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "env"),
        ({"env": {"PYTHONPATH": "/tmp"}}, "env"),
        ({"env": {"1BAD": "x"}}, "env"),
        ({"template": "custom", "image": "docker.io/evil/miner:latest", "command": ["mine"]}, "template"),
        ({"image": "nvcr.io/nvidia/pytorch:24.01-py3"}, "image"),
        ({"gpus_per_replica": 5}, "gpus_per_replica"),  # 2 x 5 = 10 > max 8
        ({"replicas": 0}, "replicas"),
        ({"replicas": 65}, "replicas"),
        ({"replicas": "2"}, "replicas"),
        ({"flavor": "no-such-flavor"}, "flavor"),
        ({"flavor": "a100-40gb-mig-1g.5gb"}, "flavor"),  # exists, but acme has no quota for it
        ({"priority": 51}, "priority"),
        ({"preemptible": False, "gpus_per_replica": 4}, "preemptible"),  # 8 units, guarantee 4
        ({"topology": {"level": "galaxy", "mode": "required"}}, "topology.level"),
        ({"topology": {"level": "node", "mode": "required", "spread": 2}}, "topology.spread"),
        ({"checkpoint_every_steps": 41}, "checkpoint_every_steps"),
        ({"name": "Bad_Name"}, "name"),
        ({"environment": 2**40}, "environment"),
    ],
)
def test_an_escape_or_bad_field_is_a_400_naming_it_and_creates_nothing(client_for, owner, environment, change, field):
    response = _post(client_for(owner), job_data(environment, **change))
    assert response.status_code == 400, response.json()
    assert field in response.json(), response.json()
    assert not Job.objects.exists() and not JobEvent.objects.exists()


def test_another_tenants_environment_is_a_400_naming_it(client_for, owner, outsider, other_tenant, environment, flavors):
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=0, max=8)
    theirs = ready_environment(actor=outsider, tenant=other_tenant, name="vision")
    response = _post(client_for(owner), job_data(environment, environment=theirs.id))
    assert response.status_code == 400 and "environment" in response.json()
    assert not Job.objects.exists()


def test_a_tenant_one_does_not_belong_to_reads_as_no_such_tenant(client_for, outsider, environment):
    response = _post(client_for(outsider), job_data(environment))
    assert response.status_code == 400 and "tenant" in response.json()


def test_a_viewer_reads_but_cannot_submit_or_cancel(client_for, owner, viewer, environment):
    job_id = _post(client_for(owner), job_data(environment)).json()["id"]
    client = client_for(viewer)
    assert _post(client, job_data(environment, name="mine")).status_code == 403
    assert client.get(f"/api/v1/jobs/{job_id}/").status_code == 200
    assert client.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 403
    assert Job.objects.get(id=job_id).state == "queued"


def test_another_tenants_job_is_a_404_everywhere(client_for, owner, outsider, environment):
    job_id = _post(client_for(owner), job_data(environment)).json()["id"]
    client = client_for(outsider)
    assert client.get("/api/v1/jobs/").json()["count"] == 0
    for path in ("", "logs/", "metrics/"):
        assert client.get(f"/api/v1/jobs/{job_id}/{path}").status_code == 404
    assert client.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 404


def test_cancelling_a_queued_job_ends_it_and_a_second_cancel_is_a_409(client_for, owner, environment):
    client = client_for(owner)
    job_id = _post(client, job_data(environment)).json()["id"]
    response = client.post(f"/api/v1/jobs/{job_id}/cancel/")
    assert response.status_code == 202 and response.json()["state"] == "cancelled"
    assert [event["to_state"] for event in response.json()["events"]] == ["queued", "cancelled"]
    assert client.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 409


def test_the_list_filters_by_tenant_and_state(client_for, owner, environment):
    client = client_for(owner)
    first = _post(client, job_data(environment, name="one")).json()["id"]
    _post(client, job_data(environment, name="two"))
    client.post(f"/api/v1/jobs/{first}/cancel/")
    assert [job["name"] for job in client.get("/api/v1/jobs/?state=queued").json()["results"]] == ["two"]
    assert client.get("/api/v1/jobs/?tenant=acme").json()["count"] == 2
    assert client.get("/api/v1/jobs/?state=sleeping").status_code == 400


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"image": "docker.io/evil/miner:latest", "command": ["mine"]}, "image"),
        ({"image": "nvcr.io.evil.example/nvidia/pytorch:1", "command": ["python"]}, "image"),
        ({"image": "nvcr.io/nvidia/pytorch:24.01-py3", "command": "python train.py"}, "command"),
        ({"image": None, "command": ["python"]}, "image"),
    ],
)
def test_where_custom_images_run_only_allow_listed_registries_are_accepted(
    client_for, owner, environment, settings, change, field
):
    settings.CLUSTER_BACKEND = "kubernetes"  # the only backend that runs custom images
    settings.ALLOWED_IMAGE_REGISTRIES = ["nvcr.io/nvidia"]
    response = _post(client_for(owner), job_data(environment, template="custom", **change))
    assert response.status_code == 400 and field in response.json(), response.json()
    assert not Job.objects.exists()


def test_an_allow_listed_custom_image_is_accepted_where_it_can_run(client_for, owner, environment, settings):
    settings.CLUSTER_BACKEND = "kubernetes"
    settings.ALLOWED_IMAGE_REGISTRIES = ["nvcr.io/nvidia"]
    response = _post(client_for(owner), job_data(
        environment, template="custom", image="nvcr.io/nvidia/pytorch:24.01-py3", command=["python", "train.py"]
    ))
    assert response.status_code == 201, response.json()
    assert Job.objects.get().spec["image"] == "nvcr.io/nvidia/pytorch:24.01-py3"


def test_staff_see_jobs_with_attempts_and_events_in_the_admin_but_cannot_change_them(client, staff, owner, environment):
    from runners.jobs import services as jobs

    staff.is_superuser = True
    staff.save()
    job = jobs.job_submit(actor=owner, data=job_data(environment))
    client.force_login(staff)
    assert "llm-pretrain" in client.get("/admin/jobs/job/").content.decode()
    page = client.get(f"/admin/jobs/job/{job.id}/change/")
    assert page.status_code == 200 and "Submitted by olivia." in page.content.decode()
    assert client.post(f"/admin/jobs/job/{job.id}/change/", {"name": "renamed"}).status_code == 403
    # Bookmarks from before jobs had their own app lead to the same page.
    moved = client.get(f"/admin/runners/job/{job.id}/change/")
    assert moved.status_code == 301 and moved["Location"] == f"/admin/jobs/job/{job.id}/change/"
    assert Job.objects.get().name == "llm-pretrain"


@pytest.mark.parametrize("path", ["/api/v1/jobs/?state=", "/api/v1/environments/?state="])
def test_a_state_filter_given_without_a_value_is_a_400_naming_it(client_for, owner, environment, path):
    response = client_for(owner).get(path)
    assert response.status_code == 400 and "state" in response.json()

"""Script jobs through the pages (Django's test client): the bundle picker, the command one argument per
line, errors at their fields, the job page saying what it runs, and Clone keeping all of it."""

import json
import re
from datetime import timedelta
from html import unescape

import pytest
from django.utils import timezone

from runners.bundles.models import Bundle
from runners.jobs import services as jobs
from runners.jobs.models import Job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

OLD_SHA, NEW_SHA, THEIR_SHA = "a1" * 32, "b2" * 32, "c3" * 32


@pytest.fixture
def environment(tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8, max_priority=20)
    return ready_environment(actor=owner, tenant=tenant)


@pytest.fixture
def bundles(tenant, other_tenant, owner):
    """Two of acme's bundles (the older uploaded a day before), one deleted, and one of globex's."""
    old = Bundle.objects.create(tenant=tenant, sha256=OLD_SHA, size_bytes=900, unpacked_bytes=4096, files=1,
                                created_by=owner)
    Bundle.objects.filter(id=old.id).update(created_at=timezone.now() - timedelta(days=1))
    new = Bundle.objects.create(tenant=tenant, sha256=NEW_SHA, size_bytes=2000, unpacked_bytes=3 * 1024 * 1024,
                                files=12, created_by=owner)
    Bundle.objects.create(tenant=tenant, sha256="d4" * 32, size_bytes=1, unpacked_bytes=1, files=1,
                          deleted_at=timezone.now())
    Bundle.objects.create(tenant=other_tenant, sha256=THEIR_SHA, size_bytes=1, unpacked_bytes=1, files=1)
    return {"old": old, "new": new}


def _form(environment, **fields):
    data = {"template": "script", "bundle": NEW_SHA, "command": "python\ntrain.py\n--epochs\n3\n",
            "hyperparameters": '{"lr": 0.01, "layers": [32, 32]}',
            "environment": environment.id, "name": "mine", "flavor": "h100-80gb", "replicas": 2, "gpus_per_replica": 1,
            "cpu_milli_per_replica": 2000, "memory_mib_per_replica": 256, "topology_level": "none",
            "topology_mode": "preferred", "priority": 0, "preemptible": "on", "steps": 50, "checkpoint_every_steps": 10,
            "max_runtime_s": 600, "max_retries": 1}
    data.update(fields)
    return data


def _field_errors(html: str, field: str) -> str:
    return unescape(html.split(f'id="id_{field}-errors"', 1)[1].split("</ul>", 1)[0])


def test_the_picker_offers_the_tenants_kept_bundles_newest_first_with_what_they_hold(client, owner, environment, bundles):
    client.force_login(owner)
    html = client.get("/tenants/acme/jobs/").content.decode()
    picker = html.split('name="bundle"', 1)[1].split("</select>", 1)[0]
    offered = re.findall(r'<option value="([0-9a-f]*)"[^>]*>([^<]*)</option>', picker)
    assert [value for value, _ in offered] == ["", NEW_SHA, OLD_SHA]  # not the deleted one, nor globex's
    assert unescape(offered[1][1]).startswith(f"{NEW_SHA[:12]} · 12 files, 3.0\xa0MB · uploaded ")
    assert unescape(offered[2][1]).startswith(f"{OLD_SHA[:12]} · 1 file, 4.0\xa0KB")


def test_without_a_bundle_the_form_says_how_to_upload_one(client, owner, environment):
    client.force_login(owner)
    html = client.get("/tenants/acme/jobs/").content.decode()
    assert 'data-testid="no-bundles"' in html and "portal run" in html


def test_a_script_job_submitted_from_the_form_runs_the_command_as_typed_one_argument_a_line(
    client, owner, environment, bundles
):
    client.force_login(owner)
    command = "python\n  train.py  \n\n--note\nhello world; rm -rf /\n"
    response = client.post("/tenants/acme/jobs/new/", _form(environment, command=command))
    job = Job.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.id}/"
    assert job.bundle == bundles["new"]
    # Each line one argument: the spaces and the semicolon stay inside it, nothing is split or run by a shell.
    assert job.spec["command"] == ["python", "train.py", "--note", "hello world; rm -rf /"]
    assert job.spec["hyperparameters"] == {"lr": 0.01, "layers": [32, 32]}
    assert job.spec["memory_mib_per_replica"] == 256  # the trainer's floor is the trainer's only

    html = client.get(f"/jobs/{job.id}/").content.decode()
    code = html.split('data-testid="job-code"', 1)[1].split("</section>", 1)[0]
    assert f'title="{NEW_SHA}">{NEW_SHA[:12]}</code>' in code and "12 files" in code
    assert "<code>python train.py --note &#x27;hello world; rm -rf /&#x27;</code>" in code
    assert "run as 4 arguments, without a shell, in the bundle" in unescape(code)


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"bundle": ""}, "bundle", "Choose the bundle"),
        ({"bundle": THEIR_SHA}, "bundle", "Select a valid choice"),
        ({"bundle": "d4" * 32}, "bundle", "Select a valid choice"),  # deleted
        ({"command": "\n  \n"}, "command", "one argument per line"),
        ({"hyperparameters": "{lr: 1}"}, "hyperparameters", "Not JSON"),
        ({"hyperparameters": "[1, 2]"}, "hyperparameters", "A JSON object"),
    ],
)
def test_a_bad_script_field_is_shown_at_it_and_nothing_is_submitted(
    client, owner, environment, bundles, fields, field, message
):
    client.force_login(owner)
    response = client.post("/tenants/acme/jobs/new/", _form(environment, **fields))
    assert response.status_code == 400
    assert message in _field_errors(response.content.decode(), field)
    assert not Job.objects.exists()


def test_the_trainers_form_sends_nothing_of_a_script_and_keeps_its_memory_floor(client, owner, environment, bundles):
    client.force_login(owner)
    response = client.post("/tenants/acme/jobs/new/", _form(environment, template="pytorch-ddp"))
    assert response.status_code == 400 and "At least" in _field_errors(response.content.decode(),
                                                                        "memory_mib_per_replica")
    response = client.post("/tenants/acme/jobs/new/", _form(environment, template="pytorch-ddp",
                                                            memory_mib_per_replica=4096))
    job = Job.objects.get()
    assert response.status_code == 302 and job.spec["template"] == "pytorch-ddp" and job.bundle is None
    assert job.spec["command"] is None and job.spec["hyperparameters"]["lr"] == jobs.HYPERPARAMETERS["lr"][3]


def test_clone_keeps_the_bundle_the_command_and_the_hyperparameters(client, owner, environment, bundles):
    source = jobs.job_submit(actor=owner, data=job_data(
        environment, name="sweep-3", template="script", bundle=OLD_SHA, command=["python", "-m", "pkg.train", "a b"],
        hyperparameters={"lr": 0.5, "tags": ["x"]}, replicas=1, topology={"level": "none", "mode": "preferred"},
        memory_mib_per_replica=1024, env={}))
    client.force_login(owner)
    assert f'href="/tenants/acme/jobs/new/?from={source.id}#submit"' in client.get(f"/jobs/{source.id}/").content.decode()
    response = client.get(f"/tenants/acme/jobs/new/?from={source.id}")
    form = response.context["form"]
    assert (form["template"].value(), form["bundle"].value(), form["name"].value()) == ("script", OLD_SHA, "sweep-4")
    assert form["command"].value() == "python\n-m\npkg.train\na b"
    assert json.loads(form["hyperparameters"].value()) == {"lr": 0.5, "tags": ["x"]}
    assert f"It runs bundle <code>{OLD_SHA[:12]}</code>" in response.content.decode()

    data = {name: form[name].value() for name in form.fields if name != "preemptible"}
    response = client.post("/tenants/acme/jobs/new/", data)
    clone = Job.objects.get(name="sweep-4")
    assert response.status_code == 302 and response["Location"] == f"/jobs/{clone.id}/"
    assert clone.bundle == bundles["old"] and clone.spec["bundle"] == OLD_SHA
    assert clone.spec["command"] == ["python", "-m", "pkg.train", "a b"]
    assert clone.spec["hyperparameters"] == {"lr": 0.5, "tags": ["x"]}


def test_a_custom_images_job_is_shown_but_not_offered_for_clone(client, owner, environment, settings):
    settings.CLUSTER_BACKEND = "kubernetes"
    settings.ALLOWED_IMAGE_REGISTRIES = ["nvcr.io/nvidia"]
    job = jobs.job_submit(actor=owner, data=job_data(environment, template="custom",
                                                     image="nvcr.io/nvidia/pytorch:24.01-py3", command=["python", "x.py"]))
    client.force_login(owner)
    html = client.get(f"/jobs/{job.id}/").content.decode()
    assert 'data-testid="clone-job"' not in html
    assert "<code>nvcr.io/nvidia/pytorch:24.01-py3</code>" in html and "<code>python x.py</code>" in html
    assert client.get(f"/tenants/acme/jobs/new/?from={job.id}").status_code == 404

"""Every form page shows all its errors after one submit: a summary on top linking to each field,
and each field marked invalid and described by its error."""

import re
from html import unescape

import pytest

from runners.clusters.models import NodePool
from runners.jobs.models import Job
from tests.support.endpoints import trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

SUMMARY = re.compile(r'<div class="error-summary"[^>]*data-testid="error-summary">(.*?)</div>', re.S)


def summary(html: str) -> tuple[str, dict[str, str]]:
    """The summary's title, and its links: field id -> text."""
    found = SUMMARY.findall(html)
    assert len(found) == 1, f"{len(found)} error summaries"
    title = unescape(re.search(r"<h2[^>]*>(.*?)</h2>", found[0]).group(1))
    links = {href: unescape(text) for href, text in re.findall(r'<a href="#([^"]+)">(.*?)</a>', found[0])}
    return title, links


def assert_marked(html: str, field_id: str) -> None:
    """The control says it is invalid and is described by its error, which is on the page."""
    control = re.search(rf'<(?:input|select|textarea)[^>]*\bid="{field_id}"[^>]*>', html)
    assert control, field_id
    assert 'aria-invalid="true"' in control.group(0), control.group(0)
    described = re.search(r'aria-describedby="([^"]*)"', control.group(0))
    assert described and f"{field_id}_error" in described.group(1).split(), control.group(0)
    assert f'id="{field_id}_error"' in html


@pytest.fixture
def environment(tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8, max_priority=20)
    return ready_environment(actor=owner, tenant=tenant)


def _job_form(environment, **fields):
    data = {"environment": environment.id, "name": "llm", "flavor": "h100-80gb", "replicas": 2, "gpus_per_replica": 2,
            "cpu_milli_per_replica": 2000, "memory_mib_per_replica": 4096, "topology_level": "node",
            "topology_mode": "required", "priority": 0, "preemptible": "on", "steps": 50, "checkpoint_every_steps": 10,
            "max_runtime_s": 600, "max_retries": 1}
    return {**data, **fields}


def test_the_job_form_names_every_bad_field_in_one_submit(client, owner, environment):
    client.force_login(owner)
    # The name used to be checked only by the service, which runs once the rest is valid: its error
    # came a submit later. Now the form checks its shape with the others.
    response = client.post("/tenants/acme/jobs/new/", _job_form(
        environment, name="Bad_Name", replicas=0, steps=50, checkpoint_every_steps=60, max_retries=99))
    assert response.status_code == 400
    html = response.content.decode()
    title, links = summary(html)
    assert title == "There are 4 problems"
    assert list(links) == ["id_name", "id_replicas", "id_checkpoint_every_steps", "id_max_retries"]
    assert links["id_name"].startswith("Name: Lowercase letters, digits and '-', at most 40")
    assert links["id_checkpoint_every_steps"] == "Checkpoint every (steps): Must be between 0 and 50, got 60."
    assert links["id_max_retries"].endswith("less than or equal to 20.")  # the service's bound, now the form's too
    for field_id in links:
        assert_marked(html, field_id)
    assert not Job.objects.exists()


def test_a_valid_job_form_still_goes_to_the_service_which_has_the_last_word(client, owner, environment):
    client.force_login(owner)
    response = client.post("/tenants/acme/jobs/new/", _job_form(environment, priority=21))
    assert response.status_code == 400
    title, links = summary(response.content.decode())
    assert title == "There is 1 problem" and links == {"id_priority": "Priority: At most 20 for tenant acme on h100-80gb."}


def test_a_page_without_errors_has_no_summary(client, owner, environment):
    client.force_login(owner)
    for path in ("/tenants/acme/jobs/", "/tenants/acme/", "/tokens/"):
        html = client.get(path).content.decode()
        assert 'data-testid="error-summary"' not in html and 'aria-invalid' not in html, path


def test_the_endpoint_form_checks_the_name_and_the_replica_range_together(client, owner, environment):
    job = trained_job(actor=owner, environment=environment, name="tiny-lm", step=10)
    client.force_login(owner)
    response = client.post("/tenants/acme/endpoints/new/", {
        "name": "Chat!", "environment": environment.id, "job": job.id, "step": "", "flavor": "h100-80gb",
        "gpus_per_replica": 1, "min_replicas": 2, "max_replicas": 1, "warm_replicas": 3, "queue_limit": 64,
        "batch_token_budget": 4096, "max_batch_wait_ms": 5, "default_deadline_ms": 10000})
    assert response.status_code == 400
    html = response.content.decode()
    title, links = summary(html)
    assert title == "There are 3 problems"
    assert links == {
        "id_name": "Name: Lowercase letters, digits and '-', at most 30, starting and ending alphanumeric.",
        "id_max_replicas": "Max replicas: At least min_replicas (2) and at least 1.",
        "id_warm_replicas": "Warm replicas: At most max_replicas (1).",
    }
    for field_id in links:
        assert_marked(html, field_id)


@pytest.mark.parametrize(
    ("path", "data", "expected"),
    [
        ("/tenants/acme/environments/new/", {"name": "Not A Label"}, ["id_name"]),
        ("/tenants/acme/members/new/", {"username": "", "role": "emperor"}, ["id_username", "id_role"]),
        ("/tokens/new/", {"name": "", "expires_in_days": 0}, ["id_name", "id_expires_in_days"]),
    ],
)
def test_the_tenant_and_token_forms_list_every_error(client, owner, path, data, expected):
    client.force_login(owner)
    response = client.post(path, data)
    assert response.status_code == 400
    html = response.content.decode()
    title, links = summary(html)
    assert list(links) == expected
    assert title == (f"There are {len(expected)} problems" if len(expected) > 1 else "There is 1 problem")
    for field_id in expected:
        assert_marked(html, field_id)


def test_the_staff_forms_list_every_error(client, staff, tenant, inventory):
    client.force_login(staff)
    demo_cluster_with_flavors()
    html = client.post("/quotas/set/", {"tenant": "", "flavor": "h100-80gb", "guaranteed": 9, "max": 3,
                                        "fair_share_weight": 1, "max_priority": 100}).content.decode()
    assert summary(html)[1] == {"id_tenant": "Tenant: This field is required.",
                                "id_guaranteed": "Guaranteed: guaranteed (9) cannot exceed max (3)."}
    assert_marked(html, "id_guaranteed")

    html = client.post("/partitions/new/", {"name": "Bad Name", "gpu_model": "T4", "kind": "timeslice",
                                            "layout": "", "replicas": 0}).content.decode()
    assert list(summary(html)[1]) == ["id_name", "id_replicas"]

    pool = NodePool.objects.order_by("id").first()
    html = client.post(f"/node-pools/{pool.id}/apply/", {"profile": "", "drain": "wait"}).content.decode()
    assert list(summary(html)[1]) == ["id_profile"]
    assert_marked(html, "id_profile")


def test_the_login_form_lists_both_missing_fields(client):
    html = client.post("/login/", {"username": "", "password": ""}).content.decode()
    title, links = summary(html)
    assert title == "There are 2 problems" and list(links) == ["id_username", "id_password"]


def test_a_message_names_the_states_it_describes_through_extra_tags():
    from django.contrib.auth.models import AnonymousUser
    from django.contrib.messages import constants
    from django.contrib.messages.storage.base import Message
    from django.template.loader import render_to_string

    html = render_to_string("frontend/base.html", {"user": AnonymousUser(), "messages": [
        Message(constants.SUCCESS, "Requested train.", extra_tags="state:requested provisioning"),
        Message(constants.SUCCESS, "Saved."),
        Message(constants.ERROR, "Could not."),
    ]})
    assert '<div class="message message-success" data-message data-state="requested provisioning">' in html
    assert '<div class="message message-success" data-message data-until-state-changes>' in html
    assert '<div class="message message-error" data-message>' in html
    assert "<li" not in html.split('data-messages', 1)[1].split("</main>", 1)[0]



def test_every_field_description_a_form_page_points_to_is_on_it(client, staff, tenant, owner, environment, inventory):
    """Django points each input at "<id>_helptext" and "<id>_error"; a field rendered by hand must keep those ids."""
    pool = NodePool.objects.order_by("id").first()
    visits = [(staff, path, None) for path in ("/quotas/", "/partitions/", f"/node-pools/{pool.id}/", "/tokens/")]
    visits += [(owner, path, None) for path in ("/tenants/acme/", "/tenants/acme/jobs/", "/tenants/acme/endpoints/new/")]
    visits += [(owner, "/tenants/acme/jobs/new/", _job_form(environment, name="Bad_Name", replicas=0))]
    checked = 0
    for user, path, data in visits:
        client.force_login(user)
        html = (client.post(path, data) if data else client.get(path)).content.decode()
        for described in re.findall(r'aria-describedby="([^"]*)"', html):
            for element_id in described.split():
                assert f'id="{element_id}"' in html, f"{path}: nothing has the id {element_id}"
                checked += 1
    assert checked > 10

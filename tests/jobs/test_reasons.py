"""Every reason a team reads is in its words: no "gang", no epoch seconds, no doubled words, no link to
another tenant's job, and the time that goes with it as a datetime beside it (API) or in local time (pages).

Scenarios run the real cycle against the database; the reasons are read back as each tenant reads them,
through the API and the job page. A queued job the cluster shrinks under says it cannot fit now, and why.
"""

import re
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from runners.clusters.registry import get_backend
from runners.clusters.services import inventory_sync
from runners.jobs import attempts
from runners.jobs.models import Job
from runners.scheduling import services as scheduling
from tests.support.jobs import give_quota, play_launch, submit

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

# "t=1796324575s" as the scheduler used to print its clock, or a bare epoch in seconds.
EPOCH = re.compile(r"\bt=\d+(\.\d+)?s\b|\b1[5-9]\d{8}\b")






def _reasons_through_the_api(client, tenant) -> dict[int, list[str]]:
    """Every reason a tenant's member can read, per job: the job's, its attempts' and its events'."""
    found = {}
    for job_id in Job.objects.filter(tenant=tenant).values_list("id", flat=True):
        body = client.get(f"/api/v1/jobs/{job_id}/").json()
        found[job_id] = [body["reason"], *(a["reason"] for a in body["attempts"]),
                         *(e["reason"] for e in body["events"])]
    return found


def assert_readable(text: str, *, others: list[Job] = ()) -> None:
    """What a person can read: the scheduler's words and clock stay out, another tenant's job is named, never linked."""
    assert "gang" not in text.lower(), text
    assert not EPOCH.search(text), text
    assert "<a" not in text and "href" not in text, text
    words = re.findall(r"[a-z'-]+", text.lower())
    doubled = [word for word, following in zip(words, words[1:]) if word == following]
    assert not doubled, (doubled, text)
    assert text.lower().count("preempted") <= 1, text
    for other in others:
        assert f"job {other.id}" not in text and f"/jobs/{other.id}/" not in text, text


def _iso(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_a_preemption_and_the_waits_around_it_read_like_a_person_wrote_them(
    flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env, settings, client_for, client
):
    settings.PREEMPTION_GRACE_PERIOD_S = 120
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    borrower = submit(owner, acme_env, name="borrower", replicas=2, gpus_per_replica=8,
                       topology={"level": "none", "mode": "preferred"})
    scheduling.cycle_run()
    attempt = play_launch(borrower)
    owed = submit(outsider, globex_env, name="train-resnet", replicas=1, gpus_per_replica=8)
    scheduling.cycle_run()
    borrower.refresh_from_db(), owed.refresh_from_db()

    # The victim's reason names the other tenant's job by name and says what happens next.
    assert borrower.state == "preempted"
    assert borrower.reason.startswith(
        "Preempted for job train-resnet of tenant globex: tenant acme is borrowing h100-80gb beyond its guarantee"
    ), borrower.reason
    assert "within 2 minutes" in borrower.reason and "resumes from its newest checkpoint" in borrower.reason
    acme, globex = client_for(owner), client_for(outsider)
    body = acme.get(f"/api/v1/jobs/{borrower.id}/").json()
    assert _iso(body["stop_deadline"]) == borrower.stop_deadline
    assert body["projected_start"] is None
    # The claimant waits for the victim to stop: its start is the victim's deadline, as a time beside the reason.
    assert owed.state == "queued" and "checkpointing and stopping" in owed.reason
    projected = _iso(globex.get(f"/api/v1/jobs/{owed.id}/").json()["projected_start"])
    assert abs((projected - borrower.stop_deadline).total_seconds()) < 1

    # The job page shows the reason as text and the deadline in local time; no link to the other tenant's job.
    client.force_login(owner)
    html = client.get(f"/jobs/{borrower.id}/").content.decode()
    assert f"/jobs/{owed.id}/" not in html and "job train-resnet of tenant globex" in html
    assert "Stopped at the latest in about 2 minutes, at " in html and " UTC" in html

    # The victim stops; the claimant starts; the victim waits again, borrowing, with a projected start.
    assert attempts.attempt_end(borrower.id, attempt.id, outcome="preempted", reason=borrower.reason)
    scheduling.cycle_run()
    borrower.refresh_from_db(), owed.refresh_from_db()
    assert owed.state == "admitted"
    assert borrower.state == "queued" and borrower.reason.startswith("Waiting: only 8 h100-80gb idle, it needs 16")
    assert borrower.projected_start is not None and borrower.projected_start > timezone.now()
    html = client.get(f"/jobs/{borrower.id}/").content.decode()
    assert "Expected to start in about " in html
    listing = client.get(f"/tenants/{tenant.slug}/jobs/").content.decode()
    assert "Expected to start in about " in listing

    for reasons in _reasons_through_the_api(acme, tenant).values():
        for text in reasons:
            assert_readable(text, others=[owed])
    for reasons in _reasons_through_the_api(globex, other_tenant).values():
        for text in reasons:
            assert_readable(text, others=[borrower])


def test_a_job_waiting_at_its_max_and_one_held_behind_another_say_so_without_naming_it(
    flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env, client_for
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=16, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=0, max=8)
    running = submit(owner, acme_env, name="running", replicas=2, gpus_per_replica=8,
                      topology={"level": "none", "mode": "preferred"}, max_runtime_s=1200)
    scheduling.cycle_run()
    play_launch(running)
    at_max = submit(owner, acme_env, name="at-max", replicas=1, gpus_per_replica=1)
    borrowing = submit(outsider, globex_env, name="borrowing", replicas=1, gpus_per_replica=8)
    scheduling.cycle_run()
    at_max.refresh_from_db(), borrowing.refresh_from_db(), running.refresh_from_db()
    assert at_max.reason == (
        "Waiting: tenant acme is at its max for h100-80gb (max 16, 16 in use, it needs 1 more); it starts when the "
        "tenant's other jobs free some."
    )
    assert at_max.projected_start is None
    assert borrowing.reason.startswith("Waiting: only 0 h100-80gb idle, it needs 8"), borrowing.reason
    # Reserved behind the running job: it starts when that one's runtime budget ends.
    expected = running.started_at + timedelta(seconds=1200)
    assert abs((borrowing.projected_start - expected).total_seconds()) <= 1
    for reasons in _reasons_through_the_api(client_for(outsider), other_tenant).values():
        for text in reasons:
            assert_readable(text, others=[running, at_max])


def test_a_job_that_fails_past_its_retries_says_why_and_what_to_do(flavors, tenant, owner, acme_env, client_for):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    job = submit(owner, acme_env, name="flaky", replicas=1, max_retries=1)
    for _ in range(2):
        scheduling.cycle_run()
        attempt = play_launch(job)
        assert attempts.attempt_end(job.id, attempt.id, outcome="failed", reason="Replica 0 exited with 1.",
                                    exit_code=1)
        job.refresh_from_db()
    assert job.state == "failed"
    assert job.reason == (
        "Replica 0 exited with 1. It failed twice and max_retries is 1: fix the cause, then submit it again."
    )
    for reasons in _reasons_through_the_api(client_for(owner), tenant).values():
        assert any(text.startswith("Retrying (1 of 1) after: Replica 0 exited with 1.") for text in reasons)
        for text in reasons:
            assert_readable(text)


# --- The cluster shrinks under a queued job ----------------------------------------------------


def _h100_nodes_of(tmp_path, gpus: int) -> str:
    """The demo cluster file with each H100 node holding `gpus` GPUs."""
    from django.conf import settings

    text = open(settings.LOCAL_CLUSTER_FILE).read()
    assert text.count("gpus: {model: H100-80GB, count: 8}") == 2
    path = tmp_path / "smaller.yaml"
    path.write_text(text.replace("gpus: {model: H100-80GB, count: 8}", f"gpus: {{model: H100-80GB, count: {gpus}}}"))
    return str(path)


def _use_cluster_file(settings, path: str) -> None:
    settings.LOCAL_CLUSTER_FILE = path
    get_backend.cache_clear()
    inventory_sync()


def test_a_queued_job_whose_replica_no_longer_fits_any_node_says_so_and_why(
    flavors, tenant, owner, acme_env, client_for, settings, tmp_path
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    job = submit(owner, acme_env, name="big-replica", replicas=1, gpus_per_replica=8)
    demo = settings.LOCAL_CLUSTER_FILE
    _use_cluster_file(settings, _h100_nodes_of(tmp_path, 4))
    result = scheduling.cycle_run()

    body = client_for(owner).get(f"/api/v1/jobs/{job.id}/").json()
    assert body["state"] == "queued" and job.id in result["waiting"]
    assert body["reason"] == (
        "Blocked: it cannot fit the cluster as it is now. Each replica needs 8 h100-80gb GPUs on one node, and the "
        "largest node now has 4 (2 nodes with h100-80gb left); the most one replica can have is 4. Cancel it and "
        "submit a smaller job, or leave it queued: it is considered again once the capacity comes back."
    )
    assert_readable(body["reason"])

    # The cluster grows back: it is admitted.
    _use_cluster_file(settings, demo)
    assert scheduling.cycle_run()["admitted"] == [job.id]


def test_a_job_that_cannot_fit_is_in_no_line_and_has_no_projected_start(
    flavors, tenant, owner, staff, acme_env, client, client_for, settings, tmp_path
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    job = submit(owner, acme_env, name="big-replica", replicas=1, gpus_per_replica=8)
    # What an earlier cycle wrote while it could still fit.
    Job.objects.filter(id=job.id).update(queue_position=7, projected_start=timezone.now() + timedelta(minutes=5))
    _use_cluster_file(settings, _h100_nodes_of(tmp_path, 4))
    result = scheduling.cycle_run()

    job.refresh_from_db()
    assert job.state == "queued" and job.reason.startswith("Blocked: it cannot fit") and job.id in result["waiting"]
    assert job.queue_position is None and job.projected_start is None
    body = client_for(owner).get(f"/api/v1/jobs/{job.id}/").json()
    assert body["queue_position"] is None and body["projected_start"] is None
    client.force_login(owner)
    for path in (f"/jobs/{job.id}/", "/tenants/acme/jobs/"):
        assert "in line" not in client.get(path).content.decode(), path
    # Nor is it "new" on the staff queue: the cycle has seen it and set it aside.
    client.force_login(staff)
    html = client.get("/queue/").content.decode()
    place = re.search(rf'data-job="{job.id}".*?data-testid="place">(.*?)</td>', html, re.S)
    assert place and "new" not in place.group(1) and "7" not in place.group(1), place and place.group(1)


def test_a_queued_job_the_cluster_shrank_under_preempts_nobody_and_says_how_many_replicas_fit(
    flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env, client_for
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=8)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=16, max=16)
    borrower = submit(owner, acme_env, name="borrower", replicas=1, gpus_per_replica=8)
    scheduling.cycle_run()
    play_launch(borrower)
    lost = next(node for node in ("h100-node-1", "h100-node-2") if node != borrower.attempts.get().placement[0]["node"])
    # Within its guarantee, this job would preempt the borrower; but the cluster loses a node first.
    owed = submit(outsider, globex_env, name="wide", replicas=2, gpus_per_replica=8,
                   topology={"level": "none", "mode": "preferred"})
    get_backend().set_node_down(lost)
    inventory_sync()
    result = scheduling.cycle_run()

    assert result["preempted"] == []
    borrower.refresh_from_db()
    assert borrower.state == "running"
    reason = client_for(outsider).get(f"/api/v1/jobs/{owed.id}/").json()["reason"]
    assert reason.startswith(
        "Blocked: it cannot fit the cluster as it is now. It needs 2 replicas of 8 h100-80gb GPUs in the cluster, "
        "and at most 1 fit in the cluster as it is now (1 node with h100-80gb left)."
    ), reason
    assert_readable(reason, others=[borrower])

    get_backend().set_node_down(lost, down=False)
    inventory_sync()
    scheduling.cycle_run()
    owed.refresh_from_db(), borrower.refresh_from_db()
    assert borrower.state == "preempted" and "job wide of tenant globex" in borrower.reason
    assert "cannot fit" not in owed.reason


def test_the_cycle_counts_a_flavors_units_per_node_as_the_inventory_does(flavors):
    from runners.clusters.models import Node
    from runners.clusters.services import flavor_units_per_node

    get_backend().cordon("t4-node-2")
    inventory_sync()
    nodes = list(Node.objects.filter(schedulable=True).prefetch_related("gpus"))
    kinds = set()
    for flavor in flavors.values():
        kinds.add(flavor.kind)
        assert scheduling._units_per_node(flavor, nodes) == flavor_units_per_node(flavor), flavor.name
    assert kinds == {"whole", "mig", "timeslice"}

"""Jobs you can work with, and lists that scale, through Django's test client (and the API for logs).

Logs per replica (a picker, the newest line last, a download without the trainer's progress lines),
Clone (the submit form filled from a job, 404 for anyone else's), how long a job ran and waited,
and filtered, sorted, paginated lists of jobs, environments, members and nodes.
"""

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from runners.clusters.registry import get_backend
from runners.jobs import services as jobs
from runners.jobs.models import Job, JobAttempt
from runners.scheduling import services as scheduling
from tests.support.jobs import give_quota, job_data, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

METRIC = 'PORTAL_METRIC {"step": 3, "loss": 2.5}'
CHECKPOINT = 'PORTAL_CHECKPOINT {"step": 3, "uri": "step-3.pt"}'


@pytest.fixture
def environment(tenant, owner, flavors):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16, max_priority=20)
    return ready_environment(actor=owner, tenant=tenant)


def _write_log(job, attempt, rank, lines):
    """What the local backend's replica process would have written: its log file, where the backend reads it."""
    folder = get_backend().jobs.attempt_dir(job.id, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{rank}.log").write_text("".join(f"{line}\n" for line in lines))


@pytest.fixture
def two_attempts(owner, environment):
    """A 2-replica job on its second attempt (the first one preempted), both attempts' logs on disk."""
    job = jobs.job_submit(actor=owner, data=job_data(environment, name="llm", replicas=2))
    scheduling.cycle_run()
    first = job.attempts.get()
    now = timezone.now()
    JobAttempt.objects.filter(id=first.id).update(started_at=now - timedelta(minutes=5), ended_at=now - timedelta(minutes=4),
                                                  outcome="preempted")
    JobAttempt.objects.create(job=job, number=2, placement=first.placement, started_at=now - timedelta(minutes=3))
    Job.objects.filter(id=job.id).update(state="running")
    for attempt in (1, 2):
        for rank in (0, 1):
            _write_log(job, attempt, rank, [f"a{attempt} r{rank} starting", METRIC, f"a{attempt} r{rank} step 3",
                                            CHECKPOINT, f"a{attempt} r{rank} newest line"])
    job.refresh_from_db()
    return job


def _log(html: str) -> str:
    return html.split('data-testid="job-log"', 1)[1].split(">", 1)[1].split("</pre>", 1)[0]


# --- Logs per replica -----------------------------------------------------------------------


def test_the_log_shows_the_newest_attempts_rank_0_without_progress_lines_newest_last(client, owner, two_attempts):
    client.force_login(owner)
    html = client.get(f"/jobs/{two_attempts.id}/").content.decode()
    log = _log(html)
    assert log.strip().splitlines() == ["a2 r0 starting", "a2 r0 step 3", "a2 r0 newest line"]
    assert "PORTAL_" not in log
    region = html.split('data-testid="job-log"', 1)[1].split(">", 1)[0]
    assert 'tabindex="0"' in region and 'aria-label="Log of attempt 2, replica 0, newest line last"' in region
    # Follow is on for a job that runs; the card polls its own fragment.
    assert 'data-log-follow data-testid="log-follow" checked' in html
    assert f'data-log-url="/jobs/{two_attempts.id}/log/"' in html


def test_the_picker_offers_each_replica_of_each_attempt_whose_log_the_backend_still_has(client, owner, two_attempts):
    client.force_login(owner)
    picker = client.get(f"/jobs/{two_attempts.id}/").content.decode().split('data-testid="log-picker"', 1)[1]
    picker = picker.split("</nav>", 1)[0]
    assert re.findall(r'data-attempt="(\d)" data-rank="(\d)"', picker) == [("2", "0"), ("2", "1"), ("1", "0"), ("1", "1")]

    html = client.get(f"/jobs/{two_attempts.id}/?attempt=1&rank=1").content.decode()
    assert _log(html).strip().splitlines()[-1] == "a1 r1 newest line"
    assert 'data-attempt="1" data-rank="1" aria-current="true"' in html
    # An earlier attempt is not followed: nothing more comes to it.
    assert "data-log-follow data-testid=\"log-follow\" checked" not in html

    # Once the backend no longer has attempt 1's log (a Kubernetes attempt's pods are gone), it is not offered.
    for rank in (0, 1):
        (get_backend().jobs.attempt_dir(two_attempts.id, 1) / f"rank-{rank}.log").unlink()
    picker = client.get(f"/jobs/{two_attempts.id}/").content.decode().split('data-testid="log-picker"', 1)[1]
    assert 'data-attempt="1"' not in picker.split("</nav>", 1)[0]


def test_the_follow_fragment_reads_the_replica_asked_for(client, owner, two_attempts):
    client.force_login(owner)
    response = client.get(f"/jobs/{two_attempts.id}/log/?rank=1")
    assert response.status_code == 200 and response["Cache-Control"].startswith("max-age=0")
    assert _log(response.content.decode()).strip().splitlines()[-1] == "a2 r1 newest line"


def test_a_replica_picked_from_the_newest_attempt_follows_the_next_attempt_after_a_requeue(client, owner, two_attempts):
    job = two_attempts
    client.force_login(owner)
    picker = client.get(f"/jobs/{job.id}/").content.decode().split('data-testid="log-picker"', 1)[1].split("</nav>", 1)[0]
    # The newest attempt's links name only the replica; an earlier attempt's name the attempt too.
    assert re.findall(r'<a href="([^"]+)" data-attempt', picker) == [
        "?rank=0#log", "?rank=1#log", "?attempt=1&amp;rank=0#log", "?attempt=1&amp;rank=1#log"]
    html = client.get(f"/jobs/{job.id}/?rank=1").content.decode()
    assert f'data-log-url="/jobs/{job.id}/log/?rank=1"' in html
    assert f'href="/jobs/{job.id}/log/download/?attempt=2&amp;rank=1"' in html
    # Naming the newest attempt pins nothing either; an earlier one is pinned.
    assert f'data-log-url="/jobs/{job.id}/log/?rank=1"' in client.get(f"/jobs/{job.id}/?attempt=2&rank=1").content.decode()
    assert (f'data-log-url="/jobs/{job.id}/log/?attempt=1&amp;rank=1"'
            in client.get(f"/jobs/{job.id}/?attempt=1&rank=1").content.decode())

    # Requeued: attempt 2 ends, attempt 3 runs. What Follow polls now reads attempt 3, and its Download too.
    second = job.attempts.get(number=2)
    JobAttempt.objects.filter(id=second.id).update(ended_at=timezone.now(), outcome="preempted")
    JobAttempt.objects.create(job=job, number=3, placement=second.placement, started_at=timezone.now())
    _write_log(job, 3, 1, ["a3 r1 starting"])
    fragment = client.get(f"/jobs/{job.id}/log/?rank=1").content.decode()
    assert _log(fragment).strip().splitlines() == ["a3 r1 starting"]
    assert "attempt 3, replica 1" in fragment
    assert f'href="/jobs/{job.id}/log/download/?attempt=3&amp;rank=1" download data-log-download' in fragment


def test_messages_about_a_state_name_it_so_they_go_once_the_badge_shows_another(client, owner, tenant, two_attempts):
    client.force_login(owner)
    html = client.post(f"/jobs/{two_attempts.id}/cancel/", follow=True).content.decode()
    assert '<div class="message message-success" data-message data-state="cancelling">' in html
    assert 'data-testid="job-state">cancelling<' in html
    waiting = jobs.job_submit(actor=owner, data=job_data(two_attempts.environment, name="waits", replicas=1))
    html = client.post(f"/jobs/{waiting.id}/cancel/", follow=True).content.decode()
    assert "Cancelled waits." in html and 'data-message data-until-state-changes' in html

    html = client.post("/tenants/acme/environments/new/", {"name": "eval"}, follow=True).content.decode()
    assert '<div class="message message-success" data-message data-state="requested provisioning">' in html
    environment = two_attempts.environment
    html = client.post(f"/environments/{environment.id}/delete/", follow=True).content.decode()
    assert '<div class="message message-success" data-message data-state="deleting">' in html


@pytest.mark.parametrize(("query", "name"), [("rank=2", "rank"), ("rank=x", "rank"), ("attempt=3", "attempt"),
                                             ("attempt=-1", "attempt"), ("rank=%C2%B2", "rank"),
                                             ("attempt=%C2%B2", "attempt"), ("rank=" + "9" * 5000, "rank"),
                                             ("attempt=" + "1" * 5000, "attempt"), ("rank=%EF%BC%91", "rank")])
def test_a_replica_the_job_does_not_have_is_a_400_naming_the_parameter(client, owner, two_attempts, query, name):
    client.force_login(owner)
    for path in (f"/jobs/{two_attempts.id}/", f"/jobs/{two_attempts.id}/log/"):
        response = client.get(f"{path}?{query}")
        assert response.status_code == 400, path
        assert f"<code>{name}</code>" in response.content.decode(), path
    response = client.get(f"/jobs/{two_attempts.id}/log/download/?{query}")
    assert response.status_code == 400 and response.content.decode().startswith(f"{name}:")


def test_download_is_the_replicas_log_as_a_file_without_progress_lines(client, owner, two_attempts):
    client.force_login(owner)
    html = client.get(f"/jobs/{two_attempts.id}/?attempt=1&rank=1").content.decode()
    assert f'href="/jobs/{two_attempts.id}/log/download/?attempt=1&amp;rank=1"' in html
    response = client.get(f"/jobs/{two_attempts.id}/log/download/?attempt=1&rank=1")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert response["Content-Disposition"] == f'attachment; filename="llm-{two_attempts.id}-attempt-1-rank-1.log"'
    assert response.content.decode() == "a1 r1 starting\na1 r1 step 3\na1 r1 newest line\n"


def test_another_tenants_log_is_404(client, outsider, two_attempts):
    client.force_login(outsider)
    for path in ("/", "/log/", "/log/download/"):
        assert client.get(f"/jobs/{two_attempts.id}{path}").status_code == 404


def test_the_api_reads_a_rank_of_an_attempt_and_downloads_it(client_for, owner, outsider, two_attempts):
    api = client_for(owner)
    url = f"/api/v1/jobs/{two_attempts.id}/logs/"
    body = api.get(url, {"attempt": 1, "rank": 1}).json()
    assert body["attempt"] == 1 and body["replica"] == 1 and METRIC in body["text"]
    assert body["text"].splitlines()[-1] == "a1 r1 newest line"
    assert api.get(url).json()["text"].splitlines()[0] == "a2 r0 starting"
    assert api.get(url, {"replica": 1}).json()["replica"] == 1  # the older name still works

    response = api.get(f"{url}download/", {"attempt": 2, "rank": 1})
    assert response.status_code == 200 and response["Content-Type"] == "text/plain; charset=utf-8"
    assert response["Content-Disposition"].startswith("attachment; ")
    assert response.content.decode() == "a2 r1 starting\na2 r1 step 3\na2 r1 newest line\n"

    for query, name in (({"rank": 2}, "rank"), ({"attempt": 7}, "attempt"), ({"attempt": "one"}, "attempt"),
                        ({"replica": 9}, "replica")):
        for path in (url, f"{url}download/"):
            response = api.get(path, query)
            assert response.status_code == 400 and name in response.json(), (path, query)

    stranger = client_for(outsider)
    assert stranger.get(url).status_code == 404 and stranger.get(f"{url}download/").status_code == 404


def test_the_api_documents_the_log_parameters_and_the_download(client_for, owner):
    schema = client_for(owner).get("/api/schema/", HTTP_ACCEPT="application/json").json()
    logs = schema["paths"]["/api/v1/jobs/{id}/logs/"]["get"]
    assert {"rank", "attempt", "replica", "tail"} <= {p["name"] for p in logs["parameters"]}
    download = schema["paths"]["/api/v1/jobs/{id}/logs/download/"]["get"]
    assert "text/plain" in download["responses"]["200"]["content"]
    assert {"400", "404", "503"} <= set(download["responses"])


# --- Clone and resubmit ---------------------------------------------------------------------


def test_clone_fills_the_submit_form_from_the_job_and_submitting_makes_a_new_job(client, owner, environment):
    source = jobs.job_submit(actor=owner, data=job_data(
        environment, name="llm-7", replicas=3, gpus_per_replica=2, priority=15, preemptible=False, steps=70,
        checkpoint_every_steps=7, max_runtime_s=900, max_retries=2, topology={"level": "rack", "mode": "preferred"}))
    jobs.job_cancel(actor=owner, job=source)
    client.force_login(owner)
    assert f'href="/tenants/acme/jobs/new/?from={source.id}#submit"' in client.get(f"/jobs/{source.id}/").content.decode()

    response = client.get(f"/tenants/acme/jobs/new/?from={source.id}")
    assert response.status_code == 200
    form = response.context["form"]
    assert {name: form[name].value() for name in (
        "name", "environment", "flavor", "replicas", "gpus_per_replica", "priority", "preemptible", "steps",
        "checkpoint_every_steps", "max_runtime_s", "max_retries", "topology_level", "topology_mode",
    )} == {
        "name": "llm-8", "environment": environment.id, "flavor": "h100-80gb", "replicas": 3, "gpus_per_replica": 2,
        "priority": 15, "preemptible": False, "steps": 70, "checkpoint_every_steps": 7, "max_runtime_s": 900,
        "max_retries": 2, "topology_level": "rack", "topology_mode": "preferred",
    }
    html = response.content.decode()
    assert 'value="llm-8"' in html and f"Clone {source.name}" in html

    # What the browser sends back is the filled form as it stands.
    data = {name: form[name].value() for name in form.fields if name != "preemptible"}
    response = client.post("/tenants/acme/jobs/new/", data)
    clone = Job.objects.get(name="llm-8")
    assert response.status_code == 302 and response["Location"] == f"/jobs/{clone.id}/"
    assert (clone.replicas, clone.gpus_per_replica, clone.priority, clone.preemptible) == (3, 2, 15, False)
    assert clone.spec["topology"] == {"level": "rack", "mode": "preferred"} and clone.spec["steps"] == 70
    assert Job.objects.get(id=source.id).state == "cancelled"


def test_a_clone_name_counts_up_within_the_length_limit():
    from frontend.job_views import clone_name

    assert clone_name("llm") == "llm-2" and clone_name("llm-2") == "llm-3" and clone_name("run-9-1") == "run-9-2"
    long = "a" * 40
    assert clone_name(long) == "a" * 38 + "-2" and len(clone_name(long)) == 40


def test_clone_of_another_tenants_job_is_404(client, owner, outsider, other_tenant, flavors, environment):
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=1, max=2)
    theirs = jobs.job_submit(actor=outsider, data=job_data(ready_environment(actor=outsider, tenant=other_tenant),
                                                           replicas=1))
    mine = jobs.job_submit(actor=owner, data=job_data(environment, replicas=1))
    client.force_login(owner)
    assert client.get(f"/tenants/acme/jobs/new/?from={theirs.id}").status_code == 404
    assert client.get(f"/tenants/globex/jobs/new/?from={theirs.id}").status_code == 404
    assert client.get("/tenants/acme/jobs/new/?from=nonsense").status_code == 404
    client.force_login(outsider)
    assert client.get(f"/tenants/globex/jobs/new/?from={mine.id}").status_code == 404
    assert client.get(f"/tenants/acme/jobs/new/?from={mine.id}").status_code == 404


def test_a_viewer_is_offered_no_clone(client, owner, viewer, environment):
    job = jobs.job_submit(actor=owner, data=job_data(environment, replicas=1))
    client.force_login(viewer)
    assert 'data-testid="clone-job"' not in client.get(f"/jobs/{job.id}/").content.decode()


# --- How long it ran and waited ------------------------------------------------------------


def test_the_job_page_and_list_say_how_long_it_ran_and_waited(client, owner, environment):
    job = jobs.job_submit(actor=owner, data=job_data(environment, name="timed", replicas=1))
    scheduling.cycle_run()
    t0 = timezone.now() - timedelta(hours=1)
    # Queued 10 s, started 5 s later, ran 55 s, preempted, queued 30 s more, ran 2 min to the end.
    Job.objects.filter(id=job.id).update(submitted_at=t0, state="succeeded", finished_at=t0 + timedelta(seconds=220))
    first = job.attempts.get()
    JobAttempt.objects.filter(id=first.id).update(
        admitted_at=t0 + timedelta(seconds=10), started_at=t0 + timedelta(seconds=15),
        ended_at=t0 + timedelta(seconds=70), outcome="preempted")
    second = JobAttempt.objects.create(job=job, number=2, placement=first.placement)
    JobAttempt.objects.filter(id=second.id).update(  # admitted_at is the row's creation time otherwise
        admitted_at=t0 + timedelta(seconds=100), started_at=t0 + timedelta(seconds=100),
        ended_at=t0 + timedelta(seconds=220), outcome="succeeded")
    client.force_login(owner)
    # Running: 55 s + 120 s (not the 30 s queued between them); waiting: 10 s before the first, 30 s between.
    for path in (f"/jobs/{job.id}/live/", "/tenants/acme/jobs/"):
        html = client.get(path).content.decode()
        assert '<span data-testid="ran-for">Ran for 2m 55s</span>' in html, path
        assert '<span class="muted" data-testid="queued-for">· queued 40s</span>' in html, path


def test_a_running_job_counts_only_its_attempts_running_not_the_wait_between(client, owner, environment):
    job = jobs.job_submit(actor=owner, data=job_data(environment, name="requeued", replicas=1))
    scheduling.cycle_run()
    now = timezone.now()
    first = job.attempts.get()
    # Ran 50 s, preempted, queued 100 s, running again for the last 20 s.
    JobAttempt.objects.filter(id=first.id).update(
        admitted_at=now - timedelta(seconds=170), started_at=now - timedelta(seconds=170),
        ended_at=now - timedelta(seconds=120), outcome="preempted")
    second = JobAttempt.objects.create(job=job, number=2, placement=first.placement)
    JobAttempt.objects.filter(id=second.id).update(admitted_at=now - timedelta(seconds=20),
                                                   started_at=now - timedelta(seconds=20))
    Job.objects.filter(id=job.id).update(submitted_at=now - timedelta(seconds=170), state="running")
    client.force_login(owner)
    html = client.get(f"/jobs/{job.id}/live/").content.decode()
    assert re.search(r'data-testid="ran-for">Running for 1m 1[0-9]s<', html), html
    assert re.search(r'data-testid="queued-for">· queued 1m 40s<', html)


def test_a_job_still_waiting_says_so(client, owner, environment):
    job = jobs.job_submit(actor=owner, data=job_data(environment, name="waiting", replicas=1))
    Job.objects.filter(id=job.id).update(submitted_at=timezone.now() - timedelta(minutes=2, seconds=5))
    client.force_login(owner)
    html = client.get(f"/jobs/{job.id}/live/").content.decode()
    assert '<span data-testid="ran-for">Not started</span>' in html
    assert re.search(r'data-testid="queued-for">· queued 2m 0[5-9]s<', html)


# --- The job list ------------------------------------------------------------------------------


def _rows(html: str, attribute: str = "data-job") -> list[str]:
    return re.findall(rf'<tr {attribute}="([^"]+)"', html)


@pytest.fixture
def many_jobs(owner, teammate, environment):
    """30 jobs of the owner (job-00 oldest), 2 of the teammate, 3 of them cancelled."""
    made = [jobs.job_submit(actor=owner, data=job_data(environment, name=f"job-{i:02d}", replicas=1))
            for i in range(30)]
    for index, job in enumerate(made):
        Job.objects.filter(id=job.id).update(submitted_at=timezone.now() - timedelta(minutes=60 - index))
    for job in made[:3]:
        jobs.job_cancel(actor=owner, job=job)
    for name in ("tom-a", "tom-b"):
        jobs.job_submit(actor=teammate, data=job_data(environment, name=name, replicas=1))
    return made


def test_the_job_list_comes_in_pages_of_25_newest_first_and_page_links_keep_the_filters(client, owner, many_jobs):
    client.force_login(owner)
    html = client.get("/tenants/acme/jobs/").content.decode()
    rows = _rows(html)
    assert len(rows) == 25 and rows[:3] == ["tom-b", "tom-a", "job-29"]
    assert 'href="?page=2"' in html and "1–25 of 32" in html
    assert _rows(client.get("/tenants/acme/jobs/?page=2").content.decode()) == [f"job-{i:02d}" for i in range(6, -1, -1)]
    # Past the end: the last page.
    assert _rows(client.get("/tenants/acme/jobs/?page=9").content.decode())[-1] == "job-00"

    html = client.get("/tenants/acme/jobs/?q=job&sort=name").content.decode()
    assert _rows(html)[:2] == ["job-00", "job-01"] and len(_rows(html)) == 25
    assert 'href="?q=job&amp;sort=name&amp;page=2"' in html
    assert _rows(client.get("/tenants/acme/jobs/?q=job&sort=name&page=2").content.decode()) == [
        f"job-{i}" for i in range(25, 30)]


def test_the_job_list_filters_by_mine_state_and_name(client, owner, teammate, many_jobs):
    client.force_login(teammate)
    assert sorted(_rows(client.get("/tenants/acme/jobs/?mine=on").content.decode())) == ["tom-a", "tom-b"]
    client.force_login(owner)
    assert len(_rows(client.get("/tenants/acme/jobs/?mine=on&page=2").content.decode())) == 5
    assert _rows(client.get("/tenants/acme/jobs/?state=cancelled").content.decode()) == ["job-02", "job-01", "job-00"]
    assert _rows(client.get("/tenants/acme/jobs/?q=TOM").content.decode()) == ["tom-b", "tom-a"]
    html = client.get("/tenants/acme/jobs/?q=nothing-like-this").content.decode()
    assert _rows(html) == [] and "No job matches these filters." in html


def test_the_job_list_sorts_by_each_column_both_ways(client, owner, many_jobs):
    client.force_login(owner)
    html = client.get("/tenants/acme/jobs/?sort=-name").content.decode()
    assert _rows(html)[:2] == ["tom-b", "tom-a"]
    # The sorted column says so, and its link turns the order round; the others start ascending.
    assert '<th scope="col" aria-sort="descending"><a class="sort-link" href="?sort=name">Job' in html
    assert 'href="?sort=state"' in html and 'href="?sort=submitted"' in html and 'href="?sort=flavor"' in html
    # Within one state, newest first.
    assert _rows(client.get("/tenants/acme/jobs/?sort=state").content.decode())[:3] == ["job-02", "job-01", "job-00"]
    assert _rows(client.get("/tenants/acme/jobs/?sort=submitted").content.decode())[0] == "job-00"
    assert _rows(client.get("/tenants/acme/jobs/?sort=-submitted").content.decode())[0] == "tom-b"
    assert client.get("/tenants/acme/jobs/?sort=flavor").status_code == 200


@pytest.mark.parametrize(("query", "name"), [("state=bogus", "state"), ("sort=secret", "sort"), ("page=0", "page"),
                                             ("page=two", "page"), ("page=%C2%B2", "page"), ("page=" + "7" * 5000, "page"),
                                             ("page=%EF%BC%92", "page"), ("page=+2", "page")])
def test_a_bad_list_parameter_is_a_400_naming_it(client, owner, many_jobs, query, name):
    client.force_login(owner)
    response = client.get(f"/tenants/acme/jobs/?{query}")
    assert response.status_code == 400
    errors = response.content.decode().split('data-testid="list-errors"', 1)[1].split("</div>", 1)[0]
    assert f"<code>{name}</code>" in errors


# --- Environments and members on the tenant page, nodes on a node pool page --------------------------


def test_environments_come_in_pages_with_search_state_and_sort(client, owner, tenant):
    from runners.environments.models import Environment, EnvironmentState

    for i in range(30):
        Environment.objects.create(tenant=tenant, name=f"env-{i:02d}", namespace=f"acme--env-{i:02d}",
                                   state=EnvironmentState.READY if i % 10 == 0 else EnvironmentState.FAILED)
    client.force_login(owner)
    html = client.get("/tenants/acme/").content.decode()
    rows = _rows(html, "id=\"environment-row-\\d+\" data-environment")
    assert len(rows) == 25 and rows[0] == "env-29"
    assert 'href="?env-page=2"' in html
    assert len(_rows(client.get("/tenants/acme/?env-page=2").content.decode(),
                     "id=\"environment-row-\\d+\" data-environment")) == 5

    def names(query):
        return _rows(client.get(f"/tenants/acme/?{query}").content.decode(), "id=\"environment-row-\\d+\" data-environment")

    assert names("env-q=env-1") == [f"env-{i}" for i in range(19, 9, -1)]
    assert names("env-state=ready&env-sort=name") == ["env-00", "env-10", "env-20"]
    assert names("env-state=ready&env-sort=-name") == ["env-20", "env-10", "env-00"]
    # Sorting one list keeps the other list's filters, and starts its own at page 1.
    html = client.get("/tenants/acme/?env-page=2&member-q=oli").content.decode()
    assert 'href="?member-q=oli&amp;env-sort=name"' in html
    response = client.get("/tenants/acme/?env-state=gone")
    assert response.status_code == 400 and "<code>env-state</code>" in response.content.decode()


@pytest.mark.parametrize("value", ["%C2%B2", "3" * 5000])
def test_a_crafted_number_for_a_list_on_the_tenant_page_is_a_400_naming_it(client, owner, tenant, value):
    client.force_login(owner)
    for name in ("env-page", "member-page"):
        response = client.get(f"/tenants/acme/?{name}={value}")
        assert response.status_code == 400, name
        assert f"<code>{name}</code>" in response.content.decode(), name
    # Leading zeros spell the number they lead (and do not count against int()'s limit on digits).
    assert client.get("/tenants/acme/?env-page=" + "0" * 5000 + "1").status_code == 200


def test_a_crafted_number_in_the_serve_form_prefill_is_ignored(client, owner, tenant):
    client.force_login(owner)
    for query in ("job=%C2%B2&step=%C2%B2", f"job={'4' * 5000}&step={'5' * 5000}"):
        assert client.get(f"/tenants/acme/endpoints/new/?{query}").status_code == 200, query


def test_environment_rows_still_update_themselves_on_a_page(client, owner, tenant):
    from runners.environments import services as environments

    environment = environments.environment_request(actor=owner, tenant=tenant, name="fresh")
    client.force_login(owner)
    html = client.get("/tenants/acme/?env-q=fre").content.decode()
    assert f'data-poll-url="/environments/{environment.id}/row/"' in html


def test_members_come_in_pages_with_search_role_and_sort(client, owner, tenant, make_user):
    from tenants.models import Membership

    for i in range(30):
        Membership.objects.create(user=make_user(f"user-{i:02d}"), tenant=tenant, role="viewer" if i % 2 else "member")
    client.force_login(owner)

    def names(query=""):
        html = client.get(f"/tenants/acme/?{query}").content.decode()
        table = html.split('data-testid="members"', 1)[1].split("</table>", 1)[0]
        return re.findall(r"<td>([a-z0-9-]+)(?: <span|</td>)", table)

    first = names()
    assert len(first) == 25 and first[:2] == ["olivia", "user-00"]
    assert names("member-page=2") == [f"user-{i}" for i in range(24, 30)]
    assert names("member-q=user-1") == [f"user-{i}" for i in range(10, 20)]
    assert names("member-role=owner") == ["olivia"]
    assert names("member-sort=-role")[0] == "olivia"  # owner ranks highest
    assert names("member-sort=role&member-q=user-0") == ["user-01", "user-03", "user-05", "user-07", "user-09",
                                                         "user-00", "user-02", "user-04", "user-06", "user-08"]
    assert client.get("/tenants/acme/?member-role=king").status_code == 400


def test_nodes_come_in_pages_with_search_state_and_sort_and_the_live_poll_keeps_them(client, staff, inventory):
    from runners.clusters.models import Node, NodePool

    pool = NodePool.objects.create(name="big", gpu_model="H100-80GB")
    for i in range(30):
        Node.objects.create(name=f"big-{i:02d}", pool=pool, cpu_milli=1000, memory_mib=1000, source="local",
                            seen_at=timezone.now(), schedulable=i % 3 != 0)
    client.force_login(staff)

    def names(query=""):
        return re.findall(r'<div class="node" data-node="([^"]+)"', client.get(f"/node-pools/{pool.id}/?{query}").content.decode())

    assert names() == [f"big-{i:02d}" for i in range(25)]
    assert names("page=2") == [f"big-{i}" for i in range(25, 30)]
    assert names("q=big-2") == [f"big-{i}" for i in range(20, 30)]
    assert names("state=cordoned&sort=-name") == [f"big-{i:02d}" for i in range(27, -1, -3)]
    assert names("state=schedulable&q=big-0") == ["big-01", "big-02", "big-04", "big-05", "big-07", "big-08"]
    assert client.get(f"/node-pools/{pool.id}/?state=melted").status_code == 400
    # The live fragment reads the same parameters, so an update in flight keeps the page as filtered.
    html = client.get(f"/node-pools/{pool.id}/live/?q=big-2&sort=-name").content.decode()
    assert re.findall(r'data-node="([^"]+)"', html)[0] == "big-29"

"""Why an attempt's pods are not made, read from its controllers' FailedCreate Events (pure, on plain dicts)."""

import pytest

from runners.backends.k8s_jobs import pods_refused

pytestmark = pytest.mark.unit

QUOTA = ("exceeded quota: gpus, requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=2, "
         "limited: requests.nvidia.com/gpu=2")


def event(message: str, *, last: str = "2026-12-05T10:00:00Z", uid: str = "job-uid", name: str = "job-7-1",
          kind: str = "Job", type_: str = "Warning", reason: str = "FailedCreate", count: int = 1) -> dict:
    return {"type": type_, "reason": reason, "message": message, "lastTimestamp": last, "count": count,
            "involvedObject": {"kind": kind, "name": name, "uid": uid}}


def test_the_newest_refusal_of_the_job_is_given_from_its_reason_on():
    events = [
        event('Error creating: pods "job-7-1-1-aaaaa" is forbidden: violates PodSecurity "restricted:latest": x',
              last="2026-12-05T09:00:00Z"),
        event(f'Error creating: pods "job-7-1-1-bbbbb" is forbidden: {QUOTA}', last="2026-12-05T10:00:00Z"),
    ]
    assert pods_refused(events, uid="job-uid") == f"Waiting for its pods: the cluster refuses to create them ({QUOTA})."


def test_the_reason_stays_the_same_while_the_refusal_does():
    first = pods_refused([event(f'Error creating: pods "job-7-1-1-aaaaa" is forbidden: {QUOTA}')], uid="job-uid")
    again = pods_refused([event(f'Error creating: pods "job-7-1-1-zzzzz" is forbidden: {QUOTA}', count=4)], uid="job-uid")
    assert first == again


def test_combined_events_read_as_their_message():
    combined = event(f'(combined from similar events): Error creating: pods "job-7-1-1-ccccc" is forbidden: {QUOTA}')
    assert pods_refused([combined], uid="job-uid").endswith(f"({QUOTA}).")


@pytest.mark.parametrize("other", [
    event("x", uid="an-older-job-of-the-same-name"),
    event("x", type_="Normal"),
    event("x", reason="SuccessfulCreate"),
])
def test_only_warnings_of_failed_creates_about_this_job_count(other):
    assert pods_refused([other], uid="job-uid") == ""


def test_a_replica_is_found_by_its_replica_sets_name():
    mine = event(f'Error creating: pods "job-9-1-5d8f-x" is forbidden: {QUOTA}', kind="ReplicaSet", name="job-9-1-5d8f")
    another = event("another's", kind="ReplicaSet", name="job-9-10-77aa", last="2026-12-05T11:00:00Z")
    assert pods_refused([mine, another], name_prefix="job-9-1-").endswith(f"({QUOTA}).")
    assert pods_refused([another], name_prefix="job-9-1-") == ""

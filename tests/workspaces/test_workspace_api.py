"""The workspaces' API without a worker: what a create checks (a 400 naming the field), who sees and drives a
workspace (everyone else a 404), and whether a start is on the guarantee or borrows."""

import pytest

from runners.jobs.models import Job
from runners.workspaces.models import Workspace, WorkspaceState
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def world(tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["t4-shared"], guaranteed=1, max=4)
    return {"environment": ready_environment(actor=owner, tenant=tenant)}


def body(world, **fields) -> dict:
    return {"tenant": "acme", "environment": world["environment"].id, "name": "nb", "flavor": "t4-shared",
            **fields}


@pytest.mark.parametrize("fields, field", [
    ({"name": "Not A Label"}, "name"),
    ({"flavor": "no-such-flavor"}, "flavor"),
    ({"environment": 999_999}, "environment"),
    ({"environment": "1"}, "environment"),
    ({"gpus": 99}, "gpus"),
    ({"gpus": True}, "gpus"),
    ({"idle_minutes": 0}, "idle_minutes"),
    ({"shared": "yes"}, "shared"),
    ({"image": "evil/image"}, "image"),
    ({"tenant": "nope"}, "tenant"),
])
def test_a_bad_field_is_a_400_that_names_it(world, client_for, owner, fields, field):
    answer = client_for(owner).post("/api/v1/workspaces/", body(world, **fields), format="json")
    assert answer.status_code == 400, answer.content
    assert field in answer.json(), answer.json()
    assert not Workspace.objects.exists()


def test_a_start_within_the_guarantee_is_not_preemptible_and_one_beyond_it_borrows(world, client_for, owner):
    api = client_for(owner)
    first = api.post("/api/v1/workspaces/", body(world, name="one"), format="json").json()
    second = api.post("/api/v1/workspaces/", body(world, name="two"), format="json").json()
    assert (first["preemptible"], second["preemptible"]) == (False, True)
    assert "borrows" in second["reason"]
    assert {job.kind for job in Job.objects.all()} == {Job.Kind.WORKSPACE}
    assert api.post("/api/v1/workspaces/", body(world, name="one"), format="json").status_code == 400  # name taken
    assert api.post(f"/api/v1/workspaces/{first['id']}/start/").status_code == 409  # it is queued already
    assert api.delete(f"/api/v1/workspaces/{first['id']}/").status_code == 409  # stop it first
    assert api.post(f"/api/v1/workspaces/{first['id']}/stop/").json()["state"] == WorkspaceState.STOPPED
    assert api.delete(f"/api/v1/workspaces/{first['id']}/").status_code == 204


def test_a_workspace_is_its_owners_its_admins_and_when_shared_its_members(
        world, client_for, owner, teammate, viewer, outsider, make_user, tenant):
    from tenants.models import Membership

    mia = make_user("mia")
    Membership.objects.create(user=mia, tenant=tenant, role="member")
    created = client_for(teammate).post("/api/v1/workspaces/", body(world, start=False), format="json")
    assert created.status_code == 201, created.content
    path = f"/api/v1/workspaces/{created.json()['id']}/"
    for user in (mia, viewer, outsider):
        assert client_for(user).get(path).status_code == 404
        assert client_for(user).post(path + "start/").status_code == 404
        assert created.json()["id"] not in [w["id"] for w in client_for(user).get("/api/v1/workspaces/").json()["results"]]
    assert client_for(owner).get(path).status_code == 200  # the tenant's owner sees and drives it
    Workspace.objects.filter(id=created.json()["id"]).update(shared=True)
    assert client_for(mia).get(path).status_code == 200
    assert client_for(mia).post(path + "start/").status_code == 403  # opening is not driving
    assert client_for(viewer).get(path).status_code == 404  # viewers do not open workspaces
    assert client_for(outsider).get(path).status_code == 404
    assert client_for(teammate).post(path + "start/").status_code == 202


def test_the_sandboxed_server_trusts_the_headers_the_portal_sends():
    import ast
    from pathlib import Path

    from runners.backends import base

    # The workload is read as text: importing it takes jupyter-server, which the portal's processes do not load.
    source = Path(base.__file__).resolve().parents[1] / "workloads" / "workspace.py"
    spelled = {node.targets[0].id: node.value.value for node in ast.parse(source.read_text()).body
               if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
               and isinstance(node.value, ast.Constant)}
    assert (spelled["KEY_HEADER"], spelled["USER_HEADER"]) == (base.WORKSPACE_KEY_HEADER, base.WORKSPACE_USER_HEADER)

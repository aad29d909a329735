"""No list the API serves is unbounded: every one is paginated, with a page size a client cannot raise
past MAX_PAGE_SIZE, or is on the short list below with what bounds it.

The lists are read from the OpenAPI schema, so a list added later is checked without being named here.
"""

import re

import pytest
from django.urls import resolve
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from common.pagination import MAX_PAGE_SIZE, PageNumberPagination
from runners.datasets.models import Dataset, DatasetVersion
from runners.notifications.models import Webhook
from tenants.models import Membership, Tenant

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

# GET operations that answer a bare array, and what bounds it. A new one fails the test below: paginate it
# (a ListModelMixin or GenericViewSet list gets the default pagination), or add it here with its bound.
UNPAGINATED = {
    "/api/v1/budget-alerts/": "the newest 200 alerts (runners/usage/api.py)",
    "/api/v1/cloud-prices/": "the first 500 prices (runners/usage/api.py)",
    "/api/v1/notification-preferences/": "one row per tenant the caller is a member of",
    "/api/v1/usage/": "aggregated: one row per group and day, over a range of at most 400 days",
    "/api/v1/usage/idle/": "one row per allocation running now",
}


def _schema() -> dict:
    return SchemaGenerator().get_schema(request=None, public=True)


def _list_operations(schema: dict) -> tuple[dict[str, dict], set[str]]:
    """(paginated GET operations by path, paths of GET operations answering a bare array)."""
    paginated, arrays = {}, set()
    for path, operations in schema["paths"].items():
        operation = operations.get("get")
        if operation is None:
            continue
        answer = operation["responses"].get("200", {}).get("content", {}).get("application/json", {}).get("schema", {})
        if answer.get("$ref", "").split("/")[-1].startswith("Paginated"):
            paginated[path] = operation
        elif answer.get("type") == "array":
            arrays.add(path)
    return paginated, arrays


@pytest.fixture
def world(inventory, make_user, tenant):
    """A user who is staff and an owner of acme (so every list is open to them), a webhook, and a dataset with a
    version (its own tenant reads an open one)."""
    root = make_user("root", is_staff=True, is_superuser=True)
    Membership.objects.create(user=root, tenant=tenant, role="owner")
    webhook = Webhook.objects.create(tenant=tenant, url="https://hooks.example.com/x", secret="s" * 32,
                                     events=["job.finished"], created_by=root)
    dataset = Dataset.objects.create(tenant=tenant, name="images")
    version = DatasetVersion.objects.create(dataset=dataset, number=1)
    client = APIClient()
    client.force_authenticate(root)
    return {"client": client, "values": {"tenant_slug": tenant.slug, "id": webhook.id, "name": dataset.name,
                                         "number": version.number}}


def _fill(path: str, values: dict) -> str:
    return re.sub(r"\{(\w+)\}", lambda match: str(values[match.group(1)]), path)


def test_every_list_is_paginated_or_bounded_by_what_it_lists():
    paginated, arrays = _list_operations(_schema())
    assert len(paginated) >= 15, sorted(paginated)
    assert arrays == set(UNPAGINATED), (
        "GET operations answering an unpaginated array changed; paginate a new one, or say what bounds it "
        f"in UNPAGINATED: {sorted(arrays ^ set(UNPAGINATED))}"
    )


def test_every_paginated_list_documents_a_bounded_page_size():
    paginated, _ = _list_operations(_schema())
    for path, operation in paginated.items():
        parameters = {p["name"]: p for p in operation.get("parameters", []) if p["in"] == "query"}
        assert parameters["page"]["schema"] == {"type": "integer", "minimum": 1}, path
        assert parameters["page_size"]["schema"] == {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE}, path


def test_every_paginated_list_refuses_a_page_size_over_the_maximum(world):
    paginated, _ = _list_operations(_schema())
    client = world["client"]
    for path in paginated:
        url = _fill(path, world["values"])
        view = resolve(url).func
        pagination = getattr(getattr(view, "cls", None), "pagination_class", None)
        assert pagination is not None and issubclass(pagination, PageNumberPagination), path
        assert pagination.max_page_size == MAX_PAGE_SIZE, path
        assert client.get(url, {"page_size": MAX_PAGE_SIZE}).status_code == 200, path
        for refused in (MAX_PAGE_SIZE + 1, 0, "ten", "", 10**30):
            response = client.get(url, {"page_size": refused})
            assert response.status_code == 400, (path, refused, response.content[:300])
            assert list(response.json()) == ["page_size"], (path, refused)


def test_a_page_holds_the_default_size_and_page_size_asks_for_more_up_to_the_maximum(world, settings):
    Tenant.objects.bulk_create(Tenant(slug=f"t{n:03d}", name=f"Tenant {n}") for n in range(MAX_PAGE_SIZE + 10))
    client = world["client"]
    total = Tenant.objects.count()
    default = settings.REST_FRAMEWORK["PAGE_SIZE"]
    assert total > MAX_PAGE_SIZE > default

    first = client.get("/api/v1/tenants/").json()
    assert first["count"] == total and len(first["results"]) == default
    assert len(client.get("/api/v1/tenants/", {"page_size": 7}).json()["results"]) == 7
    largest = client.get("/api/v1/tenants/", {"page_size": MAX_PAGE_SIZE}).json()
    assert len(largest["results"]) == MAX_PAGE_SIZE and "page_size=200" in largest["next"]
    # The last of repeated parameters wins, as with page.
    assert len(client.get("/api/v1/tenants/?page_size=500&page_size=3").json()["results"]) == 3
    assert client.get("/api/v1/tenants/?page_size=3&page_size=500").status_code == 400

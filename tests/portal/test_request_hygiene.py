"""No request, signed in or not, gets a 500: control characters and hostile bodies are refused first.

Every route the portal serves (the API, the pages, the admin's login) is tried
with a NUL in each place a client controls: a path segment, a query value, a
header (Authorization, Cookie, X-Forwarded-For), a JSON string, and with a body
nested far deeper than any request needs. On PostgreSQL a NUL that reaches a
query is a DataError, so these run on PostgreSQL only.
"""

import json
import re
from urllib.parse import quote

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from quotas.models import Quota
from runners.clusters.models import NodePool, PartitionProfile
from runners.environments.models import Environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

DEEP = "[" * 1000 + "]" * 1000


def _walk(patterns, prefix=""):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern.url_patterns, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            yield prefix + str(pattern.pattern)


def _routes() -> list[str]:
    """Every route as a template with {name} holes, admin pages beyond its login left out."""
    routes = set()
    for raw in _walk(get_resolver().url_patterns):
        if raw.startswith("admin/") and raw not in ("admin/login/", "admin/"):
            continue
        route = raw.replace("^", "").replace("$", "").replace("\\Z", "").replace("\\.", ".").replace("/?", "/")
        route = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", route)
        route = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)
        if "{format}" in route:
            continue  # DRF's format suffixes: the same views again
        routes.add("/" + route)
    return sorted(routes)


@pytest.fixture
def objects(inventory, tenant, owner, flavor_factory):
    flavor = flavor_factory()
    environment = Environment.objects.create(tenant=tenant, name="train", namespace="acme--train", backend="local",
                                             state="ready")
    quota = Quota.objects.create(tenant=tenant, flavor=flavor, guaranteed=1, max=2)
    profile = PartitionProfile.objects.create(name="h100-half", gpu_model="H100-80GB", kind="mig", layout=["3g.40gb"])
    pool = NodePool.objects.first()
    values = {
        "pk": environment.id, "environment_id": environment.id, "quota_id": quota.id, "pool_id": pool.id,
        "slug": tenant.slug, "tenant_slug": tenant.slug, "name": flavor.name, "username": owner.username,
    }
    # Routes whose pk is not an environment's.
    pks = {"quotas": quota.id, "partition-profiles": profile.id, "node-pools": pool.id,
           "nodes": pool.nodes.first().id}
    return values, pks


def _fill(route: str, values: dict, pks: dict, poison: str | None = None) -> str:
    """The route with real values in its holes; the first hole (or the last segment) poisoned when asked."""
    holes = re.findall(r"{(\w+)}", route)
    path = route
    for index, hole in enumerate(holes):
        value = str(values.get(hole, "1"))
        if hole == "pk":
            collection = route.split("/{pk}")[0].rsplit("/", 1)[-1]
            value = str(pks.get(collection, values["pk"]))
        if poison is not None and index == 0:
            value += quote(poison)
        path = path.replace("{" + hole + "}", value, 1)
    if poison is not None and not holes:
        path = path.rstrip("/") + quote(poison) + "/"
    return path


@pytest.fixture(params=["anonymous", "member", "staff"])
def caller(request, owner, staff, client_for):
    if request.param == "anonymous":
        return APIClient()
    return client_for(owner if request.param == "member" else staff)


def _assert_no_500(response, what: str):
    assert response.status_code < 500, f"{what} answered {response.status_code}: {response.content[:300]!r}"


def test_the_route_list_covers_the_api_and_the_pages():
    routes = _routes()
    for expected in ("/api/v1/tenants/{slug}/", "/api/v1/environments/{pk}/", "/tenants/{slug}/quota/",
                     "/api/v1/auth/token/", "/login/", "/admin/login/", "/api/v1/node-pools/{pk}/apply/"):
        assert expected in routes
    assert len(routes) > 40


@pytest.mark.parametrize("poison", ["\x00", "\x01", "\x1b", "\n"])
def test_a_control_character_in_a_path_segment_is_never_a_500(objects, caller, poison):
    values, pks = objects
    for route in _routes():
        path = _fill(route, values, pks, poison=poison)
        for method in ("get", "post", "patch", "delete"):
            _assert_no_500(getattr(caller, method)(path), f"{method.upper()} {path!r}")


def test_a_nul_in_a_query_value_or_name_is_a_400_on_every_route(objects, caller):
    values, pks = objects
    for route in _routes():
        path = _fill(route, values, pks)
        for query in ("?tenant=%00", "?state=a%00b&page=1", "?page=%00", "?x%00y=1", "?search=%01"):
            response = caller.get(path + query)
            assert response.status_code == 400, f"GET {path + query!r} answered {response.status_code}"


@pytest.mark.parametrize(
    ("header", "value", "status"),
    [
        ("HTTP_AUTHORIZATION", "Token abc\x00def", 401),
        ("HTTP_AUTHORIZATION", "Bearer \x07", 401),
        ("HTTP_COOKIE", "sessionid=abc\x00def", 400),
        ("HTTP_X_FORWARDED_FOR", "10.0.0.1\x00", 400),
        ("HTTP_USER_AGENT", "probe\x00", 400),
    ],
)
def test_a_control_character_in_a_header_is_refused_on_every_route(objects, header, value, status):
    values, pks = objects
    client = APIClient()
    for route in _routes():
        path = _fill(route, values, pks)
        response = client.generic("GET", path, **{header: value})
        assert response.status_code == status, f"GET {path} with {header} answered {response.status_code}"
        if path.startswith("/api/"):
            assert header.removeprefix("HTTP_").split("_")[0].lower() in response.json()["detail"].lower()


def test_a_nul_in_the_token_header_is_a_401_that_names_the_header(db):
    response = APIClient().get("/api/v1/tenants/", HTTP_AUTHORIZATION="Token abc\x00def")
    assert response.status_code == 401
    assert response.json() == {"detail": "The Authorization header holds a NUL character."}


def test_a_nul_in_the_tenant_slug_is_refused_before_any_query(client_for, owner, tenant, django_assert_max_num_queries):
    client = client_for(owner)
    with django_assert_max_num_queries(0):
        response = client.get("/api/v1/tenants/ml%00research/")
    assert response.status_code == 400
    assert "NUL" in response.json()["detail"]


def test_the_tenant_route_takes_only_slugs(client_for, owner, tenant):
    assert client_for(owner).get("/api/v1/tenants/ACME!/").status_code == 404
    assert client_for(owner).get("/api/v1/tenants/acme/").status_code == 200


BODIES = {
    "nul": {"tenant": "acme\x00", "name": "x\x00", "username": "olivia\x00", "password": "p\x00", "role": "viewer\x00",
            "flavor": "h100\x00", "profile": "p\x00", "slug": "s\x00", "layout": ["1g\x00"], "gpu_model": "H100\x00"},
    "nul-key": {"tenant\x00": "acme"},
    "surrogate": {"tenant": "\ud800", "name": "\udfff", "username": "\ud83d"},
    "nested-nul": {"env": {"A": ["ok", {"deep": "x\x00"}]}},
}


@pytest.mark.parametrize("body", list(BODIES))
def test_a_bad_string_anywhere_in_a_json_body_is_a_400_naming_where(objects, caller, body):
    values, pks = objects
    raw = json.dumps(BODIES[body])  # json escapes NUL as \u0000 and surrogates as \udXXX
    for route in _routes():
        if not route.startswith("/api/v1/"):
            continue
        path = _fill(route, values, pks)
        for method in ("post", "patch"):
            response = getattr(caller, method)(path, raw, content_type="application/json")
            _assert_no_500(response, f"{method.upper()} {path} with a {body} body")
            if response.status_code == 400:
                text = json.dumps(response.json())
                assert "Null characters" in text or "Surrogate characters" in text or "detail" in text


def test_the_nul_error_names_the_nested_field(client_for, owner, tenant):
    response = client_for(owner).post("/api/v1/environments/", json.dumps(BODIES["nested-nul"]),
                                      content_type="application/json")
    assert response.status_code == 400
    assert response.json() == {"env.A.1.deep": ["Null characters are not allowed."]}


def test_an_over_deep_body_is_a_400_on_every_route(objects, caller):
    values, pks = objects
    for route in _routes():
        if not route.startswith("/api/"):
            continue
        path = _fill(route, values, pks)
        for method in ("post", "patch"):
            response = getattr(caller, method)(path, DEEP, content_type="application/json")
            _assert_no_500(response, f"{method.upper()} {path} with 1,000 nested lists")


def test_the_token_endpoint_refuses_deep_nesting_with_a_400_that_says_so(db):
    response = APIClient().post("/api/v1/auth/token/", DEEP, content_type="application/json")
    assert response.status_code == 400
    assert "nests 1000 levels deep" in response.json()["detail"]
    nested_in_strings = json.dumps({"username": "[" * 100, "password": "{" * 250})
    response = APIClient().post("/api/v1/auth/token/", nested_in_strings, content_type="application/json")
    assert response.status_code == 401, "brackets inside strings are text, not nesting"


def test_an_oversized_body_is_a_400(db, settings):
    settings.API_MAX_BODY_BYTES = 2048
    body = json.dumps({"username": "x" * 4096, "password": "y"})
    response = APIClient().post("/api/v1/auth/token/", body, content_type="application/json")
    assert response.status_code == 400
    assert "larger than 2048 bytes" in response.json()["detail"]


def test_the_api_takes_json_only(client_for, owner, tenant):
    response = client_for(owner).post("/api/v1/environments/", "tenant=acme&name=train",
                                      content_type="application/x-www-form-urlencoded")
    assert response.status_code == 415
    assert not Environment.objects.exists()


def test_a_huge_id_is_a_404_not_a_500(client_for, client, owner, tenant):
    assert client_for(owner).get("/api/v1/environments/99999999999999999999999/").status_code == 404
    client.force_login(owner)
    assert client.get("/environments/99999999999999999999999/").status_code == 404


@pytest.mark.parametrize("who", ["member", "staff"])
def test_a_control_character_in_any_page_form_field_is_never_a_500(objects, owner, staff, who):
    from django.test import Client

    values, pks = objects
    client = Client()
    client.force_login(owner if who == "member" else staff)
    fields = ["name", "username", "role", "tenant", "flavor", "guaranteed", "max", "fair_share_weight", "max_priority",
              "gpu_model", "kind", "layout", "replicas", "profile", "drain", "password", "confirm"]
    for route in _routes():
        if route.startswith("/api/"):
            continue
        path = _fill(route, values, pks)
        # NUL, BEL, and the UTF-8 bytes of a lone surrogate (which no decoder should let through).
        for poison in ("%00", "%07", "%ED%A0%80"):
            body = "&".join(f"{field}=x{poison}y" for field in fields)
            response = client.post(path, body, content_type="application/x-www-form-urlencoded")
            _assert_no_500(response, f"POST {path} with {poison} in every field")


# --- Body size: every request, not only the API's JSON ------------------------------------------------


@pytest.mark.parametrize("path", ["/api/v1/auth/token/", "/api/v1/environments/"])
def test_a_body_over_the_limit_is_a_json_413_under_the_api_before_it_is_read(db, settings, path):
    from django.test import Client

    small = b'{"username": "x"}'
    # The body says it is a gigabyte and holds 17 bytes: reading it would fail the test client ("Cannot read
    # more than the available bytes"), so a 413 means nothing read it.
    response = Client().post(path, small, content_type="application/json", CONTENT_LENGTH=str(10**9))
    assert response.status_code == 413
    assert response.json() == {"detail": f"The body is larger than {settings.REQUEST_MAX_BODY_BYTES} bytes."}
    assert response["X-Request-ID"]


@pytest.mark.parametrize("path", ["/login/", "/admin/login/", "/tenants/acme/environments/new/"])
def test_a_body_over_the_limit_is_a_short_413_page_elsewhere(db, settings, path):
    from django.test import Client

    body = "a=" + "x" * settings.REQUEST_MAX_BODY_BYTES
    response = Client().post(path, body, content_type="application/x-www-form-urlencoded")
    assert response.status_code == 413
    assert response["Content-Type"].startswith("text/plain")
    assert response.content.decode() == f"The body is larger than {settings.REQUEST_MAX_BODY_BYTES} bytes."


def test_a_body_at_the_limit_goes_through_and_the_api_keeps_its_own_bound(db, settings):
    from django.test import Client

    assert settings.DATA_UPLOAD_MAX_MEMORY_SIZE == settings.REQUEST_MAX_BODY_BYTES >= settings.API_MAX_BODY_BYTES
    padding = "x" * (settings.REQUEST_MAX_BODY_BYTES - len('{"username": "", "password": "y"}'))
    body = json.dumps({"username": padding, "password": "y"})
    assert len(body) == settings.REQUEST_MAX_BODY_BYTES
    response = Client().post("/api/v1/auth/token/", body, content_type="application/json")
    assert response.status_code == 400 and list(response.json()) == ["username"], "read, and the field judged"

    # A deployment may let pages take more than the API: the API's parser still refuses past its own bound.
    settings.REQUEST_MAX_BODY_BYTES = settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4 * settings.API_MAX_BODY_BYTES
    body = json.dumps({"username": "x" * (2 * settings.API_MAX_BODY_BYTES), "password": "y"})
    response = Client().post("/api/v1/auth/token/", body, content_type="application/json")
    assert response.status_code == 400
    assert response.json() == {"detail": f"The body is larger than {settings.API_MAX_BODY_BYTES} bytes."}


def test_a_form_with_more_fields_than_allowed_is_a_400(db, settings):
    from django.test import Client

    body = "&".join(f"f{n}=1" for n in range(settings.DATA_UPLOAD_MAX_NUMBER_FIELDS + 1))
    response = Client().post("/login/", body, content_type="application/x-www-form-urlencoded")
    assert response.status_code == 400

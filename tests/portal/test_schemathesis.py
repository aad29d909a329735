"""The API answers as its OpenAPI schema says: every operation, fuzzed with schemathesis.

The schema is loaded from the app in-process (WSGI, ``/api/schema/``), and every
operation is fuzzed twice: as a signed-in member of a tenant that has an environment,
a quota and the demo inventory, and as staff, each with a real knox token, on
PostgreSQL. Each example goes through the whole Django stack and is judged by the
checks below; any server error or schema violation fails the test of that
operation (``test_api_conforms_to_its_schema_as_member[METHOD /path][member]``, ``..._as_staff[...][staff]``).

It is bounded to stay quick and reproducible: a fixed seed, Hypothesis derandomized
and without its example database, ``MAX_EXAMPLES`` fuzzed examples per operation
and persona, plus schemathesis' deterministic coverage
cases (boundaries, missing and wrong-typed values), which run once per operation, as
staff. The input checks are the same whoever calls, and staff may call every
operation, so staff's run reaches each of them; the member's run is there for what
differs for a member (staff's operations refused before any input is read, objects of
other tenants out of sight). Most of the file's CPU is Hypothesis drawing examples
(filtered draws above all), not the requests. Rerun one operation with
``-k``, e.g.
``make test PYTEST_ARGS='tests/portal/test_schemathesis.py -k "node-pools and staff"'``.
"""

import collections
import os
import re

import pytest
import schemathesis
from django.core import signals
from django.db import close_old_connections
from django.utils import timezone
from hypothesis import HealthCheck, settings
from rest_framework import fields as drf_fields
from rest_framework import serializers as drf_serializers
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    content_type_conformance,
    ensure_resource_availability,
    ignored_auth,
    missing_required_header,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
    use_after_free,
)

from portal.wsgi import application

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("SCHEMATHESIS_SEED", "20260101"))
# The short form `make test` runs; the long form is the same test with more examples and another seed:
#   SCHEMATHESIS_MAX_EXAMPLES=500 SCHEMATHESIS_SEED=7 make test PYTEST_ARGS=tests/portal/test_schemathesis.py
MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "25"))
TOKEN_REVOKE = "DELETE /api/v1/auth/token/"

# The coverage phase (every field's boundaries, missing, null and wrong-typed values, deterministic) runs in
# `make test`; the fast tier's loop (`make test-fast`) leaves it out and only fuzzes.
COVERAGE = os.environ.get("SCHEMATHESIS_COVERAGE", "1") != "0"


def _config(coverage: bool) -> schemathesis.Config:
    return schemathesis.Config.from_dict(
        {
            "seed": SEED,
            # Valid and invalid input both: invalid input must be refused with a documented 4xx.
            "generation": {"mode": "all"},
            "phases": {"coverage": {"enabled": coverage}},
        }
    )


# The endpoints' /serve/ routes are in the schema for API clients, but the edge answers them (runners/edge/), not
# this WSGI app: their input checks are tested through a real edge process (tests/edge/).
SCHEMA_PATH = "/api/schema/"
schema = schemathesis.openapi.from_wsgi(SCHEMA_PATH, application, config=_config(COVERAGE)).exclude(path_regex="^/serve/")
# The member's: the same schema document, fuzzed without the coverage phase (see the module's docstring).
member_schema = schemathesis.openapi.from_dict(schema.raw_schema, config=_config(False)).exclude(path_regex="^/serve/")
member_schema.app, member_schema.location = application, SCHEMA_PATH


# --- A check of our own -------------------------------------------------------
#
# schemathesis' positive_data_acceptance expects every schema-valid request to be
# accepted; here a valid request that names a tenant, flavor or profile that does
# not exist is rightly a 400 ("Object with slug=... does not exist."), and the
# schema cannot list which objects exist. So that check is replaced by a narrower
# one: a schema-valid request must never be refused for a reason the schema does
# state (required, null, blank, type, length, choice), which is how a schema that
# lies about a field shows.


def _message_re(template: str) -> re.Pattern:
    parts = re.split(r"\{[a-z_]+\}", str(template))
    return re.compile(".+".join(re.escape(part) for part in parts) + r"\Z", re.DOTALL)


_SCHEMA_STATED = [
    _message_re(message)
    for field_class, keys in [
        (drf_fields.Field, ["required", "null"]),
        (drf_fields.CharField, ["blank", "invalid", "max_length", "min_length"]),
        (drf_fields.ChoiceField, ["invalid_choice"]),
        (drf_fields.ListField, ["not_a_list", "empty", "max_length", "min_length"]),
        (drf_fields.IntegerField, ["invalid"]),
        (drf_fields.DateTimeField, ["invalid"]),
        (drf_serializers.Serializer, ["invalid"]),
    ]
    for key in keys
    for message in [field_class.default_error_messages[key]]
]
# A number's range is stated (minimum, maximum); a decimal sent as a string has only a pattern,
# which cannot say "at least 0.01", so a range refusal counts only when the value was a JSON number.
_RANGE = [_message_re(drf_fields.IntegerField.default_error_messages[key]) for key in ("max_value", "min_value")]


def _messages(body):
    if isinstance(body, str):
        yield body
    elif isinstance(body, list):
        for item in body:
            yield from _messages(item)
    elif isinstance(body, dict):
        for item in body.values():
            yield from _messages(item)


def _stated(field: str, message: str, sent) -> bool:
    if any(pattern.match(message) for pattern in _SCHEMA_STATED):
        return True
    value = sent.get(field) if isinstance(sent, dict) else None
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return is_number and any(pattern.match(message) for pattern in _RANGE)


def schema_valid_input_refused_for_a_stated_reason(ctx, response, case):
    """A valid request refused as blank, missing, null, mistyped, too long, out of range or not a choice."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 400:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None  # Not the documented shape: response_schema_conformance says so.
    sent = case.body if isinstance(case.body, dict) else {}
    stated = sorted(
        {f"{field}: {m}" for field, errors in body.items() for m in _messages(errors) if _stated(field, m, sent)}
    )
    if stated:
        raise AssertionError(f"A schema-valid request was refused for a reason the schema states: {stated}; {body}")
    return None


CHECKS = [
    # Server errors and the schema's truth about status codes, content types, bodies and headers.
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    # Invalid input is refused; valid input is not refused for a reason the schema states.
    negative_data_rejection,
    schema_valid_input_refused_for_a_stated_reason,
    # Authentication is enforced where the schema requires it.
    ignored_auth,
    missing_required_header,
    # Undocumented methods get a 405 with an Allow header.
    unsupported_method,
    allow_header_conformance,
    # Stateful checks: they only act on linked sequences of calls, kept for completeness.
    use_after_free,
    ensure_resource_availability,
]


# --- The world it runs in -------------------------------------------------------


@pytest.fixture
def fast_passwords(settings):
    """The personas sign in with tokens only; hashing their passwords slowly would double the run."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def world(fast_passwords, db, tenant, owner, staff, inventory, flavor_factory):
    """One tenant with a member, an environment and a quota; staff; the demo inventory and its extras."""
    from quotas.models import PriceCard, Quota
    from runners.clusters.models import Node, NodePool, PartitionChange, PartitionProfile
    from runners.environments.models import Environment

    flavor = flavor_factory()
    PriceCard.objects.create(flavor=flavor, price_per_hour="4.2", effective_from="2026-01-01T00:00Z")
    Quota.objects.create(tenant=tenant, flavor=flavor, guaranteed=2, max=4)
    Environment.objects.create(tenant=tenant, name="train", namespace="acme-train", backend="local", created_by=owner)
    # Whoever created this one has left: created_by is null.
    Environment.objects.create(tenant=tenant, name="old", namespace="acme-old", backend="local", state="ready")
    # A node in no pool, and a pool with a partition change behind it (staff see it as latest_change).
    Node.objects.create(name="loose-node", pool=None, cpu_milli=1000, memory_mib=1024, source="local",
                        seen_at=timezone.now())
    profile = PartitionProfile.objects.create(name="t4-share-2", gpu_model="T4", kind="timeslice", replicas=2)
    PartitionChange.objects.create(pool=NodePool.objects.order_by("name").first(), profile=profile,
                                   state="succeeded", finished_at=timezone.now())
    return {"member": owner, "staff": staff}


@pytest.fixture
def in_process_wsgi():
    """Keep the test's database connection across requests, as Django's test client does."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


_EXAMPLES: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if _EXAMPLES and reporter is not None and capture is not None:
        per_persona = collections.Counter()
        for (_label, name), count in _EXAMPLES.items():
            per_persona[name] += count
        operations = len({label for label, _name in _EXAMPLES})
        _EXAMPLES.clear()
        with capture.global_and_fixture_disabled():
            personas = ", ".join(f"{name} {count}" for name, count in sorted(per_persona.items()))
            reporter.write_line(
                f"\nschemathesis {schemathesis.__version__}: {operations} operations, "
                f"{sum(per_persona.values())} requests ({personas})"
            )


def _token(user) -> str:
    from knox.models import AuthToken

    return AuthToken.objects.create(user)[1]


def _persona(request, world):
    user = world[request.param]
    return request.param, user, _token(user)


# Each a fixture with one parameter: its name ends every test's id (``[METHOD /path][member]``), which keeps the
# ids unique, as pytest-xdist needs (schemathesis names an operation's test by its label only when the test is
# parametrized).
@pytest.fixture(params=["member"])
def member(request, world, in_process_wsgi):
    return _persona(request, world)


@pytest.fixture(params=["staff"])
def staff_persona(request, world, in_process_wsgi):
    return _persona(request, world)


def _fuzz_settings(max_examples: int):
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
    )


def _call(case, persona) -> None:
    name, user, token = persona
    if case.operation.label == TOKEN_REVOKE:
        # Revoking deletes the token it is sent with: each example revokes a token of its own,
        # so the persona's other requests keep theirs.
        token = _token(user)
    _EXAMPLES[(case.operation.label, name)] += 1
    case.call_and_validate(headers={"Authorization": f"Token {token}"}, checks=CHECKS)


@member_schema.parametrize()
@_fuzz_settings(MAX_EXAMPLES)
def test_api_conforms_to_its_schema_as_member(case, member):
    _call(case, member)


@schema.parametrize()
@_fuzz_settings(MAX_EXAMPLES)
def test_api_conforms_to_its_schema_as_staff(case, staff_persona):
    _call(case, staff_persona)


# --- What the fuzzing relies on, stated once ---------------------------------------


def _operations():
    for path, item in schema.raw_schema["paths"].items():
        for method, operation in item.items():
            if method in {"get", "post", "put", "patch", "delete"}:
                yield f"{method.upper()} {path}", operation


def test_every_operation_documents_its_error_answers():
    for label, operation in _operations():
        codes = set(operation["responses"])
        assert {"400", "401"} <= codes, label
        parameters = operation.get("parameters", [])
        if any(p["in"] == "path" for p in parameters) or any(p["name"] == "page" for p in parameters):
            assert "404" in codes, label
        if operation.get("security") and {} not in operation["security"]:
            assert "403" in codes, label
        if "requestBody" in operation:
            assert "415" in codes, label
    assert "429" in schema.raw_schema["paths"]["/api/v1/auth/token/"]["post"]["responses"]


def test_read_only_relations_over_nullable_keys_say_null():
    """A read-only relation whose foreign key may be null must be allow_null, or the schema says string."""
    from rest_framework.relations import RelatedField

    from portal.api import router

    missing = []
    for _prefix, viewset, _basename in router.registry:
        serializer = viewset.serializer_class()
        for name, field in serializer.fields.items():
            if not (isinstance(field, RelatedField) and field.read_only):
                continue
            model_field = serializer.Meta.model._meta.get_field(field.source)
            if model_field.null and not field.allow_null:
                missing.append(f"{type(serializer).__name__}.{name}")
    assert missing == []


@pytest.mark.parametrize(
    ("query", "status"),
    [("", 200), ("?page=1", 200), ("?page=01", 200), ("?page=", 400), ("?page=0", 400), ("?page=-1", 400),
     ("?page=x", 400), ("?page=1.0", 400), ("?page=last", 400), ("?page=2", 404), ("?page=" + "9" * 5000, 404)],
)
def test_page_is_a_positive_integer_and_past_the_end_is_a_404(client_for, owner, query, status):
    response = client_for(owner).get(f"/api/v1/tenants/{query}")
    assert response.status_code == status, response.content
    if status == 400:
        assert list(response.json()) == ["page"]


@pytest.mark.parametrize("value", [" ", "\t\n", "\u00a0", "\u3000 "])
def test_a_name_that_trims_to_nothing_is_refused_as_the_schema_says(client_for, staff, value):
    name = schema.raw_schema["components"]["schemas"]["TenantCreateRequest"]["properties"]["name"]
    pattern = re.compile(name["pattern"])
    assert pattern.search(value) is None
    response = client_for(staff).post("/api/v1/tenants/", {"slug": "blank", "name": value}, format="json")
    assert response.status_code == 400 and "name" in response.json()


@pytest.mark.parametrize(
    ("body", "field"),
    [({"slug": "numbers", "name": 7}, "name"), ({"slug": 7, "name": "Seven"}, "slug")],
)
def test_a_string_field_takes_only_a_json_string(client_for, staff, body, field):
    response = client_for(staff).post("/api/v1/tenants/", body, format="json")
    assert response.status_code == 400 and response.json()[field] == ["Not a valid string."]

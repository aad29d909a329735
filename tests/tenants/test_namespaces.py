"""Namespaces are unique by construction across tenants, and errors speak only of the caller's tenant."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runners.environments.models import Environment
from tenants.models import DNS_LABEL_RE, NAMESPACE_MAX, Membership, Tenant, environment_namespace

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

label = st.from_regex(DNS_LABEL_RE, fullmatch=True).filter(lambda s: len(s) <= 32)


@given(label, label, label, label)
def test_two_different_tenant_and_name_pairs_never_share_a_namespace(slug_a, name_a, slug_b, name_b):
    if (slug_a, name_a) != (slug_b, name_b):
        assert environment_namespace(slug_a, name_a) != environment_namespace(slug_b, name_b)


@given(label, label)
def test_a_namespace_is_a_dns_1123_label(slug, name):
    import re

    namespace = environment_namespace(slug, name)
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", namespace)


def test_every_split_of_a_hyphenated_string_gets_its_own_namespace():
    parts = ["ml", "research", "train"]
    pairs = {("-".join(parts[:i]), "-".join(parts[i:])) for i in range(1, len(parts))}
    assert len({environment_namespace(*pair) for pair in pairs}) == len(pairs)


@pytest.fixture
def squatting(make_user):
    """Tenant 'ml' (owned by mallory) and tenant 'ml-research' (owned by rita)."""
    ml = Tenant.objects.create(slug="ml", name="ML")
    research = Tenant.objects.create(slug="ml-research", name="ML Research")
    mallory, rita = make_user("mallory"), make_user("rita")
    Membership.objects.create(tenant=ml, user=mallory, role="owner")
    Membership.objects.create(tenant=research, user=rita, role="owner")
    return mallory, rita


def test_a_tenant_cannot_squat_another_tenants_future_namespace(client_for, squatting):
    mallory, rita = squatting
    squat = client_for(mallory).post("/api/v1/environments/", {"tenant": "ml", "name": "research-train"})
    assert squat.status_code == 201
    real = client_for(rita).post("/api/v1/environments/", {"tenant": "ml-research", "name": "train"})
    assert real.status_code == 201, real.content
    assert squat.json()["namespace"] != real.json()["namespace"]
    assert {squat.json()["namespace"], real.json()["namespace"]} == {"ml--research-train", "ml-research--train"}


@pytest.mark.parametrize("field", ["slug", "name"])
def test_double_hyphens_are_refused_so_the_separator_stays_unambiguous(client_for, staff, owner, tenant, field):
    if field == "slug":
        response = client_for(staff).post("/api/v1/tenants/", {"slug": "ml--research", "name": "x"})
    else:
        response = client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "a--b"})
    assert response.status_code == 400
    assert field in response.json()


def test_an_error_about_a_taken_namespace_never_names_another_tenant(client_for, squatting):
    mallory, rita = squatting
    # An environment from before namespaces were built this way holds what rita's would get.
    ml = Tenant.objects.get(slug="ml")
    Environment.objects.create(tenant=ml, name="old", namespace="ml-research--train", backend="local", state="ready")
    response = client_for(rita).post("/api/v1/environments/", {"tenant": "ml-research", "name": "train"})
    assert response.status_code == 400
    text = str(response.json())
    assert "ml-research" in text and "pick another" in text
    for leak in ("'ml'", "ml--", "namespace", "taken", "old"):
        assert leak not in text, f"the error reveals {leak!r}"


def test_the_longest_names_still_fit_in_63_characters(client_for, staff, make_user):
    slug = "t" * 30
    tenant = Tenant.objects.create(slug=slug, name="Long")
    user = make_user("lena")
    Membership.objects.create(tenant=tenant, user=user, role="owner")
    ok = client_for(user).post("/api/v1/environments/", {"tenant": slug, "name": "n" * (NAMESPACE_MAX - 32)})
    assert ok.status_code == 201 and len(ok.json()["namespace"]) == NAMESPACE_MAX
    too_long = client_for(user).post("/api/v1/environments/", {"tenant": slug, "name": "m" * 32})
    assert too_long.status_code == 400
    assert "at most 31" in too_long.json()["name"][0]


def test_separator_and_limits_agree_for_every_length():
    for slug_len, name_len in itertools.product(range(1, 31), range(1, 33)):
        namespace = environment_namespace("a" * slug_len, "b" * name_len)
        assert (len(namespace) <= NAMESPACE_MAX) == (slug_len + name_len <= NAMESPACE_MAX - 2)

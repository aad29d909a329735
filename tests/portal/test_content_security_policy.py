"""Every answer carries the Content-Security-Policy, and no template has a script the policy would refuse."""

import re

import pytest
from django.conf import settings

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.mark.parametrize("path", ["/login/", "/api/v1/flavors/", "/api/docs/", "/healthz"])
def test_pages_api_and_probes_carry_the_policy(client, path):
    response = client.get(path)
    policy = response["Content-Security-Policy"]
    assert policy == settings.CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in policy and "'unsafe-inline'" not in policy.split("script-src")[1].split(";")[0]


def test_an_empty_setting_turns_the_header_off(client, settings):
    from django.test import override_settings

    with override_settings(CONTENT_SECURITY_POLICY=""):
        # The middleware reads the setting once; a fresh handler is a fresh middleware.
        from django.test import Client

        assert "Content-Security-Policy" not in Client().get("/login/")


def test_no_template_has_an_inline_script_or_a_handler_attribute():
    offending = []
    for path in sorted((REPO / "frontend" / "templates").rglob("*.html")):
        text = path.read_text()
        for match in re.finditer(r"<script\b([^>]*)>", text):
            if "src=" not in match.group(1) and 'type="application/json"' not in match.group(1):
                offending.append(f"{path.relative_to(REPO)}: {match.group(0)}")
        offending += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in re.finditer(r"\son[a-z]+\s*=\s*[\"']", text)]
    assert offending == [], "\n".join(offending)

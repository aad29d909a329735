"""The README: short, the two commands, and links that lead somewhere."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_the_readme_is_what_a_newcomer_reads_and_no_more():
    assert len(README.splitlines()) < 200
    for command in ("make run", "make test", "make test-fast"):
        assert f"\n{command}" in README, f"the README does not give `{command}` in a code block"
    assert "portal-demo" in README


def test_every_link_of_the_readme_into_the_repository_names_a_file_and_an_anchor_it_has():
    links = re.findall(r"\]\(((?!https?://)[^)#]+)(?:#([^)]+))?\)", README)
    assert any(path.startswith("docs/") for path, _ in links)
    for path, anchor in links:
        target = REPO / path
        assert target.exists(), f"README links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-") for heading in headings}
            assert anchor in slugs, f"README links to {path}#{anchor}, which has no such heading"

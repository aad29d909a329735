"""docs/: it builds strictly (a broken link or anchor fails), reads offline, and says what the code does."""

import re
import time
from pathlib import Path

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config

from runners.jobs import services as jobs

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
# Where the portal reads its environment variables, and how.
SETTINGS_FILES = ["portal/settings.py", "portal/gunicorn_conf.py"]
READS = re.compile(r"\benv_[a-z]+\(\s*\"([A-Z][A-Z0-9_]+)\"")
# Files whose variables the configuration page may also name (the inference server's, embedded servers', make's, the
# garbage collector's).
OTHER_READERS = ["runners/workloads/serve.py", "portal/embedded.py", "Makefile", "runners/edge/__main__.py",
                 "portal/collector.py", "portal/celery.py"]


def test_the_docs_build_strictly_into_a_folder_of_their_own(tmp_path):
    config = load_config(config_file=str(REPO / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)  # strict: any warning (a broken link, a missing anchor, a page left out of nav) aborts
    pages = {path.relative_to(tmp_path / "site").as_posix() for path in (tmp_path / "site").rglob("*.html")}
    for page in DOCS.glob("*.md"):
        assert page.with_suffix(".html").name in pages
    # Readable offline: nothing a page loads (scripts, styles, fonts, images) comes from the network.
    for path in (tmp_path / "site").rglob("*"):
        if path.suffix in (".html", ".css", ".js"):
            text = path.read_text(errors="replace")
            loads = re.findall(r"<(?:script|link|img)\b[^>]*(?:src|href)=\"((?:https?:)?//[^\"]+)\"", text)
            loads += re.findall(r"@import\s+url\(\s*['\"]?((?:https?:)?//[^)'\"]+)", text)
            loads += re.findall(r"url\(\s*['\"]?((?:https?:)?//[^)'\"]+)", text) if path.suffix == ".css" else []
            assert not loads, f"{path.name} loads {loads[0]} from the network"


def test_the_configuration_page_names_every_variable_the_settings_read():
    page = (DOCS / "configuration.md").read_text()
    read = {name for file in SETTINGS_FILES for name in READS.findall((REPO / file).read_text())}
    assert len(read) > 50
    missing = sorted(name for name in read if f"`{name}`" not in page)
    assert not missing, f"docs/configuration.md does not name {missing}"


def test_every_variable_the_configuration_page_names_is_read_somewhere():
    page = (DOCS / "configuration.md").read_text()
    rows = [line.split("|")[1] for line in page.splitlines() if line.startswith("| `")]
    named = {name for cell in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)}
    sources = "\n".join((REPO / file).read_text() for file in SETTINGS_FILES + OTHER_READERS)
    unread = sorted(name for name in named if f'"{name}"' not in sources and f"{name}=" not in sources
                    and not re.search(rf"\b{name}\b", sources))
    assert not unread, f"docs/configuration.md names {unread}, which nothing reads"


def test_the_job_spec_table_names_every_field_the_check_takes_and_no_other():
    page = (DOCS / "jobs.md").read_text()
    table = page.split("**The job spec**", 1)[1].split("\n\n", 2)[1]
    named = set(re.findall(r"`([a-z_]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:])))
    assert named == set(jobs.FIELDS)


def test_the_api_page_uses_the_portal_variable_and_defines_every_variable_it_sends():
    api = (DOCS / "api.md").read_text().split("## Every endpoint", 1)[0]
    assert "127.0.0.1:8000/api" not in api
    block = re.search(r"^```sh\n(.*?)^```$", api, re.S | re.M).group(1)
    for name in set(re.findall(r"\$([A-Z_]+)", block)):
        assert re.search(rf"^{name}=|\b{name}=\$\(", block, re.M) or name == "PORT", f"${name} is used but never set"


def test_the_receivers_signature_check_in_the_notifications_page_accepts_what_the_portal_signs():
    from runners.notifications.services import signature

    code = re.search(r"```python\n(.*?)```", (DOCS / "notifications.md").read_text(), re.S).group(1)
    namespace: dict = {}
    exec(code, namespace)
    genuine = namespace["genuine"]
    secret, body, now = "0f" * 32, b'{"event":"job_finished"}', str(int(time.time()))
    headers = {"X-Portal-Timestamp": now, "X-Portal-Signature": signature(secret, body, now)}
    assert genuine(secret, headers, body)
    assert not genuine(secret, headers, body + b" ")
    old = str(int(time.time()) - 3600)
    assert not genuine(secret, {"X-Portal-Timestamp": old, "X-Portal-Signature": signature(secret, body, old)}, body)

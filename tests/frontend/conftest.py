"""Browser-test plumbing: Chromium, pages, logging in, and screenshots of failures."""

import os
from pathlib import Path

import pytest

from tests.conftest import PASSWORD


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    # Kept on the item so the page fixture can take a screenshot only when the test failed.
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
LIVE_TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def _allow_sync_db_next_to_playwright():
    """Let the test thread use the ORM while Playwright's event loop runs in it.

    Playwright's sync API keeps an asyncio loop running in this thread, which makes
    Django refuse ORM calls here (SynchronousOnlyOperation). The calls are really
    synchronous, so Django's documented escape hatch is safe for this module.
    """
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    yield
    if previous is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture(scope="module")
def browser(_allow_sync_db_next_to_playwright):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"Browser tests need Debian's Chromium at {CHROMIUM} (apt-get install chromium).")
    with _playwright().sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, request, tmp_path):
    """A fresh laptop-sized tab; a screenshot lands in tmp_path if the test fails."""
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    yield page
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        path = tmp_path / "failure.png"
        page.screenshot(path=str(path), full_page=True)
        print(f"Screenshot of the failing page: {path}")
    context.close()


@pytest.fixture
def screenshot_dir(tmp_path) -> Path:
    """Where page screenshots go: FRONTEND_SCREENSHOT_DIR if set (to look at them), else tmp_path."""
    directory = Path(os.environ.get("FRONTEND_SCREENSHOT_DIR") or tmp_path)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def snap(page, path: Path, *, full_page: bool = True) -> None:
    """A full-page screenshot for a person to look at: taken only with FRONTEND_SCREENSHOT_DIR set.

    Encoding a whole page as PNG is a good part of a browser test's CPU, and nobody looks at the ones
    left in tmp_path; a failing test's page is photographed all the same (the page fixture).
    """
    if os.environ.get("FRONTEND_SCREENSHOT_DIR"):
        page.screenshot(path=str(path), full_page=full_page)


def log_in(page, live_server, username, screenshot_dir=None):
    page.goto(f"{live_server.url}/login/")
    if screenshot_dir:
        snap(page, screenshot_dir / "login.png", full_page=False)
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    _playwright().expect(page.get_by_test_id("current-user")).to_have_text(username)


def mark_loaded(page):
    """Tag this page load; a reload would lose the tag, so its presence later proves there was none."""
    page.evaluate("window.__sameLoad = true")


def assert_not_reloaded(page):
    assert page.evaluate("window.__sameLoad === true"), "the page reloaded; live updates must not need a reload"




def _playwright():
    return pytest.importorskip("playwright.sync_api")

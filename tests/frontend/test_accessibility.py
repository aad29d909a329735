"""axe-core on every page (each template, as each persona) of the portal, as each role, on a laptop and on a phone.

The pages are found as a person finds them: from the start page, following the links of the
portal's own pages (not the Django admin's, not the API's), at most SAME_PATTERN_MAX of each URL
pattern (/jobs/1/ and /jobs/2/ are one, so are a page and its sorted or filtered views). Every page
reached is loaded at both widths: at 390 px no page may be wider than the screen; anything the
Content-Security-Policy refuses is a problem, and a link that answers 4xx or 5xx is one too (its
friendly error page would pass axe). axe runs on one page of each template as each persona the role
has, at each width: the first page the crawl reaches of each URL pattern (with a tenant's slug as
<t>) and role in the page's tenant (its path's or its breadcrumbs' tenant: bob is a member of one
tenant and a viewer of another, which changes the page; staff are neither in both). A serious or
critical violation fails the test with the page, the rule and the element. (The same template again,
with another object's or tenant's data, or sorted, adds little for axe: 136 axe runs instead of 196.)
Each role must have reached the pages it is known to have (REQUIRED). With FRONTEND_SCREENSHOT_DIR
set, every page is photographed at both widths into it (full-page PNGs: most of the browser's work when
nobody looks at them, so not otherwise).
"""

import re
from collections import defaultdict, deque
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest
from django.conf import settings
from django.test import Client

from tenants.models import Membership
from tests.frontend.conftest import snap
from tests.support.jobs import demo_with_jobs

axe_playwright = pytest.importorskip("axe_playwright_python.sync_playwright")

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# The axe-core `make install` takes from the npm registry (pinned there); without it, the older one
# axe-playwright-python bundles.
AXE_CORE_JS = Path(__file__).resolve().parents[2] / ".venv" / "axe" / "node_modules" / "axe-core" / "axe.min.js"
WIDTHS = {"laptop": (1280, 800), "phone": (390, 844)}
ROLES = {"anonymous": None, "member": "bob", "owner": "alice", "staff": "admin"}
SKIPPED = ("/admin/", "/api/", "/static/", "/logout/", "/serve/")
SAME_PATTERN_MAX = 2  # two jobs, two endpoints...: the same template with other data adds little
MAX_PAGES = 60
IMPACTS = ("serious", "critical")
# The pages each role must have reached (and found whole: HTML, 200), as path patterns.
_MEMBER_PAGES = (r"/tenants/[-a-z0-9]+/", r"/environments/\d+/", r"/jobs/\d+/", r"/tenants/[-a-z0-9]+/jobs/",
                 r"/tenants/[-a-z0-9]+/notifications/", r"/tokens/", r"/tenants/[-a-z0-9]+/datasets/",
                 r"/tenants/[-a-z0-9]+/models/", r"/tenants/[-a-z0-9]+/storage/")
REQUIRED = {
    "anonymous": (r"/login/",),
    "member": _MEMBER_PAGES,
    "owner": _MEMBER_PAGES,
    "staff": (r"/cockpit/", r"/queue/", r"/flavors/", r"/jobs/\d+/", r"/tenants/[-a-z0-9]+/jobs/", r"/node-pools/\d+/",
              r"/usage/cluster/", r"/tenants/[-a-z0-9]+/usage/"),
}
# The tenant a page belongs to, as its breadcrumbs say (None for the portal-wide pages).
TENANT_JS = "() => document.querySelector('.crumbs a[href^=\"/tenants/\"]')?.getAttribute('href') ?? null"
TENANT_PATH = re.compile(r"^/tenants/([^/]+)/")
LINKS_JS = "() => Array.from(document.querySelectorAll('a[href]:not([download])'), a => a.getAttribute('href'))"


def _pattern(path: str) -> str:
    """/jobs/12/ and /jobs/13/ are one pattern; so are a page and its sorted or filtered views."""
    return re.sub(r"/\d+/", "/<n>/", urlparse(path).path)


def _links(page, path: str) -> list[str]:
    found = []
    for href in page.evaluate(LINKS_JS):
        link = urlparse(urljoin(path, href))
        if link.netloc or not link.path.startswith("/") or link.path.startswith(SKIPPED) or link.path.endswith(".csv"):
            continue
        if "format=csv" in link.query:
            continue
        found.append(link.path + (f"?{link.query}" if link.query else ""))
    return found


def _visit_all(page, base_url: str, start: str, visit, problems: list[str]) -> list[str]:
    """Every page reachable by links from `start`, at most SAME_PATTERN_MAX per URL pattern; visit(path) on each.

    Returns the HTML pages that answered 200. The crawl follows only links a person can click, so
    every one must answer: a 4xx or 5xx (a friendly 404 or 500 page would pass axe) is a problem
    naming the link and the page it was on.
    """
    seen, per_pattern, queue, visited = set(), defaultdict(int), deque([(start, None)]), []
    while queue and len(seen) < MAX_PAGES:
        path, source = queue.popleft()
        if path in seen or per_pattern[_pattern(path)] >= SAME_PATTERN_MAX:
            continue
        seen.add(path)
        per_pattern[_pattern(path)] += 1
        response = page.goto(base_url + path)
        status = response.status if response is not None else None
        if status is None or status >= 400:
            problems.append(f"{path} answered {status}" + (f" (linked from {source})" if source else ""))
            continue
        if status != 200 or not response.headers.get("content-type", "").startswith("text/html"):
            continue
        visited.append(path)
        visit(path)
        queue.extend((link, path) for link in _links(page, path))
    return sorted(visited)


def _session_cookie(user, base_url: str) -> dict:
    client = Client()
    client.force_login(user)
    return {"name": settings.SESSION_COOKIE_NAME, "value": client.cookies[settings.SESSION_COOKIE_NAME].value,
            "url": base_url}


def _file_name(role: str, width: str, path: str) -> str:
    return f"{role}-{width}-" + (re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "home") + ".png"


@pytest.mark.parametrize("role", list(ROLES))
def test_every_page_passes_axe_and_fits_a_phone(browser, live_server, screenshot_dir, role):
    users = demo_with_jobs()
    axe = axe_playwright.Axe.from_file(AXE_CORE_JS) if AXE_CORE_JS.exists() else axe_playwright.Axe()
    problems: list[str] = []
    tenant_roles = {membership.tenant.slug: membership.role for membership in Membership.objects.filter(
        user__username=ROLES[role]).select_related("tenant")}
    for width_name, (width, height) in WIDTHS.items():
        context = browser.new_context(viewport={"width": width, "height": height})
        if ROLES[role]:
            context.add_cookies([_session_cookie(users.get(username=ROLES[role]), live_server.url)])
        page = context.new_page()
        # The Content-Security-Policy allows no inline script: Chromium says so on the console for any
        # script, handler attribute or resource a page has that the policy refuses.
        page.on("console", lambda message, page=page, width=width: problems.append(
            f"{width}px {page.url}: {message.text}") if "Content Security Policy" in message.text else None)

        checked = set()  # (pattern, role in the page's tenant) axe has run on at this width

        def visit(path, page=page, width=width, width_name=width_name, checked=checked):
            snap(page, screenshot_dir / _file_name(role, width_name, path))
            if width < 400:
                page_width = page.evaluate("document.documentElement.scrollWidth")
                if page_width > width:
                    problems.append(f"{width}px {path}: the page is {page_width}px wide")
            tenant = TENANT_PATH.match(urlparse(path).path) or TENANT_PATH.match(page.evaluate(TENANT_JS) or "")
            template = (TENANT_PATH.sub("/tenants/<t>/", _pattern(path)), tenant and tenant_roles.get(tenant[1]))
            if template in checked:
                return
            checked.add(template)
            for violation in axe.run(page).response["violations"]:
                if violation["impact"] in IMPACTS:
                    targets = [" ".join(map(str, node["target"])) for node in violation["nodes"]]
                    more = f" and {len(targets) - 3} more" if len(targets) > 3 else ""
                    problems.append(f"{width}px {path}: {violation['id']} ({violation['impact']}) at "
                                    f"{' | '.join(targets[:3])}{more}")

        visited = _visit_all(page, live_server.url, "/" if ROLES[role] else "/login/", visit, problems)
        context.close()
        missed = [pattern for pattern in REQUIRED[role] if not any(re.fullmatch(pattern, path.split("?")[0])
                                                                   for path in visited)]
        assert not missed, f"as {role} at {width}px, no page visited of {missed}; visited {visited}"
    assert problems == [], f"{len(problems)} problems as {role}:\n" + "\n".join(problems)


def test_the_capacity_preview_shows_every_column_beside_the_apply_form_on_a_wide_screen(
    browser, live_server, screenshot_dir
):
    from runners.clusters.models import NodePool

    users = demo_with_jobs()
    pool = NodePool.objects.get(gpu_model="H100-80GB")
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    context.add_cookies([_session_cookie(users.get(username="admin"), live_server.url)])
    page = context.new_page()
    page.goto(f"{live_server.url}/node-pools/{pool.id}/")
    page.get_by_test_id("apply-profile").get_by_label("Profile").select_option("h100-4g-3g")
    preview = page.get_by_test_id("capacity-preview")
    # The H100 guarantees no longer fit once the pool is cut into MIG instances: the last column says so.
    assert "ml-research (8)" in preview.locator('tr[data-flavor="h100-80gb"] [data-testid="unbacked"]').inner_text()
    card = page.locator("#apply-profile").bounding_box()
    header = preview.get_by_role("columnheader", name="No longer fits").bounding_box()
    fits = preview.evaluate("table => table.parentElement.scrollWidth <= table.parentElement.clientWidth")
    snap(page, screenshot_dir / "node-pool-capacity-preview-1440.png")
    context.close()
    assert header["x"] + header["width"] <= card["x"] + card["width"], (header, card)
    assert fits, "the preview table scrolls inside its card"

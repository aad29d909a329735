"""Follow every link a person can click, from one page, and say what went wrong on the way.

The crawler does not care how a page is fetched: ``fetch(path)`` answers ``(status, headers,
text)``, from Django's test client in-process or over HTTP from a running portal. Problems are
a 5xx, a debug page (a traceback, Django's URL list), and a 404 that is not the portal's own page.
"""

import re
from collections import deque
from collections.abc import Callable
from urllib.parse import urljoin, urlparse

DEBUG_MARKS = ("Traceback", "Using the URLconf", "Request Method:", "Exception Value:", "You're seeing this error")
HREF = re.compile(r'href="([^"#]*)"')
MAX_PAGES = 400

Fetch = Callable[[str], tuple[int, dict, str]]


def crawl(fetch: Fetch, start: str, *, max_pages: int = MAX_PAGES) -> tuple[dict[str, int], list[str]]:
    seen: dict[str, int] = {}
    problems: list[str] = []
    # The portal's own pages first, the Django admin's (hundreds of changelist filters) after them,
    # so the page cap never leaves a page of the portal unvisited.
    queue, admin_pages = deque([start]), deque()
    while (queue or admin_pages) and len(seen) < max_pages:
        path = queue.popleft() if queue else admin_pages.popleft()
        if path in seen:
            continue
        status, headers, text = fetch(path)
        seen[path] = status
        if status in (301, 302):
            target = urljoin(path, headers["Location"])
            (admin_pages if target.startswith("/admin/") else queue).append(target)
            continue
        if status >= 500:
            problems.append(f"{path}: {status}")
        if not headers.get("Content-Type", "").startswith("text/html"):
            continue
        problems += [f"{path}: shows {mark!r}" for mark in DEBUG_MARKS if mark in text]
        if status == 404 and "Page not found" not in text:
            problems.append(f"{path}: a 404 that is not the portal's page")
        for href in HREF.findall(text):
            link = urlparse(urljoin(path, href.replace("&amp;", "&")))
            if link.netloc or not link.path.startswith("/") or link.path.startswith(("/static/", "/logout/")):
                continue
            target = link.path + (f"?{link.query}" if link.query else "")
            (admin_pages if target.startswith("/admin/") else queue).append(target)
    return seen, problems

"""Links of the pages' lists (sort by a column, go to a page: every other parameter kept) and durations."""

from datetime import timedelta
from urllib.parse import urlencode

from django import template

register = template.Library()


def _query(current: dict, **changes) -> str:
    query = {key: value for key, value in current.items() if value != ""}
    for key, value in changes.items():
        if value is None:
            query.pop(key, None)
        else:
            query[key] = value
    return "?" + urlencode(query)


def _sort(page_list, key: str) -> tuple[str, str | None]:
    """The link that sorts by `key` (ascending first, descending when clicked again), and the direction now."""
    sort = page_list.sort
    direction = "ascending" if sort == key else "descending" if sort == f"-{key}" else None
    target = f"-{key}" if sort == key else key
    return _query(page_list.query, **{page_list.param("sort"): target, page_list.param("page"): None}), direction


@register.inclusion_tag("frontend/_sort_link.html")
def sort_header(page_list, key: str, label: str) -> dict:
    """A column header that sorts the list by `key`."""
    href, direction = _sort(page_list, key)
    return {"href": href, "label": label, "direction": direction, "cell": True}


@register.inclusion_tag("frontend/_sort_link.html")
def sort_link(page_list, key: str, label: str) -> dict:
    """The same link outside a table (a list of cards)."""
    href, direction = _sort(page_list, key)
    return {"href": href, "label": label, "direction": direction, "cell": False}


@register.simple_tag
def page_url(page_list, number: int) -> str:
    return _query(page_list.query, **{page_list.param("page"): number})


@register.filter
def duration(value) -> str:
    """Seconds (or a timedelta) the way a person reads them: 45s, 3m 05s, 2h 04m, 3d 4h."""
    if value is None or value == "":
        return ""
    seconds = int(value.total_seconds() if isinstance(value, timedelta) else value)
    seconds = max(0, seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {seconds:02d}s"
    return f"{seconds}s"

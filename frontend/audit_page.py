"""The audit log page: who changed what, when, before and after, newest first.

Staff read every entry; a tenant's owners and admins read their tenants' entries; for anyone else
the page is a 404, as the staff pages are. Filters come in the query string (a GET form), the list
is cut into pages like every other list here.
"""

import json

import django_filters
from django import forms
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_GET

from audit import selectors
from audit.filters import AuditEntryFilter, UtcDateTimeFilter
from frontend.filters import page_list


class AuditPageFilter(AuditEntryFilter):
    """The API's filters with the page's inputs: a form sends every field, so an empty one means no filter."""

    tenant = django_filters.ChoiceFilter(field_name="tenant_slug", empty_label="Any tenant")
    since = UtcDateTimeFilter(field_name="at", lookup_expr="gte", label="Since",
                              widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    until = UtcDateTimeFilter(field_name="at", lookup_expr="lt", label="Until",
                              widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))

    def __init__(self, *args, tenant_slugs=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.filters["tenant"].extra["choices"] = [(slug, slug) for slug in tenant_slugs]

    def is_valid(self) -> bool:
        # Not the API's strict rules (the form sends its empty fields), but the same range of moments.
        return django_filters.FilterSet.is_valid(self) and self.moments_in_range()


def _value(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


def changes(entry) -> list[dict]:
    """The entry's fields side by side: name, before, after (a dash where one side has none)."""
    before = entry.before if isinstance(entry.before, dict) else {}
    after = entry.after if isinstance(entry.after, dict) else {}
    names = list(before) + [name for name in after if name not in before]
    return [{"name": name, "before": _value(before.get(name)) if name in before else "—",
             "after": _value(after.get(name)) if name in after else "—",
             "changed": before.get(name) != after.get(name)} for name in names]


@login_required
@require_GET
def audit_log(request):
    if not selectors.can_read_audit(user=request.user):
        raise Http404("No such page.")
    slugs = selectors.reader_tenant_slugs(user=request.user)

    class Filter(AuditPageFilter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, tenant_slugs=slugs, **kwargs)

    entries = page_list(request, Filter, selectors.entry_list(user=request.user))
    rows = [{"entry": entry, "changes": changes(entry)} for entry in entries.page]
    context = {"list": entries, "rows": rows, "is_staff": request.user.is_staff, "tenant_slugs": slugs}
    return render(request, "frontend/audit.html", context, status=400 if entries.errors else 200)

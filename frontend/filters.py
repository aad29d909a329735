"""The pages' list filters (django-filter) and the one way a page cuts a list into pages.

A page list reads its parameters from the query string, under a prefix when one page shows two
lists (the tenant page's `env-q` and `member-q`). A value that is not one the filter takes is a
400 whose page names the parameter; the list is then shown unfiltered, so the page still works.
"""

from dataclasses import dataclass, field

import django_filters
from django import forms
from django.core.paginator import Page, Paginator
from django.db.models import Case, IntegerField, QuerySet, Value, When

from common.numbers import whole_number
from runners.environments.models import LIVE_STATES
from runners.jobs.models import JobState
from tenants.models import ROLE_RANK, Role

PAGE_SIZE = 25


class JobPageFilter(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")
    state = django_filters.ChoiceFilter(choices=JobState.choices, empty_label="Any state")
    mine = django_filters.BooleanFilter(method="filter_mine", widget=forms.CheckboxInput,
                                        label="Submitted by me")
    sort = django_filters.OrderingFilter(
        fields=(("name", "name"), ("state", "state"), ("submitted_at", "submitted"), ("flavor__name", "flavor")),
    )

    def filter_mine(self, queryset, name, value):
        return queryset.filter(submitted_by=self.request.user) if value else queryset


class EnvironmentPageFilter(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")
    state = django_filters.ChoiceFilter(choices=[(state, state) for state in LIVE_STATES], empty_label="Any state")
    sort = django_filters.OrderingFilter(fields=(("name", "name"), ("state", "state"), ("created_at", "created")))


class MemberPageFilter(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="user__username", lookup_expr="icontains", label="User contains")
    role = django_filters.ChoiceFilter(choices=Role.choices, empty_label="Any role")
    # role_rank: see with_role_rank, so "role" sorts viewer < member < admin < owner, not by spelling.
    sort = django_filters.OrderingFilter(fields=(("user__username", "user"), ("role_rank", "role")))


class NodePageFilter(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")
    state = django_filters.ChoiceFilter(choices=[("schedulable", "schedulable"), ("cordoned", "cordoned")],
                                        empty_label="Any state", method="filter_state")
    sort = django_filters.OrderingFilter(fields=(("name", "name"), ("schedulable", "state")))

    def filter_state(self, queryset, name, value):
        return queryset.filter(schedulable=value == "schedulable") if value else queryset


def with_role_rank(memberships: QuerySet) -> QuerySet:
    return memberships.annotate(role_rank=Case(*[When(role=role, then=Value(rank)) for role, rank in ROLE_RANK.items()],
                                               output_field=IntegerField()))


@dataclass
class PageList:
    """One filtered, sorted page of a list, and what its links need to keep the filters."""

    filterset: django_filters.FilterSet
    page: Page
    query: dict  # the request's parameters, to build links that change one of them
    prefix: str = ""
    errors: dict[str, list[str]] = field(default_factory=dict)  # parameter -> messages

    def param(self, name: str) -> str:
        return f"{self.prefix}-{name}" if self.prefix else name

    @property
    def sort(self) -> str:
        return self.query.get(self.param("sort"), "")

    @property
    def page_numbers(self) -> list:
        """The page links to show: the first and last, and two each side of this one (… between)."""
        return list(self.page.paginator.get_elided_page_range(self.page.number, on_each_side=2, on_ends=1))

    @property
    def filtered(self) -> bool:
        """Whether anything but sorting and paging narrows the list (an empty one then says "no match")."""
        return any(self.query.get(self.param(name)) for name in self.filterset.filters if name != "sort")


def page_list(request, filterset_class, queryset: QuerySet, *, prefix: str = "", tiebreak: str = "-id",
              per_page: int = PAGE_SIZE) -> PageList:
    """The request's page of `queryset` through `filterset_class`; bad parameters are in `errors`."""
    data = request.GET
    filterset = filterset_class(data, queryset=queryset, request=request, prefix=prefix or None)
    errors: dict[str, list[str]] = {}
    if not filterset.is_valid():
        errors = {(f"{prefix}-{name}" if prefix else name): list(messages)
                  for name, messages in filterset.errors.items()}
        rows = queryset
    else:
        rows = filterset.qs
    # A stable order under every sort, so a row never shows on two pages.
    rows = rows.order_by(*(rows.query.order_by or queryset.model._meta.ordering or []), tiebreak)
    page_param = f"{prefix}-page" if prefix else "page"
    raw = data.get(page_param, "1") or "1"
    number = whole_number(raw)
    if number is None or number < 1:
        errors[page_param] = ["A page number: a whole number from 1."]
        number = 1
    page = Paginator(rows, per_page).get_page(number)  # past the end: the last page
    return PageList(filterset=filterset, page=page, query=data.dict(), prefix=prefix, errors=errors)

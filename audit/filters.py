"""List filters of the audit log, shared by the API and the page."""

import django_filters

from audit.models import AuditEntry
from common.filters import StrictFilterSet


class AuditEntryFilter(StrictFilterSet):
    tenant = django_filters.CharFilter(field_name="tenant_slug", help_text="Only this tenant's entries (its slug).")
    action = django_filters.CharFilter(
        method="filter_action",
        help_text='One action ("job.cancelled"), or every action on one kind of object ending in a dot ("job.").',
    )
    actor = django_filters.CharFilter(field_name="actor_name", help_text='Who made the change: a username, "scheduler" '
                                                                         'or "system".')
    object_type = django_filters.CharFilter(help_text='The kind of object changed: "job", "quota", "tenant", ...')
    object_id = django_filters.CharFilter(help_text="The id of the object changed (with object_type).")
    since = django_filters.IsoDateTimeFilter(field_name="at", lookup_expr="gte", help_text="Entries at or after this moment.")
    until = django_filters.IsoDateTimeFilter(field_name="at", lookup_expr="lt", help_text="Entries before this moment.")

    class Meta:
        model = AuditEntry
        fields = ["tenant", "action", "actor", "object_type", "object_id", "since", "until"]

    def is_valid(self) -> bool:
        # An empty moment is not a date-time (the schema's format), so a 400 naming it, as with a choice.
        valid = super().is_valid()
        for name in ("since", "until"):
            if name in self.data and self.data.get(name) == "":
                self.form.add_error(name, "Give a date and time (ISO 8601), or leave the parameter out.")
                valid = False
        return valid

    def filter_action(self, queryset, name, value):
        if value.endswith("."):
            return queryset.filter(action__startswith=value)
        return queryset.filter(action=value)

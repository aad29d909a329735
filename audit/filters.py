"""List filters of the audit log, shared by the API and the page."""

from datetime import timezone

import django_filters

from audit.models import AuditEntry
from common.filters import StrictFilterSet


class UtcDateTimeFilter(django_filters.IsoDateTimeFilter):
    """An ISO 8601 moment, compared in UTC: PostgreSQL refuses a value sent with an offset past
    +/-15:59, which ISO 8601 (and so the schema) allows up to +/-23:59."""

    def filter(self, qs, value):
        if value:
            value = value.astimezone(timezone.utc)
        return super().filter(qs, value)


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
    since = UtcDateTimeFilter(field_name="at", lookup_expr="gte", help_text="Entries at or after this moment.")
    until = UtcDateTimeFilter(field_name="at", lookup_expr="lt", help_text="Entries before this moment.")

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
        return self.moments_in_range() and valid

    def moments_in_range(self) -> bool:
        """Whether since and until (once parsed) are moments of years 1 to 9999 in UTC; adds the error if not."""
        valid = True
        for name in ("since", "until"):
            moment = getattr(self.form, "cleaned_data", {}).get(name)
            if moment is None:
                continue
            try:
                moment.astimezone(timezone.utc)
            except OverflowError:  # 0001-01-01T00:00+01:00 is in year 0 in UTC
                self.form.add_error(name, "This moment is outside the years 1 to 9999 in UTC.")
                valid = False
        return valid

    def filter_action(self, queryset, name, value):
        if value.endswith("."):
            return queryset.filter(action__startswith=value)
        return queryset.filter(action=value)

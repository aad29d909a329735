"""The base of every list filterset: a choice parameter given with no value is a 400 naming it.

django-filter reads `?state=` as "no filter", but the schema says `state` is one of an enum,
and automation that sends an empty value has a bug it should hear about.
"""

import django_filters


class StrictFilterSet(django_filters.FilterSet):
    def is_valid(self) -> bool:
        valid = super().is_valid()
        for name, filter_ in self.filters.items():
            if isinstance(filter_, django_filters.ChoiceFilter) and name in self.data and self.data.get(name) == "":
                self.form.add_error(name, "Give one of the values, or leave the parameter out.")
                valid = False
        return valid

"""The jobs API's answers built with less work per field: the same JSON as DRF's own serializers.

A page of 50 jobs nests some 400 objects (attempts, checkpoints, events). DRF reads every field of
every object through several layers, looks up the current time zone for every datetime, and gives
every job a queryset per nested list. Here:

- ``PlainFieldsMixin`` plans once per serializer instance how to read each field, and takes a short
  way for the field types whose output it reproduces exactly (text, whole numbers, choices,
  datetimes, a related object's slug or primary key); any other field goes through DRF as before.
- ``attach_nested_rows`` reads a page's nested lists as plain rows (one query per relation, as a
  prefetch does, but no model instance per row), and ``PrefetchedListSerializer`` serializes the list
  it left on each job; a job without one is read through its relation as before.

tests/runners/test_query_counts.py checks the answers match DRF's field for field.
"""

import datetime
from collections.abc import Mapping
from types import SimpleNamespace

from django.core.exceptions import ObjectDoesNotExist
from django.utils import timezone
from rest_framework import fields, relations, serializers
from rest_framework.fields import SkipField
from rest_framework.relations import PKOnlyObject
from rest_framework.settings import api_settings


def prefetched_name(relation: str) -> str:
    """Where ``attach_nested_rows`` leaves the relation's rows of an instance as a list."""
    return f"listed_{relation}"


def attach_nested_rows(instances: list, nested: dict[str, tuple[type, list[str]]]) -> None:
    """For each relation (name: (its model, the fields the answer shows)), the rows of all these instances
    in one query, in the model's own order, set on each instance as a list of plain objects. The answer
    reads nothing else of them, so they need not be model instances."""
    if not instances:
        return
    ids = [instance.pk for instance in instances]
    for relation, (model, names) in nested.items():
        key = instances[0]._meta.get_field(relation).field.attname  # the row's own key to the instance
        grouped: dict[int, list] = {}
        for row in model.objects.filter(**{f"{key}__in": ids}).values(key, *names):
            grouped.setdefault(row.pop(key), []).append(SimpleNamespace(**row))
        for instance in instances:
            setattr(instance, prefetched_name(relation), grouped.get(instance.pk, []))


class PrefetchedListSerializer(serializers.ListSerializer):
    """A nested list read from the plain list ``attach_nested_rows`` left on the instance, when the view made one."""

    def get_attribute(self, instance):
        listed = getattr(instance, prefetched_name(self.source), None)
        return listed if listed is not None else super().get_attribute(instance)


def _plain_kind(field) -> str | None:
    """How the short way reads this field, or None: through DRF. Exact types only, not subclasses,
    whose output may differ."""
    if len(field.source_attrs) != 1 or field.source == "*":
        return None
    kind = type(field)
    if kind is fields.CharField:
        return "text"
    if kind is fields.IntegerField:
        return "integer"
    if kind is fields.ChoiceField:
        return "choice"
    if kind is fields.DateTimeField:
        iso = getattr(field, "format", api_settings.DATETIME_FORMAT)
        own_zone = hasattr(field, "timezone")
        return "datetime" if isinstance(iso, str) and iso.lower() == "iso-8601" and not own_zone else None
    if kind is relations.SlugRelatedField and "__" not in field.slug_field:
        return "slug"
    if kind is relations.PrimaryKeyRelatedField and field.pk_field is None:
        return "pk"
    return None


class PlainFieldsMixin:
    """``to_representation`` of a ModelSerializer without DRF's per-field layers where they change nothing."""

    def _plain_plan(self) -> list[tuple]:
        plan = self.__dict__.get("_plain_plan_cache")
        if plan is None:
            plan = [(field.field_name, field.source_attrs[0] if kind else None, kind, field)
                    for field in self._readable_fields for kind in [_plain_kind(field)]]
            self._plain_plan_cache = plan
        return plan

    def to_representation(self, instance):
        if isinstance(instance, Mapping):
            return super().to_representation(instance)
        zone = self.__dict__.get("_plain_zone")
        if zone is None:  # once per serializer (a request's), not once per row: it is a context-local lookup
            zone = self._plain_zone = timezone.get_current_timezone()
        ret = {}
        for name, attr, kind, field in self._plain_plan():
            if kind is not None:
                try:
                    value = instance.serializable_value(attr) if kind == "pk" else getattr(instance, attr)
                except (ObjectDoesNotExist, AttributeError):
                    value = _THROUGH_DRF  # DRF's steps say what such a field gives
                if value is None:
                    ret[name] = None
                    continue
                if value is not _THROUGH_DRF and not callable(value):
                    short = _short(kind, field, value, zone)
                    if short is not _THROUGH_DRF:
                        ret[name] = short
                        continue
            # DRF's own steps (Serializer.to_representation).
            try:
                attribute = field.get_attribute(instance)
            except SkipField:
                continue
            check_for_none = attribute.pk if isinstance(attribute, PKOnlyObject) else attribute
            ret[name] = None if check_for_none is None else field.to_representation(attribute)
        return ret


_THROUGH_DRF = object()


def _short(kind: str, field, value, zone):
    """The field's output for a value that is not None, or _THROUGH_DRF where only DRF's steps give it."""
    if kind == "text":
        return str(value)
    if kind == "integer":
        return int(value)
    if kind == "choice":
        return value if value == "" else field.choice_strings_to_values.get(str(value), value)
    if kind == "datetime":
        # DRF's DateTimeField for an aware datetime: ISO 8601 in the current zone, UTC written as Z.
        if not isinstance(value, datetime.datetime) or value.utcoffset() is None:
            return _THROUGH_DRF
        try:
            text = value.astimezone(zone).isoformat()
        except OverflowError:
            return _THROUGH_DRF
        return text[:-6] + "Z" if text.endswith("+00:00") else text
    if kind == "slug":
        return getattr(value, field.slug_field)
    return value  # pk

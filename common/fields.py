"""Request serializers that take each value only in the JSON type the schema gives it.

DRF coerces: a ``CharField`` takes ``0`` as ``"0"``, an ``IntegerField`` takes
``"8"`` as ``8``. The schema says ``string`` and ``integer``, and a client that
sends the other type has a bug worth a 400. ``StrictTypesMixin`` refuses a value
of the wrong JSON type, naming the field, before DRF would coerce it. Decimals
are the exception: they are documented as a string or a number, and take both.
"""

from collections.abc import Mapping

from rest_framework import serializers
from rest_framework.fields import empty

STRING_FIELDS = (serializers.CharField, serializers.ChoiceField, serializers.SlugRelatedField)


def type_error(field, value) -> str | list | dict | None:
    """Why ``value`` is not of the JSON type ``field`` documents, or None when it is."""
    if value is None:
        return None  # allow_null is the field's own business.
    if isinstance(field, STRING_FIELDS):
        return None if isinstance(value, str) else "Not a valid string."
    if isinstance(field, serializers.BooleanField):
        return None if isinstance(value, bool) else "Must be a valid boolean."
    if isinstance(field, serializers.IntegerField):
        # JSON Schema counts 5.0 as an integer; DRF takes it as 5 and refuses 5.5 itself.
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "A valid integer is required."
    if isinstance(field, serializers.ListField) and isinstance(value, list):
        errors = {index: [error] for index, item in enumerate(value) if (error := type_error(field.child, item))}
        return errors or None
    return None


class StrictTypesMixin:
    """For request serializers (``serializers.Serializer`` subclasses); goes first in the bases."""

    def to_internal_value(self, data):
        type_errors = {}
        if isinstance(data, Mapping):
            for name, field in self.fields.items():
                if field.read_only:
                    continue
                value = data.get(field.field_name, empty)
                if value is empty:
                    continue
                error = type_error(field, value)
                if error:
                    type_errors[name] = error if isinstance(error, dict) else [error]
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if not type_errors:
                raise
            detail = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
            raise serializers.ValidationError({**detail, **type_errors}) from None
        if type_errors:
            raise serializers.ValidationError(type_errors)
        return value

"""PostgreSQL refuses text holding NUL (0x00); refuse it first, as a 400 that names the field.

DRF's and Django's plain text fields already do this; fields that look a value
up in the database (slug lookups, model choices) do not, so they get these.
"""

from django import forms
from django.core.exceptions import ValidationError
from rest_framework import serializers

NULL_MESSAGE = "Null characters are not allowed."


def has_null(value) -> bool:
    return isinstance(value, str) and "\x00" in value


class SlugRelatedField(serializers.SlugRelatedField):
    def to_internal_value(self, data):
        if has_null(data):
            raise serializers.ValidationError(NULL_MESSAGE)
        return super().to_internal_value(data)


class ModelChoiceField(forms.ModelChoiceField):
    def to_python(self, value):
        if has_null(value):
            raise ValidationError(NULL_MESSAGE, code="null_characters_not_allowed")
        return super().to_python(value)


def query_param(request, name: str) -> str | None:
    """A query parameter, or a 400 naming it when it holds NUL."""
    value = request.query_params.get(name)
    if has_null(value):
        raise serializers.ValidationError({name: [NULL_MESSAGE]})
    return value

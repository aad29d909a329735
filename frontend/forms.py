"""Browser forms: shape and syntax only; the services decide what is allowed."""

from django import forms
from django.core.exceptions import ValidationError

from tenants.models import ENVIRONMENT_NAME_MAX, Role, dns_label_validator


class EnvironmentForm(forms.Form):
    name = forms.CharField(
        max_length=ENVIRONMENT_NAME_MAX,
        validators=[dns_label_validator],
        help_text=f"Lowercase letters, digits and '-', up to {ENVIRONMENT_NAME_MAX} characters.",
        widget=forms.TextInput(attrs={"placeholder": "e.g. train-llm", "autocomplete": "off"}),
    )


class MemberAddForm(forms.Form):
    username = forms.CharField(max_length=150, widget=forms.TextInput(attrs={"autocomplete": "off"}))
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


def add_service_errors(form: forms.Form, error: ValidationError) -> None:
    """Put a service's ValidationError next to the fields it names; the rest go on top of the form."""
    if not hasattr(error, "error_dict"):
        form.add_error(None, error)
        return
    for field, messages in error.message_dict.items():
        # A service may name a field this form does not show (a namespace, say); say it anyway.
        form.add_error(field if field in form.fields else None, messages)

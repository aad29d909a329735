"""The error summary at the top of every page whose form came back with errors."""

from django import forms, template

register = template.Library()


def _validated_forms_with_errors(context) -> list[forms.BaseForm]:
    found, seen = [], set()
    for value in context.flatten().values():
        # Only forms the view already validated: validating here would run a clean() twice (the
        # login form's counts an attempt).
        if isinstance(value, forms.BaseForm) and id(value) not in seen and getattr(value, "_errors", None):
            seen.add(id(value))
            found.append(value)
    return found


@register.inclusion_tag("frontend/_error_summary.html", takes_context=True)
def error_summary(context):
    """Every error of every form on the page, each linking to its field; the form's own ones unlinked."""
    problems = []
    for form in _validated_forms_with_errors(context):
        problems += [{"message": message, "field_id": None} for message in form.non_field_errors()]
        for field in form:
            problems += [{"message": message, "label": field.label, "field_id": field.id_for_label}
                         for message in field.errors]
    return {"problems": problems}

"""A tenant's notifications page: each member's mail choices; for owners, the webhooks and their delivery log."""

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from frontend.forms import add_service_errors
from runners.notifications import selectors as notify_selectors
from runners.notifications import services as notify
from runners.notifications.models import EventKind
from tenants import selectors
from tenants.models import Membership

# Rows of the delivery log shown per webhook (the API pages through all of them).
LOG_ROWS = 20


class WebhookForm(forms.Form):
    url = forms.CharField(label="URL", max_length=notify.URL_MAX, help_text="http:// or https://; each event is POSTed here.",
                          widget=forms.URLInput(attrs={"placeholder": "https://example.com/hooks/gpu-portal"}))
    events = forms.MultipleChoiceField(label="Events", choices=EventKind.choices, widget=forms.CheckboxSelectMultiple,
                                       initial=[EventKind.JOB_FAILED, EventKind.JOB_PREEMPTED, EventKind.ENVIRONMENT_FAILED])

    def clean_url(self):
        try:
            return notify.webhook_url_check(self.cleaned_data["url"])
        except ValidationError as exc:
            raise forms.ValidationError(exc.message_dict["url"]) from None


def _render(request, tenant, *, webhook_form=None, created=None, status=200):
    is_member = Membership.objects.filter(user=request.user, tenant=tenant).exists()
    can_manage = notify_selectors.can_manage_webhooks(user=request.user, tenant=tenant)
    choices = notify_selectors.preferences_of(user=request.user, tenant=tenant) if is_member else {}
    webhooks = []
    if can_manage:
        for webhook in notify_selectors.webhook_list(user=request.user, slug=tenant.slug):
            webhooks.append({"webhook": webhook, "labels": [EventKind(kind).label for kind in webhook.events],
                             "deliveries": list(notify_selectors.delivery_list(webhook)[:LOG_ROWS])})
    context = {
        "tenant": tenant, "is_member": is_member, "can_manage": can_manage,
        "email_rows": [{"kind": kind, "label": label, "on": choices.get(kind, False)} for kind, label in EventKind.choices],
        "webhooks": webhooks, "webhook_form": webhook_form or WebhookForm(), "created": created,
    }
    return render(request, "frontend/notifications.html", context, status=status)


@login_required
@require_GET
def notifications(request, slug):
    """Any member (viewers included) sets their own mail; owners see the webhooks. A 404 for anyone else."""
    return _render(request, selectors.tenant_get(user=request.user, slug=slug))


@login_required
@require_POST
def email_choices_save(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    chosen = set(request.POST.getlist("email"))
    notify.preferences_set(user=request.user, tenant=tenant, choices={kind: kind in chosen for kind in EventKind.values})
    messages.success(request, "Saved your mail choices.")
    return redirect("notifications", slug=tenant.slug)


@never_cache  # the answer holds the secret: no cache keeps it
@login_required
@require_POST
def webhook_create(request, slug):
    tenant = selectors.tenant_get(user=request.user, slug=slug)
    form = WebhookForm(request.POST)
    if form.is_valid():
        try:
            webhook = notify.webhook_create(actor=request.user, tenant=tenant, **form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            # Rendered, not redirected: the secret is shown in this answer only.
            return _render(request, tenant, created=webhook, status=201)
    return _render(request, tenant, webhook_form=form, status=400)


@login_required
@require_POST
def webhook_delete(request, slug, webhook_id):
    webhook = notify_selectors.webhook_get(user=request.user, slug=slug, webhook_id=webhook_id)
    notify.webhook_delete(actor=request.user, webhook=webhook)
    messages.success(request, f"Deleted the webhook to {webhook.url}.")
    return redirect("notifications", slug=slug)

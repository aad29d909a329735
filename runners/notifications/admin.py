"""Notifications in the Django admin, read-only: webhooks are made through the API and the pages
(which make their secrets), choices by each member."""

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.notifications.models import Delivery, Event, Outbox, Preference, Webhook


@admin.register(Webhook)
class WebhookAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "url", "events", "active", "created_by", "created_at"]
    list_filter = ["active", "tenant"]
    exclude = ["secret"]


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "webhook", "kind", "state", "attempts", "status_code", "error", "delivered_at"]
    list_filter = ["state", "kind"]


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "tenant", "kind", "key", "emailed_at", "email_attempts", "email_error"]
    list_filter = ["kind", "tenant"]


@admin.register(Outbox)
class OutboxAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "source", "ref", "key", "processed_at"]
    list_filter = ["source"]


@admin.register(Preference)
class PreferenceAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "user", "event", "email", "updated_at"]
    list_filter = ["event", "email", "tenant"]

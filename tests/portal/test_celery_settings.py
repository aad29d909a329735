"""Celery reads its configuration from Django's CELERY_* settings, live, through portal.celery.CelerySettings."""

import pytest
from django.test import override_settings

from portal.celery import app, celery_settings

pytestmark = pytest.mark.unit


def test_celery_sees_each_celery_setting_of_django_under_its_new_name():
    from django.conf import settings

    assert app.conf.task_default_queue == settings.CELERY_TASK_DEFAULT_QUEUE
    assert app.conf.broker_transport_options == settings.CELERY_BROKER_TRANSPORT_OPTIONS
    assert app.conf.task_publish_retry_policy == settings.CELERY_TASK_PUBLISH_RETRY_POLICY
    assert app.conf.worker_prefetch_multiplier == 1 and app.conf.task_ignore_result is True
    # What Django does not set comes from Celery's defaults, as before.
    assert app.conf.task_send_sent_event is False and app.conf.task_protocol == 2


def test_an_override_is_seen_at_once_and_undone_with_it():
    # A setting no test sets on app.conf itself (a value set there, in Celery's own changes, comes first).
    assert app.conf.worker_prefetch_multiplier == 1
    with override_settings(CELERY_WORKER_PREFETCH_MULTIPLIER=4):
        assert app.conf.worker_prefetch_multiplier == 4
    assert app.conf.worker_prefetch_multiplier == 1


def test_a_setting_django_did_not_have_is_seen_while_overridden_and_gone_after():
    assert "CELERY_TASK_SEND_SENT_EVENT" not in celery_settings
    with override_settings(CELERY_TASK_SEND_SENT_EVENT=True):
        assert celery_settings["CELERY_TASK_SEND_SENT_EVENT"] is True
        assert app.conf.task_send_sent_event is True
    assert "CELERY_TASK_SEND_SENT_EVENT" not in celery_settings
    assert app.conf.task_send_sent_event is False


def test_names_django_lacks_miss_without_asking_django():
    # Only CELERY_ names that Django has are looked up there: other spellings are refused by the set alone.
    assert "task_default_queue" not in celery_settings and "DEBUG" not in celery_settings
    assert all(name.startswith("CELERY_") for name in celery_settings)

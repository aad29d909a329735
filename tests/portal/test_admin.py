"""The Django admin: every model of the portal's apps is there to look at, and nothing there
deletes a job, an environment or a tenant's work in bulk, or changes what only services may."""

import pytest
from django.apps import apps
from django.contrib import admin
from django.test import Client

from tests.support.jobs import demo_with_jobs

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

PORTAL_APPS = {"tenants", "quotas", "clusters", "environments", "jobs", "scheduling"}


def test_every_model_of_the_portals_apps_is_registered():
    models = [model for config in apps.get_app_configs() if config.label in PORTAL_APPS for model in config.get_models()]
    assert len(models) >= 20
    missing = [model._meta.label for model in models if not admin.site.is_registered(model)]
    assert missing == []


def test_no_bulk_delete_and_no_hand_edits_of_rows_services_own(rf, django_user_model):
    staff = django_user_model.objects.create_superuser("root", password="x")
    request = rf.get("/admin/")
    request.user = staff
    for model, model_admin in admin.site._registry.items():
        if model._meta.app_label not in PORTAL_APPS:
            continue
        assert "delete_selected" not in model_admin.get_actions(request), model._meta.label
        if model._meta.label not in ("tenants.Tenant",):
            assert not model_admin.has_delete_permission(request), model._meta.label
            assert not model_admin.has_change_permission(request), model._meta.label


def test_every_changelist_and_object_page_opens_for_staff():
    users = demo_with_jobs()
    client = Client()
    client.force_login(users.get(username="admin"))
    for model, _ in admin.site._registry.items():
        if model._meta.app_label not in PORTAL_APPS:
            continue
        opts = model._meta
        changelist = client.get(f"/admin/{opts.app_label}/{opts.model_name}/")
        assert changelist.status_code == 200, opts.label
        first = model.objects.first()
        if first is not None:
            assert client.get(f"/admin/{opts.app_label}/{opts.model_name}/{first.pk}/change/").status_code == 200, opts.label

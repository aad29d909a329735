from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from audit.api import router as audit_router
from frontend.forms import AdminLoginForm
from frontend.views import throttled_login
from portal import health, metrics
from portal.api import router
from runners.bundles.api import router as bundles_router
from runners.bundles.fetch_view import bundle_fetch
from runners.inference.router import ChatCompletionsView, CompletionsView, GenerateView
from runners.usage.api import (
    BudgetAlertView,
    BudgetView,
    CloudPriceView,
    IdleView,
    UsageView,
    UtilizationView,
)
from tenants.api import TokenView

# The admin's login shares the throttle of the login page and the token endpoint.
admin.site.login_form = AdminLoginForm

# Admin pages of the models that moved from the app `runners` to the apps inside it keep working
# from old bookmarks: /admin/runners/job/5/change/ -> /admin/jobs/job/5/change/.
MOVED_ADMIN = {"job": "jobs", "environment": "environments"}

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics.MetricsView.as_view(), name="metrics"),
    path("admin/login/", throttled_login(admin.site.login), name="admin-login"),
    *[
        re_path(rf"^admin/runners/{model}/(?P<rest>.*)$",
                RedirectView.as_view(url=f"/admin/{label}/{model}/%(rest)s", permanent=True, query_string=True))
        for model, label in MOVED_ADMIN.items()
    ],
    path("admin/", admin.site.urls),
    path("api/v1/auth/token/", TokenView.as_view(), name="api-token"),
    path("api/v1/usage/", UsageView.as_view(), name="usage"),
    path("api/v1/usage/idle/", IdleView.as_view(), name="usage-idle"),
    path("api/v1/utilization/", UtilizationView.as_view(), name="utilization"),
    path("api/v1/budget-alerts/", BudgetAlertView.as_view(), name="budget-alerts"),
    path("api/v1/budgets/<slug:slug>/", BudgetView.as_view(), name="budget"),
    path("api/v1/cloud-prices/", CloudPriceView.as_view(), name="cloud-prices"),
    path("api/v1/", include(audit_router.urls)),
    path("api/v1/", include(bundles_router.urls)),
    # Datasets: /api/v1/tenants/<slug>/datasets/... and the pods' signed shard fetch (runners/datasets/urls.py).
    path("", include("runners.datasets.urls")),
    # A tenant's checkpoint storage: /api/v1/tenants/<slug>/storage/ and its retention preview.
    path("", include("runners.jobs.storage_urls")),
    # Models: /api/v1/tenants/<slug>/models/... and the replicas' signed weights fetch (runners/registry/urls.py).
    path("", include("runners.registry.urls")),
    path("api/v1/", include(router.urls)),
    # Endpoints are served by the edge (runners/edge/) in front of this process; these document the routes and
    # answer a request that reached gunicorn directly with a pointer (runners/inference/router.py).
    path("serve/<slug:tenant>/<slug:name>/v1/generate", GenerateView.as_view(), name="endpoint-generate"),
    path("serve/<slug:tenant>/<slug:name>/v1/completions", CompletionsView.as_view(), name="endpoint-completions"),
    path("serve/<slug:tenant>/<slug:name>/v1/chat/completions", ChatCompletionsView.as_view(),
         name="endpoint-chat-completions"),
    # A script job's pod fetches its bundle here, with a URL the portal signed for it (runners/bundles/fetch_view.py).
    path("bundles/fetch/<str:token>/", bundle_fetch, name="bundle-fetch"),
    # A Kubernetes job's pods upload its checkpoints here, with a URL signed for the attempt (runners/jobs/checkpoint_upload.py).
    path("", include("runners.jobs.checkpoint_upload")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # The split view serves Swagger UI's start-up script as a file of its own: no inline script, so the
    # Content-Security-Policy holds on this page too.
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
    path("", include("frontend.urls")),
]

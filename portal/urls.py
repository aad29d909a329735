from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from frontend.forms import AdminLoginForm
from frontend.views import throttled_login
from portal import health
from portal.api import router
from tenants.api import TokenView

# The admin's login shares the throttle of the login page and the token endpoint.
admin.site.login_form = AdminLoginForm

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("admin/login/", throttled_login(admin.site.login), name="admin-login"),
    path("admin/", admin.site.urls),
    path("api/v1/auth/token/", TokenView.as_view(), name="api-token"),
    path("api/v1/", include(router.urls)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("", include("frontend.urls")),
]

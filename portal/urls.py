from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from portal.api import router
from tenants.api import TokenView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/auth/token/", TokenView.as_view(), name="api-token"),
    path("api/v1/", include(router.urls)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("", include("frontend.urls")),
]

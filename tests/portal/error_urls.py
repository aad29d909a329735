"""The portal's URLs plus two views that fail, for tests of what a server error looks like."""

from django.urls import path

from portal.urls import urlpatterns as portal_urlpatterns


def failing_page(request):
    raise RuntimeError("a page that fails, for the test")


def failing_api(request):
    raise RuntimeError("an API view that fails, for the test")


urlpatterns = [
    path("broken/", failing_page),
    path("api/v1/broken/", failing_api),
    *portal_urlpatterns,
]

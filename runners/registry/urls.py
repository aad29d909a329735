"""The registry's URLs: the API under /api/v1/tenants/<slug>/models/, and the replicas' signed weights fetch.

Included at the root by portal/urls.py.
"""

from django.urls import include, path

from runners.registry.api import router
from runners.registry.fetch_view import weights_fetch

urlpatterns = [
    path("api/v1/", include(router.urls)),
    # A replica's pod fetches a version's weights here, with a URL the portal signed for its attempt.
    path("models/fetch/<str:token>/", weights_fetch, name="model-weights-fetch"),
]

"""The datasets' URLs: the API under /api/v1/tenants/<slug>/datasets/, and the signed shard fetch of pods.

Included at the root by portal/urls.py.
"""

from django.urls import path

from runners.datasets import api
from runners.datasets.fetch_view import shard_fetch

NAME = "<slug:tenant_slug>/datasets/<slug:name>"
VERSION = f"{NAME}/versions/<int:number>"

urlpatterns = [
    path("api/v1/tenants/<slug:tenant_slug>/datasets/", api.DatasetListView.as_view(), name="datasets"),
    path(f"api/v1/tenants/{NAME}/", api.DatasetDetailView.as_view(), name="dataset"),
    path(f"api/v1/tenants/{NAME}/shares/", api.DatasetSharesView.as_view(), name="dataset-shares"),
    path(f"api/v1/tenants/{NAME}/shares/<slug:other>/", api.DatasetShareView.as_view(), name="dataset-share"),
    path(f"api/v1/tenants/{NAME}/registrations/", api.DatasetRegisterView.as_view(), name="dataset-register"),
    path(f"api/v1/tenants/{NAME}/versions/", api.VersionListView.as_view(), name="dataset-versions"),
    path(f"api/v1/tenants/{VERSION}/", api.VersionDetailView.as_view(), name="dataset-version"),
    path(f"api/v1/tenants/{VERSION}/shards/", api.VersionShardsView.as_view(), name="dataset-version-shards"),
    path(f"api/v1/tenants/{VERSION}/shards/<str:sha256>/", api.ShardUploadView.as_view(), name="dataset-shard-upload"),
    path(f"api/v1/tenants/{VERSION}/seal/", api.VersionSealView.as_view(), name="dataset-version-seal"),
    path(f"api/v1/tenants/{VERSION}/index/", api.VersionIndexView.as_view(), name="dataset-version-index"),
    # A pod fetches a shard here, with a URL the portal signed for its attempt (runners/datasets/fetch_view.py).
    path("datasets/fetch/<str:token>/", shard_fetch, name="dataset-shard-fetch"),
]

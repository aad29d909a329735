"""The checkpoint storage's URLs under /api/v1/tenants/<slug>/storage/ (included at the root by portal/urls.py)."""

from django.urls import path

from runners.jobs import storage_api

urlpatterns = [
    path("api/v1/tenants/<slug:tenant_slug>/storage/", storage_api.StorageView.as_view(), name="tenant-storage-api"),
    path("api/v1/tenants/<slug:tenant_slug>/storage/preview/", storage_api.StoragePreviewView.as_view(),
         name="tenant-storage-preview"),
]

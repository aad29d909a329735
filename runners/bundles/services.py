"""Code bundles: looking one up, where its archive lies, storing an upload once, deleting it.

Lookups for the jobs layer (a ``script`` job names its bundle by digest): ``get_bundle``,
``bundle_url``, ``open_archive``. Storage is fsspec's: BUNDLE_STORAGE_URL is a folder (``file://``)
or a bucket (``s3://bucket/prefix``, s3fs), opened with BUNDLE_STORAGE_OPTIONS.
"""

import fsspec
from django.conf import settings

from runners.bundles.models import Bundle
from tenants.models import Tenant


def storage():
    """(the fsspec filesystem, the root path in it) of BUNDLE_STORAGE_URL."""
    fs, root = fsspec.core.url_to_fs(settings.BUNDLE_STORAGE_URL, **settings.BUNDLE_STORAGE_OPTIONS)
    return fs, root.rstrip("/")


def object_path(tenant: Tenant, sha256: str) -> str:
    """Where a tenant's bundle of this digest lies, as a path of the storage's filesystem."""
    _fs, root = storage()
    return f"{root}/{tenant.slug}/{sha256}.tar.gz"


def get_bundle(tenant: Tenant, sha256: str) -> Bundle:
    """The tenant's kept bundle of this digest; raises Bundle.DoesNotExist (a deleted one is gone too)."""
    return Bundle.objects.select_related("tenant").get(tenant=tenant, sha256=sha256, deleted_at__isnull=True)


def bundle_url(bundle: Bundle) -> str:
    """The fsspec URL of the bundle's archive (file:///... or s3://...), what a backend fetches it from."""
    fs, _root = storage()
    return fs.unstrip_protocol(object_path(bundle.tenant, bundle.sha256))


def open_archive(bundle: Bundle):
    """The bundle's archive (.tar.gz), as a binary file object opened for reading through fsspec."""
    fs, _root = storage()
    return fs.open(object_path(bundle.tenant, bundle.sha256), "rb")

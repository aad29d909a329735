"""A script job's pod fetches its bundle from the portal through a short-lived signed URL.

On Kubernetes the pod's init container (``python -m gpuportal.fetch``) downloads the archive. The pod
holds no storage credentials: the launch hands it a URL of this view, signed by the portal
(``django.core.signing``, SECRET_KEY) for one bundle and the job's attempt it is for, valid
FETCH_URL_MAX_AGE_S from the attempt's admission. Like a pre-signed S3 URL, whoever holds it may read
that one archive until it expires, nothing else. The view answers the archive while the bundle is
kept; anything else reads as not found (an expired URL says so, 410). The same URL works whatever the
storage is (a folder under var/ or an S3 bucket), which a pre-signed S3 URL would not, and the pod
needs to reach only the portal.
"""

from datetime import datetime

from django.http import FileResponse, Http404, HttpResponse
from django.views.decorators.http import require_GET

from common.signed_fetch import FETCH_URL_MAX_AGE_S, signed_payload, signed_url
from runners.bundles.models import Bundle
from runners.bundles.services import open_archive

# FETCH_URL_MAX_AGE_S is the one age of every signed fetch URL; named here too, where it was first.
__all__ = ["FETCH_URL_MAX_AGE_S", "bundle_fetch", "signed_fetch_url"]

SALT = "runners.bundles.fetch"


def signed_fetch_url(bundle: Bundle, *, job_id: int, attempt: int, since: datetime) -> str:
    """The URL the pods of this attempt fetch the bundle's archive from, valid FETCH_URL_MAX_AGE_S after `since`
    (absolute when PORTAL_PUBLIC_URL is set). The same attempt always gets the same URL, so a launch applied
    again leaves its pods' spec as it was."""
    return signed_url("bundle-fetch", salt=SALT, since=since,
                      payload={"bundle": bundle.id, "sha256": bundle.sha256, "job": job_id, "attempt": attempt})


@require_GET
def bundle_fetch(request, token: str):
    """The archive a signed URL names, while the bundle is kept; 404 for anything else, 410 once the URL expired."""
    signed = signed_payload(token, salt=SALT, not_found="No such bundle.",
                            expired="This bundle URL has expired; each attempt of the job is signed one of its own.\n")
    if isinstance(signed, HttpResponse):
        return signed
    bundle = Bundle.objects.select_related("tenant").filter(
        id=signed.get("bundle"), sha256=signed.get("sha256"), deleted_at__isnull=True
    ).first()
    if bundle is None:
        raise Http404("No such bundle.")
    return FileResponse(open_archive(bundle), as_attachment=True, filename=f"{bundle.sha256}.tar.gz",
                        content_type="application/gzip")

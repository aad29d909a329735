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

import time
from datetime import datetime

from django.conf import settings
from django.core import signing
from django.http import FileResponse, Http404, HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_GET

from runners.bundles.models import Bundle
from runners.bundles.services import open_archive

SALT = "runners.bundles.fetch"
# Counted from the attempt's admission: long enough for a pod that waits to be placed, bound and pull its
# image; the next attempt gets a URL of its own.
FETCH_URL_MAX_AGE_S = 6 * 3600


def signed_fetch_url(bundle: Bundle, *, job_id: int, attempt: int, since: datetime) -> str:
    """The URL the pods of this attempt fetch the bundle's archive from, valid FETCH_URL_MAX_AGE_S after `since`
    (absolute when PORTAL_PUBLIC_URL is set). The same attempt always gets the same URL, so a launch applied
    again leaves its pods' spec as it was."""
    until = int(since.timestamp()) + FETCH_URL_MAX_AGE_S
    token = signing.Signer(salt=SALT).sign_object(
        {"bundle": bundle.id, "sha256": bundle.sha256, "job": job_id, "attempt": attempt, "until": until}
    )
    return settings.PORTAL_PUBLIC_URL.rstrip("/") + reverse("bundle-fetch", kwargs={"token": token})


@require_GET
def bundle_fetch(request, token: str):
    """The archive a signed URL names, while the bundle is kept; 404 for anything else, 410 once the URL expired."""
    try:
        signed = signing.Signer(salt=SALT).unsign_object(token)
    except signing.BadSignature:
        raise Http404("No such bundle.") from None
    if not isinstance(signed.get("until"), int) or signed["until"] < time.time():
        return HttpResponse("This bundle URL has expired; each attempt of the job is signed one of its own.\n",
                            status=410, content_type="text/plain; charset=utf-8")
    bundle = Bundle.objects.select_related("tenant").filter(
        id=signed.get("bundle"), sha256=signed.get("sha256"), deleted_at__isnull=True
    ).first()
    if bundle is None:
        raise Http404("No such bundle.")
    return FileResponse(open_archive(bundle), as_attachment=True, filename=f"{bundle.sha256}.tar.gz",
                        content_type="application/gzip")

"""URLs the portal signs for one attempt's pods, and the checked blobs their views serve.

A pod holds no storage credentials and no login: the launch hands it a URL of one of the portal's views whose
last part is a token signed by the portal (``django.core.signing``, SECRET_KEY, a salt of the view's own) over
what it may read and until when. Like a pre-signed S3 URL, whoever holds it may read that one thing until it
expires, nothing else; a token edited, forged or signed with another view's salt reads as not found (404), one
past its ``until`` says so (410). The same attempt always gets the same URL (the payload holds no clock but the
``until`` counted from the attempt's admission), so a launch applied again leaves its pods' spec as it was.

A blob is copied out of the store checked against its hash before a byte is sent, so bytes that are not the
key's are never served (404). The views that use this module decide what a payload names and who may still
read it: runners/bundles, runners/datasets and runners/registry ``fetch_view.py``, runners/jobs
``checkpoint_upload.py``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from datetime import datetime

from django.conf import settings
from django.core import signing
from django.http import FileResponse, Http404, HttpResponse
from django.urls import reverse

from runners.storage.blobs import BlobMissing, BlobStore, HashMismatch

# Counted from the attempt's admission: long enough for a pod that waits to be placed, bound and pull its
# image; the next attempt gets a URL of its own.
FETCH_URL_MAX_AGE_S = 6 * 3600


def signed_url(view_name: str, *, salt: str, payload: dict, since: datetime,
               max_age_s: int = FETCH_URL_MAX_AGE_S) -> str:
    """The URL of `view_name` with a token over `payload`, valid `max_age_s` after `since` (absolute when
    PORTAL_PUBLIC_URL is set). The token is the same for the same payload and `since`."""
    until = int(since.timestamp()) + max_age_s
    token = signing.Signer(salt=salt).sign_object({**payload, "until": until})
    return settings.PORTAL_PUBLIC_URL.rstrip("/") + reverse(view_name, kwargs={"token": token})


def signed_payload(token: str, *, salt: str, not_found: str, expired: str) -> dict | HttpResponse:
    """The payload `token` was signed over with `salt`, or the 410 saying `expired` once its ``until`` has passed.

    A token not signed by the portal with this salt raises Http404(`not_found`)."""
    try:
        signed = signing.Signer(salt=salt).unsign_object(token)
    except signing.BadSignature:
        raise Http404(not_found) from None
    if not isinstance(signed, dict) or not isinstance(signed.get("until"), int) or signed["until"] < time.time():
        return HttpResponse(expired, status=410, content_type="text/plain; charset=utf-8")
    return signed


def checked_blob_response(store: BlobStore, sha256: str, *, filename: str, content_type: str,
                          missing: str) -> FileResponse:
    """The blob `sha256` of `store` as an attachment, copied out whole and checked against its hash first;
    Http404(`missing`) when the store lacks it or its bytes do not match."""
    work = tempfile.mkdtemp(prefix="signed-fetch-")
    try:
        store.fetch(sha256, f"{work}/blob")  # whole and checked, or nothing
        handle = open(f"{work}/blob", "rb")  # noqa: SIM115 - the response closes it; its name goes at once
    except (HashMismatch, BlobMissing):
        raise Http404(missing) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return FileResponse(handle, as_attachment=True, filename=filename, content_type=content_type)

"""A pod that cannot read its node's cache fetches a dataset's shard from the portal through a signed URL.

Like a script job's bundle (runners/bundles/fetch_view.py): the launch hands the pod, per shard, a URL of
this view signed (``django.core.signing``, SECRET_KEY) for that shard and the job's attempt, valid
FETCH_URL_MAX_AGE_S from the attempt's admission; whoever holds it may read that one shard until it
expires, nothing else. Access to the dataset was checked when the launch was built. The shard is copied
out of the store checked against its hash before a byte is sent, so a shard whose stored bytes are not
its name's is never served (a 404 saying so, and the pod's SDK checks the hash again).
"""

import shutil
import tempfile
import time
from datetime import datetime

from django.conf import settings
from django.core import signing
from django.http import FileResponse, Http404, HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_GET

from runners.bundles.fetch_view import FETCH_URL_MAX_AGE_S
from runners.datasets.models import VersionShard, VersionState
from runners.datasets.services import store
from runners.storage.blobs import BlobMissing, HashMismatch

SALT = "runners.datasets.fetch"


def signed_shard_url(sha256: str, *, job_id: int, attempt: int, since: datetime) -> str:
    """The URL this attempt's pods fetch the shard from (absolute when PORTAL_PUBLIC_URL is set); the same attempt
    always gets the same URL."""
    until = int(since.timestamp()) + FETCH_URL_MAX_AGE_S
    token = signing.Signer(salt=SALT).sign_object({"sha256": sha256, "job": job_id, "attempt": attempt, "until": until})
    return settings.PORTAL_PUBLIC_URL.rstrip("/") + reverse("dataset-shard-fetch", kwargs={"token": token})


@require_GET
def shard_fetch(request, token: str):
    """The shard a signed URL names, checked; 404 for anything else, 410 once the URL expired."""
    try:
        signed = signing.Signer(salt=SALT).unsign_object(token)
    except signing.BadSignature:
        raise Http404("No such shard.") from None
    if not isinstance(signed.get("until"), int) or signed["until"] < time.time():
        return HttpResponse("This shard URL has expired; each attempt of the job is signed one of its own.\n",
                            status=410, content_type="text/plain; charset=utf-8")
    sha256 = signed.get("sha256")
    if not VersionShard.objects.filter(sha256=sha256, stored=True, version__state=VersionState.SEALED).exists():
        raise Http404("No such shard.")
    work = tempfile.mkdtemp(prefix="shard-fetch-")
    try:
        store().fetch(sha256, f"{work}/shard")  # whole and checked, or nothing
        handle = open(f"{work}/shard", "rb")  # noqa: SIM115 - the response closes it; its name goes at once
    except (HashMismatch, BlobMissing):
        raise Http404("This shard's stored bytes are missing or do not match its hash; it is not served.") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return FileResponse(handle, as_attachment=True, filename=f"{sha256}.tar", content_type="application/x-tar")

"""A pod that cannot read its node's cache fetches a dataset's shard from the portal through a signed URL.

Like a script job's bundle (runners/bundles/fetch_view.py): the launch hands the pod, per shard, a URL of
this view signed (``django.core.signing``, SECRET_KEY) for that shard and the job's attempt, valid
FETCH_URL_MAX_AGE_S from the attempt's admission; whoever holds it may read that one shard until it
expires, nothing else. Access to the dataset was checked when the launch was built. The shard is copied
out of the store checked against its hash before a byte is sent, so a shard whose stored bytes are not
its name's is never served (a 404 saying so, and the pod's SDK checks the hash again).
"""

from datetime import datetime

from django.http import Http404, HttpResponse
from django.views.decorators.http import require_GET

from common.signed_fetch import checked_blob_response, signed_payload, signed_url
from runners.datasets.models import VersionShard, VersionState
from runners.datasets.services import store

SALT = "runners.datasets.fetch"


def signed_shard_url(sha256: str, *, job_id: int, attempt: int, since: datetime) -> str:
    """The URL this attempt's pods fetch the shard from (absolute when PORTAL_PUBLIC_URL is set); the same attempt
    always gets the same URL."""
    return signed_url("dataset-shard-fetch", salt=SALT, since=since,
                      payload={"sha256": sha256, "job": job_id, "attempt": attempt})


@require_GET
def shard_fetch(request, token: str):
    """The shard a signed URL names, checked; 404 for anything else, 410 once the URL expired."""
    signed = signed_payload(token, salt=SALT, not_found="No such shard.",
                            expired="This shard URL has expired; each attempt of the job is signed one of its own.\n")
    if isinstance(signed, HttpResponse):
        return signed
    sha256 = signed.get("sha256")
    if not VersionShard.objects.filter(sha256=sha256, stored=True, version__state=VersionState.SEALED).exists():
        raise Http404("No such shard.")
    return checked_blob_response(
        store(), sha256, filename=f"{sha256}.tar", content_type="application/x-tar",
        missing="This shard's stored bytes are missing or do not match its hash; it is not served.")

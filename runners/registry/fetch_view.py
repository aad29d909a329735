"""An inference replica's pod fetches the model version's weights from the portal through a signed URL.

On Kubernetes a replica serving a model version reads its weights from the node cache's volume where the
cluster runs the cache agents; elsewhere its init container (``python -m runners.workloads.fetch_weights``)
downloads them into an emptyDir the server reads. The pod holds no storage credentials: the launch hands it a
URL of this view signed by the portal (``django.core.signing``, SECRET_KEY) for one version, its weights'
sha256, and the replica job's attempt it is for, valid FETCH_URL_MAX_AGE_S from the attempt's admission. Like
a pre-signed S3 URL, whoever holds it may read those weights until it expires, nothing else. The weights are
copied out of the store checked against their hash before a byte is sent, so bytes that are not the version's
are never served (a 404 saying so; the init container checks the hash again). A version deleted since reads
as not found, an expired URL says so (410), a forged one is not found.
"""

from datetime import datetime

from django.http import Http404, HttpResponse
from django.views.decorators.http import require_GET

from common.signed_fetch import checked_blob_response, signed_payload, signed_url
from runners.registry.models import ModelVersion
from runners.registry.selectors import version_of_replica_weights
from runners.registry.services import weights_store

SALT = "runners.registry.weights-fetch"


def signed_weights_url(version: ModelVersion, *, job_id: int, attempt: int, since: datetime) -> str:
    """The URL this replica attempt's pod fetches the version's weights from, valid FETCH_URL_MAX_AGE_S after
    `since` (absolute when PORTAL_PUBLIC_URL is set). The same attempt always gets the same URL, so a launch
    applied again leaves its pod's spec as it was."""
    return signed_url("model-weights-fetch", salt=SALT, since=since, payload={
        "version": version.id, "sha256": version.weights_sha256, "job": job_id, "attempt": attempt})


@require_GET
def weights_fetch(request, token: str):
    """The weights a signed URL names, checked; 404 for anything else, 410 once the URL expired."""
    signed = signed_payload(
        token, salt=SALT, not_found="No such model weights.",
        expired="This weights URL has expired; each attempt of a replica is signed one of its own.\n")
    if isinstance(signed, HttpResponse):
        return signed
    version_id, sha256 = signed.get("version"), signed.get("sha256")
    if not isinstance(version_id, int) or not isinstance(sha256, str):
        raise Http404("No such model weights.")
    version = version_of_replica_weights(version_id=version_id, sha256=sha256)
    if version is None:
        raise Http404("No such model weights (the version was deleted, or never had these).")
    return checked_blob_response(
        weights_store(), sha256, filename=f"{version.name}-v{version.version}-{sha256[:12]}.weights",
        content_type="application/octet-stream",
        missing="These weights' stored bytes are missing or do not match their hash; they are not served.")

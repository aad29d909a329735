"""A Kubernetes job's checkpoints reach the store through the portal: its pods' uploader sends them here.

On Kubernetes a checkpoint's file lies on the environment's volume in the cluster, where the portal does not
read it, so the upload happens in the pod: the uploader (`runners.workloads.checkpoint_uploader`, a native
sidecar of the job's pods) watches the job folder's checkpoints, cuts each into the store's chunks
(runners.storage.chunks) and

1. POSTs its manifest to ``checkpoints/upload/<token>/``: the portal claims the recorded checkpoint of that
   step (state storing, under a lease), reserves its chunks' bytes against the tenant's storage quota exactly
   as the worker does (`checkpoint_store.checkpoint_reserve`), and answers the chunks the store lacks;
2. PUTs each of those to ``checkpoints/upload/<token>/chunks/<sha256>``: the portal checks its bytes hash to
   the key and that a checkpoint of the job being stored names that chunk of that size, and stores it;
3. POSTs the manifest again: once the store holds every chunk (checked under the store's lock, as the
   worker's seal is) the checkpoint is durable.

The pod never holds the store's credentials: the token is signed by the portal (``django.core.signing``,
SECRET_KEY) for one job's attempt, valid UPLOAD_URL_SLACK_S past the attempt's runtime budget from its
admission, and lets its holder store that job's checkpoints' chunks, nothing else; another job's or a
forged token reads as not found. A checkpoint the portal has not recorded yet (its progress read lags the
file) is a 409: the uploader asks again later.
"""

from __future__ import annotations

import hashlib
import json

from django.http import Http404, HttpResponse, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from common.signed_fetch import signed_payload, signed_url
from runners.jobs import checkpoint_store
from runners.jobs.models import Checkpoint, Job, JobAttempt
from runners.storage import chunks

SALT = "runners.jobs.checkpoint_upload"
# Past the attempt's runtime budget, counted from its admission: the wait to be placed and started, and the
# upload of the checkpoint written at the end.
UPLOAD_URL_SLACK_S = 6 * 3600
# The largest manifest body (a checkpoint of a few hundred GB is a few hundred thousand chunks).
MANIFEST_MAX_BYTES = 64 << 20


def signed_upload_url(job: Job, attempt: JobAttempt) -> str:
    """Where this attempt's pods send the job's checkpoints (absolute when PORTAL_PUBLIC_URL is set). The same
    attempt always gets the same URL, so a launch applied again leaves its pods' spec as it was."""
    return signed_url("checkpoint-upload", salt=SALT, payload={"job": job.id, "attempt": attempt.number},
                      since=attempt.admitted_at,
                      max_age_s=int(job.spec.get("max_runtime_s") or 0) + UPLOAD_URL_SLACK_S)


def _job_of(token: str) -> Job | HttpResponse:
    signed = signed_payload(token, salt=SALT, not_found="No such upload.",
                            expired="This upload URL has expired; each attempt of the job is signed one of its own.\n")
    if isinstance(signed, HttpResponse):
        return signed
    job = Job.objects.select_related("tenant").filter(id=signed.get("job")).first()
    if job is None or not job.attempts.filter(number=signed.get("attempt")).exists():
        raise Http404("No such upload.")
    return job


def _answer(checkpoint: Checkpoint, missing: list[str], status: int = 200) -> JsonResponse:
    return JsonResponse({"step": checkpoint.step, "state": checkpoint.store_state,
                         "reason": checkpoint.store_reason, "missing": missing}, status=status)


@csrf_exempt
@require_http_methods(["POST"])
def checkpoint_manifest(request, token: str):
    """Claim the job's recorded checkpoint of this step for the manifest, reserve it, and answer the chunks the
    store lacks; durable once it lacks none."""
    job = _job_of(token)
    if isinstance(job, HttpResponse):
        return job
    body = request.read(MANIFEST_MAX_BYTES + 1)
    if len(body) > MANIFEST_MAX_BYTES:
        return JsonResponse({"detail": "The manifest is too large."}, status=413)
    try:
        data = json.loads(body)
        step, uri = data["step"], data["path"]
        manifest = chunks.Manifest.from_json(data["manifest"])
        if not isinstance(step, int) or not isinstance(uri, str):
            raise ValueError("step is an integer and path a string")
    except (ValueError, KeyError, TypeError) as exc:
        return JsonResponse({"detail": f"Not a checkpoint manifest: {exc}"}, status=400)
    checkpoint = Checkpoint.objects.select_related("job__tenant").filter(job=job, step=step).first()
    if checkpoint is None:
        return JsonResponse({"detail": f"The portal has not recorded the checkpoint of step {step} yet; "
                                       "send it again later."}, status=409)
    if checkpoint.uri != uri or (checkpoint.bytes and checkpoint.bytes != manifest.bytes):
        return JsonResponse({"detail": f"The checkpoint of step {step} is {checkpoint.uri} of {checkpoint.bytes} "
                                       "bytes, not this file."}, status=400)
    if not checkpoint_store.store_enabled():
        return JsonResponse({"detail": "The checkpoint store is off."}, status=409)
    claimed = Checkpoint.objects.filter(id=checkpoint.id, store_state__in=("", "pending")).update(
        store_state="storing", store_reason="", store_lease_until=checkpoint_store.lease_until())
    checkpoint.refresh_from_db()
    if claimed:
        try:
            checkpoint_store.checkpoint_reserve(checkpoint, manifest)
        except checkpoint_store.StoreRefused as exc:
            checkpoint_store.checkpoint_fail(checkpoint, str(exc))
            checkpoint.refresh_from_db()
            return _answer(checkpoint, [])
        checkpoint.refresh_from_db()
    if checkpoint.store_state != "storing":
        return _answer(checkpoint, [])  # durable already, or failed, skipped, discarded: nothing to send
    if (checkpoint.manifest or {}).get("sha256") != manifest.sha256:
        return JsonResponse({"detail": f"The checkpoint of step {step} is being stored from other bytes."},
                            status=409)
    Checkpoint.objects.filter(id=checkpoint.id, store_state="storing").update(
        store_lease_until=checkpoint_store.lease_until())
    store = checkpoint_store.checkpoint_blobs()
    missing = chunks.missing(store, manifest)
    if not missing:
        checkpoint_store.checkpoint_seal(checkpoint.id, manifest, store=store)
        checkpoint.refresh_from_db()
        missing = [] if checkpoint.store_state == "durable" else chunks.missing(store, manifest)
    return _answer(checkpoint, missing)


@csrf_exempt
@require_http_methods(["PUT"])
def checkpoint_chunk(request, token: str, sha256: str):
    """Store one chunk that a checkpoint of the job being stored names, once its bytes hash to its key."""
    job = _job_of(token)
    if isinstance(job, HttpResponse):
        return job
    data = request.read(chunks.MAX_CHUNK_BYTES + 1)
    if len(data) > chunks.MAX_CHUNK_BYTES:
        return JsonResponse({"detail": f"A chunk is at most {chunks.MAX_CHUNK_BYTES} bytes."}, status=413)
    if hashlib.sha256(data).hexdigest() != sha256:
        return JsonResponse({"detail": "The chunk's bytes do not hash to its key."}, status=400)
    named = Checkpoint.objects.filter(job=job, store_state="storing",
                                      manifest__chunks__contains=[[sha256, len(data)]])
    if not named.exists():
        return JsonResponse({"detail": "No checkpoint of the job being stored names this chunk."}, status=404)
    checkpoint_store.checkpoint_blobs().put_bytes(data)
    named.update(store_lease_until=checkpoint_store.lease_until())
    return HttpResponse(status=204)


urlpatterns = [
    path("checkpoints/upload/<str:token>/", checkpoint_manifest, name="checkpoint-upload"),
    path("checkpoints/upload/<str:token>/chunks/<str:sha256>", checkpoint_chunk, name="checkpoint-upload-chunk"),
]

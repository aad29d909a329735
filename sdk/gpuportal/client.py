"""The portal's HTTP API, as the `portal` command uses it (httpx; no Django).

    client = Client("https://portal.example.com", token="...")
    job = client.job(42)

Every call answers the API's JSON, or raises PortalError: its message says what went wrong in one line
(the field a 400 names, the detail of a 401, 403, 404 or 409) and its `exit_code` is what the command
exits with (the EXIT_ codes below).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import IO, Any

import httpx

# What the command's exit status means; docs/cli.md lists the same.
EXIT_OK = 0
EXIT_JOB_FAILED = 1  # the job ended failed or cancelled (or `portal` itself could not go on)
EXIT_BAD_INPUT = 2  # a flag, a job file or the portal said the request was wrong (400, 409, 413, 415)
EXIT_AUTH = 3  # no token, a token the portal refuses (401) or a role that may not (403)
EXIT_NOT_FOUND = 4  # no such job, environment or checkpoint (404, 410), or another tenant's
EXIT_UNAVAILABLE = 5  # the portal did not answer, or answered 5xx or 429 after retrying

TIMEOUT_S = 30.0
# Reads, submits and uploads are sent again this many times when the connection fails or the portal
# answers 503 or 429 (a submit carries the same Idempotency-Key, so a repeat never makes a second job).
RETRIES = 3
RETRY_WAIT_MAX_S = 10.0


class PortalError(Exception):
    """A request the portal refused or could not answer: one line to show, and the exit code it means."""

    def __init__(self, message: str, exit_code: int, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.status = status


def exit_code_for_status(status: int) -> int:
    """The command's exit code for an HTTP error status."""
    if status in (401, 403):
        return EXIT_AUTH
    if status in (404, 410):
        return EXIT_NOT_FOUND
    if status == 429 or status >= 500:
        return EXIT_UNAVAILABLE
    return EXIT_BAD_INPUT


def _first_error(body: Any) -> str:
    """The first thing an error body says, as `field: message` when it names a field."""
    if isinstance(body, list) and body:
        return _first_error(body[0])
    if isinstance(body, dict) and body:
        if "detail" in body:
            return _first_error(body["detail"])
        field, value = next(iter(body.items()))
        return f"{field}: {_first_error(value)}"
    return str(body).strip()


# What to do next, after the portal's own words, for the statuses where it is always the same.
ADVICE = {
    401: "log in again with `portal login URL`, or set PORTAL_TOKEN",
    403: "ask an owner of the tenant for a role that may",
    429: "wait a little and try again",
}


def error_message(response: httpx.Response) -> str:
    """One line for an error answer: what the portal said, and what to do where that is always the same."""
    try:
        said = _first_error(response.json())
    except ValueError:
        said = ""
    if not said:
        said = f"{response.request.method} {response.request.url.path} answered {response.status_code} {response.reason_phrase}"
    said = " ".join(said.split())
    advice = ADVICE.get(response.status_code)
    if response.status_code == 503 and "Retry-After" in response.headers:
        advice = f"try again in {response.headers['Retry-After']} s"
    return f"{said} ({advice})" if advice else said


class _Counted:
    """A file the upload reads in chunks, telling `progress` how many bytes went so far (from 0 again when a
    retry starts over)."""

    def __init__(self, data: bytes, progress: Callable[[int], None] | None):
        self.data = data
        self.offset = 0
        self.progress = progress

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size is None or size < 0 else min(len(self.data), self.offset + size)
        chunk = self.data[self.offset:end]
        self.offset = end
        if chunk and self.progress:
            self.progress(self.offset)
        return chunk

    def seek(self, offset: int, whence: int = 0) -> int:
        self.offset = offset if whence == 0 else (len(self.data) + offset if whence == 2 else self.offset + offset)
        return self.offset

    def tell(self) -> int:
        return self.offset


def package_version() -> str:
    """The installed gpuportal's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpuportal")
    except PackageNotFoundError:
        return "unknown"


class Client:
    """One portal and the token sent to it; use it as a context manager (it holds a connection pool)."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = TIMEOUT_S):
        self.url = url.rstrip("/")
        headers = {"User-Agent": f"gpuportal/{package_version()}", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Token {token}"
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # --- Plumbing -----------------------------------------------------------

    def _send(self, method: str, path: str, *, retry: bool = False, **kwargs) -> httpx.Response:
        """One request; PortalError for a connection that fails or an error status.

        With `retry`, a failed connection, a 503 or a 429 is sent again (waiting Retry-After, at most
        RETRY_WAIT_MAX_S) up to RETRIES times: only for requests that are safe to repeat.
        """
        for attempt in range(RETRIES + 1 if retry else 1):
            last = attempt == (RETRIES if retry else 0)
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TimeoutException as exc:
                if last:
                    raise PortalError(f"{self.url} did not answer in time ({exc.__class__.__name__}); try again",
                                      EXIT_UNAVAILABLE) from None
            except httpx.TransportError as exc:
                if last:
                    raise PortalError(f"cannot reach {self.url}: {exc} (is the URL right and the portal up?)",
                                      EXIT_UNAVAILABLE) from None
            else:
                if response.is_success:
                    return response
                if last or response.status_code not in (429, 503):
                    raise PortalError(error_message(response), exit_code_for_status(response.status_code),
                                      response.status_code)
                wait = response.headers.get("Retry-After", "1")
                time.sleep(min(RETRY_WAIT_MAX_S, float(wait) if wait.isdigit() else 1.0))
                continue
            time.sleep(min(RETRY_WAIT_MAX_S, 2.0 ** attempt))
        raise AssertionError("unreachable")  # the loop returns or raises on its last round

    def get(self, path: str, **params) -> Any:
        params = {key: value for key, value in params.items() if value is not None}
        return self._send("GET", path, params=params, retry=True).json()

    def post(self, path: str, body: dict | None = None, *, headers: dict | None = None, retry: bool = False) -> Any:
        response = self._send("POST", path, json=body if body is not None else {}, headers=headers, retry=retry)
        return response.json() if response.content else None

    def pages(self, path: str, *, limit: int | None = None, **params) -> Iterator[dict]:
        """The items of a paginated list, page after page, at most `limit` of them."""
        params = {key: value for key, value in params.items() if value is not None}
        seen = 0
        page: Any = self._send("GET", path, params=params, retry=True).json()
        while True:
            items = page["results"] if isinstance(page, dict) and "results" in page else page
            for item in items:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield item
            following = page.get("next") if isinstance(page, dict) else None
            if not following:
                return
            page = self._send("GET", following, retry=True).json()

    # --- Who ----------------------------------------------------------------

    def login(self, username: str, password: str) -> dict:
        """A new token for a username and password: {token, expiry}."""
        return self.post("/api/v1/auth/token/", {"username": username, "password": password})

    def logout(self) -> None:
        """Revoke the token in use."""
        self._send("DELETE", "/api/v1/auth/token/")

    def current_token(self) -> dict:
        """The token in use: {id, name, user, created, expiry, last_used_at, current}."""
        for info in self.pages("/api/v1/tokens/"):
            if info.get("current"):
                return info
        raise PortalError("the portal does not list the token in use; log in again with `portal login URL`",
                          EXIT_AUTH)

    def tenants(self) -> list[dict]:
        return list(self.pages("/api/v1/tenants/"))

    # --- Environments, quotas -----------------------------------------------

    def environments(self, tenant: str | None = None, state: str | None = None) -> list[dict]:
        return list(self.pages("/api/v1/environments/", tenant=tenant, state=state))

    def environment(self, environment_id: int) -> dict:
        return self.get(f"/api/v1/environments/{environment_id}/")

    def kubeconfig(self, environment_id: int) -> tuple[str, str | None]:
        """The environment's kubeconfig (YAML) and when its token stops working."""
        response = self._send("GET", f"/api/v1/environments/{environment_id}/kubeconfig/", retry=True)
        return response.text, response.headers.get("X-Token-Expires-At")

    def quotas(self, tenant: str | None = None) -> list[dict]:
        return list(self.pages("/api/v1/quotas/", tenant=tenant))

    def flavors(self) -> list[dict]:
        return list(self.pages("/api/v1/flavors/"))

    # --- Jobs ---------------------------------------------------------------

    def jobs(self, *, tenant: str | None = None, state: str | None = None, limit: int | None = None) -> list[dict]:
        return list(self.pages("/api/v1/jobs/", limit=limit, tenant=tenant, state=state))

    def job(self, job_id: int) -> dict:
        return self.get(f"/api/v1/jobs/{job_id}/")

    def submit(self, spec: dict, idempotency_key: str | None = None) -> dict:
        """Submit a job; sent again with the same Idempotency-Key when the answer is lost (one job, never two)."""
        key = idempotency_key or str(uuid.uuid4())
        return self.post("/api/v1/jobs/", spec, headers={"Idempotency-Key": key}, retry=True)

    def cancel(self, job_id: int) -> dict:
        return self.post(f"/api/v1/jobs/{job_id}/cancel/")

    def logs(self, job_id: int, *, rank: int | None = None, attempt: int | None = None, tail: int | None = None) -> dict:
        """{attempt, replica, text}: one replica's last lines."""
        return self.get(f"/api/v1/jobs/{job_id}/logs/", rank=rank, attempt=attempt, tail=tail)

    def checkpoint_download(self, job_id: int, step: int, out: IO[bytes],
                            progress: Callable[[int, int | None], None] | None = None) -> int:
        """Write a checkpoint's file to `out`, telling `progress` (bytes so far, total) as it goes: its size."""
        path = f"/api/v1/jobs/{job_id}/checkpoints/{step}/download/"
        try:
            with self.http.stream("GET", path) as response:
                if not response.is_success:
                    response.read()
                    raise PortalError(error_message(response), exit_code_for_status(response.status_code),
                                      response.status_code)
                total = int(response.headers["Content-Length"]) if "Content-Length" in response.headers else None
                written = 0
                for chunk in response.iter_bytes():
                    out.write(chunk)
                    written += len(chunk)
                    if progress:
                        progress(written, total)
                return written
        except httpx.TransportError as exc:
            raise PortalError(f"the download from {self.url} broke off: {exc}; try again", EXIT_UNAVAILABLE) from None

    # --- Bundles ------------------------------------------------------------

    def bundle_exists(self, tenant: str, digest: str) -> bool:
        try:
            self._send("GET", f"/api/v1/tenants/{tenant}/bundles/{digest}/", retry=True)
        except PortalError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def bundle_upload(self, tenant: str, archive: bytes, progress: Callable[[int], None] | None = None) -> dict:
        """Upload a packed folder (`gpuportal.bundle.pack`), telling `progress` the bytes sent so far; the
        portal answers 201, or 200 when it had it already."""
        body = _Counted(archive, progress)
        response = self._send("POST", f"/api/v1/tenants/{tenant}/bundles/",
                              files={"archive": ("bundle.tar.gz", body, "application/gzip")}, retry=True)
        return response.json()

    # --- Datasets (gpuportal.cli.data pushes through these) -------------------

    def _dataset_path(self, tenant: str, name: str) -> tuple[str, dict]:
        """The API path of a dataset named `name` or `owner/name`, and the query that names its owner."""
        owner, _, bare = name.rpartition("/")
        return f"/api/v1/tenants/{tenant}/datasets/{bare}", ({"owner": owner} if owner else {})

    def datasets(self, tenant: str) -> list[dict]:
        """Every dataset the tenant reads, its own and those shared with it (every page of the list)."""
        return list(self.pages(f"/api/v1/tenants/{tenant}/datasets/"))

    def dataset_versions(self, tenant: str, name: str) -> list[dict]:
        """The dataset's sealed versions, newest first (every page of the list)."""
        path, query = self._dataset_path(tenant, name)
        return list(self.pages(f"{path}/versions/", **query))

    def dataset_shards(self, tenant: str, name: str, number: int) -> Iterator[dict]:
        """The version's shards in order, read a page at a time: {position, sha256, bytes, samples, stored}."""
        path, query = self._dataset_path(tenant, name)
        return self.pages(f"{path}/versions/{number}/shards/", **query)

    def dataset_index(self, tenant: str, name: str, number: int) -> Iterator[dict]:
        """The version's files in order, read a page at a time: {path, bytes, shard}."""
        path, query = self._dataset_path(tenant, name)
        return self.pages(f"{path}/versions/{number}/index/", **query)

    def dataset(self, tenant: str, name: str) -> dict:
        path, query = self._dataset_path(tenant, name)
        return self.get(f"{path}/", **query)

    def dataset_version(self, tenant: str, name: str, number: int) -> dict:
        path, query = self._dataset_path(tenant, name)
        return self.get(f"{path}/versions/{number}/", **query)

    def dataset_create(self, tenant: str, name: str, description: str = "") -> dict:
        return self.post(f"/api/v1/tenants/{tenant}/datasets/", {"name": name, "description": description})

    def dataset_share(self, tenant: str, name: str, other: str) -> dict:
        return self.post(f"/api/v1/tenants/{tenant}/datasets/{name}/shares/", {"tenant": other})

    def dataset_register(self, tenant: str, name: str, url: str) -> dict:
        return self.post(f"/api/v1/tenants/{tenant}/datasets/{name}/registrations/", {"url": url})

    def dataset_version_open(self, tenant: str, name: str, manifest_sha256: str) -> dict:
        """An open version to push into (a cut push of the same shards gets its own open version back)."""
        return self.post(f"/api/v1/tenants/{tenant}/datasets/{name}/versions/", {"manifest_sha256": manifest_sha256},
                         retry=True)

    def dataset_shards_declare(self, tenant: str, name: str, number: int, shards: list[dict]) -> list[dict]:
        """Declare shards (safe to repeat): the version's shards the portal still lacks, with the bytes it has."""
        return self.post(f"/api/v1/tenants/{tenant}/datasets/{name}/versions/{number}/shards/", {"shards": shards},
                         retry=True)["missing"]

    def dataset_shard_part(self, tenant: str, name: str, number: int, sha256: str, offset: int, data: bytes) -> dict:
        """Send the part of a shard that starts at `offset`: {sha256, received_bytes, stored}."""
        response = self._send("PUT", f"/api/v1/tenants/{tenant}/datasets/{name}/versions/{number}/shards/{sha256}/",
                              params={"offset": offset}, content=data,
                              headers={"Content-Type": "application/octet-stream"})
        return response.json()

    def dataset_seal(self, tenant: str, name: str, number: int, shards: int) -> dict:
        return self.post(f"/api/v1/tenants/{tenant}/datasets/{name}/versions/{number}/seal/", {"shards": shards},
                         retry=True)

    # --- The model registry (gpuportal.cli.models) ---------------------------

    def models(self, tenant: str) -> list[dict]:
        return list(self.pages(f"/api/v1/tenants/{tenant}/models/"))

    def model(self, tenant: str, name: str) -> dict:
        return self.get(f"/api/v1/tenants/{tenant}/models/{name}/")

    def model_version(self, tenant: str, name: str, version: int) -> dict:
        return self.get(f"/api/v1/tenants/{tenant}/models/{name}/versions/{version}/")

    def model_promote(self, tenant: str, *, name: str, job_id: int, step: int | None = None) -> dict:
        """A new version of `name` from the job's checkpoint (the same version again when it holds it already)."""
        body = {"name": name, "job": job_id, **({} if step is None else {"step": step})}
        return self.post(f"/api/v1/tenants/{tenant}/models/", body)

    # --- Checkpoint storage ------------------------------------------------

    def storage(self, tenant: str) -> dict:
        """The tenant's checkpoint storage: quota, bytes stored after deduplication, retention policy."""
        return self.get(f"/api/v1/tenants/{tenant}/storage/")

    def storage_set(self, tenant: str, **fields) -> dict:
        """Change `retention` (admins, owners; None keeps everything) or `quota_gb` (staff; None: no limit)."""
        return self._send("PATCH", f"/api/v1/tenants/{tenant}/storage/", json=fields).json()

    def retention_preview(self, tenant: str, retention: dict | None, *, job_id: int | None = None) -> dict:
        """What a proposed retention policy would delete and free now; nothing is saved."""
        body = {"retention": retention, **({} if job_id is None else {"job": job_id})}
        return self.post(f"/api/v1/tenants/{tenant}/storage/preview/", body)

    # --- Endpoints, usage ---------------------------------------------------

    def endpoint_create(self, spec: dict) -> dict:
        return self.post("/api/v1/endpoints/", spec)

    def endpoint(self, endpoint_id: int) -> dict:
        return self.get(f"/api/v1/endpoints/{endpoint_id}/")

    def workspaces(self, tenant: str | None = None) -> list[dict]:
        return [w for w in self.pages("/api/v1/workspaces/") if tenant is None or w["tenant"] == tenant]

    def workspace(self, workspace_id: int) -> dict:
        return self.get(f"/api/v1/workspaces/{workspace_id}/")

    def workspace_create(self, spec: dict) -> dict:
        return self.post("/api/v1/workspaces/", spec)

    def workspace_start(self, workspace_id: int) -> dict:
        return self.post(f"/api/v1/workspaces/{workspace_id}/start/")

    def workspace_stop(self, workspace_id: int) -> dict:
        return self.post(f"/api/v1/workspaces/{workspace_id}/stop/")

    def usage(self, *, start: str | None = None, end: str | None = None, group_by: str | None = None,
              tenant: str | None = None) -> list[dict]:
        return self.get("/api/v1/usage/", start=start, end=end, group_by=group_by, tenant=tenant)

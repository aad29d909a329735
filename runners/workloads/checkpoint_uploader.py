"""The checkpoint uploader: a native sidecar of a Kubernetes job's pods that sends the job's checkpoints to the
portal's store through the portal (runners/jobs/checkpoint_upload.py), with a URL signed for the attempt.

    python -m runners.workloads.checkpoint_uploader --job-dir /checkpoints/job-7 [--interval-s 10] [--once]

The URL comes in PORTAL_CHECKPOINT_UPLOAD_URL. Rank 0's pod uploads (the SDK writes the checkpoints there); the
other ranks' uploaders wait for the end without doing anything (a native sidecar that exited would be
restarted). Every ``interval`` it lists the job folder's checkpoints (final names only: the SDK renames a
checkpoint into place once it is whole) and, for each it has not finished, cuts it into the store's chunks
(runners.storage.chunks, hashed once), POSTs the manifest, PUTs each chunk the portal says the store lacks,
and POSTs the manifest again until the portal says the checkpoint is durable (or failed, skipped, discarded:
then it stops too). A checkpoint the portal has not recorded yet (409) is tried again at the next pass.

It holds no credentials of the store, reads the job folder only (mounted read-only), and runs at the lowest
CPU priority the kernel gives it (SCHED_IDLE, else nice 19), so the training's cores come first. On SIGTERM
(the kubelet ends sidecars once the trainer has exited) it makes one last pass, for the checkpoint the trainer
wrote as it stopped, then exits 0.

Pure: stdlib, runners.storage.chunks (fastcdc) and the SDK's checkpoint names; no Django, no portal app.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpuportal import _protocol as protocol

from runners.storage import chunks

URL_VARIABLE = "PORTAL_CHECKPOINT_UPLOAD_URL"
FINISHED = ("durable", "failed", "skipped", "discarded")
HTTP_TIMEOUT_S = 60
# How many manifest rounds one pass gives a checkpoint (a chunk collected between its PUT and the seal is
# asked for again).
ROUNDS = 3


class Portal:
    """The upload endpoints of one attempt."""

    def __init__(self, url: str, opener=urllib.request.urlopen):
        self.url = url.rstrip("/") + "/"
        self.open = opener

    def _call(self, method: str, url: str, data: bytes, content_type: str) -> tuple[int, dict]:
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
        try:
            with self.open(request, timeout=HTTP_TIMEOUT_S) as response:
                body = response.read()
                return response.status, json.loads(body) if body else {}
        except urllib.error.HTTPError as exc:
            body = exc.read()
            try:
                return exc.code, json.loads(body) if body else {}
            except ValueError:
                return exc.code, {"detail": body.decode(errors="replace")[:500]}

    def manifest(self, step: int, path: str, manifest: chunks.Manifest) -> tuple[int, dict]:
        body = json.dumps({"step": step, "path": path, "manifest": manifest.to_json()}).encode()
        return self._call("POST", self.url, body, "application/json")

    def chunk(self, sha256: str, data) -> tuple[int, dict]:
        return self._call("PUT", f"{self.url}chunks/{sha256}", bytes(data), "application/octet-stream")


def lower_priority() -> str:
    """The lowest CPU priority the kernel gives this process: "idle" (SCHED_IDLE), "nice" (19) or "normal"."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (OSError, AttributeError):
        pass
    try:
        os.nice(19 - os.nice(0))
        return "nice"
    except OSError:
        return "normal"


def checkpoints(job_dir: Path) -> list[tuple[int, Path]]:
    """The job folder's checkpoint files (never a folder or a link), oldest first."""
    found = []
    for step, path in protocol.checkpoint_entries(job_dir).items():
        if path.is_file() and not path.is_symlink():
            found.append((step, path))
    return found


def upload(portal: Portal, job_dir: Path, step: int, path: Path, log=print) -> str:
    """Send one checkpoint; the state the portal answered last ("recorded later" for a 409, "error" for
    anything else it refused)."""
    relative = path.relative_to(job_dir).as_posix()
    manifest = chunks.split(path)
    for _round in range(ROUNDS):
        status, answer = portal.manifest(step, relative, manifest)
        if status == 409:
            return "recorded later"
        if status != 200:
            log(f"checkpoint of step {step}: the portal answered {status}: {answer.get('detail', answer)}")
            return "error"
        if answer["state"] in FINISHED or not answer["missing"]:
            return answer["state"]
        wanted = set(answer["missing"])
        with open(path, "rb") as handle:
            offset = 0
            for chunk in manifest.chunks:
                start, offset = offset, offset + chunk.bytes
                if chunk.sha256 not in wanted:
                    continue
                wanted.discard(chunk.sha256)
                handle.seek(start)
                status, answer = portal.chunk(chunk.sha256, handle.read(chunk.bytes))
                if status != 204:
                    log(f"checkpoint of step {step}: chunk {chunk.sha256} refused ({status}): "
                        f"{answer.get('detail', answer)}")
                    return "error"
    return "storing"


def run_pass(portal: Portal, job_dir: Path, done: set[int], log=print) -> None:
    for step, path in checkpoints(job_dir):
        if step in done:
            continue
        try:
            state = upload(portal, job_dir, step, path, log)
        except FileNotFoundError:
            continue  # deleted by the SDK meanwhile (a newer one was written)
        except (OSError, ValueError) as exc:
            log(f"checkpoint of step {step}: not sent this time: {exc}")
            continue
        if state in FINISHED:
            done.add(step)
            log(f"checkpoint of step {step}: {state}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--interval-s", type=float, default=10.0)
    parser.add_argument("--once", action="store_true", help="one pass, then exit")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"checkpoint-uploader: {message}", flush=True)

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    if os.environ.get("RANK", "0") != "0":
        log("not rank 0: nothing to upload")
        while not stopping:
            signal.pause()
        return 0
    url = os.environ.get(URL_VARIABLE, "")
    if not url:
        log(f"no {URL_VARIABLE}: nothing to upload to")
        return 2
    log(f"watching {args.job_dir} at {lower_priority()} priority")
    portal = Portal(url)
    done: set[int] = set()
    while True:
        last = bool(stopping) or args.once
        run_pass(portal, args.job_dir, done, log)
        if last:
            return 0
        deadline = time.monotonic() + args.interval_s
        while not stopping and time.monotonic() < deadline:
            time.sleep(min(0.5, args.interval_s))


if __name__ == "__main__":
    sys.exit(main())

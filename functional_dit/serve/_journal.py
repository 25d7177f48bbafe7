"""The journal of accepted requests (``serve --journal PATH``): one JSON line per event.

``{"event": "accepted", "id", "body", "time"}`` is written and fsynced after a request
passes its checks and is queued, before its first step; ``{"event": "done", "id",
"status"}`` when its answer is decided (200, 499 client gone, 500, 504). What
``serve --resume-journal`` promises (docs/serving.md): every accepted request without a
"done" line is run again from its body at start-up, before new requests are admitted
(same seed, same images), and written to ``PATH.results/<id>-<j>.png``, then marked
done with status "resumed", or "failed" with the reason when it cannot run now (for
example a LoRA no longer loaded). The original client is not answered again.
"""

from __future__ import annotations

import json
import os
import threading
import time

from ._app import BadRequest
from ._engine import Job


class Journal:
    def __init__(self, path: str):
        self.path, self._lock = path, threading.Lock()
        torn = os.path.exists(path) and os.path.getsize(path) and not _ends_with_newline(path)
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the server's life
        if torn:  # a crash mid-line: the next record starts on a line of its own
            self._f.write("\n")

    def _write(self, record: dict) -> None:
        with self._lock:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())

    def accepted(self, job_id: str, body: dict) -> None:
        self._write({"event": "accepted", "id": job_id, "body": body, "time": time.time()})

    def done(self, job_id: str, status) -> None:
        self._write({"event": "done", "id": job_id, "status": status})

    def close(self) -> None:
        self._f.close()


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def unfinished(path: str) -> list[tuple[str, dict]]:
    """(id, body) of each accepted request with no "done" line, in order; a torn last
    line (a crash mid-write) is skipped."""
    if not os.path.exists(path):
        return []
    accepted, done = {}, set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "accepted":
                accepted[rec["id"]] = rec["body"]
            elif rec.get("event") == "done":
                done.add(rec["id"])
    return [(i, b) for i, b in accepted.items() if i not in done]


def resume(path: str, service, submit) -> int:
    """Queue every unfinished request of the journal at ``path`` again (module docstring);
    ``submit(job)`` queues a job. Returns how many were queued."""
    out = path + ".results"
    queued = 0
    for job_id, body in unfinished(path):
        try:
            reqs = service.requests(body)
        except BadRequest as e:
            service.journal.done(job_id, f"failed: {e}")
            continue

        def deliver(images, err, job_id=job_id):
            if err is not None:
                service.journal.done(job_id, f"failed: {type(err).__name__}: {err}")
                return
            os.makedirs(out, exist_ok=True)
            for j, img in enumerate(images):
                img.save(os.path.join(out, f"{job_id}-{j}.png"))
            service.journal.done(job_id, "resumed")

        submit(Job(job_id, reqs, deliver, body=body))
        queued += 1
    return queued

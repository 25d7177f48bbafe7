"""``serve`` under torchrun (``--tp``, ``--sp``, ``--dp``): rank 0 serves HTTP and admits
requests; the ranks of one dp group run the same engine turn by turn on their shard of
the params (tp: the weights split; sp: each step's sequence split, Ulysses, as
``fd.sample`` on an sp mesh); the dp groups run separate batches.

At the start of each turn rank 0 broadcasts over the world what changed since the last
one (the jobs that arrived, as ids, HTTP bodies, the dp group each is assigned to and rank
0's arrival time, which orders them by priority on every rank alike; the
ids of jobs to cancel; whether to stop: `Ranks.sync`); every rank takes the jobs of its
own group and runs the same turn as the other ranks of its group, so their batches and
the collectives inside ``fd.apply`` agree. Idle, rank 0 still broadcasts once a second.

**dp groups** (``--dp N``): rank 0 assigns each request to the group with the fewest
outstanding images (ties: the lowest group), all of a request's images to one group.
Each group's leader (its first rank) returns the images its group finished to rank 0 at
the start of the next turn (one gather over the world), with its queue depth, running
batch size, skipped cache steps and (``--xla-buckets``) its backend's compile and bucket
counts for ``/metrics``; rank 0 answers the client. The groups step in lockstep
turns (one broadcast and one gather per turn), each its own batch.

A rank that dies makes the others' next collective fail (or time out after
``--rank-timeout`` s): rank 0's engine then fails, every waiting client gets a 503, and
every process exits non-zero.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import NoReturn

import torch.distributed as dist

from ._engine import Job


class Ranks:
    """This rank's place (``rank``, its dp ``group`` of ``dp``, whether it leads it) and
    the engine's ``sync`` over the world; on rank 0 also the jobs other groups run."""

    def __init__(self, service, rank: int, group: int, dp: int, leader: bool):
        self.service, self.rank, self.group, self.dp, self.leader = service, rank, group, dp, leader
        self.remote: dict = {}  # rank 0: id -> job another group runs
        self.load = [0] * dp  # rank 0: outstanding images per group
        # rank 0: (queued, running, cache-skipped, fixed-shape backend's stats or None) each leader reported last
        self.reported = [(0, 0, 0, None)] * dp
        self.outbox: list = []  # a leader: (id, images, error text) finished since the last turn

    # ------------------------------------------------------------------ rank 0's view

    def queued(self) -> int:
        return sum(r[0] for r in self.reported[1:])

    def running(self) -> int:
        return sum(r[1] for r in self.reported[1:])

    def cache_skipped(self) -> int:
        return sum(r[2] for r in self.reported[1:])

    def backend_stats(self) -> list:
        """The other groups' fixed-shape backend stats (``serve --xla-buckets``: /metrics sums them)."""
        return [r[3] for r in self.reported[1:] if r[3] is not None]

    def idle(self) -> bool:
        return not self.remote

    def jobs(self) -> list:
        return list(self.remote.values())

    def _assign(self, job) -> int:
        g = min(range(self.dp), key=lambda k: (self.load[k], k))
        self.load[g] += len(job.requests)
        return g

    def _settle(self, job_id: str, images, error: str | None) -> None:
        job = self.remote.pop(job_id, None)
        if job is None:
            return
        self.load[job.group] -= len(job.requests)
        if error is not None:
            job.deliver(None, RuntimeError(error))
            return
        m, now = self.service.engine.metrics, time.monotonic()
        m.images += len(images)
        m.recent.extend([now] * len(images))
        m.groups[job.group] += len(images)
        job.deliver(images, None)

    # ------------------------------------------------------------------ every rank

    def sync(self, new, cancel, stop):
        """The engine's ``sync``: (the jobs this rank runs, ids to cancel, stop)."""
        if self.rank == 0:
            live = self.service.engine.outstanding()
            self.load[0] = live  # group 0's images are rank 0's engine's own
            for job in new:
                job.group = self._assign(job) if self.dp > 1 else 0
            gone = [i for i, job in self.remote.items() if job.cancelled]
            for i in gone:  # the group drops it without answering
                job = self.remote.pop(i)
                self.load[job.group] -= len(job.requests)
            cancel = list(cancel) + gone
            msg = [([(job.id, job.body, job.group, job.arrived) for job in new], cancel, stop)]
        else:
            msg = [None]
        dist.broadcast_object_list(msg, src=0)
        sent, cancel, stop = msg[0]
        if self.dp > 1 and not stop:
            self._gather()
        if self.rank == 0:
            self.remote.update((job.id, job) for job in new if job.group != 0)
            return [job for job in new if job.group == 0], cancel, stop
        mine = [(i, b, a) for i, b, g, a in sent if g == self.group]  # a: rank 0's arrival (the engine's order)
        jobs = [Job(i, self.service.requests(b), self._deliver(i), body=b, priority=self.service.order(b)[0], arrived=a)
                for i, b, a in mine]  # fmt: skip
        return jobs, cancel, stop

    def _deliver(self, job_id: str):
        if not self.leader:
            return lambda images, error: None
        return lambda images, error: self.outbox.append(
            (job_id, images, None if error is None else f"{type(error).__name__}: {error}")
        )

    def _gather(self) -> None:
        """Leaders' finished images and loads to rank 0 (one gather over the world)."""
        engine = self.service.engine
        load = (
            engine.queued(),
            engine.running(),
            engine.metrics.cache_skipped,
            getattr(engine.backend, "xla_stats", lambda: None)(),
        )
        mine = (self.group, self.outbox, load) if self.leader and self.rank else None
        self.outbox = []
        every = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        if self.rank != 0:
            return
        for entry in every:
            if entry is None:
                continue
            group, results, load = entry
            self.reported[group] = load
            for job_id, images, error in results:
                self._settle(job_id, images, error)


def follow(engine) -> int:
    """A rank other than 0: run the turns rank 0 broadcasts until it says stop."""
    while not engine.turn():
        if engine.error is not None:
            return 1
    return 0


def finish(code: int) -> NoReturn:
    """End this rank's process with ``code``: on a clean exit (every rank told to stop) the
    process group destroyed first (a failed run, a dead rank, leaves it: no collective can
    agree), then stdout and stderr flushed and the process ended at once (``os._exit``).
    Everything the rank owns is closed by then (answers sent, the journal closed, the
    HTTP server stopped); what is skipped is the interpreter's teardown, in which gloo's
    threads could abort a process that had drained cleanly ("terminate called without an
    active exception": torchrun exit 1, seen after ``--xla-warmup`` with a LoRA held under
    tp=2, in 4 of 9 drains before the group was destroyed and once in a loaded CI run after)."""
    if code == 0:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def groups_metric(counts: collections.Counter) -> list[str]:
    """``fd_serve_group_images_total{group="g"}`` lines (images each dp group made)."""
    lines = ["# TYPE fd_serve_group_images_total counter"]
    return lines + [f'fd_serve_group_images_total{{group="{g}"}} {n}' for g, n in sorted(counts.items())]

"""``serve`` under torchrun (``--tp N``): rank 0 serves HTTP and admits requests; every
rank runs the same engine turn by turn on its shard of the params.

At the start of each turn rank 0 broadcasts what changed since the last one (the jobs
that arrived, as their ids and HTTP bodies, the ids of jobs to cancel, and whether to
stop: `sync`); every rank then applies the same changes and runs the same turn, so their
batches and the collectives inside ``fd.apply`` agree. Idle, rank 0 still broadcasts once
a second. A rank that dies makes the others' next collective fail (or time out after
``--rank-timeout`` s): rank 0's engine then fails, every waiting client gets a 503, and
every process exits non-zero.
"""

from __future__ import annotations


def sync(service, rank: int):
    """The engine's ``sync`` for this rank (rank 0 sends, the others receive)."""
    import torch.distributed as dist

    from ._engine import Job

    def call(new, cancel, stop):
        msg = [([(job.id, job.body) for job in new], list(cancel), stop)] if rank == 0 else [None]
        dist.broadcast_object_list(msg, src=0)
        if rank == 0:
            return new, cancel, stop
        sent, cancel, stop = msg[0]
        return [Job(i, service.requests(b), lambda images, error: None, body=b) for i, b in sent], cancel, stop

    return call


def follow(engine) -> int:
    """A rank other than 0: run the turns rank 0 broadcasts until it says stop."""
    while not engine.turn():
        if engine.error is not None:
            return 1
    return 0

"""Run a function on N CPU processes over gloo and collect what each rank returns.

    from _dist import spawn

    def work(rank, world, scale):          # module level, so spawned children can import it
        mesh = sharding.make_mesh(tp=world)
        return torch.ones(2) * rank * scale

    results = spawn(work, 2, 3.0)          # [tensor([0., 0.]), tensor([3., 3.])]

Each rank is its own process, forked from a ``forkserver`` that has imported torch, our
packages and the diffusers / transformers classes once (`PRELOAD`), so a rank starts in
a fraction of a second instead of importing them afresh each time; it sees the caller's
current environment, working directory and ``sys.path`` (as a ``spawn`` child would),
with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (a free port) set, one intra-op
thread (the test machine has few cores), and — unless ``init=False`` — a gloo default
process group with a finite ``pg_timeout``, destroyed afterwards. Arguments and
results travel through ``torch.save`` files, not pipes or shared memory, so tensors
are fine as either and a rank may exit at any time. The whole run is bounded by ``timeout``: ranks still alive then are
killed and reported as hung.

If any rank raises or hangs, `spawn` raises `DistError` whose message holds every
rank's traceback; ``errors="return"`` instead returns a `RankError` in that rank's slot
(for tests that expect failures, e.g. that a crash on one rank is noticed by all).
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import multiprocessing.forkserver
import os
import pathlib
import socket
import sys
import tempfile
import time
import traceback

import torch


@dataclasses.dataclass
class RankError:
    """What a rank that failed left behind: the exception type name, its message, the
    traceback text and seconds from the rank's start to the failure (None if it hung)."""

    kind: str
    message: str
    traceback: str
    elapsed: float | None


class DistError(RuntimeError):
    pass


# Imported by the forkserver before it forks any rank (tests/_warm.py lists what).
PRELOAD = ("_warm",)


def _context():
    """The forkserver context, its server started with `PRELOAD` imported. Python 3.11's
    forkserver drops the caller's ``sys.path`` before preloading (a preload that fails
    to import is skipped silently), so the server is started with it as PYTHONPATH."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        multiprocessing.forkserver.ensure_running()  # a no-op once it runs
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, out_dir, init, pg_timeout, env):
    os.environ.clear()  # the caller's environment now, not the forkserver's at its start
    os.environ.update(env)
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)  # the forkserver's stdout/stderr are some earlier test's; the caller replays this
    os.dup2(log, 2)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    start = time.monotonic()
    try:
        args, kwargs = torch.load(os.path.join(out_dir, "args.pt"), weights_only=False)
        if init:
            torch.distributed.init_process_group(
                "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout)
            )
        record = {"ok": True, "value": fn(rank, world, *args, **kwargs)}
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent
        record = {
            "ok": False,
            "error": RankError(type(e).__name__, str(e), traceback.format_exc(), time.monotonic() - start),
        }
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(record, path + ".tmp")
    os.replace(path + ".tmp", path)
    if record["ok"] and torch.distributed.is_initialized():
        try:  # no rank closes its sockets while a peer still finishes its last collective
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer failed; its own record says why
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # A failed rank exits at once; its peers see the connection close (or time out).
    os._exit(0)


def spawn(fn, world: int, *args, timeout: float = 300, pg_timeout: float = 60, init: bool = True, errors="raise", **kw):
    """Run ``fn(rank, world, *args, **kw)`` on ``world`` processes; return the per-rank
    results in rank order. ``fn`` must be defined at module level; its arguments go
    through ``torch.save``. ``timeout`` bounds the whole run in seconds; ``pg_timeout`` is
    the process group's collective timeout; ``errors`` is "raise" or "return"."""
    if errors not in ("raise", "return"):
        raise ValueError(f"errors: expected 'raise' or 'return', got {errors!r}")
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="fd_dist_") as out_dir:
        port = free_port()
        torch.save((args, kw), os.path.join(out_dir, "args.pt"))
        env = dict(os.environ)
        procs = [
            ctx.Process(target=_child, args=(fn, r, world, port, out_dir, init, pg_timeout, env), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        _replay_logs(out_dir, world)
        results = [_read(out_dir, r, timeout) for r in range(world)]
    failed = [(r, v) for r, v in enumerate(results) if isinstance(v, RankError)]
    if failed and errors == "raise":
        report = "\n".join(f"--- rank {r}: {e.kind}: {e.message}\n{e.traceback}" for r, e in failed)
        raise DistError(f"{len(failed)} of {world} ranks failed running {fn.__name__}:\n{report}")
    return results


def _replay_logs(out_dir: str, world: int):
    """What each rank printed, onto the caller's stderr (so pytest shows it with the test)."""
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.log")
        text = pathlib.Path(path).read_text(errors="replace") if os.path.exists(path) else ""
        if text:
            sys.stderr.write(f"--- rank {rank} output:\n{text}")


def _read(out_dir: str, rank: int, timeout: float):
    path = os.path.join(out_dir, f"rank{rank}.pt")
    if not os.path.exists(path):
        return RankError("Hung", f"rank {rank} left no result within {timeout}s and was killed", "", None)
    record = torch.load(path, weights_only=False)
    return record["value"] if record["ok"] else record["error"]

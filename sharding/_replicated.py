"""`check_replicated`: do all ranks hold the same inputs? One cheap collective, run once.

Sharded ``fd.apply`` assumes every rank passes the same ``x``, ``t`` and ``txt``: ranks
that disagree return silently wrong, rank-dependent outputs, and ranks with different
sequence lengths deadlock or abort inside a collective of mismatched size. Checking on
every call would cost a collective per step, so it is a separate function for callers
to run once (a sampler on its first step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def describe(x) -> tuple | None:
    """(dtype, shape, checksums) of a tensor on the host: its float64 sum and an
    index-weighted sum (so a permutation shows too), as hex strings (NaN equals NaN)."""
    if x is None:
        return None
    flat = x.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 1009 + 1
    sums = torch.stack([flat.sum(), (flat * weights).sum()]).cpu().tolist()
    return str(x.dtype), tuple(x.shape), tuple(float(s).hex() for s in sums)


def _show(d) -> str:
    return "None" if d is None else f"shape {d[1]} {d[0]} checksum {d[2][0]}"


def check_replicated(*tensors, names=None, group=None) -> None:
    """Raise the same ValueError on every rank unless all ranks of ``group`` (default: the
    world) passed equal ``tensors``: same count, dtype, shape and content (up to float64
    checksums). The message names the argument (``names[i]``, else ``arg{i}``) and which
    ranks hold what. One ``all_gather_object`` of a few numbers per tensor: shapes are
    compared before any collective on tensor data could be sized by them. Without an
    initialised process group it only checks its arguments. Eager only (reads values)."""
    names = [f"arg{i}" for i in range(len(tensors))] if names is None else list(names)
    if len(names) != len(tensors):
        raise ValueError(f"names: expected {len(tensors)} names (one per tensor), got {len(names)}")
    for name, x in zip(names, tensors):
        if x is not None and not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor or None, got {type(x).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = (tuple(names), tuple(describe(x) for x in tensors))
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    ranks = list(range(len(every))) if group is None else dist.get_process_group_ranks(group)
    counts = {r: len(e[1]) for r, e in zip(ranks, every)}
    if len(set(counts.values())) > 1:
        raise ValueError(f"check_replicated: expected the same number of tensors on every rank, got {counts} by rank")
    for i, name in enumerate(names):
        held: dict = {}
        for r, e in zip(ranks, every):
            held.setdefault(e[1][i], []).append(r)
        if len(held) > 1:
            found = "; ".join(f"ranks {rs}: {_show(d)}" for d, rs in held.items())
            raise ValueError(f"{name}: expected the same tensor on every rank, got {found}")

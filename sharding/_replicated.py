"""`check_replicated`: one cheap collective that tells whether every rank holds the same
tensors — the check to run once where the maths needs identical inputs on every rank
(same prompt, same seed), instead of a broadcast that would overwrite and hide a
divergence."""

from __future__ import annotations

import hashlib

import torch


def fingerprint(t: torch.Tensor) -> str:
    """A digest of a tensor's shape, dtype and exact bytes (read on the host)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{tuple(t.shape)}|{t.dtype}|".encode())
    h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_replicated(*tensors: torch.Tensor, names=None, group=None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` (default: the world) unless every
    rank passed bitwise-equal ``tensors`` (shape, dtype, values). ``names`` (one per
    tensor) name them in the message, which also lists the ranks that differ from rank 0.
    One ``all_gather_object`` of a digest per tensor; a no-op without a process group or
    on one rank."""
    import torch.distributed as dist

    names = [f"tensors[{i}]" for i in range(len(tensors))] if names is None else list(names)
    if len(names) != len(tensors):
        raise ValueError(f"names: expected {len(tensors)} names (one per tensor), got {len(names)}")
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    mine = [fingerprint(t) for t in tensors]
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    bad = []
    for i, name in enumerate(names):
        ranks = [r for r, prints in enumerate(every) if prints[i] != every[0][i]]
        if ranks:
            bad.append(f"{name} differs on ranks {ranks} from rank 0")
    if bad:
        raise ValueError(
            "inputs differ across ranks (every rank must pass the same prompt, seed and images): " + "; ".join(bad)
        )

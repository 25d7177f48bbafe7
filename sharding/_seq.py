"""Splitting and gathering the batch (``dp``) and the sequence (``sp``) in the local view.

A length that does not divide by the axis size is padded at the end; the padded
positions are masked out of attention as keys (`pad_bias`) and stripped when gathered.

The sequence axis: here ``"sp"`` names the whole sequence split, `SEQUENCE` = Ulysses'
``sp`` and ring attention's ``ring`` together, ring-major (chunk ``ring_index * sp +
sp_index``), so the model code that splits "the sequence over sp" splits it over both
and needs no change for the ring; with no ring axis (or ring = 1) it is ``sp`` alone,
exactly as before. Likewise ``"dp"`` names the batch split, `BATCH` = ``dp`` and ``fsdp``
(fully sharded parameters split the batch like data parallelism), dp-major. Any other
name, or a tuple of names (outer first), is taken as is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._axes import all_gather, axis_index, axis_size

SEQUENCE = ("ring", "sp")  # the axes "sp" stands for in this module, outer first
BATCH = ("dp", "fsdp")  # the axes "dp" stands for: fully sharded ranks split the batch too


def _axes(axis) -> tuple[str, ...]:
    if axis == "sp":
        return SEQUENCE
    if axis == "dp":
        return BATCH
    return (axis,) if isinstance(axis, str) else tuple(axis)


def split_size(axis) -> int:
    """How many chunks a dim split over ``axis`` has (`SEQUENCE` for "sp")."""
    size = 1
    for a in _axes(axis):  # a loop, not math.prod over a generator: dynamo traces this
        size *= axis_size(a)
    return size


def chunk_index(axis) -> int:
    """Which chunk of a dim split over ``axis`` this rank holds (row-major over the axes)."""
    index = 0
    for a in _axes(axis):
        index = index * axis_size(a) + axis_index(a)
    return index


def local_len(n: int, axis) -> int:
    """Length of this rank's chunk of a length-``n`` dim split over ``axis`` (padded)."""
    return math.ceil(n / split_size(axis))


def shard(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim``, zero-padded at the end to equal chunks.

    Backward (plain autograd): the chunk's gradient in place, zeros elsewhere — this
    rank's share of ``x``'s gradient; `pvary` on ``x`` over ``axis`` sums the shares
    (``fd.apply`` does so once, for every parameter and input, over sp and dp)."""
    n = split_size(axis)
    if n == 1:
        return x
    dim = dim % x.ndim
    chunk = local_len(x.shape[dim], axis)
    pad = chunk * n - x.shape[dim]
    if pad:
        widths = [0, 0] * (x.ndim - dim - 1) + [0, pad]
        x = F.pad(x, widths)
    return x.narrow(dim, chunk_index(axis) * chunk, chunk)


def gather(x: torch.Tensor, axis: str, dim: int, n: int) -> torch.Tensor:
    """Inverse of `shard`: every rank's chunk along ``dim``, concatenated and cut to ``n``.
    Backward: this rank's chunk of the (replicated) gradient (`all_gather`'s rule)."""
    if split_size(axis) == 1:
        return x
    for a in reversed(_axes(axis)):  # inner axis first: chunks come together in chunk order
        x = all_gather(x, a, dim)
    return x.narrow(dim % x.ndim, 0, n)


def pad_bias(n: int, axis: str, device, dtype=torch.float32) -> torch.Tensor | None:
    """Additive key bias (local_len,) for this rank's chunk of a length-``n`` sequence:
    0 for real positions, -inf for padding. None when there is no padding anywhere."""
    size = split_size(axis)
    chunk = local_len(n, axis)
    if chunk * size == n:
        return None
    pos = chunk_index(axis) * chunk + torch.arange(chunk, device=device)
    zero = torch.zeros((), device=device, dtype=dtype)
    return torch.where(pos < n, zero, torch.full((), float("-inf"), device=device, dtype=dtype))

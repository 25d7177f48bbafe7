"""torch's distributed checkpoint (DCP) over sharded params: honest boxes for fused leaves.

DCP describes what a rank holds as one box of the whole tensor; a leaf sharded per block
is k boxes, which DCP mishandles (docs/notes.md). `checkpoint_state` gives DCP every
fused leaf in its *block form* instead: the same storage viewed as (..., k, b, ...), on
which the per-block split is a plain ``Shard(d + 1)``. The block form depends only on
the specs, so a checkpoint saved on one mesh loads on any other, in place.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from ._plan import PACKED, config_of, specs_of
from ._shard import _contiguous_stride, _tree, is_strided
from .internal import dtensor_cls, is_dtensor
from .tree import check_same_keys, flatten


def checkpoint_state(params, tree=None) -> dict:
    """``{dotted path: tensor}`` to pass to ``torch.distributed.checkpoint.save`` / ``load``.

    ``params``: ``Params`` (plain or sharded; its config gives the fused blocks). ``tree``:
    a tree of the same keys holding tensors laid out like the params (an optimizer's
    moments, gradients), default the params' own leaves. Every fused leaf comes as its block
    form, a view of the leaf's storage (so ``dcp.load`` fills the leaf in place); the others
    come as they are, detached. Nothing is communicated or copied."""
    if config_of(params) is None:
        raise ValueError("params: expected Params (their config gives the fused blocks), got a plain tree")
    specs = flatten(specs_of(params))
    flat = flatten(_tree(params) if tree is None else _tree(tree))
    check_same_keys("tree", flat, specs, "the params")
    return {path: _block_form(path, x, specs[path]) for path, x in flat.items()}


def _block_form(path: str, x, spec):
    """``x`` with its fused dim unflattened into (blocks, rows): a plain tensor's view, or a
    DTensor over the view of its local tensor whose per-block split is ``Shard(d + 1)``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"tree: {path}: expected a tensor, got {type(x).__name__}")
    x = x.detach()
    if spec.blocks is None or len(spec.blocks) == 1:
        return x
    d, k = spec.axes.index(PACKED), len(spec.blocks)
    if not is_dtensor(x):
        return x.unflatten(d, (k, -1))
    shape = torch.Size((*x.shape[:d], k, x.shape[d] // k, *x.shape[d + 1 :]))
    placements = [_block_placement(path, p, d, k) for p in x.placements]
    local = x.to_local().unflatten(d, (k, -1))
    return dtensor_cls().from_local(
        local, x.device_mesh, placements, run_check=False, shape=shape, stride=_contiguous_stride(shape)
    )


def _block_placement(path: str, p, d: int, k: int):
    """The placement in the block form of a leaf's placement ``p`` (fused dim ``d``, k blocks)."""
    if is_strided(p) and p.dim == d and p.split_factor == k:
        return Shard(d + 1)
    if isinstance(p, Replicate):
        return p
    if isinstance(p, Shard) and not is_strided(p) and p.dim != d:
        return Shard(p.dim + (p.dim > d))
    raise ValueError(f"tree: {path}: placement {p} of fused dim {d} ({k} blocks) has no block form")

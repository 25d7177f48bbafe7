"""Fused projections: q/k/v (and FLUX.1's single-block MLP input) as one matmul.

Black Forest Labs' reference code stores q, k and v as one ``qkv`` weight and FLUX.1's
single block as one ``linear1`` = [q; k; v; mlp]; diffusers keeps them as separate
``nn.Linear`` modules, and so do our parameter trees (their keys are diffusers' keys).

`prepare(params)` lays each group of projections that read the same input out as
consecutive rows of one buffer, the leaves becoming row *views* of it: the same keys,
shapes and values, no extra memory once the old params are dropped. The forward
(`fast.linear_group`, behind `layers.linear_group`) recognises such a layout from the
tensors' storage and runs one matmul over the whole buffer, splitting its output (views, no copy); anything else
(unprepared params, tensors that require grad while grad is enabled, traced code, params
inside a ``torch.func`` transform, layerwise-cast and fp8 leaves, whose storage is another
dtype: `functional_dit.nn.layerwise`, `functional_dit.nn.quant`) runs the projections one by
one, as diffusers does; `prepare` leaves groups with such a leaf as they are.
Because the check reads the storage on every call, a prepared layout can never be
stale: a leaf replaced by another tensor breaks the adjacency and that group simply
runs unfused; an in-place update of a leaf is an update of the buffer.

Under tensor parallelism each rank's local rows of each projection are laid out
the same way (`prepare` works on sharded params too), so the fused weight is sharded
per block, as every fused projection of the plan is.
"""

from __future__ import annotations

import weakref

import torch
import torch.utils._pytree

from sharding.internal import is_dtensor, like, local_tensor, stored_block
from sharding.tree import get, map_tree, put

from ..params import Params
from .layerwise import is_cast
from .quant import is_quant

_FUSABLE_DEVICES = ("cpu", "cuda")

# The kernels mode `prepare` was given, per fused buffer (its storage's address; the entry
# goes when the buffer does): read back by `kernels` for the params laid out on it.
_MODES: dict[int, str] = {}


def _rows_of_one_buffer(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor spanning ``ts`` when they are consecutive, contiguous row blocks of
    one storage (same dtype, device and trailing shape); else None."""
    t0 = ts[0]
    if any(is_cast(t) or is_quant(t) for t in ts):
        return None  # stored in another dtype than it reads as: no buffer to read
    if t0.device.type not in _FUSABLE_DEVICES or not t0.is_contiguous():
        return None
    ptr, tail = t0.untyped_storage().data_ptr(), t0.shape[1:]
    offset, rows = t0.storage_offset() + t0.numel(), t0.shape[0]
    for t in ts[1:]:
        if (
            t.dtype != t0.dtype
            or t.shape[1:] != tail
            or not t.is_contiguous()
            or t.storage_offset() != offset
            or t.untyped_storage().data_ptr() != ptr
        ):
            return None
        offset, rows = offset + t.numel(), rows + t.shape[0]
    return t0.as_strided((rows, *tail), t0.stride(), t0.storage_offset())


def fused(ps: list) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) spanning the linear layers ``ps`` when `prepare` laid them out as
    one buffer and this call may use it (eager, no grad needed); else None."""
    if torch.compiler.is_compiling():
        return None
    ws = [p["weight"] for p in ps]
    bs = [p.get("bias") for p in ps]
    if any(t is not None and _functorch_wrapped(t) for t in ws + bs):
        return None  # under a torch.func transform (grad, jvp, vmap): no storage to read
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ws + bs):
        return None
    w = _rows_of_one_buffer(ws)
    if w is None:
        return None
    if all(b is None for b in bs):
        return w, None
    if any(b is None for b in bs):
        return None
    b = _rows_of_one_buffer(bs)
    return None if b is None else (w, b)


def active(params, groups, inputs) -> bool:
    """Whether this call of the model runs the prepared fast path: its first fused group is
    laid out as one buffer and usable (`fused`), and no input needs autograd or sits in a
    ``torch.func`` transform (the fast kernels work in place and call backend ops that
    have no batching or derivative rules). ``groups`` as `prepare`'s; ``inputs`` a pytree."""
    for blocks_key, block_groups in groups.items():
        for block in (params.tree.get(blocks_key) or {}).values():
            try:
                ps = [get(stored_block(block), path) for path in block_groups[0]]
            except KeyError:
                return False
            if fused(ps) is None:
                return False
            tensors = [t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            return not grad and not any(_functorch_wrapped(t) for t in tensors)
    return False


def kernels(params, groups) -> str:
    """The ``kernels`` mode `prepare` recorded for ``params``' fused layout (the buffer of
    its first fused group, the one `active` reads); "auto" for a layout made otherwise."""
    for blocks_key, block_groups in groups.items():
        for block in (params.tree.get(blocks_key) or {}).values():
            try:
                w = get(stored_block(block), f"{block_groups[0][0]}.weight")
            except KeyError:
                return "auto"
            if is_cast(w) or is_quant(w):
                return "auto"
            return _MODES.get(w.untyped_storage().data_ptr(), "auto")
    return "auto"


def _functorch_wrapped(t: torch.Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


# ----------------------------------------------------------------------------- prepare


def _remember(buffer: torch.Tensor, mode: str) -> None:
    ptr = buffer.untyped_storage().data_ptr()
    _MODES[ptr] = mode
    weakref.finalize(buffer, _MODES.pop, ptr, None)


def _concat_rows(leaves: list, mode: str = "auto") -> list:
    """New leaves with the values of ``leaves``, row views of one fresh buffer (for
    DTensor leaves: of one local buffer, each re-wrapped with its placements); the buffer
    remembers the kernels ``mode``."""
    is_d = [is_dtensor(t) for t in leaves]
    if any(is_cast(t) or is_quant(t) for t in leaves) or (any(is_d) and not all(is_d)):
        return leaves
    local = [local_tensor(t) for t in leaves]
    if any(is_quant(t) for t in local):  # sharded fp8 leaves
        return leaves
    if len({(t.dtype, t.device) for t in local}) != 1:
        return leaves
    if len({t.shape[1:] for t in local}) != 1:
        return _concat_flat(leaves, local, mode) if all(is_d) else leaves
    buffer = torch.cat([t.detach() for t in local])
    _remember(buffer, mode)
    views = list(buffer.split([t.shape[0] for t in local]))
    if not any(is_d):
        return views
    return [like(v, t) for v, t in zip(views, leaves)]


def _concat_flat(leaves: list, local: list, mode: str) -> list:
    """DTensor ``leaves`` whose local shards differ in trailing shape (fully sharded leaves
    split on different dims: FLUX.1's single-block q/k/v on their rows, its MLP input on its
    input dim) as consecutive flat segments of one local buffer. Not rows of
    one buffer here, so the group runs unfused on the shards; the block gather turns such
    a run of consecutive leaves into rows of one gathered buffer (docs/sharding.md)."""
    buffer = torch.cat([t.detach().reshape(-1) for t in local])
    _remember(buffer, mode)
    views = [v.view(t.shape) for v, t in zip(buffer.split([t.numel() for t in local]), local)]
    return [like(v, t) for v, t in zip(views, leaves)]


def prepare(params: Params, groups, kernels: str = "auto") -> Params:
    """``params`` with every group of ``groups`` laid out as one buffer (see the module
    docstring), the buffers remembering the ``kernels`` mode. ``groups``: ``{block list
    key: [(projection path, ...), ...]}``."""
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in params.leaves()):
        raise ValueError(
            "params: prepare is for inference and copies the fused projections into new buffers that do not "
            "require grad; got params that require grad (train with the params as they are)"
        )
    tree = map_tree(lambda _, leaf: leaf, params.tree)  # new dicts, the same leaves
    for blocks_key, block_groups in groups.items():
        for block in tree.get(blocks_key, {}).values():
            for group in block_groups:
                for leaf in ("weight", "bias"):
                    paths = [f"{p}.{leaf}" for p in group]
                    try:
                        leaves = [get(block, p) for p in paths]
                    except KeyError:
                        continue
                    for path, new in zip(paths, _concat_rows(leaves, kernels)):
                        put(block, path, new)
    return params.replace(tree)

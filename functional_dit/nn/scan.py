"""A segment of identical transformer blocks as one loop over stacked weights.

A family's ``forward`` runs each segment of blocks (FLUX.1's double and single blocks)
through `layers`. Eagerly that is the plain Python loop over ``params[name]``'s blocks,
the same ops as ever. Inside `stacked`, for the params it was given, `layers` hands the
segment to a scan function instead (``torch_xla.experimental.scan.scan`` on XLA: one
block's graph lowered into an XLA While loop, so the step graph holds each block once),
over the blocks' weights stacked along a new leading dimension once, before the loop
that uses them. docs/xla.md has the measurements.

Fully sharded params (an "fsdp" mesh axis): the stacks hold this rank's shards, and the
scan body gathers its block (one coalesced all-gather, `sharding.internal.block_gather`)
before the block computes: the weights crossing the scan are 1/N of the stacked blocks.
There is no prefetch of the next block in the body (docs/sharding.md says why).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils import _pytree as pytree

import sharding
from sharding.internal import block_gather, gathered_blocks, mesh_fsdp, stored_block

from ..params import ordered_blocks

_ACTIVE: list = []  # the `stacked` in force, innermost last (a plain list: torch.compile traces it without a break)


@dataclasses.dataclass(frozen=True)
class Stacked:
    """The params tree the stacks belong to, each segment's stacked block tree and the
    scan function ``scan(fn, carry, xs) -> (carry, ys)``; ``firsts``: each segment's first
    stored leaf, by which fully sharded params (gathered into a new tree by ``fd.apply``)
    are recognised."""

    tree: dict
    segments: dict
    scan: object
    firsts: dict = dataclasses.field(default_factory=dict)


def stack(blocks: list) -> dict:
    """Blocks with one tree structure as one tree of (n_blocks, ...) tensors."""
    return pytree.tree_map(lambda *leaves: torch.stack(leaves), *blocks)


@contextlib.contextmanager
def stacked(params, names, scan):
    """Within: `layers` over ``params``' segments ``names`` runs ``scan`` over their
    blocks stacked here, once. Fully sharded params: their local shards stacked, each block
    gathered in the scan body. Other params (LoRA-attached, tp/sp-sharded views) keep the loop."""
    local, mesh = sharding.local_view(params)
    fsdp = mesh is not None and mesh_fsdp(mesh) > 1
    source = local if fsdp else params
    segments = {n: stack(ordered_blocks(source, n)) for n in names if ordered_blocks(source, n)}
    firsts = {n: _first(ordered_blocks(local, n)[0]) for n in segments} if fsdp else {}
    _ACTIVE.append(Stacked(params.tree, segments, scan, firsts))
    try:
        yield segments
    finally:
        _ACTIVE.pop()


def _first(block):
    return pytree.tree_leaves(stored_block(block))[0]


def _state(params, name: str):
    """The `stacked` in force for ``params[name]``: these params' tree, or (fully sharded
    params, gathered by ``fd.apply`` into a new tree) blocks over the same stored shards."""
    state = _ACTIVE[-1] if _ACTIVE else None
    if state is None or name not in state.segments:
        return None
    if state.tree is params.tree:
        return state
    blocks = params.tree.get(name) or {}
    block = blocks.get("0") if isinstance(blocks, dict) else None
    if name not in state.firsts or block is None or _first(block) is not state.firsts[name]:
        return None
    same = pytree.tree_structure(stored_block(block)) == pytree.tree_structure(state.segments[name])
    return state if same else None  # (LoRA factors attached to the layers: the loop)


def scanned(params, name: str) -> bool:
    """Whether `layers` runs ``params[name]`` as a scan (inside `stacked` for these params)."""
    return _state(params, name) is not None


def layers(params, name: str, step, carry, per_layer: tuple = (), consts: tuple = (), static: tuple = ()):
    """``carry = step(carry, block, layer, consts, static)`` for each block of
    ``params[name]`` in order, ``layer`` the block's entries of the lists in ``per_layer``
    (its modulations, say). ``consts`` (a tree of tensors and Nones): its tensors ride in
    the scan's carry, so the scanned body captures no tensor; ``static`` (hashable: functions, ints) is passed as is."""
    state = _state(params, name)
    if state is None:
        blocks = ordered_blocks(params, name)  # fully sharded: each gathered when read, the next one prefetched
        for block, *layer in zip(gathered_blocks(blocks), *per_layer):
            carry = step(carry, block, tuple(layer), consts, static)
            del block  # the gathered weights of this block go now (unless autograd keeps them)
        return carry
    xs = (state.segments[name], tuple(torch.stack(list(v)) for v in per_layer))
    leaves, spec = pytree.tree_flatten(consts)
    holes = tuple(i for i, v in enumerate(leaves) if v is None)  # the scan carries tensors only
    tensors = tuple(v for v in leaves if v is not None)
    gather = block_gather(ordered_blocks(params, name)[0])  # fully sharded: each block gathered in the body
    (carry, _), _ = state.scan(_body(step, static, spec, holes, gather), (carry, tensors), xs)
    return carry


_BODIES: dict = {}


def _body(step, static: tuple, spec, holes: tuple, gather=None):
    """The scan body for ``step`` and ``static``, with the consts rebuilt from their
    tensors (``holes``: where the Nones were), one object per such key: the scan caches
    its traced graph by the body's identity. ``gather``: a fully sharded block's all-gather
    (`sharding.internal.block_gather`), run on the block's shards first; None: none."""
    key = (step, static, spec, holes, gather)
    if key not in _BODIES:

        def body(state, xs):
            carry, tensors = state
            it = iter(tensors)
            leaves = [None if i in holes else next(it) for i in range(len(holes) + len(tensors))]
            block, layer = xs
            block = block if gather is None else gather(block)
            return (step(carry, block, layer, pytree.tree_unflatten(leaves, spec), static), tensors), None

        _BODIES[key] = body
    return _BODIES[key]


def eager_scan(fn, carry, xs):
    """``scan``'s semantics as a Python loop over the leading dimension of ``xs``: the
    stacked path run eagerly (on the CPU, and to test it against the plain loop)."""
    n = pytree.tree_leaves(xs)[0].shape[0]
    ys = []
    for i in range(n):
        carry, y = fn(carry, pytree.tree_map(lambda a, i=i: a[i], xs))
        ys.append(y)
    return carry, ys

"""A segment of identical transformer blocks as one loop over stacked weights.

A family's ``forward`` runs each segment of blocks (FLUX.1's double and single blocks)
through `layers`. Eagerly that is the plain Python loop over ``params[name]``'s blocks,
the same ops as ever. Inside `stacked`, for the params it was given, `layers` hands the
segment to a scan function instead (``torch_xla.experimental.scan.scan`` on XLA: one
block's graph lowered into an XLA While loop, so the step graph holds each block once),
over the blocks' weights stacked along a new leading dimension once, before the loop
that uses them. docs/xla.md has the measurements.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils import _pytree as pytree

from sharding.internal import gathered_blocks

from ..params import ordered_blocks

_ACTIVE: list = []  # the `stacked` in force, innermost last (a plain list: torch.compile traces it without a break)


@dataclasses.dataclass(frozen=True)
class Stacked:
    """The params tree the stacks belong to, each segment's stacked block tree and the
    scan function ``scan(fn, carry, xs) -> (carry, ys)``."""

    tree: dict
    segments: dict
    scan: object


def stack(blocks: list) -> dict:
    """Blocks with one tree structure as one tree of (n_blocks, ...) tensors."""
    return pytree.tree_map(lambda *leaves: torch.stack(leaves), *blocks)


@contextlib.contextmanager
def stacked(params, names, scan):
    """Within: `layers` over ``params``' segments ``names`` runs ``scan`` over their
    blocks stacked here, once. Other params (LoRA-attached, sharded views) keep the loop."""
    segments = {n: stack(ordered_blocks(params, n)) for n in names if ordered_blocks(params, n)}
    _ACTIVE.append(Stacked(params.tree, segments, scan))
    try:
        yield segments
    finally:
        _ACTIVE.pop()


def scanned(params, name: str) -> bool:
    """Whether `layers` runs ``params[name]`` as a scan (inside `stacked` for these params)."""
    state = _ACTIVE[-1] if _ACTIVE else None
    return state is not None and state.tree is params.tree and name in state.segments


def layers(params, name: str, step, carry, per_layer: tuple = (), consts: tuple = (), static: tuple = ()):
    """``carry = step(carry, block, layer, consts, static)`` for each block of
    ``params[name]`` in order, ``layer`` the block's entries of the lists in ``per_layer``
    (its modulations, say). ``consts`` (a tree of tensors and Nones): its tensors ride in
    the scan's carry, so the scanned body captures no tensor; ``static`` (hashable: functions, ints) is passed as is."""
    state = _ACTIVE[-1] if _ACTIVE else None
    if state is None or state.tree is not params.tree or name not in state.segments:
        blocks = ordered_blocks(params, name)  # fully sharded: each gathered when read, the next one prefetched
        for block, *layer in zip(gathered_blocks(blocks), *per_layer):
            carry = step(carry, block, tuple(layer), consts, static)
            del block  # the gathered weights of this block go now (unless autograd keeps them)
        return carry
    xs = (state.segments[name], tuple(torch.stack(list(v)) for v in per_layer))
    leaves, spec = pytree.tree_flatten(consts)
    holes = tuple(i for i, v in enumerate(leaves) if v is None)  # the scan carries tensors only
    tensors = tuple(v for v in leaves if v is not None)
    (carry, _), _ = state.scan(_body(step, static, spec, holes), (carry, tensors), xs)
    return carry


_BODIES: dict = {}


def _body(step, static: tuple, spec, holes: tuple):
    """The scan body for ``step`` and ``static``, with the consts rebuilt from their
    tensors (``holes``: where the Nones were), one object per such key: the scan caches
    its traced graph by the body's identity."""
    key = (step, static, spec, holes)
    if key not in _BODIES:

        def body(state, xs):
            carry, tensors = state
            it = iter(tensors)
            leaves = [None if i in holes else next(it) for i in range(len(holes) + len(tensors))]
            block, layer = xs
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

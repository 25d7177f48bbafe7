"""Compile regions and per-block recomputation, applied to a family's block functions by
the api (`regions`), so the family files hold only the maths.

A region is a block function ``torch.compile`` compiles once and reuses for every layer
of the same shapes (``torch.compiler.nested_compile_region``, hierarchical compilation):
full-depth compile time stays near one block's. See docs/notes.md, Kernels and compile
regions, for why regions are not used under autograd or tested for export.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.utils._pytree
import torch.utils.checkpoint

import sharding

from .layerwise import is_cast


def region(fn):
    """``fn`` as a compile region: a no-op in eager (and where torch lacks the API), except
    under `recompute_blocks`; a block over layerwise-cast leaves is traced inline. Its
    inputs must not alias one another (each block's modulation has its own storage). Under
    autograd the block is traced inline, so compiled gradients equal eager ones; regions
    serve inference."""
    mark = getattr(torch.compiler, "nested_compile_region", None)
    marked = fn if mark is None else mark(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.is_grad_enabled() and _any_requires_grad((args, kwargs)):
            return _recomputed(fn, args, kwargs) if _RECOMPUTE and _RECOMPUTE[-1] else fn(*args, **kwargs)
        if _any_cast((args, kwargs)):  # torch's invoke_subgraph has no rule for tensor subclasses
            return fn(*args, **kwargs)
        return marked(*args, **kwargs)

    return call


_REGIONS: dict = {}  # family module name -> its block functions as regions


def regions(family) -> types.SimpleNamespace | None:
    """The family's block functions (its ``REGIONS``, names of module functions) as
    regions, made once per family, for its ``forward``'s ``blocks``; None without any."""
    if not getattr(family, "REGIONS", ()):
        return None
    name = family.__name__  # a string key: dynamo traces a lookup by it (not by a module)
    if name not in _REGIONS:
        _REGIONS[name] = types.SimpleNamespace(**{n: region(_looked_up(family, n)) for n in family.REGIONS})
    return _REGIONS[name]


def _looked_up(family, name: str):
    """``family.<name>`` looked up at each call (a block replaced later is the one run)."""

    def block(*args, **kwargs):
        return getattr(family, name)(*args, **kwargs)

    block.__name__ = block.__qualname__ = name
    return block


# Whether block activations are recomputed in backward (`recompute_blocks`), innermost
# last. A plain list, as sharding's bound meshes: dynamo traces list reads.
_RECOMPUTE: list = []


@contextlib.contextmanager
def recompute_blocks(enabled: bool = True):
    """Gradient (activation) checkpointing per block: under autograd each `region` block
    keeps only its inputs and recomputes its activations in backward
    (``torch.utils.checkpoint``, non-reentrant). Set by ``fd.apply(..., checkpoint=True)``."""
    _RECOMPUTE.append(bool(enabled))
    try:
        yield
    finally:
        _RECOMPUTE.pop()


def _recomputed(fn, args, kwargs):
    """``fn(*args, **kwargs)`` under ``torch.utils.checkpoint``; the recomputation in
    backward runs under the mesh bound now (backward runs outside `fd.apply`'s binding,
    and a block's collectives need it)."""
    mesh = sharding.current_mesh()

    def rerun(*a, **kw):
        with sharding.bind(mesh):
            return fn(*a, **kw)

    return torch.utils.checkpoint.checkpoint(rerun, *args, use_reentrant=False, **kwargs)


def _any_cast(tree) -> bool:
    """Whether a leaf of ``tree`` is layerwise-cast (`functional_dit.nn.layerwise`): such a
    block is traced inline (a region's higher-order op does not take tensor subclasses)."""
    return any(is_cast(t) for t in torch.utils._pytree.tree_leaves(tree))


def _any_requires_grad(tree) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in torch.utils._pytree.tree_leaves(tree))

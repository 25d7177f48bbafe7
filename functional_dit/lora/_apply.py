"""The two ways to apply LoRA adapters, equal to each other: `merge` folds the updates
into new weights; `attach` (what ``fd.apply(..., lora=[(adapter, scale), ...])`` runs)
hands each adapted layer its factors, and ``_layers.linear`` / ``row_linear`` add
``scale * (x @ A.T) @ B.T`` to the layer's output, so the base weights are shared
between calls and adapters and may stay in a lower precision.

Under tensor parallelism both run in the local view, each factor placed from its base
weight's plan (see `_adapter`): a column-parallel layer holds ``A`` whole and its rows
of ``B``; a row-parallel layer its columns of ``A`` and ``B`` whole, and sums the rank-r
products ``x @ A.T`` over the axis before ``B`` (one small all-reduce), so the forward
and every factor's gradient equal the unsharded ones.
"""

from __future__ import annotations

import functools
import numbers

import torch

import sharding
from sharding.internal import like
from sharding.tree import copy_path, flatten, map_tree

from ..params import Params
from ._adapter import Adapter

LORA = "lora"  # the key under which a layer dict carries its ((A, B, scale), ...) in attach


def check(params: Params, lora, name: str = "lora") -> list[tuple[Adapter, object]]:
    """``lora`` as a list of (Adapter, scale) pairs made for ``params``' config."""
    if isinstance(lora, Adapter) or not isinstance(lora, (list, tuple)):
        raise ValueError(f"{name}: expected a list of (adapter, scale) pairs, got {type(lora).__name__}")
    pairs = []
    for i, pair in enumerate(lora):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], Adapter)):
            raise ValueError(f"{name}[{i}]: expected an (Adapter, scale) pair, got {pair!r:.80}")
        ad, scale = pair
        if not (isinstance(scale, numbers.Real) or (isinstance(scale, torch.Tensor) and scale.ndim == 0)):
            raise ValueError(f"{name}[{i}]: scale must be a real number or a 0-d tensor, got {scale!r:.80}")
        if ad.config.base != params.config:
            raise ValueError(f"{name}[{i}]: the adapter was made for {ad.config.base}, the params are {params.config}")
        pairs.append((ad, scale))
    return pairs


def local_adapters(pairs, mesh) -> list[tuple[Adapter, object]]:
    """The adapters' local views; their mesh must be the params' ``mesh`` (None: plain)."""
    out = []
    for i, (ad, scale) in enumerate(pairs):
        local, amesh = sharding.local_view(ad)
        if (amesh is None) != (mesh is None) or (mesh is not None and amesh is not mesh and amesh != mesh):
            what = "plain tensors" if amesh is None else f"sharded on {amesh}"
            raise ValueError(
                f"lora[{i}]: the adapter is {what} but the params are "
                f"{'plain tensors' if mesh is None else f'sharded on {mesh}'}; place it like the params with "
                "sharding.shard_params(adapter, mesh) or lora.load(path, params, mesh=mesh)"
            )
        out.append((local, scale))
    return out


@functools.lru_cache(maxsize=64)
def _column_axes(config, sizes: tuple) -> dict[str, str]:
    """``{module: mesh axis}`` of the column-parallel modules (``B`` sharded, ``A`` whole)."""
    plan = flatten(sharding.plan(config, dict(sizes)))
    out = {}
    for m, _, _ in config.modules:
        b = plan[f"{m}.lora_B.weight"]
        if isinstance(b, sharding.Shard):
            out[m] = b.axis
    return out


def _replicated_input(a: torch.Tensor, axis: str) -> torch.Tensor:
    """``A`` of a column-parallel layer: whole on every rank, but each rank's gradient is
    only its output rows' share, summed over ``axis`` (Megatron's f, as for the layer's input)."""
    return sharding.pvary(a, axis)


def attach(params: Params, pairs) -> Params:
    """``params`` (local view) whose adapted layer dicts carry ``"lora": ((A, B, s), ...)``,
    ``s`` = the caller's scale x the module's ``alpha / rank``; nothing is copied but the
    dicts on the way to each adapted layer."""
    tree = dict(params.tree)
    mesh = sharding.current_mesh()
    sizes = tuple(sorted(sharding.mesh_sizes(mesh).items())) if mesh is not None else ()
    for ad, scale in pairs:
        column = _column_axes(ad.config, sizes) if sizes else {}
        for m, _, _ in ad.config.modules:
            A, B = ad.factors(m)
            if m in column:
                A = _replicated_input(A, column[m])
            node = copy_path(tree, m)
            node[LORA] = node.get(LORA, ()) + ((A, B, scale * ad.config.scale(m)),)
    return Params(params.config, tree)  # not .replace: the tree now holds (A, B, s) tuples, not only tensors


def merge(params: Params, adapter: Adapter, scale: float = 1.0) -> Params:
    """New params with ``W + scale * (alpha / rank) * B @ A`` in every adapted layer
    (computed in fp32, stored in W's dtype); ``params`` is left as it is. Plain or
    sharded alike (sharded params need the adapter placed on the same mesh)."""
    ((adapter, scale),) = check(params, [(adapter, scale)], "adapter")
    local, mesh = sharding.local_view(params)
    ((ad, _),) = local_adapters([(adapter, scale)], mesh)
    flat, new = params.flat(), local.flat()
    for m, _, _ in ad.config.modules:
        A, B = ad.factors(m)
        W = new[f"{m}.weight"]
        delta = (B.float() @ A.float()) * (scale * ad.config.scale(m))
        flat[f"{m}.weight"] = like((W.float() + delta).to(W.dtype), flat[f"{m}.weight"])  # DTensor if W was
    return Params(params.config, map_tree(lambda path, _: flat[path], params.tree))

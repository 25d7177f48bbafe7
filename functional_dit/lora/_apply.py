"""The two ways to apply LoRA adapters, equal to each other: `merge` folds the updates
into new weights; `attach` (what ``fd.apply(..., lora=[(adapter, scale), ...])`` runs)
hands each adapted layer its factors, and ``nn.layers.linear`` / ``row_linear`` add
``scale * ((x @ A.T) @ B.T + b)`` to the layer's output (``b``: ``lora_B``'s bias, if
any), so the base weights are shared between calls and adapters and may stay in a lower
precision. DoRA: attach hands the layer the factor ``g = mag / ||W + s B A||_row`` (the
norm detached, PEFT's ``DoraLinearLayer``), and the layer adds ``(g - 1) * (its output
less its bias) + g * s * B A x``; merge stores ``g * (W + s B A)``.

Under tensor parallelism both run in the local view, each factor placed from its base
weight's plan (see `_adapter`): a column-parallel layer holds ``A`` whole and its rows
of ``B``; a row-parallel layer its columns of ``A`` and ``B`` whole, and sums the rank-r
products ``x @ A.T`` over the axis before ``B`` (one small all-reduce), so the forward
and every factor's gradient equal the unsharded ones. A bias and a magnitude sit with
``B``'s rows (sharded on a column-parallel layer, whole on a row-parallel one, where the
bias is added once, after the all-reduce). DoRA's row norm of a row-parallel layer sums
the squares of this rank's columns over the axis (one all-reduce of width out).
"""

from __future__ import annotations

import functools
import numbers

import torch

import sharding
from sharding.internal import like, refuse_fsdp
from sharding.tree import copy_path, flatten, map_tree

from ..params import Params
from ._adapter import Adapter, weight_norm

LORA = "lora"  # the key under which a layer dict carries its ((A, B, s, bias, g), ...) in attach


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
def _parallel_axes(config, sizes: tuple) -> tuple[dict[str, str], dict[str, str]]:
    """``({module: mesh axis}, {module: mesh axis})`` of the column-parallel modules (``B``
    sharded, ``A`` whole) and of the row-parallel ones (``A``'s columns sharded)."""
    plan = flatten(sharding.plan(config, dict(sizes)))
    column, row = {}, {}
    for m, _, _ in config.modules:
        a, b = plan[f"{m}.lora_A.weight"], plan[f"{m}.lora_B.weight"]
        if isinstance(b, sharding.Shard):
            column[m] = b.axis
        if isinstance(a, sharding.Shard) and a.dim == 1:
            row[m] = a.axis
    return column, row


def _mesh_axes(config) -> tuple[dict[str, str], dict[str, str]]:
    """`_parallel_axes` on the bound mesh (none bound: no parallel layers)."""
    mesh = sharding.current_mesh()
    return _parallel_axes(config, tuple(sorted(sharding.mesh_sizes(mesh).items()))) if mesh is not None else ({}, {})


def _replicated_input(a: torch.Tensor, axis: str) -> torch.Tensor:
    """``A`` of a column-parallel layer: whole on every rank, but each rank's gradient is
    only its output rows' share, summed over ``axis`` (Megatron's f, as for the layer's input)."""
    return sharding.pvary(a, axis)


def _dora_factor(ad: Adapter, m: str, weight: torch.Tensor, s, axis) -> torch.Tensor | None:
    """DoRA's ``mag / ||W + s B A||_row`` of module ``m`` (None for plain LoRA); the
    gradient reaches ``mag`` only, as in PEFT."""
    if not ad.config.use_dora:
        return None
    A, B = ad.factors(m)
    return ad.magnitude(m) / weight_norm(weight, A, B, s, axis)


def attach(params: Params, pairs) -> Params:
    """``params`` (local view) whose adapted layer dicts carry ``"lora": ((A, B, s, bias,
    g), ...)``, ``s`` = the caller's scale x the module's ``alpha / rank``, ``bias`` the
    ``lora_B`` bias or None, ``g`` the DoRA factor or None; nothing is copied but the
    dicts on the way to each adapted layer."""
    tree = dict(params.tree)
    for ad, scale in pairs:
        column, row = _mesh_axes(ad.config)
        for m, _, _ in ad.config.modules:
            A, B = ad.factors(m)
            s = scale * ad.config.scale(m)
            node = copy_path(tree, m)
            g = _dora_factor(ad, m, node["weight"], s, row.get(m))
            if m in column:
                A = _replicated_input(A, column[m])
            node[LORA] = node.get(LORA, ()) + ((A, B, s, ad.bias(m), g),)
    return Params(params.config, tree)  # not .replace: the tree now holds (A, B, s, bias, g) tuples, not only tensors


def _merged(ad: Adapter, m: str, W: torch.Tensor, bias, s, axis) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Module ``m``'s weight and bias with the update folded in (fp32, in their dtypes):
    ``W + s B A`` (DoRA: ``g * (W + s B A)``, PEFT's merge) and ``bias + s * b``."""
    A, B = (f.float() for f in ad.factors(m))
    merged = W.float() + (B @ A) * s
    g = _dora_factor(ad, m, W.float(), s, axis)
    merged = merged if g is None else g.float()[:, None] * merged
    b = ad.bias(m)
    if b is not None:
        if bias is None:
            raise ValueError(
                f"adapter: {m} has a lora_B bias (lora_bias=True) but the base layer has none, so it cannot be "
                "merged (PEFT refuses it too); apply it on the fly with fd.apply(..., lora=[(adapter, scale)])"
            )
        bias = (bias.float() + b.float() * s).to(bias.dtype)
    return merged.to(W.dtype), bias


def merge(params: Params, adapter: Adapter, scale: float = 1.0) -> Params:
    """New params with ``W + scale * (alpha / rank) * B @ A`` in every adapted layer
    (computed in fp32, stored in W's dtype), ``lora_B``'s bias added to the base bias and
    DoRA's magnitude applied (see the module docstring); ``params`` is left as it is.
    Plain or sharded alike (sharded params need the adapter placed on the same mesh).
    DoRA's norm is taken of the weight given: merging onto params that already hold
    another merged adapter norms that sum (PEFT norms the unmerged weight)."""
    refuse_fsdp(params, "lora.merge", "merge before sharding")
    ((adapter, scale),) = check(params, [(adapter, scale)], "adapter")
    local, mesh = sharding.local_view(params)
    ((ad, _),) = local_adapters([(adapter, scale)], mesh)
    flat, new = params.flat(), local.flat()
    with sharding.bind(mesh):
        _, row = _mesh_axes(ad.config)
        for m, _, _ in ad.config.modules:
            s = scale * ad.config.scale(m)
            W, b = _merged(ad, m, new[f"{m}.weight"], new.get(f"{m}.bias"), s, row.get(m))
            flat[f"{m}.weight"] = like(W, flat[f"{m}.weight"])  # DTensor if W was
            if b is not None:
                flat[f"{m}.bias"] = like(b, flat[f"{m}.bias"])
    return Params(params.config, map_tree(lambda path, _: flat[path], params.tree))

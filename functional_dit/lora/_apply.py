"""The two ways to apply LoRA adapters, equal to each other: `merge` folds the updates
into new weights; `attach` (what ``fd.apply(..., lora=[(adapter, scale), ...])`` runs)
hands each adapted layer its factors, and ``nn.layers.linear`` / ``row_linear`` add
``scale * ((x @ A.T) @ B.T + b)`` to the layer's output (``b``: ``lora_B``'s bias, if
any), so the base weights are shared between calls and adapters and may stay in a lower
precision. DoRA: attach hands the layer the factor ``g = mag / ||W + s B A||_row`` (the
norm detached, PEFT's ``DoraLinearLayer``), and the layer adds ``(g - 1) * (its output
less its bias) + g * s * B A x``; merge stores ``g * (W + s B A)``.

Per item, ``(adapter, scale, rows)``: the adapter applies to those batch rows only; attach
maps them to this dp rank's rows (`local_rows`) and hands the layers a constant index, and
the layers gather those rows of ``x``, compute their update alone and add it back there
(``index_select`` / ``index_add``: static shapes, no merged copy per adapter).

Under tensor parallelism both run in the local view, each factor placed from its base
weight's plan (see `_adapter`): a column-parallel layer holds ``A`` whole and its rows
of ``B``; a row-parallel layer its columns of ``A`` and ``B`` whole, and sums the rank-r
products ``x @ A.T`` over the axis before ``B`` (one small all-reduce), so the forward
and every factor's gradient equal the unsharded ones. A bias and a magnitude sit with
``B``'s rows (sharded on a column-parallel layer, whole on a row-parallel one, where the
bias is added once, after the all-reduce). DoRA's row norm of a row-parallel layer sums
the squares of this rank's columns over the axis (one all-reduce of width out).

Fully sharded (an "fsdp" axis, docs/sharding.md "LoRA on the fly"): attach hands the layers
this rank's factor shards, gathered with their block; DoRA's norm is reduced over fsdp from
each rank's slice of ``W + s B A`` (`weight_norm`'s ``fsdp``) and merge folds each rank's
slice of ``W`` with the matching slice of ``s B A`` (`_merged`): no rank gathers a weight.
"""

from __future__ import annotations

import functools
import numbers

import torch

import sharding
from sharding.internal import finish_block, gather_dims, gather_leaf, like, start_block
from sharding.tree import copy_path, flatten, get, map_tree

from ..params import Params
from ._adapter import Adapter, fsdp_slice, weight_norm

LORA = "lora"  # the key under which a layer dict carries its ((A, B, s, bias, g[, (rows, n)]), ...) in attach


def check(params: Params, lora, name: str = "lora", batch: int | None = None) -> list[tuple]:
    """``lora`` as a list of ``(Adapter, scale)`` pairs made for ``params``' config, or
    ``(Adapter, scale, rows)`` triples: the adapter applies to those batch rows only
    (distinct ints in ``[0, batch)``, returned as a sorted tuple; per-item LoRA)."""
    if isinstance(lora, Adapter) or not isinstance(lora, (list, tuple)):
        raise ValueError(f"{name}: expected a list of (adapter, scale) pairs, got {type(lora).__name__}")
    out = []
    for i, entry in enumerate(lora):
        if not (isinstance(entry, (list, tuple)) and len(entry) in (2, 3) and isinstance(entry[0], Adapter)):
            raise ValueError(
                f"{name}[{i}]: expected an (Adapter, scale) pair or an (Adapter, scale, rows) triple, got {entry!r:.80}"
            )
        ad, scale = entry[:2]
        if not (isinstance(scale, numbers.Real) or (isinstance(scale, torch.Tensor) and scale.ndim == 0)):
            raise ValueError(f"{name}[{i}]: scale must be a real number or a 0-d tensor, got {scale!r:.80}")
        if ad.config.base != params.config:
            raise ValueError(f"{name}[{i}]: the adapter was made for {ad.config.base}, the params are {params.config}")
        out.append((ad, scale) if len(entry) == 2 else (ad, scale, _check_rows(entry[2], batch, f"{name}[{i}]")))
    return out


def _check_rows(rows, batch: int | None, name: str) -> tuple[int, ...]:
    """``rows`` as a sorted tuple of distinct batch indices (Python ints: static shapes)."""
    ok = isinstance(rows, (list, tuple, range)) and all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
    if ok and len(set(rows)) == len(rows) and (batch is None or all(0 <= r < batch for r in rows)):
        return tuple(sorted(rows))
    where = "" if batch is None else f" in [0, {batch})"
    raise ValueError(f"{name}: rows must be distinct ints{where} (batch rows), got {rows!r:.80}")


def local_rows(rows: tuple, batch: int, split: bool = True) -> tuple[int, ...] | None:
    """This rank's rows among ``rows`` of a batch of ``batch``, split over "dp" (dp x fsdp)
    as ``fd.apply`` splits it (contiguous chunks): their local indices, or None when they
    are all of this rank's real rows (the plain path, no gather). ``split=False``: the
    batch is whole on this rank (`functional_dit.pipelines.cache._items` under fsdp)."""
    chunk = sharding.local_len(batch, "dp") if split else batch
    start = sharding.chunk_index("dp") * chunk if split else 0
    real = max(0, min(chunk, batch - start))
    local = tuple(r - start for r in rows if start <= r < start + real)
    return None if local and local == tuple(range(real)) else local


def local_adapters(pairs, mesh) -> list[tuple[Adapter, object]]:
    """The adapters' local views; their mesh must be the params' ``mesh`` (None: plain)."""
    out = []
    for i, (ad, *rest) in enumerate(pairs):
        local, amesh = sharding.local_view(ad)
        if (amesh is None) != (mesh is None) or (mesh is not None and amesh is not mesh and amesh != mesh):
            what = "plain tensors" if amesh is None else f"sharded on {amesh}"
            raise ValueError(
                f"lora[{i}]: the adapter is {what} but the params are "
                f"{'plain tensors' if mesh is None else f'sharded on {mesh}'}; place it like the params with "
                "sharding.shard_params(adapter, mesh) or lora.load(path, params, mesh=mesh)"
            )
        out.append((local, *rest))
    return out


@functools.lru_cache(maxsize=64)
def _parallel_axes(config, sizes: tuple) -> tuple[dict[str, str], dict[str, str]]:
    """``({module: mesh axis}, {module: mesh axis})`` of the column-parallel modules (``B``
    sharded, ``A`` whole) and of the row-parallel ones (``A``'s columns sharded)."""
    plan = flatten(sharding.plan(config, dict(sizes)))
    column, row = {}, {}
    for m, _, _ in config.modules:
        a, b = (_tp_part(plan[f"{m}.lora_{f}.weight"]) for f in "AB")
        if isinstance(b, sharding.Shard):
            column[m] = b.axis
        if isinstance(a, sharding.Shard) and a.dim == 1:
            row[m] = a.axis
    return column, row


def _tp_part(placement):
    """A placement's split before fsdp's (`sharding.FullyShard.inner`), or the placement."""
    return placement.inner if isinstance(placement, sharding.FullyShard) else placement


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


def _fsdp_dora(ad: Adapter, tree, scale, row: dict, dims: dict) -> dict[str, torch.Tensor]:
    """``{module: DoRA factor}`` of every module of ``ad`` on fully sharded params (``tree``:
    the local view; ``dims``: `_fsdp_dims`), no rank gathering a weight, in four collectives
    for the whole adapter rather than per module: the factors gathered whole (detached, one
    coalesced all-gather), each rank's squares of its slice of ``W + s B A`` (the matching
    slice of ``B``'s rows or ``A``'s columns) summed over fsdp in one all-reduce (a row slice
    placed at its rows, zeros elsewhere), over tp in one more for the row-parallel layers,
    and the magnitudes in one all-gather (backward: this rank's slice; ``fd.apply`` then sums
    the factor's gradient over the batch's ranks)."""
    mods = [m for m, _, _ in ad.config.modules]
    n, me = sharding.axis_size("fsdp"), sharding.axis_index("fsdp")
    keys = [f"{m}.{k}" for m in mods for k in ("lora_A.weight", "lora_B.weight") if f"{m}.{k}" in dims]
    with torch.no_grad():
        xs, ds = [get(ad.tree, k).detach() for k in keys], [dims[k] for k in keys]
        whole = dict(zip(keys, finish_block(xs, ds, start_block(xs, ds)))) if keys else {}
        sq = {}
        for m in mods:
            A, B = (
                whole.get(f"{m}.{k}", f.detach()) for k, f in zip(("lora_A.weight", "lora_B.weight"), ad.factors(m))
            )
            wd, W = dims.get(f"{m}.weight"), get(tree, f"{m}.weight").detach()
            B, A = fsdp_slice(B, 0 if wd == 0 else None), fsdp_slice(A, 1 if wd == 1 else None)
            v = (W.to(A.dtype) + scale * ad.config.scale(m) * (B @ A)).square().sum(1)
            sq[m] = torch.nn.functional.pad(v, (me * len(v), (n - 1 - me) * len(v))) if wd == 0 else v
        _sum_over(sq, [m for m in mods if dims.get(f"{m}.weight") is not None], "fsdp")
        for axis in sorted({row[m] for m in mods if m in row}):
            _sum_over(sq, [m for m in mods if row.get(m) == axis], axis)
    sharded = [m for m in mods if f"{m}.{_MAG}" in dims]
    mags = {m: ad.magnitude(m) for m in mods}
    if sharded:
        rows = sharding.all_gather(torch.cat([mags[m] for m in sharded]), "fsdp", 0).view(n, -1)
        parts = rows.split([len(mags[m]) for m in sharded], 1)
        mags.update({m: part.reshape(-1) for m, part in zip(sharded, parts)})
    return {m: mags[m] / sq[m].sqrt() for m in mods}


def _sum_over(sq: dict, mods: list, axis: str) -> None:
    """``sq[m]`` for ``m`` in ``mods`` summed over ``axis`` in one all-reduce, in place."""
    if mods and sharding.axis_size(axis) > 1:
        summed = sharding.psum(torch.cat([sq[m] for m in mods]), axis).split([len(sq[m]) for m in mods])
        sq.update(zip(mods, summed))


_MAG = "lora_magnitude_vector"


def _whole(ad: Adapter, m: str, leaf: str, dims: dict) -> torch.Tensor | None:
    """Module ``m``'s adapter ``leaf`` (``"lora_A.weight"``, ...; None when the adapter has
    none) whole (tp-local): all-gathered over "fsdp" when ``dims`` says it is fully sharded
    (backward: reduce-scatter, each rank's use is a share)."""
    x = {"lora_A.weight": lambda: ad.factors(m)[0], "lora_B.weight": lambda: ad.factors(m)[1]}.get(leaf)
    x = x() if x is not None else ad.bias(m) if leaf == "lora_B.bias" else ad.magnitude(m)
    dim = dims.get(f"{m}.{leaf}")
    return x if x is None or dim is None else gather_leaf(x, dim)


def _fsdp_dims(params: Params, ad: Adapter, mesh) -> dict:
    """``{path: fsdp dim}`` of the base's and the adapter's fully sharded leaves on ``mesh``
    (empty without an "fsdp" axis); the two configs' paths differ (``m.weight`` and
    ``m.lora_A.weight``), so one dict holds both."""
    if mesh is None or sharding.mesh_sizes(mesh).get("fsdp", 1) == 1:
        return {}
    return {**gather_dims(params.config, mesh), **gather_dims(ad.config, mesh)}


def attach(
    params: Params, pairs, batch: int | None = None, fsdp_dims: dict | None = None, split: bool = True
) -> Params:
    """``params`` (local view) whose adapted layer dicts carry ``"lora": ((A, B, s, bias,
    g[, rows]), ...)``, ``s`` = the caller's scale x the module's ``alpha / rank``, ``bias`` the
    ``lora_B`` bias or None, ``g`` the DoRA factor or None; nothing is copied but the
    dicts on the way to each adapted layer. An ``(adapter, scale, rows)`` triple (rows of
    a batch of ``batch``) adds ``rows = (index, n)``: this rank's rows (`local_rows`) as an
    index tensor into its ``n`` batch rows; an adapter with none of them is not attached
    (on an fsdp mesh it is, with an empty index: every rank must gather the same factors).
    ``split=False``: the batch is whole on every rank, not split over dp x fsdp.

    Fully sharded adapters (an "fsdp" axis on the bound mesh): the factors attached are this
    rank's shards, and ``fsdp_dims`` (a dict) receives ``{path: fsdp dim}`` of each, its path
    through the tuple (``"<module>.lora.<entry>.<0: A, 1: B, 3: bias>"``), for ``fd.apply`` to
    gather them with their block's weights (`sharding.internal.wrap_tree`'s ``extra``)."""
    tree = dict(params.tree)
    mesh = sharding.current_mesh()
    fsdp = mesh is not None and sharding.axis_size("fsdp") > 1
    for ad, scale, *rows in pairs:
        dims = _fsdp_dims(params, ad, mesh) if fsdp else {}
        rows = local_rows(rows[0], batch, split) if rows else None
        if rows == () and not fsdp:
            continue  # (on fsdp every rank attaches it, none of its rows here or not: its factors ride in
            # each block's all-gather and DoRA's norm is a collective, so the ranks must agree on them)
        n = None if rows is None else sharding.local_len(batch, "dp") if split else batch  # this rank's rows
        index = () if rows is None else ((torch.tensor(rows, dtype=torch.long, device=_device(ad)), n),)
        column, row = _mesh_axes(ad.config)
        dora = _fsdp_dora(ad, tree, scale, row, dims) if fsdp and ad.config.use_dora else None
        for m, _, _ in ad.config.modules:
            A, B = ad.factors(m)
            s = scale * ad.config.scale(m)
            node = copy_path(tree, m)
            g = dora[m] if dora is not None else _dora_factor(ad, m, node["weight"], s, row.get(m))
            if m in column:
                A = _replicated_input(A, column[m])
            entry = len(node.get(LORA, ()))
            for j, leaf in ((0, "lora_A.weight"), (1, "lora_B.weight"), (3, "lora_B.bias")):
                if f"{m}.{leaf}" in dims and fsdp_dims is not None:
                    fsdp_dims[f"{m}.{LORA}.{entry}.{j}"] = dims[f"{m}.{leaf}"]
            node[LORA] = node.get(LORA, ()) + ((A, B, s, ad.bias(m), g, *index),)
    return Params(params.config, tree)  # not .replace: the tree now holds (A, B, s, bias, g) tuples, not only tensors


def _device(ad: Adapter) -> torch.device:
    """Where the adapter's factors are (its row index goes there too)."""
    return ad.factors(ad.config.modules[0][0])[0].device


def _merged(
    ad: Adapter, m: str, W: torch.Tensor, bias, s, axis, dims: dict
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Module ``m``'s weight and bias with the update folded in (fp32, in their dtypes):
    ``W + s B A`` (DoRA: ``g * (W + s B A)``, PEFT's merge) and ``bias + s * b``.

    Fully sharded (``dims``, `_fsdp_dims`): ``W`` and ``bias`` are this rank's slices; the
    factors (small) are gathered whole (backward: reduce-scatter, each rank's use is a share)
    and each rank merges its slice of ``W`` with the matching slice of ``B @ A`` (``B``'s rows
    or ``A``'s columns), DoRA's norm reduced over fsdp: no rank holds the whole weight."""
    A, B, b, mag = (_whole(ad, m, k, dims) for k in ("lora_A.weight", "lora_B.weight", "lora_B.bias", _MAG))
    A, B, wd = A.float(), B.float(), dims.get(f"{m}.weight")
    merged = W.float() + (fsdp_slice(B, 0 if wd == 0 else None) @ fsdp_slice(A, 1 if wd == 1 else None)) * s
    if mag is not None:
        g = mag / weight_norm(W.float(), A, B, s, axis, wd)
        merged = fsdp_slice(g.float(), 0 if wd == 0 else None)[:, None] * merged
    if b is not None:
        if bias is None:
            raise ValueError(
                f"adapter: {m} has a lora_B bias (lora_bias=True) but the base layer has none, so it cannot be "
                "merged (PEFT refuses it too); apply it on the fly with fd.apply(..., lora=[(adapter, scale)])"
            )
        b = fsdp_slice(b, dims.get(f"{m}.bias"))
        bias = (bias.float() + b.float() * s).to(bias.dtype)
    return merged.to(W.dtype), bias


def merge(params: Params, adapter: Adapter, scale: float = 1.0) -> Params:
    """New params with ``W + scale * (alpha / rank) * B @ A`` in every adapted layer
    (computed in fp32, stored in W's dtype), ``lora_B``'s bias added to the base bias and
    DoRA's magnitude applied (see the module docstring); ``params`` is left as it is.
    Plain or sharded alike (sharded params need the adapter placed on the same mesh); on
    fully sharded params (an "fsdp" axis) each rank merges its own slices (`_merged`), and the
    result is placed like ``params``. DoRA's norm is taken of the weight given: merging onto
    params that already hold another merged adapter norms that sum (PEFT norms the unmerged
    weight)."""
    ((adapter, scale),) = check(params, [(adapter, scale)], "adapter")
    local, mesh = sharding.local_view(params)
    ((ad, _),) = local_adapters([(adapter, scale)], mesh)
    flat, new = params.flat(), local.flat()
    dims = _fsdp_dims(params, ad, mesh)
    with sharding.bind(mesh):
        _, row = _mesh_axes(ad.config)
        for m, _, _ in ad.config.modules:
            s = scale * ad.config.scale(m)
            W, b = _merged(ad, m, new[f"{m}.weight"], new.get(f"{m}.bias"), s, row.get(m), dims)
            flat[f"{m}.weight"] = like(W, flat[f"{m}.weight"])  # DTensor if W was
            if b is not None:
                flat[f"{m}.bias"] = like(b, flat[f"{m}.bias"])
    return Params(params.config, map_tree(lambda path, _: flat[path], params.tree))

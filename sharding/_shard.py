"""Sharded parameters: DTensor as storage, the local view as the compute path.

`shard_params` cuts each rank's slice on the host and moves only that slice to the
device (no collective). Every leaf is an honest DTensor: a fused dim is split per block,
exactly torch's ``_StridedShard``, so ``full_tensor()`` and gradients give the parameter
itself. `local_view` turns DTensor leaves back into local tensors plus their mesh, which
``functional_dit.apply`` runs on (docs/sharding.md, "Sharded parameters").
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor.placement_types import _StridedShard

from ._plan import (
    PACKED,
    FullyShard,
    Replicate,
    Shard,
    _shape,
    check_placement,
    config_of,
    local_slices,
    mesh_sizes,
    specs_of,
    take,
)
from ._plan import plan as make_plan
from .internal import dtensor_cls as _dtensor_cls
from .internal import is_dtensor
from .tree import check_same_keys, get, leaves, map_tree


def _tree(params) -> Mapping:
    return params.tree if hasattr(params, "tree") and hasattr(params, "config") else params


def _rebuild(params, tree):
    """The same params type around ``tree`` (no checks: local shards have local shapes)."""
    return type(params)(params.config, tree) if hasattr(params, "tree") and hasattr(params, "config") else tree


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def mesh_device(mesh) -> torch.device:
    """Where a mesh's local shards live: the CPU, or this process's current accelerator."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else None
    return torch.device(mesh.device_type, index)


def _strided_shard():
    return _StridedShard


def is_strided(p) -> bool:
    """Whether a DTensor placement is a ``_StridedShard`` (a subclass of ``Shard`` on some torch versions)."""
    return type(p).__name__ == "_StridedShard"


def dtensor_placements(placement, names, path: str = "placement") -> tuple:
    """The DTensor placements, one per mesh dim ``names``, that `shard_params` gives a leaf
    of plan placement ``placement``: on its axis's dim ``Shard(d)``, or for a dim fused from
    k > 1 equal blocks ``_StridedShard(d, split_factor=k)`` (what a per-block split is);
    ``Replicate()`` elsewhere; a `FullyShard` adds ``Shard(dim)`` on its axis ("fsdp").
    Unequal blocks have no DTensor placement: a ValueError."""
    if isinstance(placement, FullyShard):
        inner = dtensor_placements(placement.inner, names, path)
        return tuple(DShard(placement.dim) if n == placement.axis else p for n, p in zip(names, inner))
    split = isinstance(placement, Shard)
    return tuple(_dtensor_shard(placement, path) if split and n == placement.axis else DReplicate() for n in names)


def _dtensor_shard(placement: Shard, path: str):
    blocks = placement.blocks
    if blocks is None or len(blocks) == 1:
        return DShard(placement.dim)
    if len(set(blocks)) > 1:
        raise ValueError(
            f"{path}: {placement}: blocks of unequal sizes have no DTensor placement (a rank's slices of them are no "
            f"strided shard, so full_tensor() would be wrong); expected equal blocks, e.g. cut into units of their gcd"
        )
    return _strided_shard()(placement.dim, split_factor=len(blocks))


def dtensor_from_local(local: torch.Tensor, shape, placement, mesh):
    """The DTensor `shard_params` makes for one leaf of full shape ``shape``: the
    `dtensor_placements` of ``placement``, holding only ``local`` (no communication)."""
    dims = list(dtensor_placements(placement, mesh.mesh_dim_names))
    shape = torch.Size(shape)
    return DTensor.from_local(local, mesh, dims, run_check=False, shape=shape, stride=_contiguous_stride(shape))


def _flat_specs(params) -> dict | None:
    """``{dotted path: ParamSpec}`` of a ``Params``' config, or None for a plain tree."""
    if config_of(params) is None:
        return None
    specs = specs_of(params)
    check_same_keys("params", _tree(params), specs, "the config's specs")
    return dict(leaves(specs))


def _unaliased(local: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``local`` (cut from ``full`` by `take`) as a tensor that owns exactly its bytes: a
    narrow() view would keep the whole of ``full`` alive, and so would a view of any larger
    buffer. A wrapper subclass (`fd.CastTensor`, `fd.QuantTensor`) has no storage to
    compare, so it is always copied (its own ``clone``)."""
    if type(local) is not torch.Tensor or type(full) is not torch.Tensor:
        return local.clone()
    shared = local.untyped_storage()._cdata == full.untyped_storage()._cdata
    if shared or local.untyped_storage().nbytes() != local.numel() * local.element_size():
        return local.clone(memory_format=torch.contiguous_format)
    return local


def _cut(full: torch.Tensor, placement, coords) -> torch.Tensor:
    """The local tensor of one leaf at ``coords`` (a DeviceMesh or ``{axis: (index,
    size)}``): the `local_slices` `take` cuts, a tensor of its own unless replicated (a
    replicated leaf is ``full`` itself, as the caller holds it anyway)."""
    local = take(full, local_slices(full.shape, placement, coords))
    return local if isinstance(placement, Replicate) else _unaliased(local, full)


def _checked_plan(params, sizes: dict, plan) -> Mapping:
    """The plan `shard_params` applies (``plan`` or the default on ``sizes``), every leaf
    checked against the params before any data moves."""
    tree = _tree(params)
    placements = make_plan(params, sizes) if plan is None else plan
    check_same_keys("plan", placements, tree, "the params")
    specs, flat_plan = _flat_specs(params), dict(leaves(placements))
    for path, full in leaves(tree):  # validate every leaf first: nothing moves on a bad plan
        if is_dtensor(full):
            raise ValueError(f"params: {path} is already sharded (a DTensor); unshard it first")
        spec = specs[path] if specs is not None else tuple(full.shape)
        if tuple(full.shape) != _shape(spec):
            raise ValueError(f"params: {path}: expected shape {tuple(spec.shape)}, got {tuple(full.shape)}")
        check_placement(path, flat_plan[path], spec, sizes)
        dtensor_placements(flat_plan[path], tuple(sizes), f"plan: {path}")
    return placements


def shard_params(params, mesh, plan=None):
    """The same params type whose leaves are DTensors holding only this rank's shard.

    ``plan`` defaults to ``sharding.plan(params, mesh)``; a given plan must have the
    params' keys and placements `plan` could have made on ``mesh`` (for ``Params``, a
    fused dim split per block): every leaf is checked before any data moves. The slice
    is cut where the tensor lives (the host, for weights read from disk) and only it
    moves to the mesh device; a sharded leaf owns exactly its bytes (never a view of the
    full tensor or of a larger intermediate: `live_bytes` equals `local_bytes`)."""
    placements = _checked_plan(params, mesh_sizes(mesh), plan)
    device = mesh_device(mesh)

    def leaf(path, full, placement):
        return dtensor_from_local(_cut(full, placement, mesh).to(device), full.shape, placement, mesh)

    return _rebuild(params, map_tree(leaf, _tree(params), placements))


def local_shards(params, coords, plan=None):
    """The same params type holding, as plain tensors, the local shards `shard_params`
    gives the rank at ``coords`` (``{axis: (index, size)}``, e.g. ``{"fsdp": (1, 2),
    "tp": (0, 2)}``), cut by the same code and without a process group or a device move:
    on ``device="meta"`` params (``fd.init(config, device="meta")``) it builds nothing, so
    `live_bytes` of it measures a rank's storage at released sizes
    (``examples/memory_table.py``). ``plan`` as for `shard_params`."""
    if not isinstance(coords, Mapping) or not all(isinstance(c, tuple) and len(c) == 2 for c in coords.values()):
        raise ValueError(f"coords: expected a mapping {{axis: (index, size)}}, got {coords!r}")
    placements = _checked_plan(params, {a: n for a, (_, n) in coords.items()}, plan)
    return _rebuild(params, map_tree(lambda _, full, pl: _cut(full, pl, coords), _tree(params), placements))


def local_view(params):
    """``(params with plain local tensor leaves, mesh)`` — the mesh of the DTensor leaves,
    or None when there are none (then ``params`` is returned as is).

    For ``Params`` every leaf must be placed as ``sharding.plan(config, mesh)`` (the
    default rules) places it (`check_compute_layout`); a plan edited or built from other
    rules serves storage (``weights.save`` / ``load``, `unshard`).

    Differentiable: the gradient of a local leaf flows back to its DTensor as a DTensor
    of the same placements, under ``loss.backward()`` and under ``torch.func`` (grad, vjp,
    jvp over sharded params: the DTensors then arrive wrapped, see `_unwrapped`)."""
    DTensor = _dtensor_cls()
    tree = _tree(params)
    compiling = torch.compiler.is_compiling()
    first = None
    if DTensor is not None:  # a plain loop: dynamo (torch 2.11) cannot trace a walrus inside a generator
        for _, x in leaves(tree):
            b = _unwrapped(x, compiling)
            if isinstance(b, DTensor):
                first = b
                break
    if first is None:
        return params, None
    mesh = first.device_mesh
    # to_local() is an autograd Function, slow per leaf (docs/notes.md); without grads the
    # DTensor's own local tensor is the same thing. Traced code
    # keeps the public to_local() (and skips the layout check: shapes are then guarded).
    slow = compiling or not hasattr(first, "_local_tensor")
    if not slow and config_of(params) is not None:
        check_compute_layout(tree, config_of(params), mesh, DTensor)

    def leaf(path, x):
        base = _unwrapped(x, compiling)
        if not isinstance(base, DTensor):
            return x
        if base.device_mesh is not mesh and base.device_mesh != mesh:
            raise ValueError(f"params: {path} lives on mesh {base.device_mesh}, expected {mesh} like the others")
        if base is not x:  # a torch.func wrapper around a DTensor
            return LocalOf.apply(x, _layout_of(base))
        return x.to_local() if slow or (x.requires_grad and torch.is_grad_enabled()) else x._local_tensor

    return _rebuild(params, map_tree(leaf, tree)), mesh


@functools.lru_cache(maxsize=64)
def _compute_layout(config, names: tuple, shape: tuple) -> dict:
    """``{path: (placement, DTensor placements)}`` of ``plan(config, mesh)``, default rules."""
    return {p: (pl, dtensor_placements(pl, names)) for p, pl in leaves(make_plan(config, dict(zip(names, shape))))}


def _unwrapped(x, compiling: bool = False):
    """``x`` without its ``torch.func`` wrappers (the grad / jvp / vmap levels a transform
    put around a leaf), i.e. the DTensor under a transform over sharded params."""
    if compiling or not isinstance(x, torch.Tensor):
        return x
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(x):
        x = functorch.get_unwrapped(x)
    return x


class LocalOf(torch.autograd.Function):
    """A DTensor's local tensor, differentiably: the gradient (or tangent) of the local
    tensor becomes a DTensor of the same layout ``meta`` (mesh, placements, shape,
    stride). ``torch.func``-compatible (setup_context; DTensor's own ``to_local`` is not),
    so grad / vjp / jvp over sharded params work. Its forward runs below the transform,
    on the plain DTensor, where ``to_local`` is fine."""

    @staticmethod
    def forward(x, meta):
        return x.to_local()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.meta = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return DTensorOf.apply(g, ctx.meta), None

    @staticmethod
    def jvp(ctx, tx, _):
        return LocalOf.apply(tx, ctx.meta)


class DTensorOf(torch.autograd.Function):
    """The inverse of `LocalOf`: a local tensor as the DTensor of layout ``meta`` (no communication)."""

    @staticmethod
    def forward(local, meta):
        mesh, placements, shape, stride = meta
        return _dtensor_cls().from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.meta = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return LocalOf.apply(g, ctx.meta), None

    @staticmethod
    def jvp(ctx, tx, _):
        return DTensorOf.apply(tx, ctx.meta)


def _layout_of(x) -> tuple:
    """What `DTensorOf` needs to rebuild a DTensor like ``x``: (mesh, placements, shape, stride)."""
    return x.device_mesh, tuple(x.placements), x.shape, x.stride()


def check_compute_layout(tree, config, mesh, DTensor) -> None:
    """The one layout fd.apply computes in is the default plan's: a ValueError naming the
    first leaf placed otherwise (a replicated row-parallel weight would be summed tp times,
    a split output projection would return a slice of the channels)."""
    names = tuple(mesh.mesh_dim_names)
    layout = _compute_layout(config, names, tuple(mesh.shape))
    for path, x in leaves(tree):
        x = _unwrapped(x)  # under torch.func, the DTensor inside the transform's wrappers
        got = tuple(x.placements) if isinstance(x, DTensor) else tuple(DReplicate() for _ in names)
        want, dims = layout[path]
        if got != dims:
            raise ValueError(
                f"params: {path}: fd.apply computes in the default layout, {want} (DTensor placements {dims}) on "
                f"this mesh; got {got}. A plan from other rules, or edited, serves storage only (weights.save/load)"
            )


def local_bytes(params) -> int:
    """Bytes of the tensors this rank holds (local shards of DTensor leaves), whatever
    the plan: counting needs no check of the layout fd.apply computes with. The elements'
    bytes; `live_bytes` counts the storages they keep alive."""
    local = [x.to_local() if is_dtensor(x) else x for _, x in leaves(_tree(params))]
    return sum(x.numel() * x.element_size() for x in local if isinstance(x, torch.Tensor))


def _plain_tensors(x) -> list:
    """The plain tensors under ``x``: itself, or a wrapper subclass's inner tensors (torch's
    ``__tensor_flatten__``: fp8 storage of a layerwise cast, a quantized tensor's data and
    scales), recursively; [] for a non-tensor."""
    if not isinstance(x, torch.Tensor):
        return []
    if type(x) is torch.Tensor or not hasattr(x, "__tensor_flatten__"):
        return [x]
    names, _ = x.__tensor_flatten__()
    return [t for n in names for t in _plain_tensors(getattr(x, n))]


def live_bytes(params) -> int:
    """Bytes of the storages this rank's leaves keep alive: ``untyped_storage().nbytes()``
    of each unique storage under a leaf (a DTensor's local shard, a plain tensor, a wrapper
    subclass's inner tensors), counted once however many leaves view it. Where `local_bytes`
    counts elements, a leaf that is a view into a larger buffer counts the whole buffer:
    what the rank holds at rest. Works on the meta device (`local_shards`)."""
    seen = {}
    for _, x in leaves(_tree(params)):
        for t in _plain_tensors(x.to_local() if is_dtensor(x) else x):
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()  # the storage's identity, as torch.serialization keys it
    return sum(seen.values())


def unshard(sharded, plan=None):
    """Plain full tensors from a `shard_params` result, bit-exact: each DTensor leaf's
    ``full_tensor()`` (an all-gather per sharded leaf). ``plan``, when given, must match the
    leaves' placements (a ValueError names the first that does not)."""
    tree = _tree(sharded)
    if plan is not None:
        check_same_keys("plan", plan, tree, "the params")
    specs = None
    if config_of(sharded) is not None:
        specs = specs_of(sharded)
        check_same_keys("params", tree, specs, "the config's specs")

    def leaf(path, x, *given):
        if not is_dtensor(x):
            return x
        if given:
            spec = None if specs is None else get(specs, path)
            check_placement(path, given[0], spec if spec is not None else tuple(x.shape), mesh_sizes(x.device_mesh))
            if tuple(x.placements) != dtensor_placements(given[0], x.device_mesh.mesh_dim_names, f"plan: {path}"):
                raise ValueError(f"plan: {path}: {given[0]} does not match the leaf's placements {x.placements}")
        return x.full_tensor()

    return _rebuild(sharded, map_tree(leaf, tree, *([plan] if plan is not None else [])))


def placement_of(x, spec=None):
    """The `Shard`/`Replicate` a `shard_params` DTensor leaf was made with, read off its
    DTensor placements (a ``_StridedShard`` of split factor k: k equal blocks); the
    blocks of ``spec`` (its ``ParamSpec``) when it says the dim is fused."""
    names = x.device_mesh.mesh_dim_names
    split = [(names[i], p) for i, p in enumerate(x.placements) if isinstance(p, DShard) or is_strided(p)]
    fully = [(a, p) for a, p in split if a == "fsdp" and not is_strided(p)]
    if fully and len(split) <= 2:
        rest = [(a, p) for a, p in split if a != "fsdp"]
        inner = _placement_from(x, spec, *rest[0]) if rest else Replicate()
        return FullyShard(inner, fully[0][1].dim, "fsdp")
    if not split:
        return Replicate()
    if len(split) > 1:
        raise ValueError(f"placement_of: a leaf is split over several mesh dims {split}")
    return _placement_from(x, spec, *split[0])


def _placement_from(x, spec, axis: str, p):
    """The `Shard` of DTensor placement ``p`` on mesh axis ``axis`` (see `placement_of`)."""
    if spec is not None and spec.axes[p.dim] == PACKED:
        return Shard(p.dim, axis, tuple(b.size for b in spec.blocks))
    if is_strided(p):
        k = p.split_factor
        return Shard(p.dim, axis, (x.shape[p.dim] // k,) * k)
    return Shard(p.dim, axis)

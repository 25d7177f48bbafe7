"""Placement plans: where every parameter lives on a named mesh, as data.

A plan is a pytree shaped like the params whose leaves are `Replicate()`, `Shard(dim,
axis)` or, for a fused projection, `Shard(dim, axis, blocks)` (each block split on its
own: a contiguous split of a fused dim is the classic TP bug). `plan` derives it from
each ``ParamSpec`` through a rules table mapping logical axes to mesh axes, as
maxdiffusion and haliax do, and validates every size before any data moves. `sharding`
imports no model package: specs come from a config's ``param_specs()`` method
(docs/sharding.md, "Plans"; docs/architecture.md#plans-and-rules).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from .tree import check_same_keys, leaves, map_tree

PACKED = "packed"  # the logical axis of a dim that concatenates several blocks (ParamSpec)
# The layout fd.apply computes in (heads, MLP columns and the AdaLN modulation rows, per
# chunk, over "tp"; the model all-gathers the modulation output; see
# docs/architecture.md). Other rules make storage layouts (weights.load/save, unshard).
DEFAULT_RULES = {"heads": "tp", "mlp": "tp", "mod": "tp"}


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """Dim ``dim`` split evenly over mesh axis ``axis``: the rank at coordinate r holds
    the r-th of ``size(axis)`` equal slices. With ``blocks`` (the sizes of the fused
    blocks along ``dim``, summing to it), every block is split on its own and the rank
    holds the r-th slice of each block, concatenated in block order."""

    dim: int
    axis: str
    blocks: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class FullyShard:
    """Fully sharded: the leaf is first placed as ``inner`` (``Replicate()`` or the tp
    `Shard`), then dim ``dim`` of every rank's ``inner`` slice is split evenly over mesh
    axis ``axis`` ("fsdp"), as FSDP/ZeRO-3 hold 1/N of every weight. ``dim`` is never
    ``inner``'s dim nor a fused dim, so the DTensor placements (``Shard(dim)`` on "fsdp")
    describe the local data exactly. ``fd.apply`` gathers it per block."""

    inner: Replicate | Shard
    dim: int
    axis: str = "fsdp"


FSDP = "fsdp"  # the mesh axis of fully sharded parameters
Placement = Replicate | Shard | FullyShard


# ----------------------------------------------------------------------------- trees


def is_spec(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "axes") and not isinstance(x, torch.Tensor)


def is_placement(x) -> bool:
    return isinstance(x, (Replicate, Shard, FullyShard))


# ----------------------------------------------------------------------------- sources


def config_of(source):
    """The config of a ``Params`` (``.config`` + ``.tree``), a config itself, or None for a tree."""
    if isinstance(source, Mapping):
        return None
    if hasattr(source, "config") and hasattr(source, "tree"):
        return source.config
    return source


def specs_of(source) -> Mapping:
    """The specs tree of a specs tree, a config or a ``Params`` (see the module docstring)."""
    if isinstance(source, Mapping):
        return source
    config = config_of(source)
    if isinstance(config, str):
        raise ValueError(
            f"params_or_config: got the name {config!r}; sharding imports no model package, so pass the "
            f"config (functional_dit.as_config({config!r}) or fd.PRESETS[{config!r}]), Params or a specs tree"
        )
    method = getattr(config, "param_specs", None)
    if not callable(method):
        raise ValueError(
            f"params_or_config: expected a specs tree, a config with a param_specs() method or Params, "
            f"got {type(source).__name__}"
        )
    return method()


def mesh_sizes(mesh) -> dict[str, int]:
    """``{axis name: size}`` of a named ``DeviceMesh``, or a mapping of degrees, or None (``{}``)."""
    if mesh is None:
        return {}
    if isinstance(mesh, Mapping):
        sizes = dict(mesh)
    else:
        names = getattr(mesh, "mesh_dim_names", None)
        if not names:
            raise ValueError(f"mesh: expected a DeviceMesh with mesh_dim_names or a mapping, got {mesh!r}")
        sizes = dict(zip(names, mesh.shape))
    for axis, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"mesh: axis {axis!r} must have a positive int size, got {n!r}")
    return sizes


def _effective(logical, rules: Mapping, sizes: Mapping) -> str | None:
    """The mesh axis that splits logical axis ``logical``, or None (absent or size 1)."""
    axis = rules.get(logical) if logical is not None else None
    return axis if axis is not None and sizes.get(axis, 1) > 1 else None


# ----------------------------------------------------------------------------- plan


def plan(params_or_config, mesh, rules: Mapping | None = None) -> dict:
    """A placement per parameter: nested dicts shaped like the params.

    ``params_or_config``: ``Params``, a config or a specs tree (see the module docstring).
    ``mesh``: a named ``DeviceMesh`` or a mapping ``{axis: size}`` (no processes needed).
    ``rules``: logical axis -> mesh axis name or None. The default, ``{"heads": "tp",
    "mlp": "tp", "mod": "tp"}``, is the layout ``fd.apply`` computes in; a plan from other rules is a
    storage layout (``weights.load`` / ``weights.save``, `unshard`), and ``fd.apply`` on
    params sharded by it raises a ValueError naming the first leaf placed otherwise.

    On a mesh with an "fsdp" axis of size n > 1 every leaf is then fully sharded
    (`FullyShard`): its tp slice split over fsdp on the largest dim that is neither tp's nor
    fused and divides by n; a 1-D leaf with no such dim (a tp-split bias, a fused bias) stays
    whole over fsdp (as ZeRO-3 keeps small parameters whole) and the plan shows it; a leaf of
    two or more dims with none is a ValueError naming it.

    Raises ValueError, before any data moves, when a rule names a logical axis the
    parameters do not have or a mesh axis the mesh does not have, when a sharded dim or a
    fused block does not divide by its axis size (naming the parameter, dim, size and
    degree), or when the heads do not divide by tp, or the local heads by sp (Ulysses).
    """
    specs, sizes = specs_of(params_or_config), mesh_sizes(mesh)
    rules = DEFAULT_RULES if rules is None else _check_rules(rules, specs, mesh, sizes)
    _check_heads(config_of(params_or_config), rules, sizes)
    _check_head_units(config_of(params_or_config), specs, rules, sizes)
    return map_tree(lambda path, spec: _fully(path, spec, _placement(path, spec, rules, sizes), sizes), specs)


def _fully(path, spec, inner, sizes) -> Placement:
    """``inner`` split further over "fsdp" (see `plan`), or ``inner`` when fsdp is 1."""
    n = sizes.get(FSDP, 1)
    if n == 1:
        return inner
    shape = local_shape(spec, inner, sizes)
    taken = {inner.dim} if isinstance(inner, Shard) else set()
    dim = fsdp_dim(shape, taken | {d for d, a in enumerate(spec.axes) if a == PACKED}, n)
    if dim is not None:
        return FullyShard(inner, dim)
    if len(shape) >= 2:
        raise ValueError(
            f"{path}: no dim of its local shape {shape} (after {inner}) divides by fsdp={n} (tp's dim and fused dims "
            f"excluded); choose an fsdp degree that divides one of them"
        )
    return inner


def fsdp_dim(shape: tuple, excluded, n: int) -> int | None:
    """The dim fsdp splits a leaf of (tp-local) ``shape`` on, ``n`` ways: the largest dim not
    in ``excluded`` (tp's dim, fused dims) that ``n`` divides (the first of equals); None
    when there is none. `plan` uses it; so does anything fully sharding leaves that are not
    in a specs tree (the pipeline text encoders' parameters)."""
    free = [d for d in range(len(shape)) if d not in excluded and shape[d] % n == 0]
    return max(free, key=lambda d: (shape[d], -d)) if free else None


def _logical_axes(specs) -> set:
    axes = set()
    for _, spec in leaves(specs):
        axes.update(spec.axes)
        axes.update(b.axis for b in spec.blocks or ())
    return axes - {None, PACKED}


def _check_rules(rules, specs, mesh, sizes) -> dict:
    """Rules name logical axes of these parameters and mesh axes of this mesh (a misspelt
    axis is an error, as in ``shard_map``'s specs); the mesh axis may have any size."""
    if not isinstance(rules, Mapping) or not all(isinstance(v, (str, type(None))) for v in rules.values()):
        raise ValueError(f"rules: expected a mapping of logical axis -> mesh axis name or None, got {rules!r}")
    known = _logical_axes(specs)
    for logical, axis in rules.items():
        if logical not in known:
            raise ValueError(
                f"rules: {logical!r} is not a logical axis of these parameters; expected one of {sorted(known)}"
            )
        if axis is not None and axis not in sizes:
            raise ValueError(f"rules: {logical!r} -> {axis!r}: expected a mesh axis in {tuple(sizes)}, got {axis!r}")
    return dict(rules)


def _check_heads(config, rules, sizes) -> None:
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    axis = _effective("heads", rules, sizes)
    tp = sizes[axis] if axis else 1
    if heads % tp:
        raise ValueError(f"num_attention_heads: {heads} heads do not divide by the degree {axis}={tp}")
    sp = sizes.get("sp", 1)
    if (heads // tp) % sp:
        raise ValueError(
            f"num_attention_heads: Ulysses sequence parallelism needs the {heads // tp} heads per rank "
            f"({heads} / {axis or 'tp'}={tp}) to divide by the degree sp={sp}; a ring axis splits the sequence "
            f"with no such limit (make_mesh(..., ring=n), docs/sharding.md)"
        )


def _check_head_units(config, specs, rules, sizes) -> None:
    """A fused block of heads split over its axis must be a whole q, k, v or attention
    output (all the heads): a smaller unit (a fused dim cut into units of gcd(inner, mlp)
    when the MLP width is no multiple of the inner width) would reorder the heads a rank
    holds, which the KV cache's full view and every other mesh would not share."""
    H, D = getattr(config, "num_attention_heads", None), getattr(config, "attention_head_dim", None)
    axis = _effective("heads", rules, sizes)
    if not (isinstance(H, int) and isinstance(D, int)) or axis is None:
        return
    for path, spec in leaves(specs):
        for b in spec.blocks or ():
            if b.axis == "heads" and b.size != H * D:
                raise ValueError(
                    f"{path}: fused block {b.name!r} is a unit of {b.size} of the {H * D} rows of the heads; sharding "
                    f"it over {axis}={sizes[axis]} would reorder the heads a rank holds (under tensor parallelism the "
                    f"MLP width must be a multiple of the inner width {H * D})"
                )


def _placement(path, spec, rules, sizes) -> Placement:
    split = []  # (dim, mesh axis, blocks)
    for d, logical in enumerate(spec.axes):
        if logical == PACKED:
            axes = {_effective(b.axis, rules, sizes) for b in spec.blocks}
            if len(axes) > 1:
                names = [(b.name, b.axis) for b in spec.blocks]
                raise ValueError(f"{path}: the fused blocks {names} of dim {d} map to different mesh axes {axes}")
            if None not in axes:
                split.append((d, axes.pop(), tuple(b.size for b in spec.blocks)))
        elif (axis := _effective(logical, rules, sizes)) is not None:
            split.append((d, axis, None))
    if not split:
        return Replicate()
    if len(split) > 1:
        raise ValueError(f"{path}: dims {[s[0] for s in split]} are all split; at most one sharded dim is supported")
    d, axis, blocks = split[0]
    n = sizes[axis]
    if blocks is None and spec.shape[d] % n:
        raise ValueError(f"{path}: dim {d} ({spec.axes[d]!r}) of size {spec.shape[d]} does not divide by {axis}={n}")
    for b in spec.blocks if blocks else ():
        if b.size % n:
            raise ValueError(f"{path}: dim {d} block {b.name!r} of size {b.size} does not divide by {axis}={n}")
    return Shard(d, axis, blocks)


def check_placement(path: str, placement, spec, sizes: Mapping[str, int]) -> None:
    """ValueError unless ``placement`` is one `plan` could have made for the parameter at
    ``path`` on a mesh of axis sizes ``sizes``: a placement on a mesh axis, inside the
    tensor, a fused dim split per block (and only a fused one; a contiguous split of a
    fused dim is the classic TP bug), every piece divisible by the axis size.

    ``spec``: its ``ParamSpec``, or a shape tuple when no specs are known (then the
    fused-dim check is skipped)."""
    if not is_placement(placement):
        raise ValueError(f"plan: {path}: expected Replicate(), Shard(...) or FullyShard(...), got {placement!r}")
    if isinstance(placement, FullyShard):
        _check_fully(path, placement, spec, sizes)
        placement = placement.inner
    if isinstance(placement, Replicate):
        return
    shape = _shape(spec)
    if placement.axis not in sizes:
        raise ValueError(f"plan: {path}: axis {placement.axis!r} is not a mesh dim; the mesh has {tuple(sizes)}")
    d = placement.dim
    if not (isinstance(d, int) and not isinstance(d, bool) and 0 <= d < len(shape)):
        raise ValueError(f"plan: {path}: dim {d!r} is outside the parameter's shape {shape}")
    given = None if placement.blocks is None else tuple(placement.blocks)
    if is_spec(spec):
        blocks = tuple(b.size for b in spec.blocks) if spec.axes[d] == PACKED else None
        if given != blocks:
            what = f"fused from blocks {blocks}, so it splits per block" if blocks else "not fused"
            raise ValueError(
                f"plan: {path}: dim {d} is {what}; expected Shard({d}, {placement.axis!r}, {blocks}), got {placement!r}"
            )
    n = sizes[placement.axis]
    for size in given or (shape[d],):
        if size % n:
            raise ValueError(f"plan: {path}: dim {d} of size {size} does not divide by {placement.axis}={n}")
    if given is not None and sum(given) != shape[d]:
        raise ValueError(f"plan: {path}: blocks {given} do not add up to dim {d} of size {shape[d]}")


def _check_fully(path: str, placement: FullyShard, spec, sizes: Mapping[str, int]) -> None:
    inner, d, shape = placement.inner, placement.dim, _shape(spec)
    if not isinstance(inner, (Replicate, Shard)):
        raise ValueError(f"plan: {path}: FullyShard.inner must be Replicate() or Shard(...), got {inner!r}")
    if placement.axis not in sizes:
        raise ValueError(f"plan: {path}: axis {placement.axis!r} is not a mesh dim; the mesh has {tuple(sizes)}")
    if not (isinstance(d, int) and not isinstance(d, bool) and 0 <= d < len(shape)):
        raise ValueError(f"plan: {path}: dim {d!r} is outside the parameter's shape {shape}")
    if isinstance(inner, Shard) and inner.dim == d:
        raise ValueError(f"plan: {path}: {placement}: the fsdp dim must differ from the inner split's dim {d}")
    if is_spec(spec) and spec.axes[d] == PACKED:
        raise ValueError(f"plan: {path}: {placement}: dim {d} is fused; fsdp splits an unfused dim")
    n = sizes[placement.axis]
    if shape[d] % n:
        raise ValueError(f"plan: {path}: dim {d} of size {shape[d]} does not divide by {placement.axis}={n}")


# ----------------------------------------------------------------------------- slices


def _coord(mesh, axis: str) -> tuple[int, int]:
    """(index, size) of this rank on ``axis`` of a DeviceMesh, or from a mapping
    ``{axis: (index, size)}``; (0, 1) when the axis is absent."""
    if isinstance(mesh, Mapping):
        index, size = mesh.get(axis, (0, 1))
    elif axis in (mesh.mesh_dim_names or ()):
        index, size = mesh.get_local_rank(axis), mesh.size(mesh.mesh_dim_names.index(axis))
    else:
        return 0, 1
    if not 0 <= index < size:
        raise ValueError(f"mesh: coordinate {index} is outside axis {axis!r} of size {size}")
    return index, size


def _shape(spec) -> tuple[int, ...]:
    return tuple(spec.shape if hasattr(spec, "shape") else spec)


def local_slices(spec, placement: Placement, mesh) -> list[tuple[int, int, int]]:
    """The pieces of the full tensor that this rank holds, in the order they are
    concatenated: a list of ``(dim, start, stop)`` ranges, all along the same dim.

    ``spec``: a ``ParamSpec`` (or anything with ``.shape``, or a shape tuple).
    ``placement``: the parameter's leaf of the plan. ``mesh``: a named ``DeviceMesh``
    (this rank's coordinates) or a mapping ``{axis: (index, size)}``.

    The local tensor is ``torch.cat([full.narrow(d, a, b - a) for d, a, b in ranges], d)``
    (`take` does it); for a safetensors slice, ``sl[a:b]`` along dim ``d``. A `FullyShard`
    adds one range on its fsdp dim (another dim) after the inner placement's ranges: the
    ranges of each dim are concatenated, the dims applied one after the other.
    ``Replicate()`` gives ``[(0, 0, shape[0])]`` (``[]`` for a 0-d tensor: the whole).
    A fused-block `Shard` gives one range per block: rank r of n holds rows
    ``[off_i + r*b_i/n, off_i + (r+1)*b_i/n)`` of every block i (offset off_i, size b_i).
    """
    shape = _shape(spec)
    if isinstance(placement, FullyShard):
        index, n = _coord(mesh, placement.axis)
        d, inner = placement.dim, placement.inner
        chunk = shape[d] // n
        own = [(d, index * chunk, (index + 1) * chunk)]
        return own if isinstance(inner, Replicate) else local_slices(spec, inner, mesh) + own
    if isinstance(placement, Replicate):
        return [(0, 0, shape[0])] if shape else []
    if not isinstance(placement, Shard):
        raise ValueError(f"placement: expected Replicate() or Shard(...), got {placement!r}")
    d = placement.dim
    if not 0 <= d < len(shape):
        raise ValueError(f"placement: dim {d} is outside a tensor of shape {shape}")
    index, n = _coord(mesh, placement.axis)
    blocks = placement.blocks or (shape[d],)
    if sum(blocks) != shape[d] or any(b % n for b in blocks):
        raise ValueError(
            f"placement: blocks {blocks} of dim {d} (size {shape[d]}) do not split by {placement.axis}={n}"
        )
    ranges, offset = [], 0
    for b in blocks:
        chunk = b // n
        ranges.append((d, offset + index * chunk, offset + (index + 1) * chunk))
        offset += b
    return ranges


def take(full: torch.Tensor, ranges: list[tuple[int, int, int]]) -> torch.Tensor:
    """The local tensor: the ``ranges`` of `local_slices` cut from ``full`` and concatenated
    per dim, dim after dim (a view of ``full`` when there is a single range per dim).

    The dims cut by one range (narrow: views) go first, the one cut by several (one range
    per fused block: a ``torch.cat``) last, so the concatenation allocates exactly the local
    tensor: concatenating first and narrowing another dim after (fsdp x tp on a fused leaf)
    would leave the local tensor a view that keeps the whole tp slice alive. The two orders
    give the same values (cuts on different dims commute)."""
    dims = sorted(dict.fromkeys(d for d, _, _ in ranges), key=lambda d: sum(e == d for e, _, _ in ranges) > 1)
    for dim in dims:
        parts = [full.narrow(d, a, b - a) for d, a, b in ranges if d == dim]
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    return full


def local_shape(spec, placement: Placement, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of a rank's local tensor, from the axis sizes ``{axis: size}``."""
    shape = list(_shape(spec))
    if isinstance(placement, FullyShard):
        shape = list(local_shape(shape, placement.inner, sizes))
    if isinstance(placement, (Shard, FullyShard)):
        shape[placement.dim] //= sizes.get(placement.axis, 1)
    return tuple(shape)


def bytes_per_rank(specs, plan_or_rules=None, degrees=None, dtype=torch.bfloat16) -> int:
    """Parameter bytes one rank holds: replicated bytes + sharded bytes / degree.

    ``specs``: a specs tree, a config or ``Params``; ``plan_or_rules``: a plan (from
    `plan`), a rules mapping or None (the default rules); ``degrees``: a mapping
    ``{axis: size}`` or a DeviceMesh; ``dtype``: the storage dtype. Pure arithmetic."""
    sizes = mesh_sizes(degrees)
    tree = specs_of(specs)
    is_plan = isinstance(plan_or_rules, Mapping) and any(
        isinstance(v, Mapping) or is_placement(v) for v in plan_or_rules.values()
    )
    placements = plan_or_rules if is_plan else plan(specs, sizes, plan_or_rules)
    check_same_keys("plan", placements, tree, "the specs")
    flat = dict(leaves(placements))
    return sum(math.prod(local_shape(spec, flat[path], sizes)) for path, spec in leaves(tree)) * dtype.itemsize

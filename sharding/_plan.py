"""Placement plans: where every parameter lives on a named mesh, as data.

A *plan* is a pytree shaped like the params (nested dicts, the same keys) whose leaves
are placements: `Replicate()`, `Shard(dim, axis)` or, for a fused projection,
`Shard(dim, axis, blocks)` — each block of the fused dim split independently, rank r
holding the r-th slice of every block, concatenated in block order (a contiguous split
of a fused dim is the classic TP bug, see LESSONS.md).

`plan` derives it from each parameter's ``ParamSpec`` (``shape``, logical ``axes`` and
``blocks``) through a rules table mapping logical axes to mesh axes, as maxdiffusion
and haliax do (default ``{"heads": "tp", "mlp": "tp", "mod": "tp"}``), and validates every sharded
size before any data moves. Users may edit the plan or pass their own rules.

Where the specs come from — `sharding` imports neither ``functional_dit`` nor
``weights`` (DESIGN.md's dependency direction). ``plan`` takes either a specs tree
(nested dicts of objects with ``.shape``, ``.axes`` and ``.blocks``), or a config, or a
``Params`` (anything with ``.config`` and ``.tree``). A config's specs come from a small
protocol: its ``param_specs()`` method if it has one, else the ``param_specs(config)``
function of the module that defines the config class — the family-module convention
every ``functional_dit`` family follows. Nothing is imported for it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping

import torch

PACKED = "packed"  # the logical axis of a dim that concatenates several blocks (ParamSpec)
# "mod": the AdaLN modulation rows, split per chunk; the model all-gathers their output.
DEFAULT_RULES = {"heads": "tp", "mlp": "tp", "mod": "tp"}
# The local-view model code sums row-parallel partial products with psum(..., "tp"),
# so on a mesh with tp > 1 these logical axes must be split over "tp" and no other.
MODEL_CONTRACT = {"heads": "tp", "mlp": "tp"}


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


Placement = Replicate | Shard


# ----------------------------------------------------------------------------- trees


def is_spec(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "axes") and not isinstance(x, torch.Tensor)


def is_placement(x) -> bool:
    return isinstance(x, (Replicate, Shard))


def map_tree(fn: Callable, tree: Mapping, *rest: Mapping, path: str = "") -> dict:
    """``fn(dotted_path, leaf, *other_leaves)`` over nested dicts with the same keys."""
    out = {}
    for key, value in tree.items():
        p = f"{path}{key}"
        others = [r[key] for r in rest]
        out[key] = map_tree(fn, value, *others, path=p + ".") if isinstance(value, Mapping) else fn(p, value, *others)
    return out


def leaves(tree: Mapping, path: str = ""):
    """``(dotted_path, leaf)`` pairs of nested dicts, in order."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from leaves(value, f"{path}{key}.")
        else:
            yield f"{path}{key}", value


def check_same_keys(name: str, tree: Mapping, ref: Mapping, ref_name: str) -> None:
    """ValueError naming the dotted paths in which ``tree`` and ``ref`` differ."""
    a, b = {p for p, _ in leaves(tree)}, {p for p, _ in leaves(ref)}
    if a != b:
        missing, extra = sorted(b - a)[:10], sorted(a - b)[:10]
        raise ValueError(f"{name}: expected the keys of {ref_name}; missing {missing}, unexpected {extra}")


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
    method = getattr(config, "param_specs", None)
    if callable(method):
        return method()
    fn = getattr(sys.modules.get(type(config).__module__), "param_specs", None)
    if callable(fn):
        return fn(config)
    raise ValueError(
        f"params_or_config: expected a specs tree, a config or Params whose config's module defines "
        f"param_specs(config), got {type(source).__name__}"
    )


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
    ``rules``: logical axis -> mesh axis (default ``{"heads": "tp", "mlp": "tp", "mod": "tp"}``).

    Raises ValueError, before any data moves, when a sharded dim or a fused block does
    not divide by its axis size (naming the parameter, dim, size and degree), when the
    heads do not divide by tp, or the local heads by sp (Ulysses), or when the rules
    break the model's local-view contract (heads and MLP split over "tp").
    """
    specs, sizes = specs_of(params_or_config), mesh_sizes(mesh)
    rules = _check_rules(DEFAULT_RULES if rules is None else rules, specs, sizes)
    _check_heads(config_of(params_or_config), rules, sizes)
    return map_tree(lambda path, spec: _placement(path, spec, rules, sizes), specs)


def _logical_axes(specs) -> set:
    axes = set()
    for _, spec in leaves(specs):
        axes.update(spec.axes)
        axes.update(b.axis for b in spec.blocks or ())
    return axes


def _check_rules(rules, specs, sizes) -> dict:
    if not isinstance(rules, Mapping) or not all(isinstance(v, (str, type(None))) for v in rules.values()):
        raise ValueError(f"rules: expected a mapping of logical axis -> mesh axis name or None, got {rules!r}")
    used = _logical_axes(specs)
    for logical, axis in MODEL_CONTRACT.items():
        want = axis if sizes.get(axis, 1) > 1 else None
        got = _effective(logical, rules, sizes)
        if logical in used and got != want:
            raise ValueError(
                f"rules: the model sums {logical!r} partial products over {axis!r} (psum), so on a mesh "
                f"{sizes} {logical!r} must be split over {want!r}; the rules {dict(rules)} split it over {got!r}"
            )
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
            f"({heads} / {axis or 'tp'}={tp}) to divide by the degree sp={sp}"
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
        raise ValueError(f"plan: {path}: expected Replicate() or Shard(...), got {placement!r}")
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
    (`take` does it); for a safetensors slice, ``sl[a:b]`` along dim ``d``.
    ``Replicate()`` gives ``[(0, 0, shape[0])]`` (``[]`` for a 0-d tensor: the whole).
    A fused-block `Shard` gives one range per block: rank r of n holds rows
    ``[off_i + r*b_i/n, off_i + (r+1)*b_i/n)`` of every block i (offset off_i, size b_i).
    """
    shape = _shape(spec)
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
    (a view when there is a single range)."""
    if not ranges:
        return full
    parts = [full.narrow(d, a, b - a) for d, a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, ranges[0][0])


def local_shape(spec, placement: Placement, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of a rank's local tensor, from the axis sizes ``{axis: size}``."""
    shape = list(_shape(spec))
    if isinstance(placement, Shard):
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
    total = 0
    flat = dict(leaves(placements))
    for path, spec in leaves(tree):
        n = 1
        for s in local_shape(spec, flat[path], sizes):
            n *= s
        total += n
    return total * dtype.itemsize

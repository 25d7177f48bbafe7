"""``shard_map``: run any function in the local view of a mesh, as JAX's ``shard_map``.

    f = sharding.shard_map(fn, mesh, in_specs=(P("dp", "sp"), P()), out_specs=P("dp"))
    y = f(x, w)   # fn sees x's local (B/dp, S/sp, ...) block and all of w, under bind(mesh)

``P(a0, a1, ...)`` names the mesh axis each leading dim is split over; specs are pytree
prefixes. Inputs are full tensors, the same on every rank, cut locally; outputs are
all-gathered along their split dims. Differentiable; the gradient rules: docs/sharding.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.utils._pytree as pytree

from ._axes import all_gather, axis_index, axis_size, bind, pvary
from .internal import is_dtensor


class P(tuple):
    """A partition spec: per dim, the mesh axis it is split over, or None."""

    def __new__(cls, *axes):
        for a in axes:
            if a is not None and not isinstance(a, str):
                raise ValueError(f"P: expected mesh axis names or None, got {a!r}")
        named = [a for a in axes if a is not None]
        for a in named:
            if named.count(a) > 1:
                raise ValueError(f"P: mesh axis {a!r} is used by more than one dim: P{tuple.__repr__(axes)}")
        return super().__new__(cls, axes)

    def __repr__(self) -> str:
        return f"P{tuple.__repr__(self)}"


def _is_spec(s) -> bool:
    return s is None or isinstance(s, P)


def _map_prefix(fn, specs, tree, where: str):
    """Apply ``fn(spec, leaf)`` to every tensor leaf of ``tree``, ``specs`` being a prefix of it."""
    if _is_spec(specs):
        return pytree.tree_map(lambda x: fn(specs or P(), x) if isinstance(x, torch.Tensor) else x, tree)
    if isinstance(specs, Mapping) and isinstance(tree, Mapping):
        if set(specs) != set(tree):
            raise ValueError(f"{where}: spec keys {sorted(specs)} differ from the value keys {sorted(tree)}")
        return {k: _map_prefix(fn, specs[k], tree[k], f"{where}[{k!r}]") for k in tree}
    if isinstance(specs, (tuple, list)) and isinstance(tree, (tuple, list)):
        if len(specs) != len(tree):
            raise ValueError(f"{where}: expected {len(specs)} values for the specs, got {len(tree)}")
        return type(tree)(_map_prefix(fn, s, t, f"{where}[{i}]") for i, (s, t) in enumerate(zip(specs, tree)))
    raise ValueError(f"{where}: the spec {specs!r} is not a prefix of a {type(tree).__name__}")


def _check_rank(spec: P, x: torch.Tensor) -> None:
    if len(spec) > x.ndim:
        raise ValueError(f"spec {spec!r} has {len(spec)} dims, the tensor of shape {tuple(x.shape)} only {x.ndim}")


def _local(spec: P, x: torch.Tensor) -> torch.Tensor:
    if is_dtensor(x):  # its shard is the local view
        return x.to_local()
    _check_rank(spec, x)
    x = pvary(x, tuple(a for a in spec if a))  # each rank's chunk gradient, summed into the whole
    for d, axis in enumerate(spec):
        n = axis_size(axis) if axis else 1
        if n == 1:
            continue
        if x.shape[d] % n:
            raise ValueError(f"in_specs: dim {d} of size {x.shape[d]} does not divide by {axis}={n}")
        chunk = x.shape[d] // n
        x = x.narrow(d, axis_index(axis) * chunk, chunk)
    return x


def _global(spec: P, y: torch.Tensor) -> torch.Tensor:
    _check_rank(spec, y)
    for d, axis in enumerate(spec):
        if axis:
            y = all_gather(y, axis, d)
    return y


def _check_axes(specs, names: tuple, where: str) -> None:
    """ValueError for a spec naming an axis ``names`` lacks (JAX refuses it too; here an
    absent axis has size 1, so a misspelt one would silently leave its dim unsplit)."""
    if isinstance(specs, P):
        for a in specs:
            if a is not None and a not in names:
                raise ValueError(f"{where}: axis {a!r} is not a mesh dim; the mesh has {names}")
    elif isinstance(specs, Mapping):
        for s in specs.values():
            _check_axes(s, names, where)
    elif isinstance(specs, (tuple, list)):
        for s in specs:
            _check_axes(s, names, where)


def shard_map(fn, mesh, in_specs, out_specs):
    """``fn`` run on every rank in the local view of ``mesh`` (see the module docstring).

    ``in_specs``: a prefix of the positional arguments tuple (one spec per argument, or
    one for all); ``out_specs``: a prefix of the result. ``mesh``: a named DeviceMesh,
    or None (then ``fn`` runs on the full tensors)."""

    names = None if mesh is None else tuple(mesh.mesh_dim_names or ())
    if names is not None:
        _check_axes(in_specs, names, "in_specs")
        _check_axes(out_specs, names, "out_specs")

    @functools.wraps(fn)
    def wrapped(*args):
        specs = in_specs if _is_spec(in_specs) else tuple(in_specs)
        with bind(mesh):
            local = _map_prefix(_local, specs, tuple(args), "in_specs")
            out = fn(*local)
            return _map_prefix(_global, out_specs, out, "out_specs")

    return wrapped

"""Named-axis collectives, as under JAX's ``shard_map``.

Model code is written in the local view and names mesh axes ("tp", "sp", "dp").
`bind(mesh)` makes a mesh current; with no mesh bound, or an axis of size 1, every
collective is the identity, so one code path serves one device and many. The
collectives are ``torch.distributed._functional_collectives`` so ``torch.compile``
traces them; `_autodiff` gives them the backward, jvp and vmap rules under which a
sharded model's gradients equal the unsharded ones.
"""

from __future__ import annotations

import contextlib

import torch

from . import _autodiff

# The bound meshes, innermost last. A plain list rather than a ContextVar: torch.compile
# (dynamo) traces list mutation but not ContextVar.set, and apply must compile fullgraph.
_STACK: list = []


@contextlib.contextmanager
def bind(mesh):
    """Make ``mesh`` (a named `DeviceMesh`, or None) the current mesh for collectives."""
    _STACK.append(mesh)
    try:
        yield mesh
    finally:
        _STACK.pop()


def current_mesh():
    return _STACK[-1] if _STACK else None


def _layout(mesh) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """(dim names, dim sizes, this rank's coordinate) of ``mesh``: plain constants.

    Read eagerly even under torch.compile (``assume_constant_result``): torch 2.9's
    dynamo cannot trace ``mesh.mesh_dim_names`` nor ``get_local_rank(axis)``, and a
    mesh's layout never changes, so the traced graph may treat it as a constant."""
    names = tuple(mesh.mesh_dim_names or ())
    sizes = tuple(mesh.size(i) for i in range(len(names)))
    coords = tuple(mesh.get_coordinate() or (0,) * len(names))
    return names, sizes, coords


if hasattr(torch, "compiler") and hasattr(torch.compiler, "assume_constant_result"):
    _layout = torch.compiler.assume_constant_result(_layout)


def _axis(axis: str) -> tuple[int, int]:
    """(size, this rank's index) of ``axis`` on the bound mesh; (1, 0) when absent."""
    mesh = current_mesh()
    if mesh is None:
        return 1, 0
    names, sizes, coords = _layout(mesh)
    for name, size, index in zip(names, sizes, coords):
        if name == axis:
            return size, index
    return 1, 0


def axis_size(axis: str) -> int:
    """Size of mesh axis ``axis``; 1 when no mesh is bound or it has no such axis."""
    return _axis(axis)[0]


def axis_index(axis: str) -> int:
    """This rank's coordinate on ``axis``; 0 when the axis is absent."""
    return _axis(axis)[1]


def _group(axis: str):
    mesh = current_mesh()
    return mesh.get_group(axis)


def _group_name(mesh, axis: str) -> str:
    """The registered name of ``mesh``'s process group over ``axis``: what the raw
    functional collective ops take. A constant under torch.compile (as `_layout`)."""
    return mesh.get_group(axis).group_name


if hasattr(torch, "compiler") and hasattr(torch.compiler, "assume_constant_result"):
    _group_name = torch.compiler.assume_constant_result(_group_name)


def _name(axis: str) -> str:
    """The group name of ``axis`` on the bound mesh."""
    return _group_name(current_mesh(), axis)


def psum(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum ``x`` over ``axis`` (an all-reduce). Backward: the identity (the sum is
    replicated, so is its gradient), as a row-parallel projection needs."""
    if axis_size(axis) == 1:
        return x
    return _autodiff.psum(x, _group(axis))


def pmax(x: torch.Tensor, axis: str) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``axis`` (an all-reduce), for values that take
    no gradient (``x`` is detached), such as the quantization scale of a row split over
    ``axis``."""
    if axis_size(axis) == 1:
        return x
    return _autodiff.all_reduce(x.detach(), _group(axis), "max")


def pvary(x: torch.Tensor, axes) -> torch.Tensor:
    """``x`` as is, marked as entering code that differs across ``axes`` (a name or a
    tuple of names), as JAX's ``pvary``. Backward: the gradient summed over ``axes``.

    Put it where a tensor that every rank holds whole meets rank-dependent code: the
    input of a column-parallel projection (over "tp"), a parameter used on this rank's
    tokens or batch items (over "sp", "dp"). Each rank's gradient is then its share of
    the whole and the sum is the gradient of the unsharded model."""
    for axis in (axes,) if isinstance(axes, str) else tuple(axes):
        if axis_size(axis) > 1:
            x = _autodiff.pvary(x, _group(axis))
    return x


def all_gather(x: torch.Tensor, axis: str, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in axis order. Backward: this rank's
    slice of the (replicated) gradient."""
    n, index = _axis(axis)
    if n == 1:
        return x
    return _autodiff.gather(x, _group(axis), dim % x.ndim, index)


def all_to_all(x: torch.Tensor, axis: str, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split ``x`` along ``split_dim`` into one chunk per rank, send chunk r to rank r
    and concatenate what arrives along ``concat_dim`` (Ulysses' sequence/heads swap).
    Backward: the reverse all-to-all."""
    n = axis_size(axis)
    if n == 1:
        return x
    split_dim, concat_dim = split_dim % x.ndim, concat_dim % x.ndim
    if x.shape[split_dim] % n:
        raise ValueError(f"all_to_all: dim {split_dim} of size {x.shape[split_dim]} does not divide by {axis}={n}")
    return _autodiff.swap(x, _group(axis), n, split_dim, concat_dim)


def ppermute(x: torch.Tensor, axis: str, shift: int = 1) -> torch.Tensor:
    """Pass ``x`` ``shift`` places along the ring of ``axis``: this rank sends its ``x`` to
    the rank ``shift`` after it (cyclically) and returns what the rank ``shift`` before it
    sent (JAX's ``ppermute`` with a cyclic shift). Backward: the pass back."""
    n, index = _axis(axis)
    if n == 1 or shift % n == 0:
        return x
    return _autodiff.ppermute(x, _group(axis), n, index, shift)


def ulysses(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor | None, axis: str = "sp"):
    """Run ``fn(q, k, v, key_bias)`` on the whole sequence with this rank's heads:
    q, k, v (B, S/n, H, D) -> all-to-all -> (B, S, H/n, D); ``key_bias`` (B, S/n) is
    all-gathered to (B, S) in the same rank-major order; the (B, S, H/n, D) result
    goes back to (B, S/n, H, D)."""
    if axis_size(axis) == 1:
        return fn(q, k, v, key_bias)
    q, k, v = (all_to_all(t, axis, split_dim=2, concat_dim=1) for t in (q, k, v))
    if key_bias is not None:
        key_bias = all_gather(key_bias, axis, dim=1)
    return all_to_all(fn(q, k, v, key_bias), axis, split_dim=1, concat_dim=2)

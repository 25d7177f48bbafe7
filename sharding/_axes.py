"""Named-axis collectives, as under JAX's ``shard_map``.

Model code is written in the local view and names mesh axes ("tp", "sp", "dp").
`bind(mesh)` makes a mesh current; with no mesh bound, or an axis of size 1, every
collective is the identity, so one code path serves one device and many. The
collectives are ``torch.distributed._functional_collectives`` so ``torch.compile``
traces them.
"""

from __future__ import annotations

import contextlib

import torch

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


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def _done(t: torch.Tensor) -> torch.Tensor:
    """The finished result of a functional collective. Eager funcol returns an
    ``AsyncCollectiveTensor`` that waits only when an op dispatches on it; views of it
    (``narrow``, ``movedim``) stay un-waited, and a reader that bypasses dispatch
    (``torch.save``, ``.numpy()``) would see the buffer before the collective filled it.
    So every collective here waits at once. (Traced code gets plain tensors and an
    explicit ``wait_tensor`` from funcol, so this is a no-op under torch.compile/export.)"""
    funcol = _funcol()
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def psum(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum ``x`` over ``axis`` (an all-reduce)."""
    if axis_size(axis) == 1:
        return x
    return _done(_funcol().all_reduce(x, "sum", _group(axis)))


def all_gather(x: torch.Tensor, axis: str, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in axis order."""
    n = axis_size(axis)
    if n == 1:
        return x
    dim = dim % x.ndim
    out = _done(_all_gather_dim0()(x.movedim(dim, 0).contiguous(), 0, _group(axis)))
    return out.movedim(0, dim)


def _all_gather_dim0():
    # torch 2.13 renamed funcol.all_gather_tensor to all_gather_single and made the old
    # name warn (FutureWarning) on every eager call; torch 2.9 has only the old name.
    funcol = _funcol()
    return getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def all_to_all(x: torch.Tensor, axis: str, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split ``x`` along ``split_dim`` into one chunk per rank, send chunk r to rank r
    and concatenate what arrives along ``concat_dim`` (Ulysses' sequence/heads swap)."""
    n = axis_size(axis)
    if n == 1:
        return x
    split_dim, concat_dim = split_dim % x.ndim, concat_dim % x.ndim
    if x.shape[split_dim] % n:
        raise ValueError(f"all_to_all: dim {split_dim} of size {x.shape[split_dim]} does not divide by {axis}={n}")
    chunks = x.movedim(split_dim, 0).unflatten(0, (n, -1)).contiguous()  # (n, chunk, ...)
    out = _done(_funcol().all_to_all_single(chunks.flatten(0, 1), None, None, _group(axis)))
    out = out.unflatten(0, (n, -1)).movedim(1, split_dim + 1)  # (n, ..., chunk at split_dim, ...)
    return out.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


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

"""Layerwise casting: parameters stored in a narrow dtype (float8, say) and read in the
compute dtype at each op that uses them, so the weights stay small at rest.

`layerwise_cast(params, storage_dtype, compute_dtype, skip=...)` returns `Params` whose
selected leaves are `CastTensor` s: a ``torch.Tensor`` wrapper subclass that holds the
values in ``storage_dtype`` (``.stored``) and reports ``dtype == compute_dtype``, so every
check and dtype decision of `fd.apply` (input validation against the reference leaf, LoRA
factor casts) sees the compute dtype. Each op that reads a wrapped leaf
(``__torch_dispatch__``) casts it to the compute dtype for that one op and returns plain
tensors: a compute-dtype copy of a weight lives only while its op runs (a linear layer's
matmul, Qwen-Image's batched modulation read, a LoRA merge), whichever function reads it.

In-place ops on a wrapped leaf (``copy_``, ``add_``: what `functional_dit.lora.merge`
callers, ``fuse_lora`` and ``load_state_dict`` do) run on a compute-dtype copy and write
the result back into the storage (rounded to the storage dtype); the ops' schemas say
which arguments they write. Views (``detach``, ``t``, slices), ``clone`` and device
moves keep the wrapper over the matching view, copy or move of the storage (so a write
through a view reaches the storage, and a moved leaf stays stored), which is also what
``nn.Parameter`` and ``Module.to(device)`` need. Fused projection buffers and the fast
kernels read tensor storages: `functional_dit.nn.fused` declines wrapped leaves, so the
plain per-op path runs (`fd.prepare` leaves them as they are).

Gradients flow through the reads to unwrapped inputs (``x.grad``); a wrapped leaf that
requires grad gets a compute-dtype ``.grad`` (autograd saves the wrapper, not a cast copy;
backward reads it again). `fd.apply` computes in one dtype, so the leaves left as they are
must already be in the compute dtype. ``cat`` / ``stack`` of leaves stored alike join the
storages (the values are the same), so `sharding.shard_params` of cast params keeps every
leaf stored, the per-block-split fused projections included, on every mesh kind.
`layerwise_cast` of sharded (DTensor) params stores each leaf's local shard and keeps its
placements: the same leaves as casting first, then sharding. On an fsdp mesh a stored leaf's
just-in-time all-gather moves its stored bytes and wraps the gathered storage again
(`sharding._fsdp`, which knows the wrapper only by torch's ``__tensor_flatten__`` protocol).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from sharding.internal import is_dtensor
from sharding.tree import nest

from ..params import COMPUTE_DTYPES, Params

_aten = torch.ops.aten
# A view that reinterprets the bytes: not a view of the values in the compute dtype.
_NOT_VALUE_VIEWS = (_aten.view.dtype,)


class CastTensor(torch.Tensor):
    """A leaf stored as ``stored`` (any floating dtype) that reads as ``dtype`` (the compute
    dtype) at every op; see the module docstring."""

    stored: torch.Tensor

    @staticmethod
    def __new__(cls, stored: torch.Tensor, compute_dtype: torch.dtype, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            stored.shape,
            strides=stored.stride(),
            storage_offset=stored.storage_offset(),
            dtype=compute_dtype,
            device=stored.device,
            layout=stored.layout,
            requires_grad=requires_grad,
        )

    def __init__(self, stored: torch.Tensor, compute_dtype: torch.dtype, requires_grad: bool = False):
        self.stored = stored

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"CastTensor(shape={tuple(self.shape)}, stored={self.stored.dtype}, compute={self.dtype}, "
            f"device={self.device})"
        )

    def __tensor_flatten__(self):
        return ["stored"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, compute_dtype, outer_size, outer_stride):
        return CastTensor(inner["stored"], compute_dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(args[0], CastTensor) and (
            func is _aten.clone.default or (func.is_view and func not in _NOT_VALUE_VIEWS)
        ):  # views (detach, t, slices: writes through them reach the storage) and clones stay stored
            dtype = args[0].dtype
            out = func(args[0].stored, *args[1:], **kwargs)
            return tree_map(lambda o: CastTensor(o, dtype) if isinstance(o, torch.Tensor) else o, out)
        joined = _joined(func, args, kwargs)
        if joined is not None:
            return joined
        if func is _aten._to_copy.default and isinstance(args[0], CastTensor):
            moved = _moved(args[0], kwargs)
            if moved is not None:
                return moved
        written = _written(func, args, kwargs)
        temps = {id(w): w.stored.to(w.dtype) for w in written}

        def read(t):
            if not isinstance(t, CastTensor):
                return t
            return temps[id(t)] if id(t) in temps else t.stored.to(t.dtype)

        out = func(*tree_map(read, args), **tree_map(read, kwargs))
        for w in written:  # the op wrote into compute-dtype copies: store what it wrote
            w.stored.copy_(temps[id(w)])
        if not written:
            return out
        back = {id(temps[id(w)]): w for w in written}  # an in-place op returns its argument
        return tree_map(lambda o: back.get(id(o), o), out)


# torch.save keeps a CastTensor (its storage and compute dtype); a safe load
# (torch.load(weights_only=True), the default) may rebuild it, as it rebuilds our Params.
torch.serialization.add_safe_globals([CastTensor])


def _moved(t: CastTensor, kwargs: dict) -> CastTensor | None:
    """``t.to(device)`` (no dtype change, or to its own compute dtype): the stored values on
    the new device, still wrapped; None for a real dtype change (an ordinary cast)."""
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != t.dtype:
        return None
    opts = {k: v for k, v in kwargs.items() if k in ("device", "non_blocking", "memory_format")}
    return CastTensor(t.stored.to(**opts), t.dtype)


def _joined(func, args, kwargs) -> CastTensor | None:
    """``cat`` / ``stack`` of leaves all stored alike: the storages joined, still wrapped
    (joining commutes with the elementwise cast, so the values are the same); what
    `sharding.shard_params` does to the per-block slices of a fused dim (FLUX.1's
    single-block ``proj_mlp`` / ``proj_out``), which then stay in the storage dtype. None
    for any other op or a mix."""
    if func not in (_aten.cat.default, _aten.stack.default) or not args or not isinstance(args[0], (list, tuple)):
        return None
    ts = args[0]
    if not ts or not all(isinstance(t, CastTensor) for t in ts):
        return None
    if len({(t.dtype, t.stored.dtype) for t in ts}) != 1:
        return None
    return CastTensor(func([t.stored for t in ts], *args[1:], **kwargs), ts[0].dtype)


def _written(func, args, kwargs) -> list:
    """The wrapped arguments ``func``'s schema says it writes (in-place, ``out=`` and
    ``_foreach_*_`` ops, whose written argument is a list)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else [value]:  # Tensor(a!)[]: _foreach_add_
            if isinstance(t, CastTensor) and all(t is not w for w in out):
                out.append(t)
    return out


def is_cast(t) -> bool:
    """Whether ``t`` is a `CastTensor` (a leaf stored in another dtype than it reads as)."""
    return isinstance(t, CastTensor)


# ----------------------------------------------------------------------------- the transform


def _prefixes(path: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b", "a.b.c"]``: a module and its ancestors, each of which a
    skip pattern may name (as diffusers' traversal checks every level)."""
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def skip_by_patterns(patterns: Iterable[str]) -> Callable[[str], bool]:
    """A ``skip(key)`` predicate: true when a regular expression of ``patterns`` is found
    (``re.search``) in the leaf's module path (its key less ``.weight`` / ``.bias``) or in an
    ancestor's."""
    compiled = [re.compile(p) for p in patterns]
    return lambda key: any(p.search(m) for m in _prefixes(key.rpartition(".")[0] or key) for p in compiled)


def _check_dtypes(params: Params, storage_dtype, compute_dtype) -> torch.dtype:
    if not isinstance(storage_dtype, torch.dtype) or not storage_dtype.is_floating_point:
        raise ValueError(
            f"storage_dtype: expected a floating torch.dtype (e.g. torch.float8_e4m3fn), got {storage_dtype!r}"
        )
    if compute_dtype is None:
        compute_dtype = next(t.dtype for t in params.leaves())
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype: expected one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
    return compute_dtype


def layerwise_cast(
    params: Params,
    storage_dtype: torch.dtype = torch.float8_e4m3fn,
    compute_dtype: torch.dtype | None = None,
    skip: Iterable[str] | Callable[[str], bool] = (),
) -> Params:
    """``params`` with every floating leaf not skipped held in ``storage_dtype`` and read
    as ``compute_dtype`` at each op (`CastTensor`; see the module docstring).

    ``compute_dtype``: None for the params' dtype (their first leaf's). ``skip``: regular
    expressions searched in each leaf's module path and its ancestors' (diffusers' rule:
    ``("norm", "pos_embed")`` keeps every norm and position embedding as it is), or a
    predicate over leaf keys. Leaves already wrapped are re-stored from their values.
    Storing rounds the values to ``storage_dtype``, once. Sharded (DTensor) leaves are
    stored shard by shard, placed as they were (`_cast_placed`)."""
    if not isinstance(params, Params):
        raise ValueError(f"params: expected functional_dit.Params, got {type(params).__name__}")
    compute_dtype = _check_dtypes(params, storage_dtype, compute_dtype)
    skipped = skip if callable(skip) else skip_by_patterns(skip)
    flat, kept = {}, {}
    for key, t in params.flat().items():
        if not t.is_floating_point() or skipped(key):
            flat[key] = t
            if t.is_floating_point() and t.dtype != compute_dtype:
                kept[key] = t.dtype
            continue
        flat[key] = cast_leaf(t, storage_dtype, compute_dtype)
    if kept:
        key, dtype = next(iter(kept.items()))
        raise ValueError(
            f"compute_dtype: fd.apply computes in one dtype, and the {len(kept)} leaves kept as they are (skipped) "
            f"are {dtype} (e.g. {key!r}), not {compute_dtype}: convert the params to {compute_dtype} first"
        )
    return params.replace(nest(flat))


def _cast_placed(t, storage_dtype: torch.dtype, compute_dtype: torch.dtype):
    """A DTensor leaf with its local shard stored (`cast_leaf`), on the same mesh and
    placements: the rounding is elementwise, so these are the shards `sharding.shard_params`
    cuts from the whole leaf cast (``full_tensor()`` equal bitwise). No communication."""
    grad = t.requires_grad
    with torch.no_grad():
        local = cast_leaf(t.to_local().detach(), storage_dtype, compute_dtype)
        out = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return out.requires_grad_() if grad else out


def cast_leaf(t: torch.Tensor, storage_dtype: torch.dtype, compute_dtype: torch.dtype) -> CastTensor:
    """``t`` (plain or a `CastTensor`) stored as ``storage_dtype``, read as ``compute_dtype``;
    it requires grad if ``t`` does. A DTensor: its local shard so, placed alike (`_cast_placed`)."""
    if is_dtensor(t):
        return _cast_placed(t, storage_dtype, compute_dtype)
    grad = t.requires_grad
    if isinstance(t, CastTensor):
        t = t.stored
    with torch.no_grad():
        return CastTensor(t.detach().to(storage_dtype), compute_dtype, requires_grad=grad)


def stored_leaf(t):
    """A `CastTensor`'s storage (the tensor in the dtype it is held in); anything else as is."""
    return t.stored if isinstance(t, CastTensor) else t

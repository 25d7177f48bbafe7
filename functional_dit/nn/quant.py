"""fp8 compute: linear weights held in float8 e4m3 with their scales, and the core's linear
ops running them as a scaled GEMM (``torch._scaled_mm``) on activations quantized per call.

`quantize(params, scheme, skip=..., include=...)` returns `Params` whose selected linear
weights are `QuantTensor` s: a ``torch.Tensor`` wrapper subclass holding ``qdata`` (the
weight divided by its scale, rounded to ``torch.float8_e4m3fn``) and ``scale`` (float32),
that reports ``dtype`` = the compute dtype, as `functional_dit.nn.layerwise.CastTensor`
does. `functional_dit.nn.layers`' projections (``linear``, ``row_linear``, ``row_linears``)
recognise it and call `linear` here; any other op that reads it (a LoRA merge, a DoRA
norm, a state-dict consumer) reads the dequantized weight ``qdata * scale``.

Schemes (the recipes of torchao's ``Float8DynamicActivationFloat8WeightConfig``; a scale is
``amax / 448``, computed in the tensor's own dtype, then float32):

- ``"fp8-row"``: one scale per output channel (weight row); activations quantized per token
  (one scale per row of x, dynamic).
- ``"fp8-tensor"``: one scale per weight; activations one scale per batch item (its whole
  (S, C) activation, dynamic) — per item, not per call, so an image never depends on what
  shares its batch (torchao's per-tensor scale is over the whole call).

Under tensor parallelism every scale is the one the unsharded model uses: weight scales
are computed before sharding (`sharding.shard_params` slices a row-wise scale with the
rows: see `QuantTensor`), and an activation's scale is taken over its whole row — for a
row-parallel projection, whose input is split over ``tp``, with a max all-reduce
(`sharding.pmax`) before the partial products, which are dequantized, then summed. Under
Ulysses sequence parallelism a token's row is whole on its rank (per-token scales need no
collective); ``"fp8-tensor"``'s per-item scale takes a max all-reduce over ``sp``.

The GEMM: ``torch._scaled_mm(x_fp8, W_fp8.T, scale_x, scale_W, out_dtype=compute dtype)``
on a CPU or CUDA device where it takes the shapes (on CUDA: bf16 output and sizes that are
multiples of 16); elsewhere (XLA, other shapes) the same maths emulated: the dequantized
operands multiplied in float32 (`emulated` forces it; it is the tests' reference).
Inference only: ``torch._scaled_mm`` has no derivative, and rounding to fp8 has none.
docs/quantization.md has the default skip list, the error table and the memory table.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import sharding
from sharding.internal import is_dtensor
from sharding.tree import nest

from ..params import COMPUTE_DTYPES, Params
from .layerwise import is_cast, skip_by_patterns

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_AMAX = 1e-12  # an all-zero row (sp padding) gets this amax: its values stay 0, not 0 / 0
SCHEMES = ("fp8-row", "fp8-tensor")

# The layers the field keeps in the compute dtype (docs/quantization.md): regular expressions
# searched in each linear's module path and its ancestors', as `layerwise.skip_by_patterns`.
DEFAULT_SKIP = (
    r"embed",  # x/context embedders, the timestep, guidance and pooled-text embedders
    r"^(img_in|txt_in)$",  # Qwen-Image's input embedders
    r"norm",  # norms, and the AdaLN modulation inside them (norm1.linear, norm_out.linear)
    r"(^|_)mod(_|$)|modulation",  # AdaLN modulation (img_mod, txt_mod, *_modulation)
    r"^proj_out$",  # the final layer (a block's proj_out is not top-level)
)

_aten = torch.ops.aten


class QuantTensor(torch.Tensor):
    """A linear weight (out, in) held as ``qdata`` (float8 e4m3) and ``scale`` (float32,
    (out, 1) for ``"fp8-row"``, (1, 1) for ``"fp8-tensor"``), reading as ``qdata * scale`` in
    ``dtype`` (the compute dtype) at every op but the projections of `layers`, which run a
    scaled GEMM (`linear`).

    Slices and concatenations (what `sharding.shard_params` cuts a rank's shard with, per
    block for fused projections) keep it quantized: rows take their scales along, columns
    share them. Views that keep the shape, ``clone`` and device moves do too. A transpose,
    a reshape or a cast reads the dequantized values. Writes are refused."""

    qdata: torch.Tensor
    scale: torch.Tensor
    scheme: str

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, scheme: str):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, strides=qdata.stride(), dtype=dtype, device=qdata.device, layout=qdata.layout
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, scheme: str):
        self.qdata, self.scale, self.scheme = qdata, scale, scheme

    def __repr__(self, *, tensor_contents=None) -> str:
        shape, dev = tuple(self.shape), self.device
        return f"QuantTensor(shape={shape}, scheme={self.scheme!r}, compute={self.dtype}, device={dev})"

    def __tensor_flatten__(self):
        return ["qdata", "scale"], (self.dtype, self.scheme)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return QuantTensor(inner["qdata"], inner["scale"], *meta)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def dequantize(self) -> torch.Tensor:
        """The weight the quantized one stands for: ``qdata * scale`` in the compute dtype."""
        return (self.qdata.float() * self.scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kept = _kept(func, args, kwargs)
        if kept is not None:
            return kept
        if _writes_quantized(func, args, kwargs):
            raise RuntimeError(
                f"{func}: a quantized leaf (fd.quantize) is read-only; dequantize it (leaf.dequantize()) or write to "
                "the unquantized params and quantize again"
            )
        read = lambda t: t.dequantize() if isinstance(t, QuantTensor) else t  # noqa: E731
        return func(*tree_map(read, args), **tree_map(read, kwargs))


# torch.save keeps a QuantTensor; a safe torch.load (weights_only=True) may rebuild it.
torch.serialization.add_safe_globals([QuantTensor])


def _rewrap(t: QuantTensor, qdata: torch.Tensor, scale: torch.Tensor) -> QuantTensor:
    return QuantTensor(qdata, scale, t.dtype, t.scheme)


def _kept(func, args, kwargs):
    """The result of ``func`` as a `QuantTensor` where it keeps the weight quantized (see
    the class docstring); None where the op reads the dequantized values."""
    t = args[0] if args else None
    if func is _aten.cat.default:
        return _cat(args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0))
    if not isinstance(t, QuantTensor):
        return None
    if func in (_aten.detach.default, _aten.alias.default):
        return _rewrap(t, func(t.qdata), t.scale)
    if func in (_aten.view.default, _aten._unsafe_view.default) and tuple(args[1]) == tuple(t.shape):
        return _rewrap(t, t.qdata.view(t.shape), t.scale)
    if func is _aten.clone.default:
        return _rewrap(t, t.qdata.clone(**kwargs), t.scale.clone())
    if func is _aten.slice.Tensor:
        dim, rest = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % 2, args[2:]
        qdata = _aten.slice.Tensor(t.qdata, dim, *rest)
        by_row = dim == 0 and t.scheme == "fp8-row"
        return _rewrap(t, qdata, _aten.slice.Tensor(t.scale, 0, *rest) if by_row else t.scale)
    if func is _aten._to_copy.default and kwargs.get("dtype", t.dtype) == t.dtype:
        opts = {k: v for k, v in kwargs.items() if k in ("device", "non_blocking", "memory_format")}
        return _rewrap(t, t.qdata.to(**opts), t.scale.to(**{k: v for k, v in opts.items() if k != "memory_format"}))
    return None


def _cat(ts, dim: int):
    """``torch.cat`` of pieces of one quantized weight (a shard's per-block slices): rows
    concatenate their scales, columns share theirs. None (read dequantized) otherwise."""
    if not ts or not all(isinstance(t, QuantTensor) for t in ts):
        return None
    t0, dim = ts[0], dim % 2
    if any(t.scheme != t0.scheme or t.dtype != t0.dtype for t in ts):
        return None
    qdata = torch.cat([t.qdata for t in ts], dim)
    if dim == 0 and t0.scheme == "fp8-row":
        return _rewrap(t0, qdata, torch.cat([t.scale for t in ts], 0))
    if not all(torch.equal(t.scale, t0.scale) for t in ts[1:]):
        return None  # pieces of different weights: no one scale describes them
    return _rewrap(t0, qdata, t0.scale)


def _writes_quantized(func, args, kwargs) -> bool:
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if any(isinstance(v, QuantTensor) for v in (value if isinstance(value, (list, tuple)) else [value])):
                return True
    return False


def is_quant(t) -> bool:
    """Whether ``t`` is a `QuantTensor` (an fp8 weight with its scales, `quantize`)."""
    return isinstance(t, QuantTensor)


# ----------------------------------------------------------------------------- the maths


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` in amax's dtype (as torchao), as float32; a zero amax gets `MIN_AMAX`."""
    return (amax.clamp(min=MIN_AMAX) / FP8_MAX).float()


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_weight(w: torch.Tensor, scheme: str) -> QuantTensor:
    """``w`` (out, in) as a `QuantTensor` of ``scheme``, reading as ``w.dtype``."""
    amax = w.detach().abs().amax(-1, keepdim=True) if scheme == "fp8-row" else w.detach().abs().amax().reshape(1, 1)
    scale = _scale(amax)
    return QuantTensor(_to_fp8(w.detach(), scale), scale, w.dtype, scheme)


def quantize_activation(x: torch.Tensor, scheme: str, axis: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., C) as (fp8 values, float32 scales broadcastable to x): per token
    (``"fp8-row"``: (..., 1)) or per batch item (``"fp8-tensor"``: (B, 1, ..., 1), the amax
    also taken over ``"sp"``). ``axis``: the mesh axis x's channels are split over (a
    row-parallel input), whose ranks' amaxes are maxed, so every rank has the whole row's."""
    x = x.detach()
    if scheme == "fp8-row":
        amax = x.abs().amax(-1, keepdim=True)
    else:
        amax = x.abs().amax(dim=tuple(range(1, x.dim())), keepdim=True) if x.dim() > 1 else x.abs().amax(-1, True)
        for seq_axis in ("sp", "ring"):  # the item's tokens over every sequence axis (a missing one: no-op)
            amax = sharding.pmax(amax, seq_axis)
    if axis is not None:
        amax = sharding.pmax(amax, axis)
    scale = _scale(amax)
    return _to_fp8(x, scale), scale


# Whether `linear` emulates the scaled GEMM (innermost last; a plain list: dynamo traces it).
_EMULATE: list = []


@contextlib.contextmanager
def emulated(enabled: bool = True):
    """Run `linear` as dequantize-then-matmul in float32 (the reference), not ``_scaled_mm``."""
    _EMULATE.append(bool(enabled))
    try:
        yield
    finally:
        _EMULATE.pop()


def _native(xq: torch.Tensor, out_dtype: torch.dtype, n: int) -> bool:
    """Whether ``torch._scaled_mm`` takes this GEMM here (see the module docstring)."""
    if (_EMULATE and _EMULATE[-1]) or not hasattr(torch, "_scaled_mm"):
        return False
    if xq.device.type == "cpu":
        return True
    return xq.device.type == "cuda" and out_dtype == torch.bfloat16 and xq.shape[-1] % 16 == 0 and n % 16 == 0


def gemm(xq: torch.Tensor, sx: torch.Tensor, w: QuantTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq * sx) @ (w.qdata * w.scale).T`` in ``out_dtype``: xq (..., in) fp8, sx its scales."""
    lead, n = xq.shape[:-1], w.shape[0]
    a = xq.reshape(-1, xq.shape[-1])
    sa = sx.expand(*lead, 1).reshape(-1, 1).contiguous()
    sb = w.scale.reshape(1, -1).expand(1, n).contiguous()
    if _native(xq, out_dtype, n):
        y = torch._scaled_mm(a, w.qdata.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    else:
        y = F.linear(a.float() * sa, w.qdata.float() * sb.t()).to(out_dtype)
    return y.reshape(*lead, n)


def linear(x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None, axis: str | None = None):
    """``x @ W.T + bias`` with ``W`` quantized: x quantized by ``w``'s scheme (over the whole
    row: ``axis`` names the mesh axis x's channels are split over, for a row-parallel
    partial product), the scaled GEMM in x's dtype, the bias added in x's dtype."""
    xq, sx = quantize_activation(x, w.scheme, axis)
    y = gemm(xq, sx, w, x.dtype)
    return y if bias is None else y + bias


# ----------------------------------------------------------------------------- the transform


def _selector(skip, include) -> Callable[[str], bool]:
    """``quantized(key)`` for linear weight keys: in ``include`` (all when None) and not in
    ``skip`` (`DEFAULT_SKIP` when None and no ``include``; nothing when None with one)."""
    for name, value in (("skip", skip), ("include", include)):
        if value is not None and not callable(value) and not _patterns(value):
            raise TypeError(
                f"{name}: expected None, a predicate over keys or regular expressions (strings), got {value!r}"
            )
    if skip is None:
        skip = DEFAULT_SKIP if include is None else ()
    skipped = skip if callable(skip) else skip_by_patterns(skip)
    included = (lambda key: True) if include is None else include if callable(include) else skip_by_patterns(include)
    return lambda key: included(key) and not skipped(key)


def _patterns(value) -> bool:
    if isinstance(value, str):
        return False  # one string would be iterated letter by letter: ask for a tuple
    try:
        items = list(value)
    except TypeError:
        return False
    for p in items:
        if not isinstance(p, str):
            return False
        re.compile(p)
    return True


def _check(params, scheme) -> None:
    if not isinstance(params, Params):
        raise TypeError(f"params: expected functional_dit.Params, got {type(params).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {list(SCHEMES)}, got {scheme!r}")
    for key, t in params.flat().items():
        if is_dtensor(t):
            raise ValueError(
                f"params: quantizing sharded (DTensor) params is not supported, got a DTensor at {key!r}; quantize "
                "the unsharded params, then shard them (sharding.shard_params): the scales are then the whole rows'"
            )
        if is_quant(t) or is_cast(t):
            what = "quantized (fd.quantize)" if is_quant(t) else "layerwise-cast (fd.layerwise_cast)"
            raise ValueError(f"params: {key!r} is already {what}; quantize the params as loaded")
        if t.is_floating_point() and t.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"params: {key!r} is {t.dtype}; expected a compute dtype, one of {COMPUTE_DTYPES}")


def linear_weights(params: Params) -> list[str]:
    """The keys of ``params``' linear weights (2-D ``.weight`` leaves of a module with no
    ``embedding`` in its name): what `quantize` may quantize."""
    return [k for k, t in params.flat().items() if k.endswith(".weight") and t.dim() == 2 and "embedding" not in k]


def quantize(
    params: Params,
    scheme: str = "fp8-row",
    skip: Iterable[str] | Callable[[str], bool] | None = None,
    include: Iterable[str] | Callable[[str], bool] | None = None,
) -> Params:
    """``params`` with linear weights held in fp8 and run as scaled GEMMs (`QuantTensor`;
    see the module docstring). ``scheme``: ``"fp8-row"`` or ``"fp8-tensor"``.

    Which linears: those matching ``include`` (regular expressions searched in the module
    path and its ancestors', as `fd.layerwise_cast`'s ``skip``, or a predicate over leaf
    keys; None: every linear weight) and not ``skip`` (likewise; None: `DEFAULT_SKIP`, the
    embedders, norms, AdaLN modulation and final layer, unless ``include`` is given; ``()``:
    skip nothing). Biases, norms and everything else stay as they are. The params must be
    unsharded (shard after quantizing), in one compute dtype, and not already quantized or
    layerwise-cast."""
    _check(params, scheme)
    chosen = _selector(skip, include)
    flat = dict(params.flat())
    for key in linear_weights(params):
        if chosen(key):
            flat[key] = quantize_weight(flat[key], scheme)
    return params.replace(nest(flat))


def dequantize(params: Params) -> Params:
    """``params`` with every `QuantTensor` replaced by its dequantized weight (plain)."""
    return params.replace(nest({k: t.dequantize() if is_quant(t) else t for k, t in params.flat().items()}))


def quantized_bytes(t: torch.Tensor) -> int:
    """Bytes a leaf holds: a `QuantTensor`'s fp8 values and scales, else its own."""
    if is_quant(t):
        return t.qdata.nelement() * t.qdata.element_size() + t.scale.nelement() * t.scale.element_size()
    return t.nelement() * t.element_size()

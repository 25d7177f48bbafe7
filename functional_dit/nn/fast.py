"""The fast eager kernels: the twin of each replaceable op of `layers`, for `fd.prepare`'d
params at inference. The same maths in another rounding order (equal to the exact op
within float tolerance, not bitwise): fused elementwise ops, one GEMM for a fused
projection group, a GELU fused into its GEMM, in-place activations on fresh outputs.

Each op here takes the exact op's arguments; `kernels.replaceable` calls it only where
`kernels` says the fast kernels may run. Where an op has several kernels, a table
``{"exact": fn, name: fn, ...}`` lists them and `kernels.select` picks one (its "exact"
entry is the replaced op's maths on the arguments it sees here, so "auto" may keep it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import sharding

from . import fused as _fuse
from . import kernels
from .kernels import select

# ----------------------------------------------------------------------------- modulation


def _norm_modulate_exact(x, shift, scale, eps):
    return F.layer_norm(x, x.shape[-1:], None, None, eps) * (1 + scale) + shift


def _norm_modulate_fused(x, shift, scale, eps):
    """One modulation row at batch 1: the LayerNorm's own affine (one pass); else one
    ``addcmul`` after the norm."""
    if x.shape[0] == 1 and scale.shape[1] == 1 and shift.shape[1] == 1:
        return F.layer_norm(x, x.shape[-1:], 1 + scale[0, 0], shift[0, 0], eps)
    return torch.addcmul(shift, F.layer_norm(x, x.shape[-1:], None, None, eps), 1 + scale)


NORM_MODULATE = {"exact": _norm_modulate_exact, "fused_affine": _norm_modulate_fused}


def norm_modulate(x, shift, scale, eps=1e-6):
    shift, scale = (m[:, None] if m.dim() == 2 else m for m in (shift, scale))
    return select("norm_modulate", NORM_MODULATE, x, shift, scale, eps)


GATED = {"exact": lambda x, gate, y: x + gate * y, "addcmul": torch.addcmul}


def gated(x, gate, y):
    return select("gated", GATED, x, gate, y)


# ----------------------------------------------------------------------------- projections


def _gelu_exact(p, x, axis):
    return F.gelu(F.linear(x, p["weight"], p.get("bias")), approximate="tanh")


def _gelu_onednn(p, x, axis):
    return kernels.onednn_linear_pointwise()(x, p["weight"], p.get("bias"), "gelu", [], "tanh")


def _gelu_inplace(p, x, axis):
    return torch.ops.aten.gelu_(F.linear(x, p["weight"], p.get("bias")), approximate="tanh")


GELU = {"exact": _gelu_exact, "onednn_epilogue": _gelu_onednn, "inplace": _gelu_inplace}


def linear_gelu(p, x, axis="tp"):
    return select("linear_gelu", GELU, p, x, axis)


def _group_each(ps, wb, x):
    return [F.linear(x, p["weight"], p.get("bias")) for p in ps]


def _group_fused(ps, wb, x):
    return list(F.linear(x, *wb).split([p["weight"].shape[0] for p in ps], dim=-1))


GROUP = {"exact": _group_each, "one_gemm": _group_fused}


def linear_group(ps, x, axis="tp"):
    """One GEMM over the buffer `fd.prepare` laid the weights out on (read off their
    storage each call, `fused.fused`), split into views; one per layer where there is none."""
    x = sharding.pvary(x, axis)
    wb = _fuse.fused(ps)
    if wb is None:
        return _group_each(ps, wb, x)
    return select("linear_group", GROUP, ps, wb, x)


def _group_gelu_exact(ps, x, axis):
    *ys, y = linear_group(ps, x, axis)
    return [*ys, F.gelu(y, approximate="tanh")]


def _group_gelu_two_gemms(ps, x, axis):
    """The group without its last layer in one GEMM, the last with its GELU in another:
    contiguous outputs, no strided slices."""
    return [*linear_group(ps[:-1], x, axis), linear_gelu(ps[-1], x, axis)]


def _group_gelu_inplace(ps, x, axis):
    """The GELU in place on the last layer's columns of the one fresh GEMM output."""
    *ys, y = linear_group(ps, x, axis)
    return [*ys, torch.ops.aten.gelu_(y, approximate="tanh")]


GROUP_GELU = {"exact": _group_gelu_exact, "two_gemms": _group_gelu_two_gemms, "one_gemm_inplace": _group_gelu_inplace}


def linear_group_gelu(ps, x, axis="tp"):
    return select("linear_group_gelu", GROUP_GELU, ps, x, axis)


def _one_gemm_views(w, b, x, sizes):
    return list(F.linear(x, w, b).split(sizes, dim=-1))


def _gemm_per_block(w, b, x, sizes):
    """One GEMM per output block: each block contiguous for the elementwise work after."""
    bs = [None] * len(sizes) if b is None else b.split(sizes)
    return [F.linear(x, wi, bi) for wi, bi in zip(w.split(sizes), bs)]


SPLIT = {"exact": _one_gemm_views, "gemm_per_block": _gemm_per_block}


def col_linear_split(p, x, sizes, axis="tp"):
    return select("col_linear_split", SPLIT, p["weight"], p.get("bias"), x, sizes)


def _cat_product(w, b, xs):
    return F.linear(torch.cat(xs, -1), w, b)


def _split_product(w, b, xs):
    """``cat(xs, -1) @ w.T (+ b)`` as one GEMM per part accumulating in one output (``addmm_``)."""
    lead = xs[0].shape[:-1]
    parts = zip((x.reshape(-1, x.shape[-1]) for x in xs), w.split([x.shape[-1] for x in xs], dim=1))
    x0, w0 = next(parts)
    y = torch.addmm(b, x0, w0.t()) if b is not None else x0 @ w0.t()
    for xi, wi in parts:
        y.addmm_(xi, wi.t())
    return y.view(*lead, -1)


ROW_CAT = {"exact": _cat_product, "split_gemms": _split_product}


def row_linear_cat(p, xs, axis="tp"):
    """The local product without the concatenation (the kernels time it, no collective),
    then `row_linear`'s sum over ``axis`` and bias."""
    w, b = p["weight"], p.get("bias")
    whole = sharding.axis_size(axis) == 1
    y = select("row_linear_cat", ROW_CAT, w, b if whole else None, xs)
    if whole:
        return y
    y = sharding.psum(y, axis)
    return y if b is None else y + b


# ----------------------------------------------------------------------------- norms, RoPE, activations


def _rms_norm_torch(x, w, eps):
    return F.rms_norm(x, x.shape[-1:], w, eps)


def _rms_norm_three_pass(x, w, eps):
    """The norm as one fp32 reduction, then ``x * rsqrt(norm² / D + eps) * w``; one
    rounding to x's dtype at the end (torch's CPU kernel takes six passes)."""
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    r = r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    return (x.float() * r).mul_(w).to(x.dtype)


def _rms_norm_fp32_exact(x, w, eps):
    y = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(w.dtype) if w.dtype in (torch.float16, torch.bfloat16) else y) * w


RMS = {"exact": _rms_norm_torch, "three_pass": _rms_norm_three_pass}
RMS_FP32 = {"exact": _rms_norm_fp32_exact, "three_pass": _rms_norm_three_pass, "torch_fused": _rms_norm_torch}


def rms_norm(p, x, eps=1e-6):
    return select("rms_norm", RMS, x, p["weight"], eps)


def rms_norm_fp32(p, x, eps=1e-6):
    return select("rms_norm_fp32", RMS_FP32, x, p["weight"], eps)


def _rope_real(x, cos, sin):
    xr, xi = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-xi, xr], dim=-1).flatten(-2)
    return (x.float() * cos.unsqueeze(-2) + rotated.float() * sin.unsqueeze(-2)).to(x.dtype)


def _rope_complex(x, cos, sin):
    """One complex product of (x_2i, x_2i+1) by (cos, sin), as diffusers' Qwen-Image does,
    where x's pairs are complex numbers in memory (else the real product)."""
    xf = x.float()
    if xf.stride(-1) != 1 or any(st % 2 for st in xf.stride()[:-1]) or xf.storage_offset() % 2:
        return _rope_real(x, cos, sin)
    freqs = torch.complex(cos.unsqueeze(-2)[..., 0::2], sin.unsqueeze(-2)[..., 0::2])  # ([B,] S, 1, D/2)
    xc = torch.view_as_complex(xf.unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)


ROPE = {"exact": _rope_real, "complex": _rope_complex}


def apply_rope(x, cos, sin):
    return select("apply_rope", ROPE, x, cos, sin)


def split_rows(x, n):
    """Views: the GEMMs after read strided rows."""
    return x[:, :n], x[:, n:]


def swiglu(gate, up):
    """In place on ``gate``, a fresh GEMM output."""
    return F.silu(gate, inplace=True).mul_(up)

"""Pure layer maths shared by the three families.

Every function takes a parameter dict ``p`` (the layer's slice of the tree) and
tensors. Shapes: B batch, S sequence, H heads, D head dim, C channels. Model code
runs in the *local* view: a rank holds ``H / tp`` heads and its slice of each MLP,
so head counts are read from the tensors, never from the config.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import torch
import torch.nn.functional as F
import torch.utils._pytree
import torch.utils.checkpoint

import sharding

from . import fused as _fuse
from . import kernels as _kernels

# ----------------------------------------------------------------------------- fast kernels

_FAST = contextvars.ContextVar("functional_dit_fast_kernels", default=None)  # None | "fast" | "auto"


@contextlib.contextmanager
def fast_kernels(enabled: bool | str = True):
    """Run the layers below with the fast eager kernels (`fd.prepare`'d params, inference):
    fused elementwise ops (``addcmul``, LayerNorm's own affine for AdaLN at batch 1, RoPE
    as one complex product), a linear layer's GELU fused into its GEMM where the backend
    has one (oneDNN on CPU), a concatenated input's projection as a sum of two GEMMs, and
    in-place activations on fresh outputs. The same maths in another rounding order:
    equal to the exact kernels within float tolerance, not bitwise (bf16 included). Set by
    `fd.apply` for prepared params only, and never under ``torch.compile``, a
    ``torch.func`` transform or autograd (in-place ops), where the exact kernels run.

    ``enabled``: True or "fast" (every fast kernel), "auto" (each op runs whichever of its
    kernels measured faster here, `_kernels`), False or "exact" (the exact kernels)."""
    mode = ("fast" if enabled else "exact") if isinstance(enabled, bool) else enabled
    token = _FAST.set(None if _kernels.check_mode(mode) == "exact" else mode)
    try:
        yield
    finally:
        _FAST.reset(token)


def fast() -> bool:
    """Whether the fast eager kernels are on (see `fast_kernels`)."""
    return not torch.compiler.is_compiling() and _FAST.get() is not None


def select(op: str, variants: dict, *args):
    """``variants[name](*args)`` for the kernel op ``op`` runs under the fast kernels' mode:
    the first fast one ("fast"), or the one measured fastest on these arguments ("auto",
    `_kernels.choose`). Call it only where `fast` is True; the variants must not mutate
    their arguments nor communicate (they are timed on each rank on its own)."""
    return _kernels.run(op, variants, _FAST.get(), *args)


def _onednn_linear_pointwise():
    """oneDNN's linear with a fused epilogue (CPU, fp32), or None where torch lacks it."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    return op if op is not None and torch.backends.mkldnn.is_available() else None


def _gelu_exact(p, x, axis):
    return F.gelu(col_linear(p, x, axis), approximate="tanh")


def _gelu_onednn(p, x, axis):
    return _onednn_linear_pointwise()(x, p["weight"], p.get("bias"), "gelu", [], "tanh")


def _gelu_inplace(p, x, axis):
    return torch.ops.aten.gelu_(F.linear(x, p["weight"], p.get("bias")), approximate="tanh")


_GELU = {"exact": _gelu_exact, "onednn_epilogue": _gelu_onednn, "inplace": _gelu_inplace}
_GELU_NO_ONEDNN = {"exact": _gelu_exact, "inplace": _gelu_inplace}


def linear_gelu(p, x: torch.Tensor, axis: str = "tp") -> torch.Tensor:
    """``gelu(col_linear(p, x), approximate="tanh")``; with the fast kernels, one oneDNN
    GEMM with bias and GELU fused on a CPU in fp32, or an in-place GELU on the fresh
    GEMM output."""
    if not fast() or "lora" in p:
        return _gelu_exact(p, x, axis)
    w = p["weight"]
    onednn = _onednn_linear_pointwise() is not None and x.device.type == "cpu"
    onednn = onednn and x.dtype == w.dtype == torch.float32
    return select("linear_gelu", _GELU if onednn else _GELU_NO_ONEDNN, p, x, axis)


def _norm_modulate_exact(x, shift, scale, eps):
    return layer_norm(x, eps) * (1 + scale) + shift


def _norm_modulate_fast(x, shift, scale, eps):
    if x.shape[0] == 1 and scale.shape[1] == 1 and shift.shape[1] == 1:
        return F.layer_norm(x, x.shape[-1:], 1 + scale[0, 0], shift[0, 0], eps)
    return torch.addcmul(shift, layer_norm(x, eps), 1 + scale)


_NORM_MODULATE = {"exact": _norm_modulate_exact, "fused_affine": _norm_modulate_fast}


def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """AdaLN: ``layer_norm(x) * (1 + scale) + shift`` (no affine weights of its own) over x
    (B, S, C), the modulation (B, C) or already broadcastable ((B, 1, C), (B, S, C)). Fast
    kernels: one modulation row at batch 1 becomes the LayerNorm's own affine (one pass),
    else one ``addcmul`` after the norm."""
    shift, scale = (m[:, None] if m.dim() == 2 else m for m in (shift, scale))
    if not fast():
        return _norm_modulate_exact(x, shift, scale, eps)
    return select("norm_modulate", _NORM_MODULATE, x, shift, scale, eps)


_GATED = {"exact": lambda x, gate, y: x + gate * y, "addcmul": torch.addcmul}


def gated(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gated residual ``x + gate * y`` (``gate`` broadcast over y's rows, e.g. (B, 1, C));
    one ``addcmul`` with the fast kernels."""
    return select("gated", _GATED, x, gate, y) if fast() else x + gate * y


def _cat_product(w, b, xs):
    return F.linear(torch.cat(xs, -1), w, b)


def _split_product(w, b, xs):
    """``cat(xs, -1) @ w.T (+ b)`` as one GEMM per part accumulating in one output."""
    lead = xs[0].shape[:-1]
    parts = zip((x.reshape(-1, x.shape[-1]) for x in xs), w.split([x.shape[-1] for x in xs], dim=1))
    x0, w0 = next(parts)
    y = torch.addmm(b, x0, w0.t()) if b is not None else x0 @ w0.t()
    for xi, wi in parts:
        y.addmm_(xi, wi.t())
    return y.view(*lead, -1)


_ROW_CAT = {"exact": _cat_product, "split_gemms": _split_product}


def row_linear_cat(p, xs: list, axis: str = "tp") -> torch.Tensor:
    """``row_linear(p, torch.cat(xs, -1))``; with the fast kernels, without the
    concatenation: the weight's column blocks multiply their parts and accumulate in one
    output (``addmm_``), partial sums over ``axis`` as `row_linear`."""
    if not fast() or "lora" in p:
        return row_linear(p, torch.cat(xs, -1), axis)
    w, b = p["weight"], p.get("bias")
    whole = sharding.axis_size(axis) == 1
    y = select("row_linear_cat", _ROW_CAT, w, b if whole else None, xs)  # the local product: no collective
    if whole:
        return y
    y = sharding.psum(y, axis)
    return y if b is None else y + b


def region(fn):
    """Mark a block function as a region ``torch.compile`` compiles once and reuses for
    every layer of the same shapes (``torch.compiler.nested_compile_region``, torch >=
    2.8; hierarchical compilation): full-depth compile time stays near one block's.
    A no-op in eager and where the API is missing, except for `recompute_blocks`. Its inputs must not alias one another
    (each block's modulation has its own storage, `modulations`). There is no test of
    ``torch.compiler.is_exporting()`` here: under ``torch.compile`` torch 2.9 reports True,
    which inlined every region there; strict ``torch.export`` takes the regions as they are.

    Under autograd (grad enabled and any tensor argument requiring grad) the block is
    traced inline too: a region's backward sums the per-layer gradient contributions in
    another order than eager autograd, so compiled gradients would drift from eager ones
    by float rounding (~1e-7 relative); inline, compiled training matches eager exactly.
    Regions serve inference (sampling), where compile time matters."""
    mark = getattr(torch.compiler, "nested_compile_region", None)
    marked = fn if mark is None else mark(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.is_grad_enabled() and _any_requires_grad((args, kwargs)):
            return _recomputed(fn, args, kwargs) if _RECOMPUTE and _RECOMPUTE[-1] else fn(*args, **kwargs)
        return marked(*args, **kwargs)

    return call


# Whether block activations are recomputed in backward (`recompute_blocks`), innermost
# last. A plain list, as sharding's bound meshes: dynamo traces list reads.
_RECOMPUTE: list = []


@contextlib.contextmanager
def recompute_blocks(enabled: bool = True):
    """Gradient (activation) checkpointing per block: under autograd each `region` block
    keeps only its inputs and recomputes its activations in backward
    (``torch.utils.checkpoint``, non-reentrant). Set by ``fd.apply(..., checkpoint=True)``."""
    _RECOMPUTE.append(bool(enabled))
    try:
        yield
    finally:
        _RECOMPUTE.pop()


def _recomputed(fn, args, kwargs):
    """``fn(*args, **kwargs)`` under ``torch.utils.checkpoint``; the recomputation in
    backward runs under the mesh bound now (backward runs outside `fd.apply`'s binding,
    and a block's collectives need it)."""
    mesh = sharding.current_mesh()

    def rerun(*a, **kw):
        with sharding.bind(mesh):
            return fn(*a, **kw)

    return torch.utils.checkpoint.checkpoint(rerun, *args, use_reentrant=False, **kwargs)


def _any_requires_grad(tree) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in torch.utils._pytree.tree_leaves(tree))


def linear(p, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T + b`` with whole (replicated) weights, or as the local half of a sharded one.
    With LoRA factors attached (``p["lora"]``, see ``functional_dit.lora``) their updates are added."""
    y = F.linear(x, p["weight"], p.get("bias"))
    return y if "lora" not in p else _add_lora(y, [F.linear(x.to(a.dtype), a) for a, _, _ in p["lora"]], p["lora"])


def _add_lora(y: torch.Tensor, hs, factors) -> torch.Tensor:
    """``y + sum(s * h @ B.T)`` over the attached ``(A, B, s)`` with ``h = x @ A.T``, summed
    in the adapters' dtype and cast to ``y``'s, as PEFT's ``LoraLayer`` does."""
    out = y
    for h, (_, b, s) in zip(hs, factors):
        out = out + F.linear(h, b) * s
    return out.to(y.dtype)


def col_linear(p, x: torch.Tensor, axis: str = "tp") -> torch.Tensor:
    """A column-parallel projection: this rank's output columns of a ``x`` every rank holds
    whole, so ``x``'s gradient is a per-rank share summed over ``axis`` (Megatron's f)."""
    return linear(p, sharding.pvary(x, axis))


def linear_group(ps: list, x: torch.Tensor, axis: str = "tp") -> list[torch.Tensor]:
    """Column-parallel ``[col_linear(p, x) for p in ps]``, as one matmul when `fd.prepare`
    laid the weights out as one buffer (`_fuse.fused`), the fast kernels are on and no LoRA
    factors are attached (their updates are per layer). ``x`` (whole on every rank) goes through
    ``sharding.pvary`` over ``axis`` once, so its gradient under tensor parallelism is the
    sum of the per-rank shares, fused or not."""
    x = sharding.pvary(x, axis)
    wb = None if not fast() or any("lora" in p for p in ps) else _fuse.fused(ps)
    if wb is None:
        return _group_each(ps, wb, x)
    return select("linear_group", _GROUP, ps, wb, x)


def _group_each(ps, wb, x):
    return [linear(p, x) for p in ps]


def _group_fused(ps, wb, x):
    return list(F.linear(x, *wb).split([p["weight"].shape[0] for p in ps], dim=-1))


_GROUP = {"exact": _group_each, "one_gemm": _group_fused}


def col_linear_split(p, x: torch.Tensor, sizes: list, axis: str = "tp") -> list[torch.Tensor]:
    """`col_linear` split into its output blocks of ``sizes`` (the weight's row blocks, e.g.
    a packed [gate; up]): one GEMM and views of its output, or with the fast kernels one
    GEMM per block, so each block's output is contiguous for the elementwise work after."""
    if not fast() or "lora" in p:
        return list(col_linear(p, x, axis).split(sizes, dim=-1))
    return select("col_linear_split", _SPLIT, p["weight"], p.get("bias"), x, sizes)


def _one_gemm_views(w, b, x, sizes):
    return list(F.linear(x, w, b).split(sizes, dim=-1))


def _gemm_per_block(w, b, x, sizes):
    bs = [None] * len(sizes) if b is None else b.split(sizes)
    return [F.linear(x, wi, bi) for wi, bi in zip(w.split(sizes), bs)]


_SPLIT = {"exact": _one_gemm_views, "gemm_per_block": _gemm_per_block}


def per_head(p, axis: str = "tp") -> dict:
    """A replicated parameter dict applied to each of this rank's heads (the QK norms):
    its gradient is a per-rank share, summed over ``axis``."""
    return {k: sharding.pvary(v, axis) for k, v in p.items()}


def row_linear(p, x: torch.Tensor, axis: str = "tp") -> torch.Tensor:
    """A row-parallel projection: partial products summed over ``axis``, bias added once.
    LoRA: the rank-r products ``x @ A.T`` of this rank's columns are summed over ``axis``
    too (one small all-reduce) before ``B``, so ``B`` sees the whole product."""
    if sharding.axis_size(axis) == 1:
        return linear(p, x)
    y = sharding.psum(F.linear(x, p["weight"]), axis)
    y = y if p.get("bias") is None else y + p["bias"]
    if "lora" not in p:
        return y
    hs = [F.linear(x.to(a.dtype), a) for a, _, _ in p["lora"]]
    h = sharding.psum(torch.cat(hs, -1), axis).split([t.shape[-1] for t in hs], -1)
    return _add_lora(y, h, p["lora"])


def row_linears(pairs: list, axis: str = "tp") -> list[torch.Tensor]:
    """``[row_linear(p, x) for p, x in pairs]`` with one all-reduce over ``axis`` for all of
    them (the partial products concatenated along the sequence, dim 1): a double block's
    two streams pay one collective instead of two, with the same sums. Layers with LoRA
    factors take `row_linear`'s own path."""
    if sharding.axis_size(axis) == 1 or len(pairs) == 1 or any("lora" in p for p, _ in pairs):
        return [row_linear(p, x, axis) for p, x in pairs]
    ys = [F.linear(x, p["weight"]) for p, x in pairs]
    summed = sharding.psum(torch.cat(ys, 1), axis).split([y.shape[1] for y in ys], 1)
    return [y if p.get("bias") is None else y + p["bias"] for y, (p, _) in zip(summed, pairs)]


def layer_norm(x: torch.Tensor, eps: float = 1e-6, p=None) -> torch.Tensor:
    w, b = (None, None) if p is None else (p.get("weight"), p.get("bias"))
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


def rms_norm(p, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``torch.nn.RMSNorm`` (FLUX.1/FLUX.2 QK norms)."""
    if fast() and x.device.type == "cpu":
        return select("rms_norm", _RMS, x, p["weight"], eps)
    return F.rms_norm(x, x.shape[-1:], p["weight"], eps)


def _rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], w, eps)


def _rms_norm_fast(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dim in three passes (torch's is six on a CPU; on a GPU its
    fused kernel is faster, measured 0.07 vs 0.21 ms on an H200, so this is CPU-only): the
    norm as one reduction (fp32), then ``x * rsqrt(norm² / D + eps) * w``; one rounding
    to x's dtype at the end."""
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    r = r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    return (x.float() * r).mul_(w).to(x.dtype)


def rms_norm_fp32(p, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """diffusers ``RMSNorm`` (Qwen-Image): variance in fp32; the normalised x is cast to a
    half-precision weight's dtype before the scale (an fp32 weight keeps it fp32). Fast
    kernels: `_rms_norm_fast` on a CPU, torch's fused kernel elsewhere (fp32 inside, one
    rounding at the end)."""
    if fast():
        return select("rms_norm_fp32", _RMS_FP32, x, p["weight"], eps)
    return _rms_norm_fp32_exact(x, p["weight"], eps)


def _rms_norm_fp32_exact(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(w.dtype) if w.dtype in (torch.float16, torch.bfloat16) else y) * w


def _rms_norm_fp32_fast(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_fast(x, w, eps) if x.device.type == "cpu" else _rms_norm_torch(x, w, eps)


_RMS = {"exact": _rms_norm_torch, "three_pass": _rms_norm_fast}
_RMS_FP32 = {"exact": _rms_norm_fp32_exact, "three_pass": _rms_norm_fp32_fast}


def clip_fp16(x: torch.Tensor) -> torch.Tensor:
    """Keep fp16 activations finite, as diffusers does after each block's residual."""
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


def adaln(p, emb: torch.Tensor, n: int, axis: str = "tp") -> tuple[torch.Tensor, ...]:
    """``n`` modulation vectors (B, C) from ``linear(silu(emb))`` (emb (B, C)); see `modulations`."""
    return modulations([(p, n)], emb, axis)[0].chunk(n, dim=-1)


def modulations(layers: list, emb: torch.Tensor, axis: str = "tp") -> list[torch.Tensor]:
    """``[linear(p, silu(emb)) for p, n in layers]``: each AdaLN projection's (B, n·C)
    modulation (n chunks of C, emb (B, C)), for every block of a model at once.

    A projection may be sharded over ``axis``: its rows split contiguously (a plain
    ``Shard(0)``), so its local output (B, n·C/tp) is this rank's contiguous slice of the
    whole. The sharded ones are all-gathered in ONE collective (a few KB per block), so a
    model pays one all-gather per call, not one per block. Whether a projection is sharded
    is read off its local rows (n·C: whole). A sharded projection is column-parallel
    (``emb``'s gradient is summed over ``axis``); the all-gather's backward takes this
    rank's slice, nothing more. Each result has its own storage."""
    h, C = F.silu(emb), emb.shape[-1]
    out = [linear(p, h) if p["weight"].shape[0] == n * C else None for p, n in layers]
    sharded = [i for i, y in enumerate(out) if y is None]
    if not sharded:
        return out
    size, hv = sharding.axis_size(axis), sharding.pvary(h, axis)
    local = [linear(layers[i][0], hv) for i in sharded]
    for i, y in zip(sharded, local):
        if y.shape[-1] * size != layers[i][1] * C:
            raise ValueError(
                f"modulation: the local projection gives {y.shape[-1]} rows for {layers[i][1]} chunks of {C}, which is "
                f"neither the whole (n x embed dim) nor a contiguous shard over {axis!r} (size {size})"
            )
    g = sharding.all_gather(torch.cat(local, -1), axis, dim=-1).unflatten(-1, (size, -1))  # (B, rank, local rows)
    for i, piece in zip(sharded, g.split([y.shape[-1] for y in local], dim=-1)):
        out[i] = piece.flatten(-2)  # rank order is row order (a copy, or all of g when it is the only one)
    return out


def gelu_mlp(p, x: torch.Tensor) -> torch.Tensor:
    """diffusers ``FeedForward(activation_fn="gelu-approximate")``: ``net.0.proj``, ``net.2``."""
    return row_linear(p["net"]["2"], linear_gelu(p["net"]["0"]["proj"], x))


def gelu_mlps(pairs: list) -> list[torch.Tensor]:
    """``[gelu_mlp(p, x) for p, x in pairs]``, the output projections in one all-reduce
    (`row_linears`)."""
    return row_linears([(p["net"]["2"], linear_gelu(p["net"]["0"]["proj"], x)) for p, x in pairs])


def timestep_embedding(
    t: torch.Tensor, dim: int = 256, max_period: float = 10000.0, shift: float = 0.0, scale: float = 1.0
) -> torch.Tensor:
    """Sinusoidal (B,) -> (B, dim) with cos first, as diffusers ``Timesteps(flip_sin_to_cos=True)``."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - shift))
    args = scale * t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def mlp_embed(p, x: torch.Tensor) -> torch.Tensor:
    """``linear_2(silu(linear_1(x)))``: diffusers ``TimestepEmbedding`` / ``PixArtAlphaTextProjection``."""
    return linear(p["linear_2"], F.silu(linear(p["linear_1"], x)))


FP64_UNSUPPORTED = ("mps", "npu", "neuron")  # devices without float64, as diffusers' torch_utils lists them


def rope_1d(pos: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Real-valued RoPE for one axis: (S,) positions -> cos, sin (S, dim), pairs interleaved.

    Frequencies in float64 where the device has it (as diffusers does for FLUX), cast to fp32.
    """
    fdt = torch.float32 if pos.device.type in FP64_UNSUPPORTED else torch.float64
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=fdt, device=pos.device) / dim))
    ang = pos.to(fdt)[:, None] * inv[None]  # (S, dim/2)
    return ang.cos().repeat_interleave(2, -1).float(), ang.sin().repeat_interleave(2, -1).float()


def rope(ids: torch.Tensor, axes_dim, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-axis RoPE: ids (S, n_axes) -> cos, sin (S, sum(axes_dim))."""
    parts = [rope_1d(ids[:, i].float(), d, theta) for i, d in enumerate(axes_dim)]
    return torch.cat([c for c, _ in parts], -1), torch.cat([s for _, s in parts], -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (B, S, H, D) by cos/sin (S, D) in fp32. Fast kernels:
    one complex product of (x_2i, x_2i+1) by (cos, sin), as diffusers' Qwen-Image does."""
    return select("apply_rope", _ROPE, x, cos, sin) if fast() else _rope_real(x, cos, sin)


def _rope_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` as one complex product where x's pairs are complex numbers in memory."""
    xf = x.float()
    if xf.stride(-1) != 1 or any(st % 2 for st in xf.stride()[:-1]) or xf.storage_offset() % 2:
        return _rope_real(x, cos, sin)
    freqs = torch.complex(cos[:, None, 0::2], sin[:, None, 0::2])  # (S, 1, D/2)
    xc = torch.view_as_complex(xf.unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)


def _rope_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xr, xi = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-xi, xr], dim=-1).flatten(-2)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


_ROPE = {"exact": _rope_real, "complex": _rope_complex}


def split_rows(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, C) -> its first ``n`` rows and the rest, each contiguous as diffusers makes
    them (the same GEMM path after, so bf16 matches bitwise); views with the fast kernels."""
    a, b = x[:, :n], x[:, n:]
    return (a, b) if fast() else (a.contiguous(), b.contiguous())


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, S, H*D) -> (B, S, H, D); H is whatever this rank holds."""
    return x.unflatten(-1, (-1, head_dim))


def _sdpa(q, k, v, key_bias):
    mask = None if key_bias is None else key_bias[:, None, None, :].to(q.dtype)  # (B, 1, 1, S_k)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    if sharding.forward_ad_active():  # the fused CPU/GPU kernels have no forward-mode rule
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask)[0].transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor | None = None):
    """Scaled dot-product attention: q, k, v (B, S, H, D) -> (B, S, H*D).

    ``key_bias`` (B, S) is an additive key mask (0 keep, -inf drop): static shapes, no
    boolean indexing. Under Ulysses sequence parallelism S is this rank's slice and
    `sharding.ulysses` swaps sequence for heads around the kernel.
    """
    return sharding.ulysses(_sdpa, q, k, v, key_bias).flatten(2)


def shard_joint(txt: torch.Tensor, img: torch.Tensor, pe, txt_bias: torch.Tensor | None = None):
    """Split a joint (txt; img) sequence over ``sp``: each rank holds (txt chunk; img
    chunk) and the matching RoPE rows. Returns txt, img, pe and the (B, S_local) key
    bias that masks padding (and ``txt_bias`` (B, S_txt), e.g. a prompt mask), or None."""
    T, S = txt.shape[1], img.shape[1]
    cos, sin = pe
    pe = tuple(torch.cat([sharding.shard(a[:T], "sp", 0), sharding.shard(a[T:], "sp", 0)]) for a in (cos, sin))
    if txt_bias is not None:
        txt_bias = sharding.shard(txt_bias, "sp", 1)
    biases = [sharding.pad_bias(T, "sp", img.device), sharding.pad_bias(S, "sp", img.device)]
    txt, img = sharding.shard(txt, "sp", 1), sharding.shard(img, "sp", 1)
    if txt_bias is None and all(b is None for b in biases):
        return txt, img, pe, None
    B = img.shape[0]
    tb = torch.zeros(B, txt.shape[1], device=img.device) if biases[0] is None else biases[0].expand(B, -1)
    if txt_bias is not None:
        tb = tb + txt_bias
    ib = torch.zeros(B, img.shape[1], device=img.device) if biases[1] is None else biases[1].expand(B, -1)
    return txt, img, pe, torch.cat([tb, ib], 1)

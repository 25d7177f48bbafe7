"""The exact layer maths shared by the families (≈ BFL's ``layers.py`` and ``math.py``).

Every function takes a parameter dict ``p`` (the layer's slice of the tree) and
tensors. Shapes: B batch, S sequence, H heads, D head dim, C channels. Model code
runs in the *local* view: a rank holds ``H / tp`` heads and its slice of each MLP,
so head counts are read from the tensors, never from the config, and each
projection says its collective: `col_linear` (input marked ``pvary``), `row_linear`
(partial sums ``psum``'d), `modulations` (one ``all_gather``).

An op marked ``@replaceable(fast.op)`` is the exact maths; for `fd.prepare`'d params
at inference it may run its twin in `fast` instead, chosen in `kernels`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import sharding

from . import fast, quant
from .kernels import replaceable

# ----------------------------------------------------------------------------- projections


def _matmul(x: torch.Tensor, w: torch.Tensor, b=None, axis: str | None = None) -> torch.Tensor:
    """``x @ w.T + b``; an fp8 weight (`quant.QuantTensor`) runs as a scaled GEMM, x's scales
    taken over the whole row (maxed over ``axis`` when x's channels are split over it)."""
    return quant.linear(x, w, b, axis) if quant.is_quant(w) else F.linear(x, w, b)


def linear(p, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T + b`` with whole (replicated) weights, or as the local half of a sharded one.
    With LoRA factors attached (``p["lora"]``, see ``functional_dit.lora``) their updates are added
    (in the compute dtype, also over an fp8 weight: `functional_dit.nn.quant`)."""
    y = _matmul(x, p["weight"], p.get("bias"))
    return y if "lora" not in p else _add_lora(y, [_lora_in(x, f) for f in p["lora"]], p)


def _lora_rows(f, x: torch.Tensor | None = None) -> torch.Tensor | None:
    """The batch rows an attached adapter ``f`` applies to: its optional 6th entry ``(index,
    n)``, a (k,) index tensor built from Python ints into a batch of ``n`` rows (per-item LoRA,
    `functional_dit.lora`); None: all rows. ``x``'s dim 0 must be those ``n`` items."""
    if len(f) < 6:
        return None
    index, n = f[5]
    if x is not None and x.shape[0] != n:
        raise ValueError(
            f"lora: a per-item adapter (rows) reached a layer whose input has {x.shape[0]} rows, not the batch's "
            f"{n} items (rows shared by the items, such as Qwen-Image 2.1's t = 0 timestep row); apply that "
            "adapter to every row or leave those modules out of it"
        )
    return index


def _lora_in(x: torch.Tensor, f) -> torch.Tensor:
    """``x @ A.T`` of the rows ``f`` applies to (rows on x's dim 0, the batch)."""
    rows = _lora_rows(f, x)
    return F.linear((x if rows is None else x.index_select(0, rows)).to(f[0].dtype), f[0])


def _add_lora(y: torch.Tensor, hs, p) -> torch.Tensor:
    """``y + sum(s * (h @ B.T + b))`` over the attached ``(A, B, s, b, g[, rows])`` with ``h = x @ A.T``,
    summed in the adapters' dtype and cast to ``y``'s, as PEFT's ``LoraLayer`` does. With a
    DoRA factor ``g`` (out,), PEFT's ``DoraLinearLayer``: ``+ (g - 1) * (out - bias) + g * s * h @ B.T``,
    ``out`` the output so far (the base's and earlier adapters', as PEFT's running result).
    With ``rows`` the update is computed for those batch rows only and added back at them."""
    out, base_bias = y, p.get("bias")
    for h, f in zip(hs, p["lora"]):
        _, B, s, b, g = f[:5]
        rows = _lora_rows(f)
        u = F.linear(h, B, b) * _row_scale(s, h)
        if rows is None:
            out = out + u if g is None else out + (g - 1) * (out if base_bias is None else out - base_bias) + g * u
            continue
        cur = out.index_select(0, rows)
        delta = u if g is None else (g - 1) * (cur if base_bias is None else cur - base_bias) + g * u
        out = out.to(torch.promote_types(out.dtype, delta.dtype)).index_add(0, rows, delta.to(out.dtype))
    return out.to(y.dtype)


def _row_scale(s, h: torch.Tensor):
    """An adapter's scale: a number or 0-d tensor as is; a (rows,) tensor (one scale per
    batch row, 0 where the row has no such adapter: the fixed-shape batches of the XLA
    server, `pipelines.sampler_xla_batch`) viewed to broadcast over ``h``'s other dims."""
    return s.view(-1, *(1,) * (h.ndim - 1)) if isinstance(s, torch.Tensor) and s.ndim == 1 else s


def col_linear(p, x: torch.Tensor, axis: str = "tp") -> torch.Tensor:
    """A column-parallel projection: this rank's output columns of a ``x`` every rank holds
    whole, so ``x``'s gradient is a per-rank share summed over ``axis`` (Megatron's f)."""
    return linear(p, sharding.pvary(x, axis))


@replaceable(fast.linear_gelu)
def linear_gelu(p, x: torch.Tensor, axis: str = "tp") -> torch.Tensor:
    """``gelu(col_linear(p, x), approximate="tanh")``."""
    return F.gelu(col_linear(p, x, axis), approximate="tanh")


@replaceable(fast.linear_group)
def linear_group(ps: list, x: torch.Tensor, axis: str = "tp") -> list[torch.Tensor]:
    """Column-parallel ``[col_linear(p, x) for p in ps]``: projections reading the same x
    (q, k, v), which `fd.prepare` lays out as one buffer (BFL's ``qkv``). x goes through
    ``sharding.pvary`` over ``axis`` once, so its gradient under tensor parallelism is
    the sum of the per-rank shares."""
    x = sharding.pvary(x, axis)
    return [linear(p, x) for p in ps]


@replaceable(fast.linear_group_gelu)
def linear_group_gelu(ps: list, x: torch.Tensor, axis: str = "tp") -> list[torch.Tensor]:
    """`linear_group` with a tanh GELU on its last output: FLUX.1's single-block input,
    q, k, v and the MLP from one x (BFL's ``linear1``)."""
    *ys, y = linear_group(ps, x, axis)
    return [*ys, F.gelu(y, approximate="tanh")]


@replaceable(fast.col_linear_split)
def col_linear_split(p, x: torch.Tensor, sizes: list, axis: str = "tp") -> list[torch.Tensor]:
    """`col_linear` split into its output blocks of ``sizes`` (the weight's row blocks,
    e.g. a packed [gate; up])."""
    return list(col_linear(p, x, axis).split(sizes, dim=-1))


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
    y = sharding.psum(_matmul(x, p["weight"], axis=axis), axis)
    y = y if p.get("bias") is None else y + p["bias"]
    if "lora" not in p:
        return y
    hs = [_lora_in(x, f) for f in p["lora"]]  # each adapter's rows: flattened into one all-reduce
    flat = sharding.psum(torch.cat([h.flatten() for h in hs]), axis).split([h.numel() for h in hs])
    return _add_lora(y, [v.view(h.shape) for v, h in zip(flat, hs)], p)


def row_linears(pairs: list, axis: str = "tp") -> list[torch.Tensor]:
    """``[row_linear(p, x) for p, x in pairs]`` with one all-reduce over ``axis`` for all of
    them (the partial products concatenated along the sequence, dim 1): a double block's
    two streams pay one collective instead of two, with the same sums. Layers with LoRA
    factors take `row_linear`'s own path."""
    if sharding.axis_size(axis) == 1 or len(pairs) == 1 or any("lora" in p for p, _ in pairs):
        return [row_linear(p, x, axis) for p, x in pairs]
    ys = [_matmul(x, p["weight"], axis=axis) for p, x in pairs]
    summed = sharding.psum(torch.cat(ys, 1), axis).split([y.shape[1] for y in ys], 1)
    return [y if p.get("bias") is None else y + p["bias"] for y, (p, _) in zip(summed, pairs)]


@replaceable(fast.row_linear_cat)
def row_linear_cat(p, xs: list, axis: str = "tp") -> torch.Tensor:
    """``row_linear(p, torch.cat(xs, -1))``: a projection of concatenated streams (the
    single blocks' [attn, mlp], BFL's ``linear2``)."""
    return row_linear(p, torch.cat(xs, -1), axis)


# ----------------------------------------------------------------------------- norms and modulation


def layer_norm(x: torch.Tensor, eps: float = 1e-6, p=None) -> torch.Tensor:
    w, b = (None, None) if p is None else (p.get("weight"), p.get("bias"))
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


@replaceable(fast.rms_norm)
def rms_norm(p, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``torch.nn.RMSNorm`` (FLUX.1/FLUX.2 QK norms)."""
    return F.rms_norm(x, x.shape[-1:], p["weight"], eps)


@replaceable(fast.rms_norm_fp32)
def rms_norm_fp32(p, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """diffusers ``RMSNorm`` (Qwen-Image): variance in fp32; the normalised x is cast to a
    half-precision weight's dtype before the scale (an fp32 weight keeps it fp32)."""
    w = p["weight"]
    y = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(w.dtype) if w.dtype in (torch.float16, torch.bfloat16) else y) * w


@replaceable(fast.norm_modulate)
def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """AdaLN: ``layer_norm(x) * (1 + scale) + shift`` (no affine weights of its own) over x
    (B, S, C), the modulation (B, C) or already broadcastable ((B, 1, C), (B, S, C))."""
    shift, scale = (m[:, None] if m.dim() == 2 else m for m in (shift, scale))
    return layer_norm(x, eps) * (1 + scale) + shift


@replaceable(fast.gated)
def gated(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gated residual ``x + gate * y`` (``gate`` broadcast over y's rows, e.g. (B, 1, C))."""
    return x + gate * y


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


# ----------------------------------------------------------------------------- MLPs and embeddings


def gelu_mlp(p, x: torch.Tensor) -> torch.Tensor:
    """diffusers ``FeedForward(activation_fn="gelu-approximate")``: ``net.0.proj``, ``net.2``."""
    return row_linear(p["net"]["2"], linear_gelu(p["net"]["0"]["proj"], x))


def gelu_mlps(pairs: list) -> list[torch.Tensor]:
    """``[gelu_mlp(p, x) for p, x in pairs]``, the output projections in one all-reduce
    (`row_linears`)."""
    return row_linears([(p["net"]["2"], linear_gelu(p["net"]["0"]["proj"], x)) for p, x in pairs])


@replaceable(fast.swiglu)
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (FLUX.2's MLPs)."""
    return F.silu(gate) * up


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


# ----------------------------------------------------------------------------- RoPE

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


@replaceable(fast.apply_rope)
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (B, S, H, D) by cos/sin (S, D) in fp32; (B, S, D):
    a table per row (items of several sizes in one call, `shard_joint`)."""
    xr, xi = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-xi, xr], dim=-1).flatten(-2)
    return (x.float() * cos.unsqueeze(-2) + rotated.float() * sin.unsqueeze(-2)).to(x.dtype)


# ----------------------------------------------------------------------------- attention


@replaceable(fast.split_rows)
def split_rows(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, C) -> its first ``n`` rows and the rest, each contiguous as diffusers makes
    them (the same GEMM path after, so bf16 matches bitwise)."""
    return x[:, :n].contiguous(), x[:, n:].contiguous()


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, S, H*D) -> (B, S, H, D); H is whatever this rank holds."""
    return x.unflatten(-1, (-1, head_dim))


def _sdpa(q, k, v, key_bias):
    mask = None if key_bias is None else key_bias[:, None, None, :].to(q.dtype)  # (B, 1, 1, S_k)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    if sharding.forward_ad_active():  # the fused CPU/GPU kernels have no forward-mode rule
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask)[0].transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def attention_lse(q, k, v, key_bias=None, mask=None):
    """One key block of ring attention: q (B, Sq, H, D), k, v (B, Sk, H, D) -> (out fp32
    (B, Sq, H, D) normalised over these keys, log-sum-exp fp32 (B, Sq, H)), SDPA with its
    softmax statistics kept (`sharding.merge` combines blocks).

    ``key_bias`` (B, Sk) and ``mask`` (Sq, Sk) are additive (0 keep, -inf drop). A row
    with no unmasked key gives out 0 and lse -inf. On a CPU with nothing to
    differentiate, torch's fused CPU flash kernel (the one SDPA runs there); else the
    exact maths, which autograd, forward AD, vmap and torch.compile all trace."""
    if _fused_lse_ok(q, k, v):
        return _attention_lse_cpu(q, k, v, key_bias, mask)
    return _attention_lse_math(q, k, v, key_bias, mask)


def _fused_lse_ok(*ts) -> bool:
    differentiating = torch.is_grad_enabled() and any(t.requires_grad for t in ts)
    return (
        ts[0].device.type == "cpu"
        and not differentiating
        and not torch.compiler.is_compiling()
        and not sharding.forward_ad_active()
        and not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in ts)
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    )


def _attention_lse_cpu(q, k, v, key_bias, mask):
    bias = None if key_bias is None else key_bias[:, None, None, :].float()
    if mask is not None:
        bias = mask[None, None] if bias is None else bias + mask
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = kernel(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=None if bias is None else bias.to(q.dtype))
    if bias is not None:  # the kernel gives a row with no key lse 0 (and out 0): make it -inf
        seen = torch.isfinite(bias).any(-1)  # (B or 1, 1, Sq or 1)
        lse = torch.where(seen, lse, float("-inf"))
    return out.transpose(1, 2).float(), lse.transpose(1, 2)


def _attention_lse_math(q, k, v, key_bias, mask):
    """The maths of `attention_lse`; the maximum is detached (the result does not depend
    on it, so neither does its gradient)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * q.shape[-1] ** -0.5  # (B, H, Sq, Sk)
    if key_bias is not None:
        s = s + key_bias[:, None, None, :].float()
    if mask is not None:
        s = s + mask
    top = s.amax(-1, keepdim=True).detach()
    seen = torch.isfinite(top)  # False where every key is masked
    m = torch.where(seen, top, torch.zeros((), device=top.device))
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    total = total.clamp_min(torch.finfo(p.dtype).tiny)  # 0 only where every key is masked
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.float()) / total.transpose(1, 2)
    lse = torch.where(seen, m + total.log(), float("-inf"))
    return out, lse.squeeze(-1).transpose(1, 2)


def _ring_block(q, k, v, key_bias, q_start, k_start):
    return attention_lse(q, k, v, key_bias)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor | None = None):
    """Scaled dot-product attention: q, k, v (B, S, H, D) -> (B, S, H*D).

    ``key_bias`` (B, S) is an additive key mask (0 keep, -inf drop): static shapes, no
    boolean indexing. Under sequence parallelism S is this rank's slice:
    `sharding.sequence_attention` swaps sequence for heads around the kernel (Ulysses,
    ``sp``) and, on a ``ring`` axis, passes key/value blocks around the ring
    (`attention_lse` per block, docs/sharding.md).
    """
    return sharding.sequence_attention(_sdpa, _ring_block, q, k, v, key_bias).flatten(2)


def shard_joint(txt: torch.Tensor, img: torch.Tensor, pe, txt_bias=None, img_bias=None):
    """Split a joint (txt; img) sequence over ``sp``: each rank holds (txt chunk; img
    chunk) and the matching RoPE rows (a (S, D) table, or (B, S, D): one per row). Returns
    txt, img, pe and the (B, S_local) key bias that masks padding (and ``txt_bias`` (B,
    S_txt), e.g. a prompt mask, and ``img_bias`` (B, S_img), the padding of rows that
    hold smaller images), or None."""
    T, S = txt.shape[1], img.shape[1]
    d = pe[0].ndim - 2  # the rows' dim of the table
    if d and pe[0].shape[0] != img.shape[0]:  # a split batch (dp) keeps every row's table: refused
        raise ValueError(f"rope: a table per row needs all {pe[0].shape[0]} rows here, got {img.shape[0]} (dp)")
    pe = tuple(
        torch.cat([sharding.shard(a.narrow(d, 0, T), "sp", d), sharding.shard(a.narrow(d, T, S), "sp", d)], d)
        for a in pe
    )
    txt_bias, img_bias = (None if b is None else sharding.shard(b, "sp", 1) for b in (txt_bias, img_bias))
    biases = [sharding.pad_bias(T, "sp", img.device), sharding.pad_bias(S, "sp", img.device)]
    txt, img = sharding.shard(txt, "sp", 1), sharding.shard(img, "sp", 1)
    if txt_bias is None and img_bias is None and all(b is None for b in biases):
        return txt, img, pe, None
    B = img.shape[0]
    tb = torch.zeros(B, txt.shape[1], device=img.device) if biases[0] is None else biases[0].expand(B, -1)
    if txt_bias is not None:
        tb = tb + txt_bias
    ib = torch.zeros(B, img.shape[1], device=img.device) if biases[1] is None else biases[1].expand(B, -1)
    if img_bias is not None:
        ib = ib + img_bias
    return txt, img, pe, torch.cat([tb, ib], 1)

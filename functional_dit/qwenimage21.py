"""Qwen-Image 2.1 as pure functions over a parameter tree.

Mirrors diffusers' ``QwenImage21Transformer2DModel`` (``transformer_qwenimage21.py``, the
transformer of ``QwenImage21Pipeline`` and the QwenImage21 modular pipelines): one
sequence of single-stream blocks over the vision-language encoder's text, with the
condition images' latent tokens dropped into the image slots the encoder reserved (each
slot a 2x2 group of latents) and the target image's tokens appended. One shared
modulation projection (scale and tanh-gate, no shift) feeds every block. Attention is
block-causal: causal over the sequence, bidirectional inside each image. With
``causal_condition`` the text and condition tokens are modulated at t = 0, so their keys
and values do not depend on the step and can be cached (``kv_cache="extract"`` on the
first step returns the cache, later steps pass ``kv_cache=cache`` and compute only the
target's tokens).

The layout (where each token comes from, the image blocks, the RoPE positions) is read
from ``img_mask`` and ``img_shapes`` on the host once per call, as diffusers does; the
forward then uses only static indices. Block-causal attention runs as diffusers' exact
SDPA decomposition: one call per prefix segment and one for the target.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

import sharding
from sharding.tree import flatten, mismatch_report, nest

from . import qwenimage
from .configs import (
    DiTConfig,
    Pipeline,
    as_ints,
    require_bool,
    require_non_negative,
    require_positive,
    require_positive_or_none,
    require_rope_axes,
)
from .nn import layers as L
from .nn import stages as _stages
from .nn.checks import check_floating, check_rope, check_tensor, img_valid_bias, reference_leaf
from .params import (
    COMPUTE_DTYPES,
    PACKED,
    ParamSpec,
    Segment,
    linear_spec,
    mod_spec,
    norm_spec,
    ordered_blocks,
    register_tree_node,
)

DIFFUSERS_CLASS = "QwenImage21Transformer2DModel"
NAME = "Qwen-Image 2.1"
KEY = "qwenimage21"  # the family in code: fd.sample, the adapter, the tiny pipelines, bench
TOKENS_PER_SLOT = 4  # each vision-language image slot stands for 2x2 latent tokens
MOD4 = ("scale", "gate", "scale2", "gate2")  # the shared modulation: (attn, MLP) x (scale, gate)


@dataclasses.dataclass(frozen=True)
class QwenImage21Config(DiTConfig):
    """diffusers ``QwenImage21Transformer2DModel`` config; defaults are diffusers' (Qwen-Image 2.1)."""

    patch_size: int = 1  # 2.1 consumes its latents unpatched
    in_channels: int = 64
    out_channels: int | None = 64  # None: same as in_channels
    num_layers: int = 32  # single-stream blocks
    attention_head_dim: int = 128
    num_attention_heads: int = 32
    context_in_dim: int = 4096  # the vision-language encoder's hidden size
    mlp_ratio: int = 3  # SwiGLU hidden = inner_dim * mlp_ratio
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)  # (frame, row, col) share of head_dim
    eps: float = 1e-6
    causal_condition: bool = True  # text and condition images modulated at t = 0 (cacheable)

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", as_ints(self.axes_dims_rope))
        require_positive(
            self,
            "patch_size",
            "in_channels",
            "attention_head_dim",
            "num_attention_heads",
            "context_in_dim",
            "mlp_ratio",
        )
        require_positive_or_none(self, "out_channels")
        require_non_negative(self, "num_layers")
        require_bool(self, "causal_condition")
        require_rope_axes(self, n_axes=3)

    @property
    def mlp_hidden_dim(self) -> int:
        return self.inner_dim * self.mlp_ratio

    def param_specs(self) -> dict:
        """Nested dict of `ParamSpec` (the protocol `sharding.plan` reads specs by)."""
        return param_specs(self)


# The released transformer as diffusers names it: loaders/single_file_utils.py maps a
# Qwen-Image 2.1 checkpoint (txt_in.text_norm) to "Qwen/Qwen-Image-2.1", whose shapes are
# QwenImage21Transformer2DModel's defaults, documented there: 32 blocks, 32 heads x 128
# (4096 wide), mlp_ratio 3, patch 1, 64 latent channels in and out, text features of
# 4096, RoPE (16, 56, 56), causal_condition on.
PRESETS = {
    "qwen-image-2.1": QwenImage21Config(),
    # A tiny model for tests and the offline demo (4 heads: tp x sp up to 4).
    "qwen-image-2.1-tiny": QwenImage21Config(
        in_channels=8,
        out_channels=8,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        context_in_dim=24,
        axes_dims_rope=(4, 6, 6),
    ),
}

CONFIG = QwenImage21Config
TINY = "qwen-image-2.1-tiny"  # the preset tests and the offline tiny pipelines start from
REPOS = {}  # released weights of the presets on the Hugging Face Hub: none yet
# The stock diffusers pipelines that run this transformer (see `configs.Pipeline`).
PIPELINES = (
    Pipeline("QwenImage21Pipeline", tiny="qwen-image-2.1", sample=True),
    Pipeline("QwenImage21ModularPipeline"),
)


# ----------------------------------------------------------------------------- specs


def _lin(out_dim, in_dim, out_axis, in_axis, blocks=None):
    return linear_spec(out_dim, in_dim, out_axis, in_axis, bias=False, blocks=blocks)  # no biases anywhere


def _block_specs(c) -> dict:
    D, n, m = c.attention_head_dim, c.inner_dim, c.mlp_hidden_dim
    col = _lin(n, n, "heads", "embed")
    attn = {"to_q": col, "to_k": col, "to_v": col, "to_out": {"0": _lin(n, n, "embed", "heads")}}
    mlp = {
        "proj": _lin(m, n, "mlp", "embed"),
        "out": _lin(n, m, "embed", "mlp"),
        "gate_layer": _lin(m, n, "mlp", "embed"),
    }
    return {"attn": attn | {"norm_q": norm_spec(D), "norm_k": norm_spec(D)}, "img_mlp": mlp}


def param_specs(c: QwenImage21Config) -> dict:
    """Nested dict of `ParamSpec` in diffusers ``state_dict`` order; allocates nothing."""
    n, ctx = c.inner_dim, c.context_in_dim
    return {
        "time_text_embed": {
            "timestep_embedder": {"linear_1": _lin(n, 256, "embed", "freq"), "linear_2": _lin(n, n, "embed", "embed")}
        },
        "txt_in": {
            "text_norm": {"weight": ParamSpec((ctx,), ("txt_embed",))},
            "in_layer": _lin(n, ctx, "embed", "txt_embed"),
            "out_layer": _lin(n, n, "embed", "embed"),
        },
        "img_in": _lin(n, c.in_channels * c.patch_size**2, "embed", "channels"),
        "modulation": {"1": mod_spec(n, MOD4, bias=False)},
        "transformer_blocks": {str(i): _block_specs(c) for i in range(c.num_layers)},
        "norm_out": {"linear": _lin(n, n, PACKED, "embed", blocks=(Segment("scale", n, "mod"),))},
        "proj_out": _lin(c.out_dim, n, "out_channels", "embed"),
    }


# Projections that read the same input, fused into one matmul by `fd.prepare`.
FUSED = {"transformer_blocks": [("attn.to_q", "attn.to_k", "attn.to_v"), ("img_mlp.gate_layer", "img_mlp.proj")]}


# ----------------------------------------------------------------------------- layout


class Layout(NamedTuple):
    """The joint sequence of one call, read once on the host from img_mask / img_shapes.

    ``source`` (L,) int64: joint row j is row ``source[j]`` of (txt rows; latent rows);
    ``segments`` the prefix's (start, end, is_text) runs of one text run or one image;
    ``prefix`` the number of rows before the target image (its tokens are the tail);
    ``ids`` (L, 3) fp32 RoPE positions (frame, row, col); ``text_rows`` the encoder rows
    that stay text (their order in the sequence)."""

    source: torch.Tensor
    segments: tuple
    prefix: int
    ids: torch.Tensor
    text_rows: tuple


def _joint_rows(slots: list, T: int) -> tuple[list, list]:
    """Per joint row its source index in (txt rows; latent rows), and the text rows."""
    source, text_rows, latent = [], [], 0
    for v, is_img in enumerate(slots):
        if is_img:
            source.extend(range(T + latent, T + latent + TOKENS_PER_SLOT))
            latent += TOKENS_PER_SLOT
        else:
            source.append(v)
            text_rows.append(v)
    return source, text_rows


def _positions(is_image: list, shapes) -> list:
    """(frame, row, col) per joint row, as diffusers' ``QwenImage21Rope``: text advances one
    position on every axis; each image freezes the frame at the position the text reached
    and lays its rows and columns out centred on zero, then advances by max(h, w)."""
    ids, cursor, pos = [], 0, 0
    for _, h, w in shapes:
        start = is_image.index(True, cursor)
        ids += [(p, p, p) for p in range(pos, pos + start - cursor)]
        pos += start - cursor
        ids += [(pos, r, c) for r in range(-(h - h // 2), h // 2) for c in range(-(w - w // 2), w // 2)]
        cursor, pos = start + h * w, pos + max(h, w)
    return ids + [(p, p, p) for p in range(pos, pos + len(is_image) - cursor)]


def _segments(block_of: list, prefix: int) -> tuple:
    """The prefix's runs of equal block id (-1: text) as (start, end, is_text)."""
    out, start = [], 0
    for i in range(1, prefix + 1):
        if i == prefix or block_of[i] != block_of[start]:
            out.append((start, i, block_of[start] < 0))
            start = i
    return tuple(out)


def layout(slots: list, shapes, T: int, device=None) -> Layout:
    """The `Layout` of a vision-language sequence whose image slots are ``slots`` (a list
    of bools, one per position: the encoder's T positions then the target's slots) and
    whose images are ``shapes`` [(1, h, w), ...] (conditions first, target last)."""
    source, text_rows = _joint_rows(slots, T)
    is_image = [s >= T for s in source]
    block_of, n = [-1] * len(source), 0
    image_rows = [j for j, b in enumerate(is_image) if b]
    for b, (f, h, w) in enumerate(shapes):
        for j in image_rows[n : n + f * h * w]:
            block_of[j] = b
        n += f * h * w
    prefix = len(source) - math.prod(shapes[-1])
    ids = torch.tensor(_positions(is_image, shapes), dtype=torch.float32, device=device).reshape(-1, 3)
    src = torch.tensor(source, dtype=torch.int64, device=device)
    return Layout(src, _segments(block_of, prefix), prefix, ids, tuple(text_rows))


# ----------------------------------------------------------------------------- KV cache


class QwenImage21KVCache:
    """The prefix tokens' (text and condition images) keys and values in every block,
    after QK norm and RoPE: ``tree`` = ``{"transformer_blocks": {"0": {"k": t, "v": t},
    ...}}``, t (B, prefix, heads, head_dim), full on every rank; ``config`` and ``prefix``
    are static metadata. A pytree node like `Params`. Treat as immutable."""

    __slots__ = ("config", "prefix", "tree")

    def __init__(self, config, prefix: int, tree):
        self.config, self.prefix, self.tree = config, prefix, dict(tree)

    def __getitem__(self, key: str):
        return self.tree[key]

    def flat(self) -> dict:
        return flatten(self.tree)

    def __repr__(self) -> str:
        return f"QwenImage21KVCache({self.prefix} prefix tokens, {len(self.flat())} tensors)"


register_tree_node(
    QwenImage21KVCache,
    lambda c: (c.prefix, *(getattr(c.config, f.name) for f in dataclasses.fields(c.config))),
    lambda ctx, tree: QwenImage21KVCache(QwenImage21Config(*ctx[1:]), ctx[0], tree),
    name="functional_dit.QwenImage21KVCache",
    to_json=json.dumps,
    from_json=lambda text: tuple(tuple(v) if isinstance(v, list) else v for v in json.loads(text)),
)


def cache_shapes(c, batch: int, prefix: int) -> dict:
    shape = (batch, prefix, c.num_attention_heads, c.attention_head_dim)
    return {f"transformer_blocks.{i}.{kv}": shape for i in range(c.num_layers) for kv in "kv"}


def _check_cache(c, cache, B: int, prefix: int, leaf) -> None:
    if not isinstance(cache, QwenImage21KVCache):
        raise ValueError(f"kv_cache: expected None, 'extract' or a QwenImage21KVCache, got {type(cache).__name__}")
    if cache.config != c:
        raise ValueError(f"kv_cache: built for a different model; expected config {c}, got {cache.config}")
    if cache.prefix != prefix:
        raise ValueError(f"kv_cache: holds {cache.prefix} prefix tokens; this layout has {prefix}")
    expected, flat = cache_shapes(c, B, prefix), cache.flat()
    if set(flat) != set(expected):
        missing, extra = [k for k in expected if k not in flat], [k for k in flat if k not in expected]
        raise ValueError(mismatch_report("kv_cache: expected the keys of the model's blocks", missing, extra))
    for key, shape in expected.items():
        check_tensor(f"kv_cache[{key!r}]", flat[key], shape, leaf.dtype, leaf.device)


def _local_kv(t: torch.Tensor) -> torch.Tensor:
    """A cached k or v (B, P, H, D), whole on every rank, in the local view (dp, sp, tp)."""
    t = sharding.shard(sharding.pvary(t, "tp"), "tp", 2)
    return sharding.shard(sharding.shard(t, "dp", 0), "sp", 1)


def _full_kv(t: torch.Tensor, B: int, L_: int, P: int, H: int) -> torch.Tensor:
    """This rank's k or v of the joint sequence (B, L/sp, H/tp, D) -> the prefix's whole
    (B, P, H, D) on every rank."""
    t = sharding.gather(sharding.gather(t, "tp", 2, H), "sp", 1, L_)[:, :P]
    return sharding.gather(t, "dp", 0, B)


# ----------------------------------------------------------------------------- forward


def time_embed(p, t: torch.Tensor, dtype, causal: bool) -> torch.Tensor:
    """temb (B, C), or (B + 1, C) with a last row at t = 0 (``causal_condition``): diffusers'
    ``QwenImage21TimestepProjEmbeddings`` (cos first, (1000 t) x freqs in fp32)."""
    t = t.to(dtype)
    if causal:
        t = torch.cat([t, t.new_zeros(1)])
    proj = L.timestep_embedding(t.float() * 1000, 256)
    return L.mlp_embed(p["timestep_embedder"], proj.to(dtype))


def text_in(p, txt: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers ``QwenImage21TextProjection``: zero-centred RMS norm (scale = weight + 1,
    fp32), then in_layer, tanh-GELU, out_layer."""
    h = txt.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (p["text_norm"]["weight"].float() + 1)
    return L.linear(p["out_layer"], F.gelu(L.linear(p["in_layer"], h.to(txt.dtype)), approximate="tanh"))


def _per_token(mod: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """A (B [+ 1], C) modulation per local token: (B, 1, C), or with ``target`` (S, 1) bool
    the sample's row on target tokens and the t = 0 row on the others (B, S, C)."""
    if target is None:
        return mod[:, None]
    return torch.where(target[None], mod[:-1, None], mod[-1:, None])


def modulations(params, temb, target) -> tuple[tuple, torch.Tensor]:
    """The shared block modulation (scale, gate, scale2, gate2) and the output scale, per
    local token; under TP one all-gather for both projections."""
    mod, out = L.modulations([(params["modulation"]["1"], 4), (params["norm_out"]["linear"], 1)], temb)
    return tuple(_per_token(m, target) for m in mod.chunk(4, dim=-1)), _per_token(out, target)


def _qkv(a, h, head_dim, eps, pe):
    q, k, v = (L.split_heads(y, head_dim) for y in L.linear_group([a[n] for n in ("to_q", "to_k", "to_v")], h))
    q = L.rms_norm_fp32(L.per_head(a["norm_q"]), q, eps).to(v.dtype)
    k = L.rms_norm_fp32(L.per_head(a["norm_k"]), k, eps).to(v.dtype)
    return L.apply_rope(q, *pe), L.apply_rope(k, *pe), v


def _bias4(bias: torch.Tensor | None, end: int | None = None) -> torch.Tensor | None:
    return None if bias is None else bias[:, None, None, :end]


def _sdpa(q, k, v, mask):
    """SDPA over q, k, v (B, S, H, D) with an additive mask broadcastable to (B, H, S_q, S_k)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if sharding.forward_ad_active():
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask)[0].transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.dtype)).transpose(1, 2)


def _causal_bias(start: int, end: int, device) -> torch.Tensor:
    """(1, 1, end - start, end): a text segment's queries see every key up to their own."""
    q = torch.arange(start, end, device=device)[:, None]
    allowed = torch.arange(end, device=device)[None] <= q
    zero = torch.zeros((), device=device)
    return torch.where(allowed, zero, torch.full((), float("-inf"), device=device))[None, None]


def block_causal(segments: tuple, prefix: int):
    """Attention ``fn(q, k, v, key_bias)`` over the whole sequence in diffusers' exact
    decomposition: each prefix segment's queries attend the keys before its end (a text
    segment causally), the target's queries attend every key."""

    def fn(q, k, v, key_bias):
        outs = []
        for start, end, is_text in segments:
            mask = _bias4(key_bias, end)
            if is_text:
                causal = _causal_bias(start, end, q.device)
                mask = causal if mask is None else causal + mask
            outs.append(_sdpa(q[:, start:end], k[:, :end], v[:, :end], mask))
        outs.append(_sdpa(q[:, prefix:], k, v, _bias4(key_bias)))
        return torch.cat(outs, 1)

    return fn


def _full_attention(q, k, v, key_bias):
    return _sdpa(q, k, v, _bias4(key_bias))


def segment_mask(segments: tuple, prefix: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """`block_causal`'s mask as an additive (Sq, Sk) bias of query and key positions: a
    prefix segment's queries see the keys before its end (a text segment causally), the
    target's queries (and padding rows, stripped later) see every key."""
    allowed = (q_pos >= prefix)[:, None].expand(q_pos.shape[0], k_pos.shape[0])
    for start, end, is_text in segments:
        ok = k_pos[None] < end
        if is_text:
            ok = ok & (k_pos[None] <= q_pos[:, None])
        allowed = allowed | (((q_pos >= start) & (q_pos < end))[:, None] & ok)
    zero = torch.zeros((), device=q_pos.device)
    return torch.where(allowed, zero, torch.full((), float("-inf"), device=q_pos.device))


def ring_block_causal(segments: tuple, prefix: int):
    """`block_causal` as a ring-attention block kernel (``sharding.ring_attention``): the
    same mask from the blocks' positions in the sequence."""

    def block(q, k, v, key_bias, q_start, k_start):
        pos = lambda start, n: torch.arange(start, start + n, device=q.device)  # noqa: E731
        mask = segment_mask(segments, prefix, pos(q_start, q.shape[1]), pos(k_start, k.shape[1]))
        return L.attention_lse(q, k, v, key_bias, mask)

    return block


def _ring_full(q, k, v, key_bias, q_start, k_start):
    return L.attention_lse(q, k, v, key_bias)


class Attn(NamedTuple):
    """How a block attends: ``fn`` (`block_causal` or full), and in cached mode this
    layer's cached k, v and their key bias (local view); ``block`` the same as a ring
    attention block kernel (on a ``ring`` mesh axis)."""

    fn: object
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    block: object = _ring_full


def attention(a, h, pe, head_dim, eps, key_bias, how: Attn):
    """Returns the attention output after to_out, and this layer's k, v (local)."""
    q, k, v = _qkv(a, h, head_dim, eps, pe)
    kk, vv, bias = k, v, key_bias
    if how.k is not None:  # cached: the prefix's keys and values first
        kk, vv = torch.cat([how.k, k], 1), torch.cat([how.v, v], 1)
        if key_bias is not None or how.bias is not None:
            zeros = lambda t: torch.zeros(t.shape[:2], device=t.device)  # noqa: E731
            bias = torch.cat(
                [zeros(how.k) if how.bias is None else how.bias, zeros(k) if key_bias is None else key_bias], 1
            )
    out = sharding.sequence_attention(how.fn, how.block, q, kk, vv, bias).flatten(2)
    return L.row_linear(a["to_out"]["0"], out), k, v


def swiglu_mlp(p, x: torch.Tensor) -> torch.Tensor:
    """diffusers ``QwenImage21SwiGLUFeedForward``: ``out(silu(gate_layer(x)) * proj(x))``."""
    gate, up = L.linear_group([p["gate_layer"], p["proj"]], x)
    return L.row_linear(p["out"], F.silu(gate) * up)


def block(p, x, mod, pe, head_dim, eps, key_bias, how: Attn, attn=None):
    """diffusers ``QwenImage21TransformerBlock``: x + tanh(gate) * attn(LN(x) * (1 + scale)),
    then the same with the SwiGLU MLP. ``mod`` the 4 shared per-token modulations.
    ``attn``: None, or a function given the attention module (through ``to_out``) as a
    function of no arguments, returning its output or a stand-in for it (where the
    attention-level caches hook, `functional_dit.pipelines.cache`); the layer's k, v are
    then None where it did not compute."""
    scale, gate, scale2, gate2 = mod
    h = L.layer_norm(x, eps) * (1 + scale)
    if attn is None:
        y, k, v = attention(p["attn"], h, pe, head_dim, eps, key_bias, how)
    else:
        box = [None, None]

        def module():
            out, box[0], box[1] = attention(p["attn"], h, pe, head_dim, eps, key_bias, how)
            return out

        y, (k, v) = attn(module), box
    x = x + gate.tanh() * y
    x = x + gate2.tanh() * swiglu_mlp(p["img_mlp"], L.layer_norm(x, eps) * (1 + scale2))
    return L.clip_fp16(x), k, v


def final_layer(params, x, scale, eps):
    return L.linear(params["proj_out"], L.layer_norm(x, eps) * (1 + scale))


# ----------------------------------------------------------------------------- validation


def _check_shapes(img_shapes, B: int, S: int) -> tuple:
    shapes = qwenimage.check_img_shapes(img_shapes, B, S, False)
    for f, h, w in shapes:
        if f != 1:  # diffusers' RoPE lays out h * w tokens per image
            raise ValueError(f"img_shapes: Qwen-Image 2.1 takes single-frame images (1, h, w), got {(f, h, w)}")
    return shapes


def _check_img_mask(img_mask, B: int, T: int, S: int, shapes) -> list:
    """img_mask (B, T + target/4) bool, one layout for every sample: the encoder's image
    slots, then the target's (all True); 4 latent tokens per slot make x's S tokens.
    Returns its first row as a list (read on the host, as diffusers does)."""
    target = math.prod(shapes[-1])
    if target % TOKENS_PER_SLOT:
        raise ValueError(f"img_shapes: the target image {shapes[-1]} has {target} tokens, expected a multiple of 4")
    check_tensor("img_mask", img_mask, (B, T + target // TOKENS_PER_SLOT))
    if img_mask.dtype != torch.bool:
        raise ValueError(f"img_mask: expected a bool tensor (True at image slots), got {img_mask.dtype}")
    rows = img_mask.cpu()
    if B > 1 and not bool((rows == rows[:1]).all()):
        raise ValueError("img_mask: every sample must share one layout (diffusers reads the first row)")
    slots = rows[0].tolist() if B else [False] * T + [True] * (target // TOKENS_PER_SLOT)
    if not all(slots[T:]):
        raise ValueError(f"img_mask: positions {T}.. (after txt's {T} rows) are the target's slots, expected True")
    if TOKENS_PER_SLOT * sum(slots) != S:
        raise ValueError(f"img_mask: {sum(slots)} image slots make {4 * sum(slots)} latent tokens; x has {S}")
    return slots


def _check_mask(txt_mask, B: int, T: int, device) -> None:
    check_tensor("txt_mask", txt_mask, (B, T), device=device)
    if txt_mask.dtype != torch.bool and (txt_mask.is_floating_point() or txt_mask.is_complex()):
        raise ValueError(f"txt_mask: expected a bool or integer 0/1 mask (1 = keep), got {txt_mask.dtype}")


def _check_kv(c, kv_cache, B: int, prefix: int, leaf) -> str | None:
    if kv_cache is None:
        return None
    if not c.causal_condition:
        raise ValueError("kv_cache: needs causal_condition=True (only then the prefix does not depend on the step)")
    if isinstance(kv_cache, str):
        if kv_cache != "extract":
            raise ValueError(f"kv_cache: expected None, 'extract' or a QwenImage21KVCache, got {kv_cache!r}")
        return "extract"
    _check_cache(c, kv_cache, B, prefix, leaf)
    return "cached"


def _check_streams(c, leaf, x, t, txt) -> tuple[int, int]:
    if leaf.dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"params: stored as {leaf.dtype}, which fd.apply cannot compute in; expected one of {COMPUTE_DTYPES}"
        )
    check_tensor("x", x, (None, None, c.in_channels * c.patch_size**2), leaf.dtype, leaf.device)
    B = x.shape[0]
    check_tensor("txt", txt, (B, None, c.context_in_dim), leaf.dtype, leaf.device)
    check_tensor("t", t, (B,), device=leaf.device)
    check_floating("t", t)
    return x.shape[:2]


def joint_bias(lay: Layout, txt_mask, B: int, S: int, img_bias=None, T: int = 0) -> torch.Tensor | None:
    """(B, L) additive key bias over the joint sequence: a text row takes its encoder
    row's mask, image rows are kept (diffusers' ``joint_key_valid``) or take ``img_bias``
    (B, S), the padding of x's rows (`check_inputs`' ``img_valid``); ``T``: the encoder's
    rows (txt's length, read off ``txt_mask`` where given)."""
    if txt_mask is None and img_bias is None:
        return None
    tb = torch.zeros(B, T, device=img_bias.device) if txt_mask is None else qwenimage.mask_bias(txt_mask)
    ib = tb.new_zeros(B, S) if img_bias is None else img_bias.to(tb.device)
    return torch.cat([tb, ib], 1).index_select(1, lay.source.to(tb.device))


def read_layout(img_mask, img_shapes, T: int, S: int, device=None) -> Layout:
    """The `Layout` that `check_inputs` reads from ``img_mask`` on the host (checked as
    there), for ``layout=``: read once, later calls read nothing on the host."""
    B = img_mask.shape[0] if isinstance(img_mask, torch.Tensor) and img_mask.dim() else 0
    shapes = _check_shapes(img_shapes, B, S)
    return layout(_check_img_mask(img_mask, B, T, S, shapes), shapes, T, device)


def _check_layout(lay, img_mask, T: int, S: int, device) -> Layout:
    """A precomputed ``layout`` (in place of img_mask) fits this call's T text and S latent rows."""
    if img_mask is not None:
        raise ValueError("img_mask, layout: expected one of them (layout is read from img_mask), got both")
    if not isinstance(lay, Layout):
        raise ValueError(f"layout: expected a qwenimage21.Layout (read_layout), got {type(lay).__name__}")
    L_ = lay.source.shape[0]
    if L_ != len(lay.text_rows) + S or any(r >= T for r in lay.text_rows) or lay.source.device != device:
        raise ValueError(
            f"layout: expected one for {T} text rows and {S} latent tokens on {device}, got {len(lay.text_rows)} "
            f"text rows of {L_} on {lay.source.device}"
        )
    return lay


# of fd.apply's keywords, the ones 2.1 takes
ARGS = ("txt_mask", "img_shapes", "img_mask", "kv_cache", "layout", "rope", "img_valid")
BATCHED = ("bias",)  # of check_inputs' outputs, those split over "dp" with x, t, txt


def check_inputs(
    params,
    x,
    t,
    txt,
    *,
    img_shapes=None,
    img_mask=None,
    txt_mask=None,
    kv_cache=None,
    layout=None,
    rope=None,
    img_valid=None,
) -> dict:
    """Checks the Qwen-Image 2.1 inputs (full view) and returns `forward`'s keywords: x
    (B, S, in_channels) latents (condition images first, the target last), t (B,) in
    [0, 1], txt (B, T, context_in_dim) the encoder's sequence, img_shapes per sample the
    images' (1, h, w) (conditions first), img_mask (B, T + target/4) bool: True at the
    encoder's image slots (each stands for 4 latent tokens) and at the target's appended
    slots, txt_mask (B, T) bool/int, 1 = real token. ``kv_cache="extract"``: returns
    ``(out, cache)``, a `QwenImage21KVCache` of the prefix (text and condition tokens);
    ``kv_cache=cache``: the prefix's keys and values come from the cache, only the
    target's tokens are computed. ``layout=``: `read_layout`'s result in place of img_mask
    (nothing read on the host: a fixed graph per step on lazy devices). fd.apply returns
    ``QwenImage21Transformer2DModel(...)[0]``: (B, L, out) over the joint sequence, or
    (B, target, out) with a cache passed.

    Rows padded to one layout (items of several sizes or prompt lengths in one call):
    ``rope`` (cos, sin), each (B, L, attention_head_dim) fp32, a table per row
    (or (L, attention_head_dim), as `layout`'s ids give it), and ``img_valid`` (B, S),
    1 = a real latent token; img_mask / img_shapes then describe the call's shared, padded
    layout, each row's own grids enter through its table, its padded prompt rows through
    ``txt_mask``. Padding is never attended to; its outputs are to be dropped."""
    c = params.config
    leaf = reference_leaf(params, "img_in.weight")
    B, S = _check_streams(c, leaf, x, t, txt)
    if img_shapes is None or (img_mask is None and layout is None):
        raise ValueError("img_shapes, img_mask: Qwen-Image 2.1 needs both (the images' grids and their slots)")
    T = txt.shape[1]
    if layout is not None:
        _check_shapes(img_shapes, B, S)
        lay = _check_layout(layout, img_mask, T, S, x.device)
    else:
        check_tensor("img_mask", img_mask, (B, None))
        lay = read_layout(img_mask, img_shapes, T, S, x.device)
    if txt_mask is not None:
        _check_mask(txt_mask, B, T, leaf.device)
    mode = _check_kv(c, kv_cache, B, lay.prefix, leaf)
    if rope is None:
        pe = qwenimage.rope(lay.ids, c.axes_dims_rope)
    else:  # in place of the layout's positions: one (L, D) table, or one per row
        pe = check_rope(rope, lay.source.shape[0], c.attention_head_dim, leaf.device, batch=B)
    img_bias = img_valid_bias(img_valid, B, S, leaf.device)
    bias = joint_bias(lay, txt_mask, B, S, img_bias, T)
    return dict(lay=lay, pe=pe, bias=bias, mode=mode, cache=kv_cache if mode == "cached" else None, batch=B)


prepare = check_inputs  # the old name, kept (not to confuse with fd.prepare)


# ----------------------------------------------------------------------------- apply


def _local(x, pe, bias, device):
    """A sequence, its RoPE rows (a (L, D) table, or (B, L, D): one per row) and its key
    bias on this rank's sp chunk (bias with padding)."""
    d = pe[0].ndim - 2
    if d and pe[0].shape[0] != x.shape[0]:  # a split batch (dp) keeps every row's table: refused
        raise ValueError(f"rope: a table per row needs all {pe[0].shape[0]} rows here, got {x.shape[0]} (dp)")
    pad = sharding.pad_bias(x.shape[1], "sp", device)
    x, pe = sharding.shard(x, "sp", 1), tuple(sharding.shard(a, "sp", d) for a in pe)
    bias = None if bias is None else sharding.shard(bias, "sp", 1)
    if pad is not None:
        bias = pad.expand(x.shape[0], -1) if bias is None else bias + pad
    return x, pe, bias


def _cached_layers(cache, bias, device) -> list[Attn]:
    """Per block the cached prefix k, v and their key bias, in the local view."""
    P = cache.prefix
    pbias = sharding.pad_bias(P, "sp", device)
    if bias is not None:
        pbias = sharding.shard(bias[:, :P], "sp", 1) + (0 if pbias is None else pbias)
    out = []
    for i in range(cache.config.num_layers):
        k, v = (_local_kv(cache["transformer_blocks"][str(i)][n]) for n in "kv")
        b = pbias if pbias is None or pbias.dim() == 2 else pbias.expand(k.shape[0], -1)
        out.append(Attn(_full_attention, k, v, b))
    return out


def _inputs(params, x, txt, lay: Layout, pe, bias, mode):
    """The joint sequence, its RoPE rows, its key bias and which rows are the target's
    (None: all, or modulation per sample), full length."""
    c, P = params.config, lay.prefix
    img = L.linear(params["img_in"], x)
    if mode == "cached":
        n = lay.source.shape[0] - P
        return img[:, img.shape[1] - n :], tuple(a[..., P:, :] for a in pe), None if bias is None else bias[:, P:], None
    joint = torch.cat([text_in(params["txt_in"], txt, c.eps), img], 1).index_select(1, lay.source)
    target = (torch.arange(joint.shape[1], device=x.device) >= P)[:, None] if c.causal_condition else None
    return joint, pe, bias, target


def stages(params, x, t, txt, *, lay, pe, bias, mode, cache, batch) -> _stages.Stages:
    """The model on this rank's batch as `nn.stages.Stages`: the joint sequence (``(x,)``,
    the final layer reads all of its rows), the blocks, each with how it attends (its
    cached prefix keys and values with ``mode="cached"``); with ``mode="extract"``
    ``extra`` gives the `QwenImage21KVCache` of the prefix."""
    c = params.config
    joint, pe, joint_bias_, target = _inputs(params, x, txt, lay, pe, bias, mode)
    n = joint.shape[1]
    temb = time_embed(params["time_text_embed"], t, x.dtype, c.causal_condition)
    if mode == "cached":
        temb = temb[:-1]  # every row is the target's
    target = None if target is None else sharding.shard(target, "sp", 0)
    mod, out_scale = modulations(params, temb, target)
    joint, pe, key_bias = _local(joint, pe, joint_bias_, x.device)
    blocks = ordered_blocks(params, "transformer_blocks")
    hows = (
        _cached_layers(cache, bias, x.device)
        if mode == "cached"
        else [Attn(block_causal(lay.segments, lay.prefix), block=ring_block_causal(lay.segments, lay.prefix))]
        * len(blocks)
    )
    ctx = dict(mod=mod, out_scale=out_scale, pe=pe, bias=key_bias, hows=hows, names=list(range(len(blocks))))
    if mode == "extract":
        ctx["kvs"] = {}  # filled by the blocks: each block's prefix k, v (the cache returned)
    static = (c.attention_head_dim, c.eps, batch, n, lay.prefix, c.num_attention_heads)
    seg = _stages.Segment("transformer_blocks", _block, ("hows", "names"), (), static, scan=False,
                          attention="transformer_blocks.{}.attn")  # fmt: skip
    final = lambda img, k: final_layer(params, img, k["out_scale"], c.eps)  # noqa: E731
    extra = (lambda k: QwenImage21KVCache(c, lay.prefix, nest(k["kvs"]))) if mode == "extract" else None
    batched = ("mod", "out_scale", "bias", "hows")
    image = lambda streams: streams[0]  # noqa: E731
    txt_len = len(lay.text_rows)
    keep = n - lay.prefix if mode == "extract" else None  # the cached steps compute the target's rows only
    return _stages.Stages(params, (joint,), (seg,), ctx, final, image, txt_len, n, batched, extra=extra, keep=keep)


def forward(params, x, t, txt, **inputs):
    """The model on this rank's batch (`stages`, run): returns (out sharded over "sp", its
    full length, and the extracted `QwenImage21KVCache` or None)."""
    s = stages(params, x, t, txt, **inputs)
    out, extra = s.forward()
    return out, s.seq, extra


def _block(carry, p, layer, ctx, static):
    """One block as a stage step: carry (joint,), ``layer`` its `Attn` and index; in an
    extract pass its prefix k, v recorded (full on every rank). ``ctx["hook"]``: the
    attention module's hook (an extract pass needs it to compute)."""
    D, eps, B, n, P, H = static
    how, i = layer
    x, k, v = block(p, carry[0], ctx["mod"], ctx["pe"], D, eps, ctx["bias"], how, ctx.get("hook"))
    if "kvs" in ctx:
        if k is None:
            raise ValueError("attn: extracting the prefix KV cache needs the attention computed; the hook reused it")
        ctx["kvs"][f"transformer_blocks.{i}.k"] = _full_kv(k, B, n, P, H)
        ctx["kvs"][f"transformer_blocks.{i}.v"] = _full_kv(v, B, n, P, H)
    return (x,)

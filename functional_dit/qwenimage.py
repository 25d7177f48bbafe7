"""Qwen-Image (and its Edit, Edit-2511 and Layered variants) as pure functions over a
parameter tree.

Mirrors diffusers' ``QwenImageTransformer2DModel`` (``transformer_qwenimage.py``), the
transformer of the Qwen-Image, Qwen-Image-Edit(-Plus) and Qwen-Image-Layered pipelines:
60 MMDiT blocks with separate image / text weights and modulation, QK RMS norms, one
joint attention over (txt; img) and 3-axis RoPE with Qwen's centred image positions;
text tokens sit on the diagonal after the largest image half-extent. Variants:
several images per item (Edit: reference latents appended to the sequence),
``zero_cond_t`` (Edit-2511: reference tokens modulated with t = 0),
``use_additional_t_cond`` and ``use_layer3d_rope`` (Layered).

diffusers builds RoPE with complex numbers (``torch.polar``); here it is real cos/sin
from the same fp32 angles, numerically equal (see the tests).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

import sharding

from .configs import (
    DiTConfig,
    Pipeline,
    as_ints,
    is_int,
    require_bool,
    require_non_negative,
    require_positive,
    require_positive_or_none,
    require_rope_axes,
)
from .nn import control as _control
from .nn import layers as L
from .nn import stages as _stages
from .nn.checks import check_rope, check_streams, check_tensor, img_valid_bias, reference_leaf
from .params import MOD6, MOD_OUT, ParamSpec, linear_spec, mod_spec, norm_spec, ordered_blocks

DIFFUSERS_CLASS = "QwenImageTransformer2DModel"
NAME = "Qwen-Image"
KEY = "qwenimage"  # the family in code: fd.sample, the adapter, the tiny pipelines, bench
THETA = 10000


@dataclasses.dataclass(frozen=True)
class QwenImageConfig(DiTConfig):
    """diffusers ``QwenImageTransformer2DModel`` config; defaults are Qwen-Image's."""

    patch_size: int = 2
    in_channels: int = 64  # 16 VAE channels x 2x2 packed patches
    out_channels: int | None = 16  # VAE channels per patch position; None: same as in_channels
    num_layers: int = 60  # MMDiT (double-stream) blocks; there are no single-stream blocks
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584  # Qwen2.5-VL-7B hidden size
    # diffusers keeps this key but builds no guidance embedder for it (and its forward fails
    # on a guidance tensor); no released Qwen-Image model sets it.
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)  # (frame, row, col) share of head_dim
    zero_cond_t: bool = False  # Edit-2511: reference images modulated with t = 0
    use_additional_t_cond: bool = False  # Layered: a learned 2-way embedding added to temb
    use_layer3d_rope: bool = False  # Layered: layers on the frame axis, the condition image at -1

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", as_ints(self.axes_dims_rope))
        require_positive(
            self, "patch_size", "in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim"
        )
        require_positive_or_none(self, "out_channels")
        require_non_negative(self, "num_layers")
        require_bool(self, "guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
        require_rope_axes(self, n_axes=3)  # (frame, row, col)

    @property
    def mlp_hidden_dim(self) -> int:
        return 4 * self.inner_dim  # diffusers FeedForward, mult 4

    def param_specs(self) -> dict:
        """Nested dict of `ParamSpec` (the protocol `sharding.plan` reads specs by)."""
        return param_specs(self)


PRESETS = {
    # Qwen/Qwen-Image transformer/config.json (Qwen-Image-Edit and -Edit-2509 ship the same
    # transformer config): 60 layers, 24 heads x 128, Qwen2.5-VL text features of 3584.
    # 20,430,401,088 parameters. The released file also carries "pooled_projection_dim": 768,
    # a key diffusers' class ignores (it has no such weights).
    "qwen-image": QwenImageConfig(),
    # Qwen/Qwen-Image-Edit-2511 transformer/config.json: the same plus "zero_cond_t": true.
    "qwen-image-edit-2511": QwenImageConfig(zero_cond_t=True),
    # Qwen/Qwen-Image-Layered transformer/config.json: the same plus "use_additional_t_cond": true
    # and "use_layer3d_rope": true (20,430,407,232 parameters with the 2 x 3072 embedding).
    "qwen-image-layered": QwenImageConfig(use_additional_t_cond=True, use_layer3d_rope=True),
    # A tiny model for tests and the offline demo (4 heads, so tp x sp up to 4 divides them).
    "qwen-image-tiny": QwenImageConfig(
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    ),
}

CONFIG = QwenImageConfig
TINY = "qwen-image-tiny"  # the preset tests and the offline tiny pipelines start from
# The released weights of the presets on the Hugging Face Hub (`generate` reads the local cache only).
REPOS = {
    "qwen-image": "Qwen/Qwen-Image",
    "qwen-image-edit-2511": "Qwen/Qwen-Image-Edit-2511",
}
# The stock diffusers pipelines that run this transformer (see `configs.Pipeline`).
PIPELINES = (
    Pipeline("QwenImagePipeline", tiny="qwen-image", sample=True),
    Pipeline("QwenImageEditPipeline", tiny="qwen-image-edit", sample=True),
    Pipeline("QwenImageEditPlusPipeline", tiny="qwen-image-edit-plus", sample=True),
    Pipeline("QwenImageImg2ImgPipeline", sample=True),
    Pipeline("QwenImageInpaintPipeline", sample=True),
    Pipeline("QwenImageLayeredPipeline", sample=True),
    Pipeline("QwenImageControlNetPipeline", tiny="qwen-image-controlnet", sample=True),  # docs/controlnet.md
)


# ----------------------------------------------------------------------------- specs


def _mlp(c):
    n, m = c.inner_dim, c.mlp_hidden_dim
    return {"net": {"0": {"proj": linear_spec(m, n, "mlp", "embed")}, "2": linear_spec(n, m, "embed", "mlp")}}


def _block_specs(c) -> dict:
    D, n = c.attention_head_dim, c.inner_dim
    col = lambda: linear_spec(n, n, "heads", "embed")  # noqa: E731  column-parallel over heads
    row = lambda: linear_spec(n, n, "embed", "heads")  # noqa: E731  row-parallel over heads
    return {
        "img_mod": {"1": mod_spec(n, MOD6)},
        "attn": {
            "norm_q": norm_spec(D),
            "norm_k": norm_spec(D),
            "to_q": col(),
            "to_k": col(),
            "to_v": col(),
            "add_k_proj": col(),
            "add_v_proj": col(),
            "add_q_proj": col(),
            "to_out": {"0": row()},
            "to_add_out": row(),
            "norm_added_q": norm_spec(D),
            "norm_added_k": norm_spec(D),
        },
        "img_mlp": _mlp(c),
        "txt_mod": {"1": mod_spec(n, MOD6)},
        "txt_mlp": _mlp(c),
    }


def param_specs(c: QwenImageConfig) -> dict:
    """Nested dict of `ParamSpec` in diffusers ``state_dict`` order; allocates nothing."""
    n = c.inner_dim
    time = {
        "timestep_embedder": {
            "linear_1": linear_spec(n, 256, "embed", "freq"),
            "linear_2": linear_spec(n, n, "embed", "embed"),
        }
    }
    if c.use_additional_t_cond:
        time["addition_t_embedding"] = {"weight": ParamSpec((2, n), ("t_cond", "embed"))}
    return {
        "time_text_embed": time,
        "txt_norm": norm_spec(c.joint_attention_dim, "txt_embed"),
        "img_in": linear_spec(n, c.in_channels, "embed", "channels"),
        "txt_in": linear_spec(n, c.joint_attention_dim, "embed", "txt_embed"),
        "transformer_blocks": {str(i): _block_specs(c) for i in range(c.num_layers)},
        "norm_out": {"linear": mod_spec(n, MOD_OUT)},
        "proj_out": linear_spec(c.out_dim, n, "out_channels", "embed"),
    }


# ----------------------------------------------------------------------------- RoPE


def image_ids(shapes, layer3d: bool = False, device=None) -> torch.Tensor:
    """(S_img, 3) float positions (frame, row, col) of the images ``shapes`` [(f, h, w), ...]
    in sequence order. Image ``i`` has frames i, i+1, ... (Layered: the last, the condition
    image, has frame -1); rows and cols are centred: -(h - h//2) .. h//2 - 1."""
    ar = lambda n, start: torch.arange(start, start + n, dtype=torch.float32, device=device)  # noqa: E731
    parts = []
    for i, (f, h, w) in enumerate(shapes):
        frame = ar(1, -1) if layer3d and i == len(shapes) - 1 else ar(f, i)
        rows, cols = ar(h, -(h - h // 2)), ar(w, -(w - w // 2))
        parts.append(torch.stack(torch.meshgrid(frame, rows, cols, indexing="ij"), -1).reshape(-1, 3))
    return torch.cat(parts)


def text_ids(shapes, txt_len: int, layer3d: bool = False, device=None) -> torch.Tensor:
    """(S_txt, 3) positions of the text tokens: the same on every axis, starting after the
    largest image half-extent (Layered: at least the number of layers). Every token gets
    its index, padding or not, as diffusers does (its RoPE length is the padded S_txt)."""
    start = max(max(h // 2, w // 2) for _, h, w in shapes)
    start = max(start, len(shapes) - 1) if layer3d else start
    return (start + torch.arange(txt_len, dtype=torch.float32, device=device))[:, None].expand(-1, 3)


def rope(ids: torch.Tensor, axes_dim) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (S, 3) -> cos, sin (S, sum(axes_dim)), pairs interleaved. Angles in fp32 exactly as
    diffusers' ``QwenEmbedRope.rope_params`` computes them (``theta ** (2i / dim)``, then 1/x)."""
    angles = []
    for i, dim in enumerate(axes_dim):
        # fp32 arange (diffusers: int64, then fp32; the same small ints): no int64 on neuron/mps/npu
        inv = 1.0 / torch.pow(THETA, torch.arange(0, dim, 2, dtype=torch.float32, device=ids.device).div(dim))
        angles.append(ids[:, i, None].float() * inv[None])  # (S, dim/2)
    ang = torch.cat(angles, -1)
    return ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)


def pos_embed(shapes, txt_len: int, axes_dim, layer3d: bool = False, device=None):
    """cos, sin (S_txt + S_img, head_dim) for the joint (txt; img) sequence."""
    ids = torch.cat([text_ids(shapes, txt_len, layer3d, device), image_ids(shapes, layer3d, device)])
    return rope(ids, axes_dim)


# Projections that read the same input, fused into one matmul by `fd.prepare`.
FUSED = {
    "transformer_blocks": [
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ],
}


# ----------------------------------------------------------------------------- forward


def timestep_proj(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """diffusers ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)``
    in its op order: fp32 (t * f) * 1000 (not FLUX's (1000 t) * f), cos first."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None] * 1000
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


def time_embed(p, t: torch.Tensor, t_cond: torch.Tensor | None = None, zero_cond_t: bool = False) -> torch.Tensor:
    """temb (B, C), or (2B, C) = [temb(t); temb(0)] with ``zero_cond_t``; t is in the model dtype.
    ``t_cond`` (B,) indexes the Layered model's 2-way embedding, added to every half."""
    if zero_cond_t:
        t = torch.cat([t, t * 0])
    temb = L.mlp_embed(p["timestep_embedder"], timestep_proj(t).to(t.dtype))
    if t_cond is None:
        return temb
    extra = F.embedding(t_cond, p["addition_t_embedding"]["weight"]).to(temb.dtype)  # (B, C)
    return temb + extra.repeat(temb.shape[0] // extra.shape[0], 1)


def modulations(params, temb: torch.Tensor, batch: int) -> tuple[list, list, torch.Tensor]:
    """Every AdaLN modulation of the model (under TP two all-gathers for all): per block the
    image stream's (B or 2B, 6C) from temb (2B rows with ``zero_cond_t``) and the text
    stream's (B, 6C) from its first ``batch`` rows, and the final layer's (B, 2C)."""
    blocks = ordered_blocks(params, "transformer_blocks")
    img = L.modulations([(b["img_mod"]["1"], 6) for b in blocks], temb)
    *txt, out = L.modulations(
        [(b["txt_mod"]["1"], 6) for b in blocks] + [(params["norm_out"]["linear"], 2)], temb[:batch]
    )
    return img, txt, out


def img_modulation(mod: torch.Tensor, cond_rows: torch.Tensor | None) -> list[torch.Tensor]:
    """Six (shift, scale, gate) x 2 modulation tensors for the image stream, (B, 1, C), from
    its (B, 6C) modulation; with ``zero_cond_t`` that is (2B, 6C) and ``cond_rows`` (S_img, 1)
    picks the t = 0 half for reference tokens, giving (B, S_img, C)."""
    mods = [m[:, None] for m in mod.chunk(6, dim=-1)]
    if cond_rows is None:
        return mods
    B = mod.shape[0] // 2
    return [torch.where(cond_rows, m[B:], m[:B]) for m in mods]


def qkv(p, x, head_dim, names, norms):
    """Project to q, k, v (B, S, H, D); fp32-variance RMS norm on q and k over D."""
    q, k, v = (L.split_heads(y, head_dim) for y in L.linear_group([p[n] for n in names], x))
    return L.rms_norm_fp32(L.per_head(p[norms[0]]), q), L.rms_norm_fp32(L.per_head(p[norms[1]]), k), v


def joint_attention(p, img, txt, pe, head_dim, key_bias=None):
    """A block's attention module (diffusers' ``Attention`` with the double-stream
    processor) over the normalised, modulated streams: one attention over the joint [txt;
    img] sequence (diffusers' order); returns the image and text outputs after their own
    output projections (``to_out.0`` / ``to_add_out``)."""
    iq, ik, iv = qkv(p, img, head_dim, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
    tq, tk, tv = qkv(p, txt, head_dim, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"))
    cos, sin = pe
    q, k = (L.apply_rope(torch.cat(pair, 1), cos, sin) for pair in ((tq, iq), (tk, ik)))
    out = L.attention(q, k, torch.cat([tv, iv], 1), key_bias)  # (B, T + S, H*D)
    t_out, i_out = L.split_rows(out, txt.shape[1])
    return L.row_linears([(p["to_out"]["0"], i_out), (p["to_add_out"], t_out)])  # under TP: one all-reduce


def block(p, img, txt, img_mod, txt_mod, pe, head_dim, key_bias=None, cond_rows=None, attn=None):
    """MMDiT block: img (B, S, C), txt (B, T, C); its modulations (`modulations`) img_mod
    (B, 6C), or (2B, 6C) with ``cond_rows``, and txt_mod (B, 6C). ``attn``: None, or a
    function given the block's `joint_attention` as a function of no arguments, returning
    its outputs or a stand-in for them (where diffusers' attention-level caches hook,
    `functional_dit.pipelines.cache`); the attention output is (B, ...) either way, only
    the modulation around it reads ``cond_rows``."""
    i_shift, i_scale, i_gate, i_shift2, i_scale2, i_gate2 = img_modulation(img_mod, cond_rows)
    t_shift, t_scale, t_gate, t_shift2, t_scale2, t_gate2 = (m[:, None] for m in txt_mod.chunk(6, dim=-1))
    i_in, t_in = L.norm_modulate(img, i_shift, i_scale), L.norm_modulate(txt, t_shift, t_scale)
    module = lambda: joint_attention(p["attn"], i_in, t_in, pe, head_dim, key_bias)  # noqa: E731
    img_a, txt_a = module() if attn is None else attn(module)
    img, txt = L.gated(img, i_gate, img_a), L.gated(txt, t_gate, txt_a)
    i_ff, t_ff = L.gelu_mlps(
        [
            (p["img_mlp"], L.norm_modulate(img, i_shift2, i_scale2)),
            (p["txt_mlp"], L.norm_modulate(txt, t_shift2, t_scale2)),
        ]
    )
    img, txt = L.gated(img, i_gate2, i_ff), L.gated(txt, t_gate2, t_ff)
    return L.clip_fp16(img), L.clip_fp16(txt)


REGIONS = ("block",)  # compiled once and reused per layer (`nn.compile`)
SCANNED = ("transformer_blocks",)  # the segment `forward` runs through `nn.scan.layers`


def final_layer(p, x, mod):
    scale, shift = mod.chunk(2, dim=-1)  # note: (scale, shift) order
    return L.linear(p["proj_out"], L.norm_modulate(x, shift, scale))


def mask_bias(txt_mask: torch.Tensor) -> torch.Tensor:
    """(B, S_txt) 0/1 or bool mask -> additive fp32 key bias: 0 keep, -inf drop."""
    zero = torch.zeros((), dtype=torch.float32, device=txt_mask.device)
    return torch.where(txt_mask.bool(), zero, torch.full_like(zero, float("-inf")))


def ref_mask(shapes, device=None) -> torch.Tensor:
    """(S_img, 1) bool: True for tokens of the reference images (all but the first), the
    tokens ``zero_cond_t`` modulates with t = 0 (diffusers' ``modulate_index`` == 1)."""
    first = math.prod(shapes[0])
    n = sum(math.prod(s) for s in shapes)
    return (torch.arange(n, dtype=torch.int32, device=device) >= first)[:, None]  # int32: no int64 on neuron


# ----------------------------------------------------------------------------- validation


def _image_shapes(item, b: int) -> tuple[tuple[int, int, int], ...]:
    """One batch item's img_shapes: a list of (frames, h, w), or one (frames, h, w); the
    numbers may be numpy or 0-d tensor integers (read on the host, as diffusers does)."""
    as_shape = lambda s: as_ints(s) if isinstance(s, (list, tuple)) else s  # noqa: E731
    is_shape = lambda s: isinstance(s, tuple) and len(s) == 3 and all(is_int(v) and v > 0 for v in s)  # noqa: E731
    if isinstance(item, (list, tuple)) and len(item) == 3 and all(is_int(v) for v in as_shape(item)):
        item = [item]
    shapes = [as_shape(s) for s in item] if isinstance(item, (list, tuple)) else None
    if not shapes or not all(is_shape(s) for s in shapes):
        raise ValueError(
            f"img_shapes[{b}]: expected a non-empty list of (frames, height, width) tuples of positive ints, "
            f"got {item!r}"
        )
    return tuple(shapes)


def check_img_shapes(
    img_shapes, batch: int, seq: int, layer3d: bool, padded: bool = False
) -> tuple[tuple[int, int, int], ...]:
    """img_shapes: per batch item a list of (frames, h, w) in token order, equal for every
    item (diffusers takes RoPE from the first and warns that others are wrong), whose token
    count is x's sequence length; ``padded`` (an ``img_valid``): each row's own shapes, of at
    most that many tokens. Returns the first item's shapes; for an empty batch (no item to
    read them from), one image of 1 x 1 x seq, whose positions nothing uses."""
    if not isinstance(img_shapes, (list, tuple)) or len(img_shapes) != batch:
        got = f"length {len(img_shapes)}" if isinstance(img_shapes, (list, tuple)) else type(img_shapes).__name__
        raise ValueError(f"img_shapes: expected a list of {batch} items (one per batch item), got {got}")
    if batch == 0:
        return ((1, 1, seq),)
    per_item = [_image_shapes(item, b) for b, item in enumerate(img_shapes)]
    shapes = per_item[0]
    for b, s in enumerate(per_item):
        n = sum(math.prod(v) for v in s)
        if not padded and s != shapes:
            raise ValueError(
                f"img_shapes[{b}]: expected the same shapes as img_shapes[0] = {list(shapes)}, got {list(s)}"
            )
        if n != seq and not (padded and n < seq):
            raise ValueError(f"img_shapes: {list(s)} make {n} tokens; expected x's sequence length {seq}")
        if layer3d and s[-1][0] != 1:
            raise ValueError(f"img_shapes: use_layer3d_rope needs 1 frame in the last (condition) image, got {s[-1]}")
    return shapes


def _check_mask(txt_mask, batch: int, txt_len: int, device) -> None:
    check_tensor("txt_mask", txt_mask, (batch, txt_len), device=device)
    if txt_mask.dtype != torch.bool and (txt_mask.is_floating_point() or txt_mask.is_complex()):
        raise ValueError(
            f"txt_mask: expected a bool or integer 0/1 mask (1 = keep), got {txt_mask.dtype}; "
            "a floating mask is ambiguous (an additive 0/-inf bias would be read inverted)"
        )


def _check_t_cond(c, additional_t_cond, batch: int, device) -> None:
    if c.use_additional_t_cond and additional_t_cond is None:
        raise ValueError(
            f"additional_t_cond: this model has use_additional_t_cond=True and needs ({batch},) ints in {{0, 1}}"
        )
    if not c.use_additional_t_cond and additional_t_cond is not None:
        raise ValueError("additional_t_cond: this model has use_additional_t_cond=False; expected None, got a tensor")
    if additional_t_cond is not None:
        check_tensor("additional_t_cond", additional_t_cond, (batch,), device=device)
        if additional_t_cond.dtype not in (torch.int32, torch.int64):  # what an embedding lookup takes
            raise ValueError(f"additional_t_cond: expected int64 or int32 (0 or 1), got {additional_t_cond.dtype}")
        # A value check reads the tensor (a host sync): eager only, never inside a traced graph.
        if not torch.compiler.is_compiling() and bool(((additional_t_cond < 0) | (additional_t_cond > 1)).any()):
            raise ValueError(f"additional_t_cond: expected values in {{0, 1}}, got {additional_t_cond.tolist()}")


def _validate(params, x, t, txt, txt_mask, img_shapes, additional_t_cond, img_valid=None, rope=None):
    c = params.config
    leaf = reference_leaf(params, "img_in.weight")
    B, S = check_streams(c, leaf, x, t, txt)
    if txt_mask is not None:
        _check_mask(txt_mask, B, txt.shape[1], leaf.device)
    if img_shapes is None:
        raise ValueError(f"img_shapes: Qwen-Image needs per batch item a list of (frames, h, w); x has {S} tokens")
    per_row = isinstance(rope, (tuple, list)) and len(rope) == 2 and getattr(rope[0], "ndim", 0) == 3
    if img_valid is not None and (not per_row or c.zero_cond_t):
        raise ValueError("img_valid: rows padded to one length need rope, a (B, S_txt + S_img, head_dim) table per row")
    shapes = check_img_shapes(img_shapes, B, S, c.use_layer3d_rope, padded=img_valid is not None)
    _check_t_cond(c, additional_t_cond, B, leaf.device)
    return shapes


# of fd.apply's keywords, the ones Qwen-Image takes
ARGS = ("txt_mask", "img_shapes", "additional_t_cond", "rope", "img_valid", "controlnet_block_samples")
BATCHED = ("bias", "img_bias", "t_cond")  # of check_inputs' outputs, those split over "dp" with x, t, txt


def check_inputs(
    params,
    x,
    t,
    txt,
    *,
    txt_mask=None,
    img_shapes=None,
    additional_t_cond=None,
    rope=None,
    img_valid=None,
    controlnet_block_samples=None,
) -> dict:
    """Checks the Qwen-Image inputs (full view) and returns `forward`'s keywords: x (B,
    S_img, in_channels) packed latents (Edit: the target's then the reference images'
    tokens), t (B,) in [0, 1], txt (B, S_txt, joint_attention_dim), txt_mask (B, S_txt)
    bool/int, 1 = real token (None: all real), img_shapes per batch item a list of
    (frames, h, w) whose tokens make S_img, additional_t_cond (B,) ints in {0, 1} for the
    Layered model. ``rope``: the RoPE table (cos, sin) `pos_embed` builds from img_shapes
    and S_txt, each (S_txt + S_img, attention_head_dim) fp32, to build it once per sampling
    run, or (B, S_txt + S_img, attention_head_dim): one per row. ``img_valid`` (B, S_img),
    1 = real image token, with such a ``rope``: rows padded to one length (images of
    several sizes in one call, each row's img_shapes its own; padding is never attended
    to, its outputs are to be dropped; not with zero_cond_t). fd.apply returns (B, S_img,
    patch_size² · out_channels), as
    ``QwenImageTransformer2DModel(...)[0]``. The model has no guidance embedder
    (diffusers' ``guidance_embeds`` creates no weights), so ``guidance`` must be None.
    ``controlnet_block_samples``: ControlNet residuals, a list of (B, S_img, inner_dim)
    tensors, added to the image stream after the blocks as the stock class adds them
    (`nn.control.per_block`), e.g. what `functional_dit.controlnet.apply` returns."""
    c = params.config
    shapes = _validate(params, x, t, txt, txt_mask, img_shapes, additional_t_cond, img_valid, rope)
    if rope is None:
        pe = pos_embed(shapes, txt.shape[1], c.axes_dims_rope, c.use_layer3d_rope, x.device)
    else:
        rows = txt.shape[1] + x.shape[1]
        pe = check_rope(rope, rows, c.attention_head_dim, reference_leaf(params, "img_in.weight").device, x.shape[0])
    cond_rows = sharding.shard(ref_mask(shapes, x.device), "sp", 0) if c.zero_cond_t else None
    bias = None if txt_mask is None else mask_bias(txt_mask)
    control = None
    if controlnet_block_samples is not None:
        leaf = reference_leaf(params, "img_in.weight")
        samples = _control.check_samples(
            "controlnet_block_samples", controlnet_block_samples, (*x.shape[:2], c.inner_dim), leaf.dtype, leaf.device
        )
        control = _control.per_block(samples, len(ordered_blocks(params, "transformer_blocks")))
    img_bias = img_valid_bias(img_valid, *x.shape[:2], x.device)
    return dict(pe=pe, cond_rows=cond_rows, bias=bias, img_bias=img_bias, t_cond=additional_t_cond, controlnet=control)


prepare = check_inputs  # the old name, kept (not to confuse with fd.prepare)


def stages(
    params, x, t, txt, *, pe, cond_rows, bias, t_cond, img_bias=None, blocks=None, controlnet=None
) -> _stages.Stages:
    """The model on this rank's batch as `nn.stages.Stages`: the embedded (img, txt)
    streams, the blocks, the final layer. ``blocks``: the block function as a compile
    region (`nn.compile.regions`, passed by the api); None: this module's.
    ``controlnet``: the residual after each block. ``img_bias``: the padding's key bias."""
    run_block = block if blocks is None else blocks.block
    c = params.config
    img = L.linear(params["img_in"], x)
    temb = time_embed(params["time_text_embed"], t.to(img.dtype), t_cond, c.zero_cond_t)
    txt = L.linear(params["txt_in"], L.rms_norm_fp32(params["txt_norm"], txt))
    txt, img, pe, key_bias = L.shard_joint(txt, img, pe, bias, img_bias)
    img_mods, txt_mods, out_mod = modulations(params, temb, img.shape[0])
    ctx = dict(img_mods=img_mods, txt_mods=txt_mods, out_mod=out_mod, pe=pe, bias=key_bias, cond_rows=cond_rows)
    per_layer = ("img_mods", "txt_mods")
    if controlnet is not None:
        ctx["res"], per_layer = _control.local(controlnet), (*per_layer, "res")
    seg = _stages.Segment(
        "transformer_blocks", _block, per_layer, ("pe", "bias", "cond_rows"), (run_block, c.attention_head_dim),
        attention="transformer_blocks.{}.attn",
    )  # fmt: skip
    final = lambda img, k: final_layer(params, img, k["out_mod"])  # noqa: E731
    # with zero_cond_t the image modulations are (2B, 6C) = [mod(t); mod(0)]: two halves
    batched, halved = ("txt_mods", "out_mod", "bias", "res"), ("img_mods",) if c.zero_cond_t else ()
    if not c.zero_cond_t:
        batched = (*batched, "img_mods")
    image = lambda streams: streams[0]  # noqa: E731
    return _stages.Stages(params, (img, txt), (seg,), ctx, final, image, txt.shape[1], x.shape[1], batched, halved)


def forward(params, x, t, txt, **inputs):
    """The model on this rank's batch (`stages`, run): returns (out sharded over "sp", its
    full length, None)."""
    out, _ = stages(params, x, t, txt, **inputs).forward()
    return out, x.shape[1], None


def _block(carry, p, mods, ctx, static):
    """One block as a `nn.scan.layers` step: carry (img, txt); a third entry of ``mods`` is
    a ControlNet residual added to the image stream after the block. ``ctx["hook"]``: the
    attention module's hook (the plain block function then runs, with it)."""
    fn, D = static
    kw = {}
    if ctx.get("hook") is not None:
        fn, kw = block, {"attn": ctx["hook"]}
    img, txt = fn(p, *carry, *mods[:2], ctx["pe"], D, ctx["bias"], ctx["cond_rows"], **kw)
    return (img if len(mods) == 2 else img + mods[2]), txt

"""FLUX.2 (dev, klein 4B, klein 9B) as pure functions over a parameter tree.

Mirrors diffusers' ``Flux2Transformer2DModel`` (``transformer_flux2.py``) and Black
Forest Labs' ``flux2/model.py``: double-stream (MMDiT) blocks and parallel single-stream
blocks whose AdaLN modulation is computed once from the timestep (and guidance) and
shared by every block, SwiGLU MLPs, fused ``to_qkv_mlp_proj`` / ``to_out`` projections in
the single blocks, 4-axis RoPE over (txt; img) ids, and no biases anywhere.

FLUX.2-klein image editing can cache the reference image tokens' keys and values
(``kv_cache="extract"`` / ``kv_cache=cache``); the cache type and its checks live in
`flux2_kv`, the block maths that use it here.

`double_attention` and `parallel_attention` are the stock attention modules
(``Flux2Attention``, ``Flux2ParallelSelfAttention``); the blocks call them through an
``attn`` hook where diffusers' attention-level caches hook them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

import sharding

from . import flux2_kv as kv
from .configs import (
    DiTConfig,
    Pipeline,
    as_ints,
    require,
    require_bool,
    require_non_negative,
    require_positive,
    require_positive_number,
    require_positive_or_none,
    require_rope_axes,
)
from .flux2_kv import Ref
from .nn import layers as L
from .nn import stages as _stages
from .nn.checks import (
    check_guidance,
    check_ids,
    check_rope,
    check_rope_or_ids,
    check_streams,
    img_valid_bias,
    reference_leaf,
)
from .params import MOD3, MOD6, MOD_OUT, PACKED, Segment, linear_spec, mod_spec, norm_spec, ordered_blocks, units

DIFFUSERS_CLASS = "Flux2Transformer2DModel"
NAME = "FLUX.2"
KEY = "flux2"  # the family in code: fd.sample, the adapter, the tiny pipelines, bench


@dataclasses.dataclass(frozen=True)
class Flux2Config(DiTConfig):
    """diffusers ``Flux2Transformer2DModel`` config; defaults are FLUX.2-dev's."""

    patch_size: int = 1
    in_channels: int = 128  # 32 VAE channels x 2x2 packed patches
    out_channels: int | None = None  # None: same as in_channels
    num_layers: int = 8  # double-stream blocks
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360  # 3 stacked text-encoder layers x hidden size
    timestep_guidance_channels: int = 256  # sinusoidal embedding width
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)  # (t, h, w, l) share of head_dim
    rope_theta: int = 2000
    eps: float = 1e-6
    guidance_embeds: bool = True  # True for the guidance-distilled dev model

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", as_ints(self.axes_dims_rope))
        require_positive(
            self,
            "patch_size",
            "in_channels",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "timestep_guidance_channels",
        )
        require(
            self.timestep_guidance_channels % 2 == 0,
            f"Flux2Config.timestep_guidance_channels: expected an even int, got {self.timestep_guidance_channels}",
        )
        require_positive_or_none(self, "out_channels")
        require_non_negative(self, "num_layers", "num_single_layers")
        require_positive_number(self, "mlp_ratio", "rope_theta", "eps")
        require(
            self.mlp_hidden_dim > 0, f"Flux2Config: int(inner_dim * mlp_ratio) = {self.mlp_hidden_dim}, expected > 0"
        )
        require_bool(self, "guidance_embeds")
        require_rope_axes(self)

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.inner_dim * self.mlp_ratio)  # as diffusers: int(dim * mlp_ratio)

    def param_specs(self) -> dict:
        """Nested dict of `ParamSpec` (the protocol `sharding.plan` reads specs by)."""
        return param_specs(self)


kv.register_pytree(Flux2Config)

# Every released transformer: patch_size 1, in_channels 128 (32-channel AutoencoderKLFlux2
# latents packed 2x2), head_dim 128, mlp_ratio 3, 4-axis RoPE (32, 32, 32, 32) with theta
# 2000, eps 1e-6 - BFL flux2 src/flux2/model.py (Flux2Params, Klein9BParams, Klein4BParams)
# and the diffusers defaults. joint_attention_dim = 3 stacked hidden states of the text
# encoder (diffusers pipelines/flux2: Mistral-Small-3 layers (10, 20, 30) x 5120 for dev,
# Qwen3 layers (9, 18, 27) x hidden size for klein).
PRESETS = {
    # black-forest-labs/FLUX.2-dev: 8 double + 48 single blocks, 48 heads (6144 wide),
    # Mistral-Small-3.1 text (3 x 5120). Guidance-distilled: Flux2Pipeline passes
    # guidance=guidance_scale to the transformer, BFL use_guidance_embed=True. 32.2B params.
    "flux2-dev": Flux2Config(),
    # black-forest-labs/FLUX.2-klein-4B (and -base-4B): 5 double + 20 single blocks, 24 heads
    # (3072 wide), Qwen3-4B text (3 x 2560 = 7680). Flux2KleinPipeline always passes
    # guidance=None (CFG or step distillation, no embedded guidance): BFL use_guidance_embed=False.
    "flux2-klein-4b": Flux2Config(
        num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680, guidance_embeds=False
    ),
    # black-forest-labs/FLUX.2-klein-9B (and -base-9B, -9b-kv): 8 double + 24 single blocks,
    # 32 heads (4096 wide), Qwen3-8B text (3 x 4096 = 12288); guidance=None as above.
    "flux2-klein-9b": Flux2Config(
        num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288, guidance_embeds=False
    ),
    # A tiny guidance-distilled model for tests and the offline demo: 4 heads so TP up to 4.
    "flux2-tiny": Flux2Config(
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=40,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,
    ),
}

CONFIG = Flux2Config
TINY = "flux2-tiny"  # the preset tests and the offline tiny pipelines start from
# The released weights of the presets on the Hugging Face Hub (`generate` reads the local cache only).
REPOS = {
    "flux2-dev": "black-forest-labs/FLUX.2-dev",
    "flux2-klein-4b": "black-forest-labs/FLUX.2-klein-4B",
    "flux2-klein-9b": "black-forest-labs/FLUX.2-klein-9B",
}
# The stock diffusers pipelines that run this transformer (see `configs.Pipeline`).
PIPELINES = (
    Pipeline("Flux2Pipeline", tiny="flux2", sample=True),
    Pipeline("Flux2KleinPipeline", tiny="flux2-klein", sample=True),
    Pipeline("Flux2KleinKVPipeline", tiny="flux2-klein-kv", sample=True),
    Pipeline("Flux2KleinInpaintPipeline", sample=True),  # from_pipe of the tiny klein
)


# ----------------------------------------------------------------------------- specs

_lin = functools.partial(linear_spec, bias=False)  # FLUX.2 has no biases anywhere


def _swiglu_specs(c) -> dict:
    n, m = c.inner_dim, c.mlp_hidden_dim
    gate_up = (Segment("gate", m, "mlp"), Segment("up", m, "mlp"))
    return {
        "linear_in": _lin(2 * m, n, PACKED, "embed", blocks=gate_up),
        "linear_out": _lin(n, m, "embed", "mlp"),
    }


def _double_block_specs(c) -> dict:
    D, n = c.attention_head_dim, c.inner_dim
    col, row = _lin(n, n, "heads", "embed"), _lin(n, n, "embed", "heads")
    attn = {"to_q": col, "to_k": col, "to_v": col, "norm_q": norm_spec(D), "norm_k": norm_spec(D), "to_out": {"0": row}}
    attn |= {"norm_added_q": norm_spec(D), "norm_added_k": norm_spec(D)}
    attn |= {"add_q_proj": col, "add_k_proj": col, "add_v_proj": col, "to_add_out": row}
    return {"attn": attn, "ff": _swiglu_specs(c), "ff_context": _swiglu_specs(c)}


def _single_block_specs(c) -> dict:
    D, n, m = c.attention_head_dim, c.inner_dim, c.mlp_hidden_dim
    # Both fused dims cut into equal units of g = gcd(n, m) rows, so each shards as one
    # strided DTensor; the two are cut alike, so the heads and the hidden units a rank
    # holds agree between them (units, docs/architecture.md).
    g = math.gcd(n, m)
    mlp = (Segment("mlp_gate", m, "mlp"), Segment("mlp_up", m, "mlp"))
    qkv_mlp = tuple(Segment(b, n, "heads") for b in "qkv") + mlp
    qkv_mlp = units(qkv_mlp, g)
    attn_mlp = units((Segment("attn", n, "heads"), Segment("mlp", m, "mlp")), g)  # to_out consumes cat([attn, mlp])
    return {
        "attn": {
            "to_qkv_mlp_proj": _lin(3 * n + 2 * m, n, PACKED, "embed", blocks=qkv_mlp),
            "norm_q": norm_spec(D),
            "norm_k": norm_spec(D),
            "to_out": _lin(n, n + m, "embed", PACKED, blocks=attn_mlp),
        }
    }


def param_specs(c: Flux2Config) -> dict:
    """Nested dict of `ParamSpec` in diffusers ``state_dict`` order; allocates nothing."""
    n, f = c.inner_dim, c.timestep_guidance_channels
    emb = {
        "linear_1": _lin(n, f, "embed", "freq"),
        "linear_2": _lin(n, n, "embed", "embed"),
    }
    time = {"timestep_embedder": emb, **({"guidance_embedder": emb} if c.guidance_embeds else {})}
    return {
        "time_guidance_embed": time,
        "double_stream_modulation_img": {"linear": mod_spec(n, MOD6, bias=False)},
        "double_stream_modulation_txt": {"linear": mod_spec(n, MOD6, bias=False)},
        "single_stream_modulation": {"linear": mod_spec(n, MOD3, bias=False)},
        "x_embedder": _lin(n, c.in_channels, "embed", "channels"),
        "context_embedder": _lin(n, c.joint_attention_dim, "embed", "txt_embed"),
        "transformer_blocks": {str(i): _double_block_specs(c) for i in range(c.num_layers)},
        "single_transformer_blocks": {str(i): _single_block_specs(c) for i in range(c.num_single_layers)},
        "norm_out": {"linear": mod_spec(n, MOD_OUT, bias=False)},
        "proj_out": _lin(c.out_dim, n, "out_channels", "embed"),
    }


# Projections that read the same input, fused into one matmul by `fd.prepare` (BFL's
# qkv layout; the single blocks' to_qkv_mlp_proj is fused already).
FUSED = {
    "transformer_blocks": [
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ],
}


# ----------------------------------------------------------------------------- forward


def time_guidance_embed(p, t, guidance, channels: int) -> torch.Tensor:
    """temb (B, C) = MLP(sin(t)) [+ MLP(sin(guidance))]; t and guidance already x 1000."""
    temb = L.mlp_embed(p["timestep_embedder"], L.timestep_embedding(t, channels).to(t.dtype))
    if guidance is None:
        return temb
    return temb + L.mlp_embed(p["guidance_embedder"], L.timestep_embedding(guidance, channels).to(guidance.dtype))


def modulations(params, temb):
    """The shared modulation vectors (B, C): 6 for the img and 6 for the txt stream of the
    double blocks, (shift, scale, gate) x (attn, mlp); 3 for the single blocks."""
    names, ns = ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation"), (6, 6, 3)
    mods = L.modulations([(params[name]["linear"], n) for name, n in zip(names, ns)], temb)  # one all-gather
    return tuple(m.chunk(n, dim=-1) for m, n in zip(mods, ns))


swiglu = L.swiglu  # the MLP activation, ``silu(gate) * up`` (an old name, kept)


def feed_forward(p, x: torch.Tensor) -> torch.Tensor:
    """diffusers ``Flux2FeedForward``: ``linear_out(swiglu(linear_in(x)))``."""
    return L.row_linear(p["linear_out"], _ff_hidden(p, x))


def _ff_hidden(p, x: torch.Tensor) -> torch.Tensor:
    """``swiglu(linear_in(x))``, ``linear_in``'s rows [gate; up] (each rank holds its slice of both halves)."""
    m = p["linear_in"]["weight"].shape[0] // 2
    return L.swiglu(*L.col_linear_split(p["linear_in"], x, [m, m]))


_IMG = (("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
_TXT = (("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"))


def _stream_qkv(a, h, head_dim, eps, names):
    """One stream of a double block: q, k, v (B, S, H, D) of its normalised, modulated rows
    ``h``, q and k RMS-normalised."""
    proj, norms = names
    q, k, v = (L.split_heads(y, head_dim) for y in L.linear_group([a[n] for n in proj], h))
    return L.rms_norm(L.per_head(a[norms[0]]), q, eps), L.rms_norm(L.per_head(a[norms[1]]), k, eps), v


def _streams_out(streams, eps):
    """Per stream ``(x, attn, mod, p_ff)``, ``attn`` its attention output after the output
    projection: the gated residual attention output, then the gated residual SwiGLU MLP.
    The streams go side by side, so under TP their MLP output projections are one
    all-reduce (`L.row_linears`)."""
    xs = [L.gated(x, mod[2][:, None], y) for x, y, mod, _ in streams]
    hs = [_ff_hidden(p_ff, L.norm_modulate(x, mod[3], mod[4], eps)) for x, (_, _, mod, p_ff) in zip(xs, streams)]
    ys = L.row_linears([(p_ff["linear_out"], h) for h, (*_, p_ff) in zip(hs, streams)])
    return [L.gated(x, mod[5][:, None], y) for x, (_, _, mod, _), y in zip(xs, streams, ys)]


def _attend(q, k, v, T: int, key_bias, ref: Ref | None):
    """Joint attention of the (txt; img) queries whose first T rows are text; with ``ref``
    their keys/values sit between txt and img, diffusers' (txt; ref; img) layout."""
    if ref is None:
        return L.attention(q, k, v, key_bias)
    k, v = (torch.cat([a[:, :T], r, a[:, T:]], 1) for a, r in ((k, ref.k), (v, ref.v)))
    if key_bias is not None or ref.bias is not None:
        B, S, R = q.shape[0], q.shape[1], ref.k.shape[1]
        main = torch.zeros(B, S, device=q.device) if key_bias is None else key_bias
        rb = torch.zeros(B, R, device=q.device) if ref.bias is None else ref.bias
        key_bias = torch.cat([main[:, :T], rb, main[:, T:]], 1)
    return L.attention(q, k, v, key_bias)


def _rope_qk(q, k, pe):
    return L.apply_rope(q, *pe), L.apply_rope(k, *pe)


def _ref_rows(ref: Ref | None, eps):
    """The reference tokens' normalised, modulated rows (extract mode), else None."""
    return None if ref is None or ref.x is None else L.norm_modulate(ref.x, ref.mod[0], ref.mod[1], eps)


def _check_computed(ref_h, ref_out: list) -> None:
    """Extract mode (``ref_h``, the reference rows) needs the attention module computed:
    its reference keys and values come from it (an attention hook that reused an output)."""
    if ref_h is not None and not ref_out:
        raise ValueError("attn: extracting the reference KV cache needs the attention computed; the hook reused it")


def _double_attention(a, img, txt, pe, head_dim, eps, key_bias, ref: Ref | None, ref_h):
    """`double_attention` with reference KV: ``ref_h`` the reference tokens' rows (extract)
    or None, ``ref`` their `Ref` (cached keys/values) or None. Returns the outputs [img,
    txt(, ref)] after their output projections (under TP one all-reduce for all) and
    ``ref`` with its k, v."""
    T = txt.shape[1]
    tq, tk, tv = _stream_qkv(a, txt, head_dim, eps, _TXT)
    iq, ik, iv = _stream_qkv(a, img, head_dim, eps, _IMG)
    q, k = _rope_qk(torch.cat([tq, iq], 1), torch.cat([tk, ik], 1), pe)
    extra = []
    if ref_h is not None:
        rq, rk, rv = _stream_qkv(a, ref_h, head_dim, eps, _IMG)
        rq, rk = _rope_qk(rq, rk, ref.pe)
        ref, extra = ref._replace(k=rk, v=rv), [(a["to_out"]["0"], L.attention(rq, rk, rv, ref.bias))]
    out = _attend(q, k, torch.cat([tv, iv], 1), T, key_bias, ref)
    return L.row_linears([(a["to_out"]["0"], out[:, T:]), (a["to_add_out"], out[:, :T]), *extra]), ref


def double_attention(a, img, txt, pe, head_dim, eps=1e-6, key_bias=None):
    """A double block's attention module (diffusers' ``Flux2Attention``) over the
    normalised, modulated streams img (B, S, C) and txt (B, T, C): q, k, v per stream, one
    joint attention over (txt; img), each stream's output projection. Returns (img_attn,
    txt_attn)."""
    return tuple(_double_attention(a, img, txt, pe, head_dim, eps, key_bias, None, None)[0])


def double_block(
    p, img, txt, mod_img, mod_txt, pe, head_dim, eps=1e-6, key_bias=None, ref: Ref | None = None, attn=None
):
    """MMDiT block with shared modulation: separate weights per stream, one joint attention
    over (txt; img). Reference tokens (extract) go through the img weights with their own
    modulation and attend only to themselves. Returns img, txt and ref (with its k, v).
    ``attn``: None, or a function given the block's attention module (`double_attention`,
    with ``ref`` its reference keys and values) as a function of no arguments, returning
    its (img, txt) outputs or a stand-in for them (where diffusers' attention-level caches
    hook, `functional_dit.pipelines.cache`); extracting (``ref.x`` given) needs it computed."""
    h_img, h_txt = L.norm_modulate(img, *mod_img[:2], eps), L.norm_modulate(txt, *mod_txt[:2], eps)
    ref_h = _ref_rows(ref, eps)
    if attn is None:
        (i_attn, t_attn, *r_attn), ref = _double_attention(
            p["attn"], h_img, h_txt, pe, head_dim, eps, key_bias, ref, ref_h
        )
    else:  # the hook gets the module; the reference rows' output and k, v come out beside it
        box = {"ref": ref, "rest": []}

        def module():
            (i_out, t_out, *rest), box["ref"] = _double_attention(
                p["attn"], h_img, h_txt, pe, head_dim, eps, key_bias, ref, ref_h
            )
            box["rest"] = rest
            return i_out, t_out

        i_attn, t_attn = attn(module)
        _check_computed(ref_h, box["rest"])
        ref, r_attn = box["ref"], box["rest"]
    streams = [(img, i_attn, mod_img, p["ff"]), (txt, t_attn, mod_txt, p["ff_context"])]
    if r_attn:
        streams.append((ref.x, r_attn[0], ref.mod, p["ff"]))
    img, txt, *rest = _streams_out(streams, eps)
    if rest:
        ref = ref._replace(x=rest[0])
    return img, L.clip_fp16(txt), ref


def _single_in(a, h, head_dim, eps):
    """The fused projection of the normalised, modulated rows ``h`` to q, k, v (B, S, H, D)
    and the MLP input.

    The local rows are [q, k, v, gate, up] = 3n + 2m and ``to_out``'s local columns
    n + m, so this rank's width n of q is read off the two shapes (TP-agnostic). Returns
    q, k, v and the MLP's (gate, up).
    """
    n = a["to_qkv_mlp_proj"]["weight"].shape[0] - 2 * a["to_out"]["weight"].shape[1]
    m = a["to_out"]["weight"].shape[1] - n
    qkv, gate, up = L.col_linear_split(a["to_qkv_mlp_proj"], h, [3 * n, m, m])
    q, k, v = (L.split_heads(t, head_dim) for t in qkv.chunk(3, dim=-1))
    q, k = L.rms_norm(L.per_head(a["norm_q"]), q, eps), L.rms_norm(L.per_head(a["norm_k"]), k, eps)
    return q, k, v, (gate, up)


def _single_proj(a, attn, mlp):
    """``to_out`` over [attn, swiglu(mlp)] (BFL's ``linear2``)."""
    return L.row_linear_cat(a["to_out"], [attn, L.swiglu(*mlp)])


def _parallel_attention(a, h, pe, head_dim, eps, key_bias, txt_len, ref: Ref | None, ref_h):
    """`parallel_attention` with reference KV (``ref``, ``ref_h`` as in `_double_attention`):
    returns its output, the reference rows' output (or None) and ``ref`` with its k, v."""
    q, k, v, mlp = _single_in(a, h, head_dim, eps)
    q, k = _rope_qk(q, k, pe)
    ref_out = None
    if ref_h is not None:
        rq, rk, rv, rmlp = _single_in(a, ref_h, head_dim, eps)
        rq, rk = _rope_qk(rq, rk, ref.pe)
        ref, ref_out = ref._replace(k=rk, v=rv), L.attention(rq, rk, rv, ref.bias)
    out = _single_proj(a, _attend(q, k, v, txt_len, key_bias, ref), mlp)
    return out, None if ref_out is None else _single_proj(a, ref_out, rmlp), ref


def parallel_attention(a, h, pe, head_dim, eps=1e-6, key_bias=None, txt_len=0):
    """A single block's attention module (diffusers' ``Flux2ParallelSelfAttention``) over the
    normalised, modulated joint rows h (B, S, C): the fused q, k, v + MLP input projection,
    the joint attention, SwiGLU, and ``to_out`` over [attn, mlp]."""
    return _parallel_attention(a, h, pe, head_dim, eps, key_bias, txt_len, None, None)[0]


def single_block(p, x, mod, pe, head_dim, eps=1e-6, key_bias=None, txt_len=0, ref: Ref | None = None, attn=None):
    """Parallel attention + SwiGLU MLP over the joint (txt; img) sequence x (B, S, C).
    ``txt_len`` (the local text rows) places reference keys between txt and img. ``attn``
    as in `double_block`, given the block's `parallel_attention`."""
    a, (shift, scale, gate) = p["attn"], mod
    h = L.norm_modulate(x, shift, scale, eps)
    ref_h = _ref_rows(ref, eps)
    if attn is None:
        y, ref_y, ref = _parallel_attention(a, h, pe, head_dim, eps, key_bias, txt_len, ref, ref_h)
    else:  # as in `double_block`
        box = {"ref": ref, "rest": []}

        def module():
            out, ref_out, box["ref"] = _parallel_attention(a, h, pe, head_dim, eps, key_bias, txt_len, ref, ref_h)
            box["rest"] = [] if ref_out is None else [ref_out]
            return out

        y = attn(module)
        _check_computed(ref_h, box["rest"])
        ref, ref_y = box["ref"], (box["rest"] or [None])[0]
    out = L.clip_fp16(L.gated(x, gate[:, None], y))
    if ref_y is not None:
        ref = ref._replace(x=L.clip_fp16(L.gated(ref.x, ref.mod[2][:, None], ref_y)))
    return out, ref


REGIONS = ("double_block", "single_block")  # compiled once and reused per layer (`nn.compile`)
SCANNED = ("transformer_blocks", "single_transformer_blocks")  # `forward` scans them without reference KV


def final_layer(p, x, temb, eps=1e-6):
    scale, shift = L.adaln(p["norm_out"]["linear"], temb, 2)  # note: (scale, shift) order
    return L.linear(p["proj_out"], L.norm_modulate(x, shift, scale, eps))


# ----------------------------------------------------------------------------- validation


def _validate(params, x, t, txt, guidance, img_ids, txt_ids, rope=None):
    """Returns the RoPE table of the (txt; img) rows, and the reference leaf."""
    c = params.config
    leaf = reference_leaf(params, "x_embedder.weight")
    B, S = check_streams(c, leaf, x, t, txt)
    check_guidance(c, guidance, B, leaf.device)
    if rope is not None:
        check_rope_or_ids(rope, img_ids=img_ids, txt_ids=txt_ids)
        T = txt.shape[1]
        return check_rope(rope, T + S, c.attention_head_dim, leaf.device, batch=B), leaf
    n_axes = len(c.axes_dims_rope)
    for name, ids, n in (("img_ids", img_ids, S), ("txt_ids", txt_ids, txt.shape[1])):
        if ids is None:
            raise ValueError(f"{name}: FLUX.2 needs position ids of shape ({n}, {n_axes}) or ({B}, {n}, {n_axes})")
    img_ids = check_ids("img_ids", img_ids, S, n_axes, B, leaf.device)
    txt_ids = check_ids("txt_ids", txt_ids, txt.shape[1], n_axes, B, leaf.device)
    pe_txt, pe_img = (L.rope(ids, c.axes_dims_rope, theta=c.rope_theta) for ids in (txt_ids, img_ids))
    return tuple(torch.cat([a, b]) for a, b in zip(pe_txt, pe_img)), leaf


def rope_table(config: Flux2Config, img_ids, txt_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) table `check_inputs` builds from 2-D ids: (S_txt + S_img, attention_head_dim)
    fp32, txt rows first (with reference tokens, img_ids holds their rows too)."""
    pe_txt, pe_img = (L.rope(ids, config.axes_dims_rope, theta=config.rope_theta) for ids in (txt_ids, img_ids))
    return tuple(torch.cat([a, b]) for a, b in zip(pe_txt, pe_img))


# ----------------------------------------------------------------------------- apply


def _ref_stream(params, x, pe, t, guidance, ref_fixed_timestep):
    """Extract mode: the reference tokens x (B, R, in_channels) as a `Ref` in the local view,
    modulated at the fixed timestep (diffusers: t = ref_fixed_timestep, same guidance);
    also returns their single-block modulation."""
    temb = time_guidance_embed(
        params["time_guidance_embed"],
        torch.full_like(t, ref_fixed_timestep * 1000),
        guidance,
        params.config.timestep_guidance_channels,
    )
    mod_img, _, mod_single = modulations(params, temb)
    bias = sharding.pad_bias(x.shape[1], "sp", x.device)
    x = sharding.shard(L.linear(params["x_embedder"], x), "sp", 1)
    pe = tuple(sharding.shard(a, "sp", a.ndim - 2) for a in pe)  # a (R, D) table, or (B, R, D): one per row
    return Ref(x=x, mod=mod_img, pe=pe, bias=None if bias is None else bias.expand(x.shape[0], -1)), mod_single


class _RefRun:
    """The reference stream through the blocks (reference KV: extract or cached): the
    running `Ref`, the single blocks' reference modulation, and each block's `Ref`
    (``refs``, what an extract pass returns as its cache). Mutable, one per call."""

    def __init__(self, ref, mod_single):
        self.ref, self.mod_single, self.refs = ref, mod_single, {}


def _double(carry, p, layer, ctx, static):
    """One double block as a `nn.scan.layers` step: carry (img, txt); with reference KV
    (``ctx["ref"]``, not scanned) ``layer`` is its cached `Ref` (or None: extract) and name.
    ``ctx["hook"]``: the attention module's hook (the plain block function then runs)."""
    fn, _, D, eps, _ = static
    run, kw = ctx.get("ref"), {}
    if ctx.get("hook") is not None:
        fn, kw = double_block, {"attn": ctx["hook"]}
    ref = None if run is None else layer[0] if layer[0] is not None else run.ref
    img, txt, ref = fn(p, *carry, ctx["mod_img"], ctx["mod_txt"], ctx["pe"], D, eps, ctx["bias"], ref, **kw)
    if run is not None:
        run.ref, run.refs[layer[1]] = ref, ref
    return img, txt


def _single(carry, p, layer, ctx, static):
    """One single block as a `nn.scan.layers` step: carry ((txt; img),); with reference KV
    as `_double` (an extracted reference stream takes the single blocks' modulation)."""
    _, fn, D, eps, T = static
    run, kw = ctx.get("ref"), {}
    if ctx.get("hook") is not None:
        fn, kw = single_block, {"attn": ctx["hook"]}
    ref = None
    if run is not None and layer[0] is not None:
        ref = layer[0]
    elif run is not None and run.ref is not None and run.ref.x is not None:
        ref = run.ref._replace(mod=run.mod_single)
    x, ref = fn(p, carry[0], ctx["mod_single"], ctx["pe"], D, eps, ctx["bias"], T, ref, **kw)
    if run is not None:
        run.ref, run.refs[layer[1]] = ref, ref
    return (x,)


ARGS = ("guidance", "img_ids", "txt_ids", "rope", "img_valid", "kv_cache", "num_ref_tokens", "ref_fixed_timestep")
BATCHED = ("guidance", "img_bias")  # of check_inputs' outputs, those split over "dp" with x, t, txt


def check_inputs(
    params,
    x,
    t,
    txt,
    *,
    img_ids=None,
    txt_ids=None,
    guidance=None,
    kv_cache=None,
    num_ref_tokens=None,
    ref_fixed_timestep=None,
    rope=None,
    img_valid=None,
) -> dict:
    """Checks the FLUX.2 inputs (full view) and returns `forward`'s keywords: x (B, S_img,
    in_channels), t (B,) in [0, 1], txt (B, S_txt, joint_attention_dim), guidance (B,) when
    the model is guidance-distilled, img_ids (S_img, 4) / txt_ids (S_txt, 4) or their 3-D
    forms (B or 1, S, 4), of which, like diffusers, only the first item is used. fd.apply
    returns (B, S_img, patch_size² · out_channels) as ``Flux2Transformer2DModel(...)[0]``.

    Reference-token KV cache (FLUX.2-klein editing, diffusers' ``kv_cache_mode``):
    ``kv_cache="extract", num_ref_tokens=R, ref_fixed_timestep=0.0``: the first R tokens of
    x (and rows of img_ids) are reference tokens, modulated at the fixed timestep and
    attending only to themselves; fd.apply returns ``(out, cache)`` with out over the other
    tokens and cache a `Flux2KVCache`. ``kv_cache=cache``: x holds no reference tokens;
    every block's txt and img queries also attend to the cached reference keys and values.

    ``rope``: instead of the ids, their RoPE table (cos, sin), each (S_txt + S_img,
    attention_head_dim) fp32 with S_img counting x's rows (reference tokens included), as
    `rope_table` builds it (to build it once per sampling run), or (B, S_txt + S_img,
    attention_head_dim): one per row.

    ``img_valid`` (B, S_img) over x's rows, 1 = a real token: rows padded to one length
    (images of several sizes, and their reference tokens, in one call, each row with its own
    ``rope``; padding is never attended to, and its outputs are to be dropped). With the
    reference KV cache the reference tokens are never padded (the cache holds no mask):
    on an extract pass ``img_valid``'s first R columns must all be 1; a cached pass's
    ``img_valid`` covers its img tokens only.
    """
    pe, leaf = _validate(params, x, t, txt, guidance, img_ids, txt_ids, rope)
    c = params.config
    mode = kv.check_mode(c, x, kv_cache, num_ref_tokens, ref_fixed_timestep, leaf)
    img_bias = img_valid_bias(img_valid, *x.shape[:2], leaf.device)
    if mode == "extract" and img_bias is not None and bool(img_bias[:, :num_ref_tokens].isinf().any()):
        raise ValueError(
            f"img_valid: with kv_cache='extract' the first num_ref_tokens={num_ref_tokens} columns (the "
            "reference tokens, whose cache holds no mask) must all be 1; rows with references of several "
            "lengths take one call per length"
        )
    return dict(
        guidance=guidance,
        img_bias=img_bias,
        pe=pe,
        num_ref_tokens=num_ref_tokens if mode == "extract" else 0,
        ref_fixed_timestep=ref_fixed_timestep or 0.0,
        cache=kv_cache if mode == "cached" else None,
        batch=x.shape[0],
    )


prepare = check_inputs  # the old name, kept (not to confuse with fd.prepare)


def stages(
    params, x, t, txt, *, guidance, pe, num_ref_tokens, ref_fixed_timestep, cache, batch, img_bias=None, blocks=None
) -> _stages.Stages:
    """The model on this rank's batch as `nn.stages.Stages`: the embedded (img, txt)
    streams, the double then the single blocks, the final layer; with reference KV (an
    extract pass, or a cache) the blocks also read and write the reference stream, and
    ``extra`` gives the extracted `Flux2KVCache`. ``blocks``: the block functions as
    compile regions (`nn.compile.regions`, passed by the api); None: this module's.
    ``pe``: the (txt; x) RoPE table; ``img_bias``: the padding's key bias over x's rows
    (`check_inputs`' ``img_valid``)."""
    c, R = params.config, num_ref_tokens
    t, guidance = t.to(x.dtype) * 1000, None if guidance is None else guidance.to(x.dtype) * 1000
    temb = time_guidance_embed(params["time_guidance_embed"], t, guidance, c.timestep_guidance_channels)
    ref = ref_mod_single = None
    if R:  # x's first R rows (and the table's after the text) are the reference tokens
        T = txt.shape[1]
        ref_pe = tuple(a[..., T : T + R, :] for a in pe)
        ref, ref_mod_single = _ref_stream(params, x[:, :R], ref_pe, t, guidance, ref_fixed_timestep)
        x, pe = x[:, R:], tuple(torch.cat([a[..., :T, :], a[..., T + R :, :]], -2) for a in pe)
        img_bias = None if img_bias is None else img_bias[:, R:]  # the references: all real (`check_inputs`)
    img, txt = L.linear(params["x_embedder"], x), L.linear(params["context_embedder"], txt)
    txt, img, pe, key_bias = L.shard_joint(txt, img, pe, None, img_bias)
    mod_img, mod_txt, mod_single = modulations(params, temb)
    double, single, kv_mode = double_block, single_block, ref is not None or cache is not None
    if blocks is not None and not kv_mode:  # compile regions; their inputs must not alias
        double, single = blocks.double_block, blocks.single_block
        mod_img, mod_txt, mod_single = (tuple(m.clone() for m in mod) for mod in (mod_img, mod_txt, mod_single))
    T = txt.shape[1]
    ctx = dict(mod_img=mod_img, mod_txt=mod_txt, mod_single=mod_single, temb=temb, pe=pe, bias=key_bias)
    consts, per_layer = ("mod_img", "mod_txt", "mod_single", "pe", "bias"), {}
    static = (double, single, c.attention_head_dim, c.eps, T)
    if kv_mode:  # not scanned: each block reads its cached Ref (or the extracted stream) by name
        ctx["ref"] = _RefRun(ref, ref_mod_single)
        refs, per_layer = _ref_inputs(params, cache, img.device)
        ctx.update(refs)
    segments = tuple(
        _stages.Segment(kind, step, per_layer.get(kind, ()), consts, static, enter=enter,
                        attention=kind + ".{}.attn", scan=not kv_mode)
        for kind, step, enter in (("transformer_blocks", _double, _stages.same),
                                  ("single_transformer_blocks", _single, _stages.joint))
    )  # fmt: skip
    final = lambda img, k: final_layer(params, img, k["temb"], c.eps)  # noqa: E731
    extra = (lambda k: kv.from_refs(c, k["ref"].refs, batch, R)) if R else None
    batched = ("mod_img", "mod_txt", "mod_single", "temb", "bias", *(k for k in ctx if k.endswith(".refs")))
    image = _stages.image_rows(T)
    return _stages.Stages(params, (img, txt), segments, ctx, final, image, T, x.shape[1], batched, extra=extra)


def _ref_inputs(params, cache, device) -> tuple[dict, dict]:
    """The per-block inputs of a pass with reference KV: each block's cached `Ref` (None on
    an extract pass) and its name, as stage inputs, and which of them each block list reads."""
    inputs, per_layer = {}, {}
    for kind in ("transformer_blocks", "single_transformer_blocks"):
        n = len(ordered_blocks(params, kind))
        cached = [None if cache is None else kv.local_cache(cache, kind, i, device) for i in range(n)]
        inputs[f"{kind}.refs"], inputs[f"{kind}.names"] = cached, [f"{kind}.{i}" for i in range(n)]
        per_layer[kind] = (f"{kind}.refs", f"{kind}.names")
    return inputs, per_layer


def forward(params, x, t, txt, **inputs):
    """The model on this rank's batch (`stages`, run): returns (out sharded over "sp", its
    full length, and the extracted `Flux2KVCache` or None)."""
    s = stages(params, x, t, txt, **inputs)
    out, extra = s.forward()
    return out, s.seq, extra

"""FLUX.3 as pure functions over a parameter tree.

Mirrors diffusers' ``Flux3Transformer2DModel`` (``transformer_flux3.py``, the transformer
of ``Flux3ModularPipeline`` / ``Flux3DistilledModularPipeline``). Three token modes: the
noisy image tokens, optional reference-image tokens and the text context. Each mode first
runs through its own per-mode blocks (self-attention within the mode; parallel attention
+ SwiGLU MLP from one modulated input), then every mode joins one sequence (txt; img;
ref) for the single blocks, each mode keeping its own modulation. Modulation is per mode:
the image tokens at the flow timestep, the reference and text tokens at timestep 0. A
flow-map checkpoint (``flow_map=True``, step-distilled) embeds the timestep each step
jumps to and adds it to every mode's embedding. No biases, 4-axis RoPE.

diffusers projects every token's (identical) modulation row; here each mode's one row
(B, 1, n·C) is projected once and broadcast, the same values.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

import sharding

from . import flux2
from .configs import (
    DiTConfig,
    Pipeline,
    as_ints,
    require,
    require_bool,
    require_non_negative,
    require_positive,
    require_positive_number,
    require_rope_axes,
)
from .nn import layers as L
from .nn import stages as _stages
from .nn.checks import (
    check_floating,
    check_ids,
    check_rope,
    check_rope_or_ids,
    check_streams,
    check_tensor,
    img_valid_bias,
    reference_leaf,
)
from .params import MOD3, MOD_OUT, linear_spec, mod_spec, norm_spec

DIFFUSERS_CLASS = "Flux3Transformer2DModel"
NAME = "FLUX.3"
KEY = "flux3"  # the family in code: fd.sample, the adapter, the tiny pipelines, bench
MODES = ("image", "image_cond", "txt")  # diffusers' modulation heads, in its key order


@dataclasses.dataclass(frozen=True)
class Flux3Config(DiTConfig):
    """diffusers ``Flux3Transformer2DModel`` config; defaults are diffusers' (FLUX.3 klein)."""

    in_channels: int = 128  # 32 VAE channels x 2x2 packed patches
    cond_in_channels: int = 128  # the reference-image tokens' width
    num_layers: int = 5  # per-mode blocks (each mode has its own stack)
    num_single_layers: int = 28  # joint single blocks
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 20480  # stacked Qwen3-VL hidden states
    timestep_channels: int = 256  # sinusoidal embedding width
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)  # (t, h, w, l) share of head_dim
    rope_theta: int = 10000
    eps: float = 1e-6
    flow_map: bool = False  # step-distilled: embeds the target timestep too

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", as_ints(self.axes_dims_rope))
        require_positive(
            self,
            "in_channels",
            "cond_in_channels",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "timestep_channels",
        )
        require(
            self.timestep_channels % 2 == 0,
            f"Flux3Config.timestep_channels: expected an even int, got {self.timestep_channels}",
        )
        require_non_negative(self, "num_layers", "num_single_layers")
        require_positive_number(self, "mlp_ratio", "rope_theta", "eps")
        require(
            self.mlp_hidden_dim > 0, f"Flux3Config: int(inner_dim * mlp_ratio) = {self.mlp_hidden_dim}, expected > 0"
        )
        require_bool(self, "flow_map")
        require_rope_axes(self)

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.inner_dim * self.mlp_ratio)  # as diffusers' Flux3FeedForward: int(dim * mult)

    @property
    def out_dim(self) -> int:
        return self.in_channels  # proj_out maps back to the image tokens' width

    def param_specs(self) -> dict:
        """Nested dict of `ParamSpec` (the protocol `sharding.plan` reads specs by)."""
        return param_specs(self)


# The released transformers, as diffusers names them: loaders/single_file_utils.py maps a
# FLUX.3 checkpoint to "black-forest-labs/flux-3-image-klein-base" and, when it carries the
# target-timestep embedder (ref_time_in, "flux3-distilled"), to the step-distilled
# "black-forest-labs/flux-3-image-klein". The shapes are Flux3Transformer2DModel's defaults,
# documented there as FLUX.3's: 5 per-mode + 28 single blocks, 24 heads x 128 (3072 wide),
# mlp_ratio 3, 4-axis RoPE (32, 32, 32, 32) with theta 10000, Qwen3-VL text of 20480,
# 128-channel image and reference tokens.
PRESETS = {
    "flux3-klein-base": Flux3Config(),
    "flux3-klein": Flux3Config(flow_map=True),
    # A tiny flow-map model for tests and the offline demo: 4 heads so TP up to 4.
    "flux3-tiny": Flux3Config(
        in_channels=16,
        cond_in_channels=12,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=40,
        timestep_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        flow_map=True,
    ),
}

CONFIG = Flux3Config
TINY = "flux3-tiny"  # the preset tests and the offline tiny pipelines start from
REPOS = {}  # released weights of the presets on the Hugging Face Hub: none yet
# The stock diffusers pipelines that run this transformer (see `configs.Pipeline`).
PIPELINES = (
    Pipeline("Flux3ModularPipeline", tiny="flux3", sample=True),
    Pipeline("Flux3DistilledModularPipeline", tiny="flux3-distilled", sample=True),
)


# ----------------------------------------------------------------------------- specs


def _lin(out_dim, in_dim, out_axis, in_axis):
    return linear_spec(out_dim, in_dim, out_axis, in_axis, bias=False)  # FLUX.3 has no biases


def _block_specs(c) -> dict:
    """A per-mode or single block: q, k, v, QK norms, to_out and the SwiGLU MLP."""
    D, n = c.attention_head_dim, c.inner_dim
    col = _lin(n, n, "heads", "embed")
    attn = {"to_q": col, "to_k": col, "to_v": col, "norm_q": norm_spec(D), "norm_k": norm_spec(D)}
    return {"attn": attn | {"to_out": {"0": _lin(n, n, "embed", "heads")}}, "ff": flux2._swiglu_specs(c)}


def _embedder(c) -> dict:
    n = c.inner_dim
    return {"linear_1": _lin(n, c.timestep_channels, "embed", "freq"), "linear_2": _lin(n, n, "embed", "embed")}


def param_specs(c: Flux3Config) -> dict:
    """Nested dict of `ParamSpec` in diffusers ``state_dict`` order; allocates nothing."""
    n = c.inner_dim
    blocks = lambda k: {str(i): _block_specs(c) for i in range(k)}  # noqa: E731
    mods = {m: {"linear": mod_spec(n, MOD3, bias=False)} for m in MODES}
    return {
        "timestep_embedder": _embedder(c),
        **({"target_timestep_embedder": _embedder(c)} if c.flow_map else {}),
        "early_stream_modulations": mods,
        "single_stream_modulations": mods,
        "x_embedders": {
            "image": _lin(n, c.in_channels, "embed", "channels"),
            "image_cond": _lin(n, c.cond_in_channels, "embed", "channels"),
        },
        "context_embedder": _lin(n, c.joint_attention_dim, "embed", "txt_embed"),
        "mode_blocks": {m: blocks(c.num_layers) for m in MODES[:2]},
        "txt_mode_blocks": blocks(c.num_layers),
        "single_transformer_blocks": blocks(c.num_single_layers),
        "norm_out": {"linear": mod_spec(n, MOD_OUT, bias=False)},
        "proj_out": _lin(c.out_dim, n, "out_channels", "embed"),
    }


# Projections that read the same input, fused into one matmul by `fd.prepare` (the
# per-mode image stacks sit one level deeper and run unfused).
FUSED = {
    "single_transformer_blocks": [("attn.to_q", "attn.to_k", "attn.to_v")],
    "txt_mode_blocks": [("attn.to_q", "attn.to_k", "attn.to_v")],
}


# ----------------------------------------------------------------------------- forward


class Stream(NamedTuple):
    """One token mode in the local view: tokens x (B, S, C), its modulations (shift,
    scale, gate) (B, 1, C) for the per-mode and the single blocks, RoPE (cos, sin) of its
    rows and the (B, S) key bias masking sequence padding (None: none)."""

    x: torch.Tensor
    early: tuple
    single: tuple
    pe: tuple
    bias: torch.Tensor | None


def embed_time(p, t: torch.Tensor, channels: int) -> torch.Tensor:
    """temb (B, 1, C): ``TimestepEmbedding(Timesteps(t))``; t already x 1000, model dtype."""
    return L.mlp_embed(p, L.timestep_embedding(t, channels).to(t.dtype))[:, None]


def time_embeds(params, t, target, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The image tokens' embedding (at t) and the reference/text tokens' (at 0), each
    (B, 1, C); a flow map adds the target timestep's embedding to both."""
    c = params.config
    img = embed_time(params["timestep_embedder"], t.to(dtype) * 1000, c.timestep_channels)
    zero = embed_time(params["timestep_embedder"], torch.zeros_like(t, dtype=dtype), c.timestep_channels)
    if target is None:
        return img, zero
    extra = embed_time(params["target_timestep_embedder"], target.to(dtype) * 1000, c.timestep_channels)
    return img + extra, zero + extra


def modulations(params, temb_img, temb_zero, with_cond: bool) -> dict:
    """Every mode's (early, single) modulation triples (B, 1, C) and the output layer's
    (scale, shift): under TP one all-gather per embedding (two per call)."""
    early, single = params["early_stream_modulations"], params["single_stream_modulations"]
    layers = lambda m: [(early[m]["linear"], 3), (single[m]["linear"], 3)]  # noqa: E731
    e_img, s_img, out = L.modulations(layers("image") + [(params["norm_out"]["linear"], 2)], temb_img)
    zero_modes = ("txt", "image_cond") if with_cond else ("txt",)
    zs = L.modulations([pair for m in zero_modes for pair in layers(m)], temb_zero)
    mods = {"image": (e_img, s_img)} | {m: (zs[2 * i], zs[2 * i + 1]) for i, m in enumerate(zero_modes)}
    mods = {m: tuple(y.chunk(3, dim=-1) for y in pair) for m, pair in mods.items()}
    return mods | {"out": out.chunk(2, dim=-1)}


def _qkv(a, h, head_dim, eps):
    """q, k, v (B, S, H, D); q and k RMS-normalised in fp32, as diffusers' processor does."""
    q, k, v = (L.split_heads(y, head_dim) for y in L.linear_group([a[n] for n in ("to_q", "to_k", "to_v")], h))
    q = L.rms_norm(L.per_head(a["norm_q"]), q.float(), eps)
    return q, L.rms_norm(L.per_head(a["norm_k"]), k.float(), eps), v


def _attention(a, h, pe, head_dim, eps, key_bias) -> torch.Tensor:
    """The attention of one modulated input h before ``to_out`` (B, S, H·D)."""
    q, k, v = _qkv(a, h, head_dim, eps)
    q, k = (L.apply_rope(t, *pe).to(v.dtype) for t in (q, k))
    return L.attention(q, k, v, key_bias)


def _attn_ff(p, h, pe, head_dim, eps, key_bias, attn=None):
    """Parallel attention + SwiGLU MLP of one modulated input h: the sum of the two
    outputs (their row-parallel projections in one all-reduce under TP). ``attn``: None,
    or a function given the attention module (diffusers' ``Flux3Attention``, through
    ``to_out``) as a function of no arguments, returning its output or a stand-in for it
    (where the attention-level caches hook, `functional_dit.pipelines.cache`)."""
    if attn is None:
        a = _attention(p["attn"], h, pe, head_dim, eps, key_bias)
        y_attn, y_ff = L.row_linears(
            [(p["attn"]["to_out"]["0"], a), (p["ff"]["linear_out"], flux2._ff_hidden(p["ff"], h))]
        )
        return y_attn + y_ff
    y_attn = attn(lambda: L.row_linear(p["attn"]["to_out"]["0"], _attention(p["attn"], h, pe, head_dim, eps, key_bias)))
    return y_attn + L.row_linear(p["ff"]["linear_out"], flux2._ff_hidden(p["ff"], h))


def mode_block(p, x, mod, pe, head_dim, eps=1e-6, key_bias=None, attn=None):
    """diffusers ``Flux3ModeTransformerBlock``: x + gate * (attn(h) + ff(h)), h = AdaLN(x),
    attention within this mode only. ``attn``: a hook on the attention module (`_attn_ff`)."""
    shift, scale, gate = mod
    h = L.norm_modulate(x, shift, scale, eps)
    return L.gated(x, gate, _attn_ff(p, h, pe, head_dim, eps, key_bias, attn))


def single_block(p, xs: list, mods: list, pe, head_dim, eps=1e-6, key_bias=None, attn=None) -> list:
    """diffusers ``Flux3SingleTransformerBlock`` over the joint sequence of the modes
    ``xs`` (in sequence order, each (B, S_i, C)) with their modulations ``mods``: each
    mode is normalised with its own (shift, scale), one attention + MLP over them all,
    each mode's gated residual with its own gate. ``attn`` as in `mode_block`."""
    h = torch.cat([L.norm_modulate(x, m[0], m[1], eps) for x, m in zip(xs, mods)], 1)
    ys = _attn_ff(p, h, pe, head_dim, eps, key_bias, attn).split([x.shape[1] for x in xs], 1)
    return [L.gated(x, m[2], y) for x, m, y in zip(xs, mods, ys)]


REGIONS = ("mode_block", "single_block")  # compiled once and reused per layer (`nn.compile`)


def final_layer(params, x, mod, eps=1e-6):
    scale, shift = mod  # diffusers' Flux3AdaLayerNorm: (scale, shift) order
    return L.linear(params["proj_out"], L.norm_modulate(x, shift, scale, eps))


# ----------------------------------------------------------------------------- validation


def _ids_rope(c, name, ids, seq, batch, device):
    if ids is None:
        raise ValueError(f"{name}: FLUX.3 needs position ids of shape ({seq}, {len(c.axes_dims_rope)})")
    ids = check_ids(name, ids, seq, len(c.axes_dims_rope), batch, device)
    return L.rope(ids, c.axes_dims_rope, theta=c.rope_theta)


def _check_cond(c, image_cond, image_cond_ids, batch, leaf, rope):
    if (
        image_cond_ids is not None
        and image_cond is None
        or image_cond is not None
        and rope is None
        and image_cond_ids is None
    ):
        given, missing = (
            ("image_cond", "image_cond_ids") if image_cond is not None else ("image_cond_ids", "image_cond")
        )
        raise ValueError(f"{missing}: required with {given} (reference-image tokens and their position ids)")
    if image_cond is not None:
        check_tensor("image_cond", image_cond, (batch, None, c.cond_in_channels), leaf.dtype, leaf.device)


def _check_target(c, target_timestep, batch, device):
    if c.flow_map and target_timestep is None:
        raise ValueError(f"target_timestep: this model has flow_map=True and needs ({batch},) target timesteps")
    if not c.flow_map and target_timestep is not None:
        raise ValueError("target_timestep: this model has flow_map=False; expected None, got a tensor")
    if target_timestep is not None:
        check_tensor("target_timestep", target_timestep, (batch,), device=device)
        check_floating("target_timestep", target_timestep)


def _tables(c, x, txt, img_ids, txt_ids, image_cond, image_cond_ids, rope, device):
    """The RoPE tables of the txt, img and reference rows (None without references)."""
    B, T, S = x.shape[0], txt.shape[1], x.shape[1]
    R = 0 if image_cond is None else image_cond.shape[1]
    if rope is not None:
        check_rope_or_ids(rope, img_ids=img_ids, txt_ids=txt_ids, image_cond_ids=image_cond_ids)
        cos, sin = check_rope(rope, T + S + R, c.attention_head_dim, device, batch=B)
        parts = [(a.split([T, S, R], -2)) for a in (cos, sin)]
        tables = [tuple(p[i] for p in parts) for i in range(3)]
        return tables[0], tables[1], tables[2] if R else None
    pe_txt = _ids_rope(c, "txt_ids", txt_ids, T, B, device)
    pe_img = _ids_rope(c, "img_ids", img_ids, S, B, device)
    pe_cond = None if image_cond is None else _ids_rope(c, "image_cond_ids", image_cond_ids, R, B, device)
    return pe_txt, pe_img, pe_cond


def rope_table(config: Flux3Config, img_ids, txt_ids, image_cond_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) table `check_inputs` builds from 2-D ids: (S_txt + S_img [+ S_ref],
    attention_head_dim) fp32, rows in (txt; img; ref) order, to build it once per run."""
    ids = [i for i in (txt_ids, img_ids, image_cond_ids) if i is not None]
    parts = [L.rope(i, config.axes_dims_rope, theta=config.rope_theta) for i in ids]
    return tuple(torch.cat([p[j] for p in parts]) for j in range(2))


# ----------------------------------------------------------------------------- apply

ARGS = (
    "img_ids",
    "txt_ids",
    "rope",
    "img_valid",
    "image_cond",
    "image_cond_ids",
    "image_cond_valid",
    "target_timestep",
)
BATCHED = ("cond", "target", "img_bias", "cond_bias")  # of check_inputs' outputs, those split over "dp" with x, t, txt


def check_inputs(
    params,
    x,
    t,
    txt,
    *,
    img_ids=None,
    txt_ids=None,
    image_cond=None,
    image_cond_ids=None,
    target_timestep=None,
    rope=None,
    img_valid=None,
    image_cond_valid=None,
) -> dict:
    """Checks the FLUX.3 inputs (full view) and returns `forward`'s keywords: x (B, S_img,
    in_channels) noisy image tokens, t (B,) in [0, 1], txt (B, S_txt, joint_attention_dim),
    img_ids (S_img, 4) / txt_ids (S_txt, 4) (or 3-D, first item used); optional reference
    tokens image_cond (B, S_ref, cond_in_channels) with image_cond_ids (S_ref, 4);
    target_timestep (B,) in [0, 1], required by and only by a flow map. ``rope``: the
    (cos, sin) table `rope_table` builds, in place of the ids, or (B, S_txt + S_img [+ S_ref],
    attention_head_dim): one per row. ``img_valid`` (B, S_img) and ``image_cond_valid``
    (B, S_ref), 1 = a real token: rows padded to one length (images and references of
    several sizes in one call, each row with its own ``rope``; padding is never attended
    to, and its outputs are to be dropped). fd.apply returns (B, S_img, in_channels), as
    ``Flux3Transformer2DModel(...)[0]``."""
    c = params.config
    leaf = reference_leaf(params, "context_embedder.weight")
    B, _ = check_streams(c, leaf, x, t, txt)
    _check_cond(c, image_cond, image_cond_ids, B, leaf, rope)
    _check_target(c, target_timestep, B, leaf.device)
    pes = _tables(c, x, txt, img_ids, txt_ids, image_cond, image_cond_ids, rope, leaf.device)
    img_bias = img_valid_bias(img_valid, *x.shape[:2], leaf.device)
    cond_bias = _cond_bias(image_cond, image_cond_valid)
    return dict(cond=image_cond, target=target_timestep, pes=pes, img_bias=img_bias, cond_bias=cond_bias)


def _cond_bias(cond, cond_valid):
    """``image_cond_valid``'s key bias over the reference rows (`img_valid_bias`), or None."""
    if cond_valid is None:
        return None
    if cond is None:
        raise ValueError("image_cond_valid: only used with image_cond; expected None, got a tensor")
    return img_valid_bias(cond_valid, *cond.shape[:2], cond.device, name="image_cond_valid")


prepare = check_inputs  # the old name, kept (not to confuse with fd.prepare)


def _local_stream(x, pe, mods, device, valid_bias=None) -> Stream:
    """A mode's tokens, RoPE rows (a (S, D) table, or (B, S, D): one per row) and pad bias
    on this rank's ``sp`` chunk; ``valid_bias`` (B, S): the padding of rows that hold
    smaller images (`check_inputs`' ``img_valid``), added to it."""
    d = pe[0].ndim - 2
    if d and pe[0].shape[0] != x.shape[0]:  # a split batch (dp) keeps every row's table: refused
        raise ValueError(f"rope: a table per row needs all {pe[0].shape[0]} rows here, got {x.shape[0]} (dp)")
    bias = sharding.pad_bias(x.shape[1], "sp", device)
    bias = None if bias is None else bias.expand(x.shape[0], -1)
    if valid_bias is not None:
        valid_bias = sharding.shard(valid_bias, "sp", 1)
        bias = valid_bias if bias is None else bias + valid_bias
    x, pe = sharding.shard(x, "sp", 1), tuple(sharding.shard(a, "sp", d) for a in pe)
    return Stream(x, mods[0], mods[1], pe, bias)


def _joint_bias(streams) -> torch.Tensor | None:
    if all(s.bias is None for s in streams):
        return None
    zeros = lambda s: torch.zeros(s.x.shape[:2], device=s.x.device)  # noqa: E731
    return torch.cat([zeros(s) if s.bias is None else s.bias for s in streams], 1)


def _mode_blocks(params, mode: str) -> list:
    """The per-mode blocks of ``mode`` in numeric order (none when num_layers is 0)."""
    tree = params.tree.get("txt_mode_blocks", {}) if mode == "txt" else params.tree.get("mode_blocks", {}).get(mode, {})
    return [tree[k] for k in sorted(tree, key=int)]


def _embed_streams(params, x, txt, cond, pes, mods, biases=(None, None, None)) -> list:
    """The (txt, image[, image_cond]) streams embedded, on this rank's sp chunk; ``biases``
    their padding's key biases (None: not padded)."""
    hs = [("txt", L.linear(params["context_embedder"], txt)), ("image", L.linear(params["x_embedders"]["image"], x))]
    if cond is not None:
        hs.append(("image_cond", L.linear(params["x_embedders"]["image_cond"], cond)))
    return [(m, _local_stream(h, pe, mods[m], x.device, b)) for (m, h), pe, b in zip(hs, pes, biases)]


# The per-mode block lists as stages, the image's first (block 0 of the stages changes the
# image rows, where First-Block Cache measures): (mode, the stream's index, params key).
_MODE_SEGMENTS = (
    ("image", 1, "mode_blocks.image"),
    ("txt", 0, "txt_mode_blocks"),
    ("image_cond", 2, "mode_blocks.image_cond"),
)


def stages(params, x, t, txt, *, cond, target, pes, img_bias=None, cond_bias=None, blocks=None) -> _stages.Stages:
    """The model on this rank's batch as `nn.stages.Stages`: the embedded (txt, image[,
    image_cond]) streams, each mode through its own blocks, the single blocks over them
    all, the final layer on the image's. ``blocks``: the block functions as compile
    regions (`nn.compile.regions`, passed by the api); None: this module's. ``img_bias``,
    ``cond_bias``: the image's and the references' padding (`check_inputs`)."""
    mode, single = (mode_block, single_block) if blocks is None else (blocks.mode_block, blocks.single_block)
    c = params.config
    temb_img, temb_zero = time_embeds(params, t, target, x.dtype)
    mods = modulations(params, temb_img, temb_zero, cond is not None)
    embedded = _embed_streams(params, x, txt, cond, pes, mods, (None, img_bias, cond_bias))
    ctx = {"out_mod": mods["out"]}
    segments = []
    for m, j, key in _MODE_SEGMENTS:
        if j >= len(embedded):
            continue
        s = embedded[j][1]
        ctx[f"{m}.mod"], ctx[f"{m}.pe"], ctx[f"{m}.bias"] = tuple(a.clone() for a in s.early), s.pe, s.bias
        segments.append(
            _stages.Segment(key, _mode, static=(mode, m, j, c.attention_head_dim, c.eps), attention=key + ".{}.attn",
                            blocks=_mode_blocks(params, m), scan=False)
        )  # fmt: skip
    streams = [s for _, s in embedded]
    ctx["pe"] = tuple(torch.cat([s.pe[i] for s in streams], -2) for i in range(2))
    ctx["bias"], ctx["single_mods"] = _joint_bias(streams), [tuple(a.clone() for a in s.single) for s in streams]
    segments.append(
        _stages.Segment("single_transformer_blocks", _single, static=(single, c.attention_head_dim, c.eps),
                        attention="single_transformer_blocks.{}.attn", scan=False)
    )  # fmt: skip
    final = lambda img, k: final_layer(params, img, k["out_mod"], c.eps)  # noqa: E731
    image = lambda xs: xs[1]  # noqa: E731
    batched = ("out_mod", "bias", "single_mods", *(f"{m}.{k}" for m, _, _ in _MODE_SEGMENTS for k in ("mod", "bias")))
    xs = tuple(s.x for s in streams)
    return _stages.Stages(params, xs, tuple(segments), ctx, final, image, xs[0].shape[1], x.shape[1], batched)


def forward(params, x, t, txt, **inputs):
    """The model on this rank's batch (`stages`, run): returns (out sharded over "sp", its
    full length, None)."""
    out, _ = stages(params, x, t, txt, **inputs).forward()
    return out, x.shape[1], None


def _mode(carry, p, layer, ctx, static):
    """One per-mode block as a stage step: the mode's stream (index j of the carry)
    through it, self-attention within the mode. ``ctx["hook"]``: its attention's hook."""
    fn, m, j, D, eps = static
    kw = {}
    if ctx.get("hook") is not None:
        fn, kw = mode_block, {"attn": ctx["hook"]}
    x = fn(p, carry[j], ctx[f"{m}.mod"], ctx[f"{m}.pe"], D, eps, ctx[f"{m}.bias"], **kw)
    return (*carry[:j], x, *carry[j + 1 :])


def _single(carry, p, layer, ctx, static):
    """One single block as a stage step over every mode's stream."""
    fn, D, eps = static
    kw = {}
    if ctx.get("hook") is not None:
        fn, kw = single_block, {"attn": ctx["hook"]}
    return tuple(fn(p, list(carry), ctx["single_mods"], ctx["pe"], D, eps, ctx["bias"], **kw))

"""FLUX.1 (dev, schnell) as pure functions over a parameter tree.

Mirrors diffusers' ``FluxTransformer2DModel`` (``transformer_flux.py``) and Black
Forest Labs' ``flux/model.py``: 19 double-stream (MMDiT) blocks, 38 single-stream
blocks with parallel attention + MLP, AdaLN-Zero modulation from the timestep,
guidance and pooled text vector, and 3-axis RoPE over (txt; img) ids.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import sharding

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
from .nn import control as _control
from .nn import layers as L
from .nn import scan as _scan
from .nn import stages as _stages
from .nn.checks import (
    check_guidance,
    check_ids,
    check_rope,
    check_rope_or_ids,
    check_streams,
    check_tensor,
    img_valid_bias,
    reference_leaf,
)
from .params import (
    MOD3,
    MOD6,
    MOD_OUT,
    PACKED,
    Segment,
    linear_spec,
    mod_spec,
    norm_spec,
    ordered_blocks,
    unit_linear_spec,
    units,
)

DIFFUSERS_CLASS = "FluxTransformer2DModel"
NAME = "FLUX.1"
KEY = "flux1"  # the family in code: fd.sample, the adapter, the tiny pipelines, bench


@dataclasses.dataclass(frozen=True)
class Flux1Config(DiTConfig):
    """diffusers ``FluxTransformer2DModel`` config; defaults are FLUX.1-schnell's."""

    patch_size: int = 1
    in_channels: int = 64  # 16 VAE channels x 2x2 packed patches
    out_channels: int | None = None  # None: same as in_channels
    num_layers: int = 19  # double-stream blocks
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096  # T5-XXL hidden size
    pooled_projection_dim: int = 768  # CLIP-L pooled output
    guidance_embeds: bool = False  # True for the guidance-distilled dev model
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)  # (index, row, col) share of head_dim

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", as_ints(self.axes_dims_rope))
        require_positive(
            self,
            "patch_size",
            "in_channels",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "pooled_projection_dim",
        )
        require_positive_or_none(self, "out_channels")
        require_non_negative(self, "num_layers", "num_single_layers")
        require_bool(self, "guidance_embeds")
        require_rope_axes(self)

    @property
    def mlp_hidden_dim(self) -> int:
        return 4 * self.inner_dim  # mlp_ratio 4.0 in both block kinds

    def param_specs(self) -> dict:
        """Nested dict of `ParamSpec` (the protocol `sharding.plan` reads specs by)."""
        return param_specs(self)


PRESETS = {
    # black-forest-labs/FLUX.1-dev transformer/config.json: guidance-distilled.
    "flux1-dev": Flux1Config(guidance_embeds=True),
    # black-forest-labs/FLUX.1-schnell transformer/config.json: timestep-distilled, no guidance input.
    "flux1-schnell": Flux1Config(guidance_embeds=False),
    # A tiny model for tests and the offline demo.
    "flux1-tiny": Flux1Config(
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=24,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ),
}

CONFIG = Flux1Config
TINY = "flux1-tiny"  # the preset tests and the offline tiny pipelines start from
# The released weights of the presets on the Hugging Face Hub (`generate` reads the local cache only).
REPOS = {
    "flux1-dev": "black-forest-labs/FLUX.1-dev",
    "flux1-schnell": "black-forest-labs/FLUX.1-schnell",
}
# The stock diffusers pipelines that run this transformer (see `configs.Pipeline`).
PIPELINES = (
    Pipeline("FluxPipeline", tiny="flux", sample=True),
    Pipeline("FluxKontextPipeline", tiny="flux-kontext", sample=True),
    Pipeline("FluxImg2ImgPipeline", sample=True),
    Pipeline("FluxInpaintPipeline", sample=True),
    Pipeline("FluxControlNetPipeline", tiny="flux-controlnet", sample=True),  # with a ControlNet (docs/controlnet.md)
)


# ----------------------------------------------------------------------------- specs


def _col(c, out_dim, axis, in_dim=None):  # column-parallel: output dim sharded
    return linear_spec(out_dim, in_dim or c.inner_dim, axis, "embed")


def _row(c, in_dim, axis):  # row-parallel: input dim sharded
    return linear_spec(c.inner_dim, in_dim, "embed", axis)


def _mlp(c):
    return {"net": {"0": {"proj": _col(c, c.mlp_hidden_dim, "mlp")}, "2": _row(c, c.mlp_hidden_dim, "mlp")}}


def _time_text_specs(c) -> dict:
    emb = lambda d_in: {
        "linear_1": linear_spec(c.inner_dim, d_in, "embed", "freq" if d_in == 256 else "pooled"),  # noqa: E731
        "linear_2": linear_spec(c.inner_dim, c.inner_dim, "embed", "embed"),
    }
    tree = {"timestep_embedder": emb(256)}
    if c.guidance_embeds:
        tree["guidance_embedder"] = emb(256)
    tree["text_embedder"] = emb(c.pooled_projection_dim)
    return tree


def _double_block_specs(c) -> dict:
    D, n = c.attention_head_dim, c.inner_dim
    return {
        "norm1": {"linear": mod_spec(n, MOD6)},
        "norm1_context": {"linear": mod_spec(n, MOD6)},
        "attn": {
            "norm_q": norm_spec(D),
            "norm_k": norm_spec(D),
            "to_q": _col(c, n, "heads"),
            "to_k": _col(c, n, "heads"),
            "to_v": _col(c, n, "heads"),
            "to_out": {"0": _row(c, n, "heads")},
            "norm_added_q": norm_spec(D),
            "norm_added_k": norm_spec(D),
            "add_q_proj": _col(c, n, "heads"),
            "add_k_proj": _col(c, n, "heads"),
            "add_v_proj": _col(c, n, "heads"),
            "to_add_out": _row(c, n, "heads"),
        },
        "ff": _mlp(c),
        "ff_context": _mlp(c),
    }


def _single_block_specs(c) -> dict:
    D, n, m = c.attention_head_dim, c.inner_dim, c.mlp_hidden_dim
    # proj_out consumes cat([attn_out, mlp_hidden]): two independently sharded streams, cut
    # into equal units of g = gcd(n, m) = n rows (m = 4n) so its columns shard as one strided
    # DTensor; proj_mlp's rows are cut alike, so the hidden units a rank holds agree
    # (units, docs/architecture.md).
    g = math.gcd(n, m)
    return {
        "norm": {"linear": mod_spec(n, MOD3)},
        "proj_mlp": unit_linear_spec(Segment("mlp", m, "mlp"), n, "embed", g),
        "proj_out": linear_spec(
            n, n + m, "embed", PACKED, blocks=units((Segment("attn", n, "heads"), Segment("mlp", m, "mlp")), g)
        ),
        "attn": {
            "norm_q": norm_spec(D),
            "norm_k": norm_spec(D),
            "to_q": _col(c, n, "heads"),
            "to_k": _col(c, n, "heads"),
            "to_v": _col(c, n, "heads"),
        },
    }


def param_specs(c: Flux1Config) -> dict:
    """Nested dict of `ParamSpec` in diffusers ``state_dict`` order; allocates nothing."""
    n = c.inner_dim
    return {
        "time_text_embed": _time_text_specs(c),
        "context_embedder": linear_spec(n, c.joint_attention_dim, "embed", "txt_embed"),
        "x_embedder": linear_spec(n, c.in_channels, "embed", "channels"),
        "transformer_blocks": {str(i): _double_block_specs(c) for i in range(c.num_layers)},
        "single_transformer_blocks": {str(i): _single_block_specs(c) for i in range(c.num_single_layers)},
        "norm_out": {"linear": mod_spec(n, MOD_OUT)},
        "proj_out": linear_spec(c.out_dim, n, "out_channels", "embed"),
    }


# Projections that read the same input, fused into one matmul by `fd.prepare` (BFL's
# qkv and linear1 layouts): {block list: [paths inside a block, ...]}.
FUSED = {
    "transformer_blocks": [
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ],
    "single_transformer_blocks": [("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")],
}


# ----------------------------------------------------------------------------- forward


def time_text_embed(p, t, guidance, pooled) -> torch.Tensor:
    """vec (B, C) = MLP(sin(t)) [+ MLP(sin(guidance))] + MLP(pooled)."""
    vec = L.mlp_embed(p["timestep_embedder"], L.timestep_embedding(t).to(pooled.dtype))
    if guidance is not None:
        vec = vec + L.mlp_embed(p["guidance_embedder"], L.timestep_embedding(guidance).to(pooled.dtype))
    return vec + L.mlp_embed(p["text_embedder"], pooled)


def qkv(p, x, head_dim, names=("to_q", "to_k", "to_v"), norms=("norm_q", "norm_k")):
    """Project to q, k, v (B, S, H, D) and RMS-normalise q and k over D."""
    return heads(p, *L.linear_group([p[n] for n in names], x), head_dim, norms)


def heads(p, q, k, v, head_dim, norms=("norm_q", "norm_k")):
    """q, k, v (B, S, H·D) -> (B, S, H, D), q and k RMS-normalised over D."""
    q, k, v = (L.split_heads(y, head_dim) for y in (q, k, v))
    return L.rms_norm(L.per_head(p[norms[0]]), q), L.rms_norm(L.per_head(p[norms[1]]), k), v


def joint_attention(q, k, v, pe, key_bias=None) -> torch.Tensor:
    cos, sin = pe
    return L.attention(L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin), v, key_bias)


def double_attention(a, img, txt, pe, head_dim, key_bias=None, ip=None):
    """A double block's attention module (diffusers' ``FluxAttention``): q, k, v of both
    (normalised, modulated) streams, one joint attention over (txt; img), each stream's
    output projection. Returns (img_attn, txt_attn); with ``ip`` (IP-Adapter: per adapter
    its image-prompt keys, values (B, N, H, D) and scale) also `ip_attention` of the image
    queries, as diffusers' ``FluxIPAdapterAttnProcessor`` returns it."""
    iq, ik, iv = qkv(a, img, head_dim)
    tq, tk, tv = qkv(a, txt, head_dim, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"))
    out = joint_attention(torch.cat([tq, iq], 1), torch.cat([tk, ik], 1), torch.cat([tv, iv], 1), pe, key_bias)
    t_out, i_out = L.split_rows(out, txt.shape[1])
    # the two streams side by side: under TP each pair of output projections is one all-reduce
    i_attn, t_attn = L.row_linears([(a["to_out"]["0"], i_out), (a["to_add_out"], t_out)])
    return (i_attn, t_attn) if ip is None else (i_attn, t_attn, ip_attention(iq, ip))


def ip_attention(q, ip) -> torch.Tensor:
    """IP-Adapter's image-prompt attention: the image queries q (B, S, H, D), RMS-normalised,
    without RoPE, attend to each adapter's keys and values (B, N, H, D); returns the sum of
    each output (B, S, H·D) times the adapter's scale."""
    out = torch.zeros(*q.shape[:2], q.shape[2] * q.shape[3], dtype=q.dtype, device=q.device)
    for k, v, scale in ip:
        out = out + scale * L.attention(q, k, v)
    return out


def ip_tokens(p, embeds: torch.Tensor, n: int) -> torch.Tensor:
    """An IP-Adapter's image projection (diffusers' ``ImageProjection``): image embeddings
    (B, I, E) -> n tokens each, (B, I, n, joint_attention_dim), layer-normalised."""
    B, n_img = embeds.shape[:2]
    w = p["image_embeds"]["weight"]
    y = L.linear(p["image_embeds"], embeds.reshape(B * n_img, *embeds.shape[2:]).to(w.dtype))
    y = y.reshape(B * n_img, n, -1)
    y = torch.nn.functional.layer_norm(y, y.shape[-1:], p["norm"]["weight"], p["norm"]["bias"], 1e-5)
    return y.reshape(B, n_img, n, -1)


def ip_keys_values(ip_adapter: dict, head_dim: int) -> list:
    """Per double block, per adapter: (keys, values, scale), keys and values (B, I·n, H, D)
    from the adapter's image tokens through the block's ``to_k_ip`` / ``to_v_ip``."""
    tokens = [
        ip_tokens(p, e, n)
        for p, e, n in zip(ip_adapter["image_proj"], ip_adapter["image_embeds"], ip_adapter["tokens"])
    ]
    heads_of = lambda y: y.reshape(y.shape[0], -1, y.shape[-1]).unflatten(-1, (-1, head_dim))  # noqa: E731
    return [
        [(heads_of(L.linear(kv["to_k_ip"], h)), heads_of(L.linear(kv["to_v_ip"], h)), scale)
         for kv, h, scale in zip(layer, tokens, scales)]
        for layer, scales in zip(ip_adapter["layers"], ip_adapter["scale"])
    ]  # fmt: skip


def double_block(p, img, txt, img_mod, txt_mod, pe, head_dim, key_bias=None, attn=None, ip=None):
    """MMDiT block: separate weights per stream, one joint attention over (txt; img);
    ``img_mod``/``txt_mod`` (B, 6C) its ``norm1``/``norm1_context`` modulations (`modulations`).
    ``attn``: None, or a function given the block's `double_attention` as a function of no
    arguments, returning its outputs or a stand-in for them (where diffusers' attention-level
    caches hook, `functional_dit.pipelines.cache`). ``ip``: IP-Adapter's per-adapter keys,
    values and scales for this block (`ip_keys_values`); its output is added after the MLP."""
    i_shift, i_scale, i_gate, i_shift2, i_scale2, i_gate2 = img_mod.chunk(6, dim=-1)
    t_shift, t_scale, t_gate, t_shift2, t_scale2, t_gate2 = txt_mod.chunk(6, dim=-1)
    i_in, t_in = L.norm_modulate(img, i_shift, i_scale), L.norm_modulate(txt, t_shift, t_scale)
    module = lambda: double_attention(p["attn"], i_in, t_in, pe, head_dim, key_bias, ip)  # noqa: E731
    i_attn, t_attn, *ip_out = module() if attn is None else attn(module)
    img, txt = L.gated(img, i_gate[:, None], i_attn), L.gated(txt, t_gate[:, None], t_attn)
    i_ff, t_ff = L.gelu_mlps(
        [
            (p["ff"], L.norm_modulate(img, i_shift2, i_scale2)),
            (p["ff_context"], L.norm_modulate(txt, t_shift2, t_scale2)),
        ]
    )
    img, txt = L.gated(img, i_gate2[:, None], i_ff), L.gated(txt, t_gate2[:, None], t_ff)
    if ip_out:
        img = img + ip_out[0]
    return img, L.clip_fp16(txt)  # diffusers clips only the text stream here


def single_block(p, x, mod, pe, head_dim, key_bias=None, attn=None):
    """Parallel attention + MLP over the joint (txt; img) sequence x (B, S, C); ``mod``
    (B, 3C) its ``norm`` modulation (`modulations`). ``attn`` as in `double_block`: the
    attention module (q, k, v and the joint attention, before ``proj_out``) is then run
    apart from the MLP input projection."""
    shift, scale, gate = mod.chunk(3, dim=-1)
    h = L.norm_modulate(x, shift, scale)
    a = p["attn"]
    if attn is None:
        q, k, v, mlp = L.linear_group_gelu([a["to_q"], a["to_k"], a["to_v"], p["proj_mlp"]], h)  # BFL's linear1
        out = joint_attention(*heads(a, q, k, v, head_dim), pe, key_bias)
    else:
        mlp = L.linear_gelu(p["proj_mlp"], h)
        out = attn(lambda: joint_attention(*qkv(a, h, head_dim), pe, key_bias))
    return L.clip_fp16(L.gated(x, gate[:, None], L.row_linear_cat(p["proj_out"], [out, mlp])))


REGIONS = ("double_block", "single_block")  # compiled once and reused per layer (`nn.compile`)
SCANNED = ("transformer_blocks", "single_transformer_blocks")  # segments `forward` runs through `nn.scan.layers`


def modulations(params, vec) -> tuple[list, list, list, torch.Tensor]:
    """Every AdaLN modulation of the model from vec (B, C), in one go (under TP one
    all-gather for all): per double block (B, 6C) for img and txt, per single block
    (B, 3C), and the final layer's (B, 2C)."""
    doubles = ordered_blocks(params, "transformer_blocks")
    singles = ordered_blocks(params, "single_transformer_blocks")
    layers = [(b["norm1"]["linear"], 6) for b in doubles] + [(b["norm1_context"]["linear"], 6) for b in doubles]
    layers += [(b["norm"]["linear"], 3) for b in singles] + [(params["norm_out"]["linear"], 2)]
    mods = L.modulations(layers, vec)
    n = len(doubles)
    return mods[:n], mods[n : 2 * n], mods[2 * n : -1], mods[-1]


def final_layer(p, x, mod):
    scale, shift = mod.chunk(2, dim=-1)  # note: (scale, shift) order
    return L.linear(p["proj_out"], L.norm_modulate(x, shift, scale))


def _validate(params, x, t, txt, pooled, guidance, img_ids, txt_ids, rope=None):
    c = params.config
    leaf = reference_leaf(params, "x_embedder.weight")
    B, S = check_streams(c, leaf, x, t, txt)
    if pooled is None:
        raise ValueError(f"pooled: FLUX.1 needs pooled text embeddings of shape ({B}, {c.pooled_projection_dim})")
    check_tensor("pooled", pooled, (B, c.pooled_projection_dim), leaf.dtype, leaf.device)
    check_guidance(c, guidance, B, leaf.device)
    if rope is not None:
        check_rope_or_ids(rope, img_ids=img_ids, txt_ids=txt_ids)
        return check_rope(rope, txt.shape[1] + S, c.attention_head_dim, leaf.device, batch=B)
    if img_ids is None:
        raise ValueError(f"img_ids: FLUX.1 needs image position ids of shape ({S}, {len(c.axes_dims_rope)})")
    n_axes = len(c.axes_dims_rope)
    img_ids = check_ids("img_ids", img_ids, S, n_axes, B, leaf.device)
    if txt_ids is None:  # what the diffusers pipelines pass
        txt_ids = torch.zeros(txt.shape[1], n_axes, device=leaf.device, dtype=img_ids.dtype)
    return rope_table(c, img_ids, check_ids("txt_ids", txt_ids, txt.shape[1], n_axes, B, leaf.device))


def rope_table(config: Flux1Config, img_ids, txt_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) table `check_inputs` builds from 2-D ids: (S_txt + S_img, attention_head_dim) fp32."""
    return L.rope(torch.cat([txt_ids, img_ids], 0), config.axes_dims_rope, theta=10000.0)


CONTROLNET_ARGS = ("controlnet_block_samples", "controlnet_single_block_samples", "controlnet_blocks_repeat")
ARGS = (  # of fd.apply's keywords, those FLUX.1 takes
    "pooled",
    "guidance",
    "img_ids",
    "txt_ids",
    "rope",
    "img_valid",
    "ip_adapter",
    *CONTROLNET_ARGS,
)
BATCHED = ("pooled", "guidance", "img_bias")  # of check_inputs' outputs, those split over "dp" with x, t, txt


def check_inputs(
    params,
    x,
    t,
    txt,
    *,
    pooled=None,
    guidance=None,
    img_ids=None,
    txt_ids=None,
    rope=None,
    img_valid=None,
    ip_adapter=None,
    controlnet_block_samples=None,
    controlnet_single_block_samples=None,
    controlnet_blocks_repeat=False,
) -> dict:
    """Checks the FLUX.1 inputs (full view) and returns `forward`'s keywords: x (B, S_img,
    in_channels), t (B,) in [0, 1], txt (B, S_txt, joint_attention_dim), pooled (B,
    pooled_projection_dim), guidance (B,) when the model is guidance-distilled, img_ids
    (S_img, 3) / txt_ids (S_txt, 3) or their 3-D forms. ``rope``: instead of the ids, their
    RoPE table (cos, sin), each (S_txt + S_img, attention_head_dim) fp32, as `rope_table`
    builds it (to build it once per sampling run), or (B, S_txt + S_img, attention_head_dim):
    one per row. ``img_valid`` (B, S_img), 1 = real image token: rows padded to one length
    (images of several sizes in one call, each row with its own ``rope``; padding is
    never attended to, and its outputs are to be dropped). ``ip_adapter``: IP-Adapter's inputs
    (`check_ip_adapter`). ``controlnet_*``: ControlNet residuals, as the stock class takes
    them (`check_controlnet`). fd.apply returns (B, S_img, patch_size² · out_channels), as
    ``FluxTransformer2DModel(...)[0]``."""
    pe = _validate(params, x, t, txt, pooled, guidance, img_ids, txt_ids, rope)
    ip = None if ip_adapter is None else check_ip_adapter(params, ip_adapter, x.shape[0])
    samples = (controlnet_block_samples, controlnet_single_block_samples)
    control = check_controlnet(params, x, *samples, controlnet_blocks_repeat)
    img_bias = img_valid_bias(img_valid, *x.shape[:2], x.device)
    return dict(pooled=pooled, guidance=guidance, pe=pe, img_bias=img_bias, ip=ip, controlnet=control)


def check_controlnet(params, x, block_samples, single_block_samples, repeat) -> tuple | None:
    """ControlNet residuals (diffusers' ``controlnet_block_samples`` /
    ``controlnet_single_block_samples``: lists of (B, S_img, inner_dim) tensors, e.g. what
    `functional_dit.controlnet.apply` returns) as the residual after each double and each
    single block (`nn.control.per_block`; ``repeat``: ``controlnet_blocks_repeat``, XLabs'
    cycling over the double blocks), or None when there are none."""
    if not isinstance(repeat, bool):
        raise ValueError(f"controlnet_blocks_repeat: expected True or False, got {repeat!r}")
    if block_samples is None and single_block_samples is None:
        return None
    leaf = reference_leaf(params, "x_embedder.weight")
    shape = (x.shape[0], x.shape[1], params.config.inner_dim)
    check = lambda name, s: None if s is None else _control.check_samples(name, s, shape, leaf.dtype, leaf.device)  # noqa: E731
    doubles = check("controlnet_block_samples", block_samples)
    singles = check("controlnet_single_block_samples", single_block_samples)
    n_double = len(ordered_blocks(params, "transformer_blocks"))
    n_single = len(ordered_blocks(params, "single_transformer_blocks"))
    return _control.per_block(doubles, n_double, repeat), _control.per_block(singles, n_single)


_IP_KEYS = ("image_proj", "tokens", "image_embeds", "layers", "scale")


def check_ip_adapter(params, ip: dict, B: int) -> dict:
    """IP-Adapter's inputs (diffusers' ``MultiIPAdapterImageProjection`` and
    ``FluxIPAdapterAttnProcessor``), per adapter j: ``image_proj[j]`` its projection
    ({"image_embeds": linear, "norm": layer norm}), ``tokens[j]`` its tokens per image,
    ``image_embeds[j]`` (B, I, E) its image embeddings; per double block i:
    ``layers[i][j]`` ({"to_k_ip": linear, "to_v_ip": linear}) and ``scale[i][j]``. Not
    on a mesh, nor with scanned blocks (a ValueError)."""
    if not isinstance(ip, dict) or set(ip) != set(_IP_KEYS):
        raise ValueError(f"ip_adapter: expected a dict with keys {list(_IP_KEYS)}, got {type(ip).__name__}")
    n, blocks = len(ip["image_proj"]), len(ordered_blocks(params, "transformer_blocks"))
    if not (len(ip["tokens"]) == len(ip["image_embeds"]) == n) or len(ip["layers"]) != blocks:
        raise ValueError(
            f"ip_adapter: expected {n} tokens and image_embeds (one per adapter) and {blocks} layers (one per double "
            f"block), got {len(ip['tokens'])}, {len(ip['image_embeds'])} and {len(ip['layers'])}"
        )
    if any(len(layer) != n for layer in ip["layers"]) or any(len(s) != n for s in ip["scale"]):
        raise ValueError(f"ip_adapter: every layer and scale entry must hold {n} adapters")
    for j, e in enumerate(ip["image_embeds"]):
        if not isinstance(e, torch.Tensor) or e.ndim < 3 or e.shape[0] != B:
            raise ValueError(f"ip_adapter: image_embeds[{j}]: expected ({B}, num_images, embed_dim), got {e!r:.80}")
    busy = [a for a in ("tp", "sp", "ring", "dp") if sharding.axis_size(a) > 1]
    if busy:
        raise ValueError(
            f"ip_adapter: IP-Adapter is not supported on a mesh yet, got {busy[0]}={sharding.axis_size(busy[0])}"
        )
    return ip


prepare = check_inputs  # the old name, kept (not to confuse with fd.prepare)


def stages(
    params, x, t, txt, *, pooled, guidance, pe, img_bias=None, blocks=None, ip=None, controlnet=None
) -> _stages.Stages:
    """The model on this rank's batch as `nn.stages.Stages`: the embedded (img, txt)
    streams, the double then the single blocks, the final layer. ``blocks``: the block
    functions to call (the api passes them as compile regions, `nn.compile.regions`);
    None: this module's. ``ip``: IP-Adapter's inputs. ``controlnet``: the residual after
    each double and single block (`check_controlnet`). ``img_bias``: the padding's key bias."""
    double, single = (double_block, single_block) if blocks is None else (blocks.double_block, blocks.single_block)
    D = params.config.attention_head_dim
    img = L.linear(params["x_embedder"], x)
    t = t.to(img.dtype) * 1000
    guidance = None if guidance is None else guidance.to(img.dtype) * 1000
    vec = time_text_embed(params["time_text_embed"], t, guidance, pooled)
    txt = L.linear(params["context_embedder"], txt)
    txt, img, pe, key_bias = L.shard_joint(txt, img, pe, None, img_bias)
    img_mods, txt_mods, single_mods, out_mod = modulations(params, vec)
    ctx = dict(img_mods=img_mods, txt_mods=txt_mods, single_mods=single_mods, out_mod=out_mod, pe=pe, bias=key_bias)
    pair, extras = ("img_mods", "txt_mods"), ()
    if ip is not None:
        if _scan.scanned(params, "transformer_blocks"):
            raise ValueError("ip_adapter: IP-Adapter does not run with scanned blocks (FD_XLA_SCAN_BLOCKS); unset it")
        ctx["ip"] = ip_keys_values(ip, D)
        pair, extras = (*pair, "ip"), ("ip",)
    doubles, singles = (None, None) if controlnet is None else map(_control.local, controlnet)
    if doubles is not None:
        ctx["double_res"] = doubles
        pair, extras = (*pair, "double_res"), (*extras, "res")
    per_single = ("single_mods",)
    if singles is not None:
        ctx["single_res"], per_single = singles, ("single_mods", "single_res")
    T = txt.shape[1]
    segments = (
        _stages.Segment("transformer_blocks", _double, pair, ("pe", "bias"), (double, D, extras),
                        attention="transformer_blocks.{}.attn"),
        _stages.Segment("single_transformer_blocks", _single, per_single, ("pe", "bias"), (single, D, T),
                        enter=_stages.joint, attention="single_transformer_blocks.{}.attn"),
    )  # fmt: skip
    final = lambda img, c: final_layer(params, img, c["out_mod"])  # noqa: E731
    batched = ("img_mods", "txt_mods", "single_mods", "out_mod", "bias", "ip", "double_res", "single_res")
    return _stages.Stages(params, (img, txt), segments, ctx, final, _stages.image_rows(T), T, x.shape[1], batched)


def forward(params, x, t, txt, **inputs):
    """The model on this rank's batch (`stages`, run): returns (out sharded over "sp", its
    full length, None)."""
    out, _ = stages(params, x, t, txt, **inputs).forward()
    return out, x.shape[1], None


def _double(carry, p, layer, ctx, static):
    """One double block as a `nn.scan.layers` step: carry (img, txt); ``layer`` its
    modulations, then its ``extras``: IP-Adapter keys and values ("ip"), a ControlNet
    residual added to the image stream after the block ("res"). ``ctx["hook"]``: the
    attention module's hook (the plain block function then runs, with it)."""
    fn, D, extras = static
    more = dict(zip(extras, layer[2:]))
    kw = {"ip": more["ip"]} if "ip" in more else {}
    if ctx.get("hook") is not None:
        fn, kw = double_block, dict(kw, attn=ctx["hook"])
    img, txt = fn(p, *carry, *layer[:2], ctx["pe"], D, ctx["bias"], **kw)
    return (img + more["res"], txt) if "res" in more else (img, txt)


def _single(carry, p, layer, ctx, static):
    """One single block as a `nn.scan.layers` step: carry ((txt; img),); a second entry of
    ``layer`` is a ControlNet residual added to the image tokens after the block."""
    fn, D, T = static
    kw = {}
    if ctx.get("hook") is not None:
        fn, kw = single_block, {"attn": ctx["hook"]}
    x = fn(p, carry[0], layer[0], ctx["pe"], D, ctx["bias"], **kw)
    return (x if len(layer) == 1 else _control.add_image(x, layer[1], T),)

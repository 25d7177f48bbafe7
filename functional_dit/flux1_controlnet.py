"""FLUX.1 ControlNet (InstantX / XLabs / Union) as a pure function over its own parameter tree.

Mirrors diffusers' ``FluxControlNetModel`` (``controlnet_flux.py``): a FLUX.1 transformer
cut short (few double and single blocks, no final layer) whose image stream starts as
``x_embedder(x) + controlnet_x_embedder(cond)``, and whose every block's image output goes
through a zero-initialised ``controlnet_blocks.i`` / ``controlnet_single_blocks.i`` linear
and is scaled: those are the residuals ``FluxTransformer2DModel`` adds after its blocks
(``fd.apply(..., controlnet_block_samples=..., controlnet_single_block_samples=...)``).
Union ControlNets (``num_mode``) prepend a learned mode token to the text; XLabs' ones
(``conditioning_embedding_channels``) encode the control image with a small conv stack
(``input_hint_block``, diffusers' ``ControlNetConditioningEmbedding``) instead of taking
VAE latents, and their residuals cycle over the transformer's double blocks
(``controlnet_blocks_repeat``). The block maths are `flux1`'s own functions.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import flux1
from .configs import (
    DiTConfig,
    as_ints,
    require,
    require_bool,
    require_non_negative,
    require_positive,
    require_positive_or_none,
    require_rope_axes,
)
from .nn import layers as L
from .nn.checks import check_tensor, reference_leaf
from .params import ParamSpec, linear_spec, ordered_blocks

DIFFUSERS_CLASS = "FluxControlNetModel"
NAME = "FLUX.1 ControlNet"
KEY = "flux1-controlnet"
TRANSFORMER = flux1  # the family whose transformer takes this ControlNet's residuals
HINT_CHANNELS = (16, 16, 16, 16)  # diffusers' input_hint_block: block_out_channels, 3 stride-2 convs
HINT_IN = 3  # RGB control images


@dataclasses.dataclass(frozen=True)
class Flux1ControlNetConfig(DiTConfig):
    """diffusers ``FluxControlNetModel`` config (its ``__init__`` keys and defaults)."""

    patch_size: int = 1
    in_channels: int = 64
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    num_mode: int | None = None  # Union ControlNets: the number of control modes (a learned token each)
    conditioning_embedding_channels: int | None = None  # XLabs: the control image goes through input_hint_block

    out_channels = None  # DiTConfig's out_dim reads it; a ControlNet has no output projection

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
        require_non_negative(self, "num_layers", "num_single_layers")
        require_positive_or_none(self, "num_mode", "conditioning_embedding_channels")
        require_bool(self, "guidance_embeds")
        require_rope_axes(self)
        if self.conditioning_embedding_channels is not None:
            per_token = self.conditioning_embedding_channels * self.patch_size**2
            require(
                per_token == self.in_channels,
                f"{type(self).__name__}: conditioning_embedding_channels x patch_size² = {per_token} must equal "
                f"in_channels = {self.in_channels} (the hint tokens go through controlnet_x_embedder)",
            )

    @property
    def mlp_hidden_dim(self) -> int:
        return 4 * self.inner_dim

    def param_specs(self) -> dict:
        return param_specs(self)


PRESETS = {
    # Tiny ControlNets for tests, with flux1-tiny's widths (and the tiny pipelines').
    "flux1-controlnet-tiny": Flux1ControlNetConfig(
        in_channels=16,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=24,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ),
}
PRESETS["flux1-controlnet-union-tiny"] = dataclasses.replace(PRESETS["flux1-controlnet-tiny"], num_mode=3)
# XLabs' layout: double blocks only, the control image through input_hint_block (H/8), patchified 2x2
# into in_channels = 4 x conditioning_embedding_channels (released: 64 = 4 x 16).
PRESETS["flux1-controlnet-xlabs-tiny"] = dataclasses.replace(
    PRESETS["flux1-controlnet-tiny"], patch_size=2, num_single_layers=0, conditioning_embedding_channels=4
)
CONFIG = Flux1ControlNetConfig
TINY = "flux1-controlnet-tiny"


# ----------------------------------------------------------------------------- specs


def _conv_spec(c_out: int, c_in: int) -> dict:
    return {"weight": ParamSpec((c_out, c_in, 3, 3), ("conv_out", "conv_in", None, None)),
            "bias": ParamSpec((c_out,), ("conv_out",))}  # fmt: skip


def _hint_specs(c) -> dict:
    """diffusers ``ControlNetConditioningEmbedding(conditioning_embedding_channels, block_out_channels=(16,) * 4)``."""
    ch = HINT_CHANNELS
    blocks = {}
    for i in range(len(ch) - 1):
        blocks[str(2 * i)], blocks[str(2 * i + 1)] = _conv_spec(ch[i], ch[i]), _conv_spec(ch[i + 1], ch[i])
    return {"conv_in": _conv_spec(ch[0], HINT_IN), "blocks": blocks,
            "conv_out": _conv_spec(c.conditioning_embedding_channels, ch[-1])}  # fmt: skip


def param_specs(c: Flux1ControlNetConfig) -> dict:
    """Nested dict of `ParamSpec` in diffusers ``state_dict`` order; allocates nothing. The
    blocks are FLUX.1's (`flux1`), so they shard as the transformer's do; the ControlNet's
    own projections are replicated."""
    n = c.inner_dim
    out = lambda: linear_spec(n, n, "embed", "embed")  # noqa: E731
    tree = {
        "time_text_embed": flux1._time_text_specs(c),
        "context_embedder": linear_spec(n, c.joint_attention_dim, "embed", "txt_embed"),
        "x_embedder": linear_spec(n, c.in_channels, "embed", "channels"),
        "transformer_blocks": {str(i): flux1._double_block_specs(c) for i in range(c.num_layers)},
        "single_transformer_blocks": {str(i): flux1._single_block_specs(c) for i in range(c.num_single_layers)},
        "controlnet_blocks": {str(i): out() for i in range(c.num_layers)},
        "controlnet_single_blocks": {str(i): out() for i in range(c.num_single_layers)},
    }
    if c.num_mode is not None:
        tree["controlnet_mode_embedder"] = {"weight": ParamSpec((c.num_mode, n), ("mode", "embed"))}
    if c.conditioning_embedding_channels is not None:
        tree["input_hint_block"] = _hint_specs(c)
    tree["controlnet_x_embedder"] = linear_spec(n, c.in_channels, "embed", "channels")
    return tree


# ----------------------------------------------------------------------------- inputs

ARGS = ("pooled", "guidance", "img_ids", "txt_ids", "rope", "mode")
BATCHED = ("pooled", "guidance", "cond", "mode")  # of check_inputs' outputs, split over "dp" with x, t, txt


def blocks_repeat(params) -> bool:
    """``controlnet_blocks_repeat``, as FluxControlNetPipeline decides it: XLabs' ControlNets
    (those with an ``input_hint_block``) cycle their residuals over the double blocks."""
    return "input_hint_block" in params.tree


def _check_cond(params, cond, B: int, S: int, leaf) -> None:
    c = params.config
    if c.conditioning_embedding_channels is None:  # VAE latents, packed as x
        check_tensor("cond", cond, (B, S, c.in_channels), leaf.dtype, leaf.device)
        return
    check_tensor("cond", cond, (B, HINT_IN, None, None), leaf.dtype, leaf.device)
    down = 2 ** (len(HINT_CHANNELS) - 1) * c.patch_size
    H, W = cond.shape[2:]
    if H % down or W % down or (H // down) * (W // down) != S:
        raise ValueError(
            f"cond: a ({H}, {W}) control image gives ({H}/{down}) x ({W}/{down}) hint tokens; expected {S} "
            f"(x's image tokens), each dim a multiple of {down}"
        )


def _check_mode(params, mode, B: int, leaf):
    c = params.config
    if c.num_mode is None:
        if mode is not None:
            raise ValueError("mode: this ControlNet has num_mode=None (not a Union ControlNet); expected None")
        return None
    if mode is None:
        raise ValueError(f"mode: a Union ControlNet (num_mode={c.num_mode}) needs control modes of shape ({B},)")
    mode = mode.reshape(B, 1) if isinstance(mode, torch.Tensor) and mode.shape in ((B,), (B, 1)) else mode
    check_tensor("mode", mode, (B, 1), device=leaf.device)
    if mode.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mode: expected int64 or int32 mode indices, got {mode.dtype}")
    return mode


def check_inputs(
    params, x, t, txt, cond, *, mode=None, pooled=None, guidance=None, img_ids=None, txt_ids=None, rope=None
) -> dict:
    """Checks the inputs (full view) and returns `forward`'s keywords. x, t, txt, pooled,
    guidance, img_ids, txt_ids, rope: as `flux1.check_inputs` (what the transformer gets at
    the same step). ``cond``: the control latents packed as x (B, S_img, in_channels), or
    for a ControlNet with an ``input_hint_block`` the control image (B, 3, H, W).
    ``mode``: a Union ControlNet's control mode per item, (B,) or (B, 1) ints."""
    base = flux1.check_inputs(params, x, t, txt, pooled=pooled, guidance=guidance, img_ids=img_ids, txt_ids=txt_ids,
                              rope=rope)  # fmt: skip
    leaf = reference_leaf(params, "x_embedder.weight")
    _check_cond(params, cond, *x.shape[:2], leaf)
    mode = _check_mode(params, mode, x.shape[0], leaf)
    pe = base["pe"]
    if mode is not None:  # the mode token sits before the text, at the first text token's position
        pe = tuple(torch.cat([a[:1], a]) for a in pe)
    return dict(pooled=pooled, guidance=guidance, pe=pe, cond=cond, mode=mode)


# ----------------------------------------------------------------------------- forward


def hint(p, image: torch.Tensor) -> torch.Tensor:
    """``input_hint_block``: (B, 3, H, W) -> (B, conditioning_embedding_channels, H/8, W/8),
    convolutions with SiLU between them (diffusers' ``ControlNetConditioningEmbedding``)."""
    conv = lambda q, y, stride=1: F.conv2d(y, q["weight"], q["bias"], stride=stride, padding=1)  # noqa: E731
    y = F.silu(conv(p["conv_in"], image))
    for i, q in enumerate(p["blocks"][k] for k in sorted(p["blocks"], key=int)):
        y = F.silu(conv(q, y, stride=1 + i % 2))
    return conv(p["conv_out"], y)


def cond_tokens(params, cond: torch.Tensor) -> torch.Tensor:
    """The control input as (B, S_img, in_channels) tokens: as given, or the hint block's
    features patchified as diffusers does (channels then the patch, per token)."""
    if "input_hint_block" not in params.tree:
        return cond
    y = hint(params["input_hint_block"], cond)
    p = params.config.patch_size
    B, C, H, W = y.shape
    y = y.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return y.reshape(B, (H // p) * (W // p), -1)


def modulations(params, vec) -> tuple[list, list, list]:
    """Every block's AdaLN modulation from vec (B, C) (`flux1.modulations` without a final layer)."""
    doubles = ordered_blocks(params, "transformer_blocks")
    singles = ordered_blocks(params, "single_transformer_blocks")
    layers = [(b["norm1"]["linear"], 6) for b in doubles] + [(b["norm1_context"]["linear"], 6) for b in doubles]
    mods = L.modulations(layers + [(b["norm"]["linear"], 3) for b in singles], vec) if layers or singles else []
    n = len(doubles)
    return mods[:n], mods[n : 2 * n], mods[2 * n :]


def embed(params, x, t, txt, pooled, guidance, cond, mode):
    """The image stream (with the control input), vec and the text stream (after the mode token)."""
    img = L.linear(params["x_embedder"], x)
    img = img + L.linear(params["controlnet_x_embedder"], cond_tokens(params, cond))
    t = t.to(img.dtype) * 1000
    guidance = None if guidance is None else guidance.to(img.dtype) * 1000
    vec = flux1.time_text_embed(params["time_text_embed"], t, guidance, pooled)
    txt = L.linear(params["context_embedder"], txt)
    if mode is not None:
        txt = torch.cat([F.embedding(mode, params["controlnet_mode_embedder"]["weight"]), txt], 1)
    return img, vec, txt


def forward(params, x, t, txt, *, pooled, guidance, pe, cond, mode, scale: float = 1.0):
    """The ControlNet on this rank's batch: returns ((double-block residuals, single-block
    residuals), each a list of (B, S_img, C) sharded over "sp" or None when empty, and
    S_img)."""
    D, S = params.config.attention_head_dim, x.shape[1]
    img, vec, txt = embed(params, x, t, txt, pooled, guidance, cond, mode)
    txt, img, pe, key_bias = L.shard_joint(txt, img, pe)
    img_mods, txt_mods, single_mods = modulations(params, vec)
    doubles = []
    for p, im, tm in zip(ordered_blocks(params, "transformer_blocks"), img_mods, txt_mods):
        img, txt = flux1.double_block(p, img, txt, im, tm, pe, D, key_bias)
        doubles.append(img)
    x, T, singles = torch.cat([txt, img], 1), txt.shape[1], []
    for p, m in zip(ordered_blocks(params, "single_transformer_blocks"), single_mods):
        x = flux1.single_block(p, x, m, pe, D, key_bias)
        singles.append(x[:, T:])
    out = [residuals(params, name, s, scale) for name, s in (("controlnet_blocks", doubles),
                                                             ("controlnet_single_blocks", singles))]  # fmt: skip
    return tuple(out), S


def residuals(params, name: str, samples: list, scale: float) -> list | None:
    """Each block output through its zero-initialised linear, times ``scale``; None for none."""
    out = [L.linear(p, s) * scale for p, s in zip(ordered_blocks(params, name), samples)]
    return out or None


def fd_apply_args(samples: tuple, params) -> dict:
    """The keywords of `fd.apply` (and the stock transformer's forward) these residuals are."""
    return {
        "controlnet_block_samples": samples[0],
        "controlnet_single_block_samples": samples[1],
        "controlnet_blocks_repeat": blocks_repeat(params),
    }

"""Qwen-Image ControlNet as a pure function over its own parameter tree.

Mirrors diffusers' ``QwenImageControlNetModel`` (``controlnet_qwenimage.py``): a
Qwen-Image transformer cut short (few blocks, no final layer) whose image stream starts as
``img_in(x) + controlnet_x_embedder(cond)``, and whose every block's image output goes
through a zero-initialised ``controlnet_blocks.i`` linear and is scaled: the residuals
``QwenImageTransformer2DModel`` adds after its blocks (``fd.apply(...,
controlnet_block_samples=...)``). ``extra_condition_channels`` (ControlNet-Inpainting)
widens the control input. The block maths are `qwenimage`'s own functions.
"""

from __future__ import annotations

import dataclasses

from . import qwenimage
from .configs import (
    DiTConfig,
    as_ints,
    require_non_negative,
    require_positive,
    require_positive_or_none,
    require_rope_axes,
)
from .nn import layers as L
from .nn.checks import check_tensor, reference_leaf
from .params import linear_spec, norm_spec, ordered_blocks

DIFFUSERS_CLASS = "QwenImageControlNetModel"
NAME = "Qwen-Image ControlNet"
KEY = "qwenimage-controlnet"
TRANSFORMER = qwenimage  # the family whose transformer takes this ControlNet's residuals


@dataclasses.dataclass(frozen=True)
class QwenImageControlNetConfig(DiTConfig):
    """diffusers ``QwenImageControlNetModel`` config (its ``__init__`` keys and defaults)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16  # kept as diffusers keeps it; a ControlNet has no output projection
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    extra_condition_channels: int = 0  # ControlNet-Inpainting: the mask (and masked image) channels

    # What `qwenimage.check_inputs` reads of a transformer config; a ControlNet has none of these.
    zero_cond_t = False
    use_additional_t_cond = False
    use_layer3d_rope = False

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", as_ints(self.axes_dims_rope))
        require_positive(
            self, "patch_size", "in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim"
        )
        require_positive_or_none(self, "out_channels")
        require_non_negative(self, "num_layers", "extra_condition_channels")
        require_rope_axes(self, n_axes=3)

    @property
    def mlp_hidden_dim(self) -> int:
        return 4 * self.inner_dim

    def param_specs(self) -> dict:
        return param_specs(self)


PRESETS = {
    # A tiny ControlNet for tests, with qwen-image-tiny's widths (and the tiny pipeline's).
    "qwen-image-controlnet-tiny": QwenImageControlNetConfig(
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    ),
}
CONFIG = QwenImageControlNetConfig
TINY = "qwen-image-controlnet-tiny"


def param_specs(c: QwenImageControlNetConfig) -> dict:
    """Nested dict of `ParamSpec` in diffusers ``state_dict`` order; allocates nothing. The
    blocks are Qwen-Image's (`qwenimage`), so they shard as the transformer's do."""
    n = c.inner_dim
    return {
        "time_text_embed": {
            "timestep_embedder": {
                "linear_1": linear_spec(n, 256, "embed", "freq"),
                "linear_2": linear_spec(n, n, "embed", "embed"),
            }
        },
        "txt_norm": norm_spec(c.joint_attention_dim, "txt_embed"),
        "img_in": linear_spec(n, c.in_channels, "embed", "channels"),
        "txt_in": linear_spec(n, c.joint_attention_dim, "embed", "txt_embed"),
        "transformer_blocks": {str(i): qwenimage._block_specs(c) for i in range(c.num_layers)},
        "controlnet_blocks": {str(i): linear_spec(n, n, "embed", "embed") for i in range(c.num_layers)},
        "controlnet_x_embedder": linear_spec(n, c.in_channels + c.extra_condition_channels, "embed", "channels"),
    }


ARGS = ("txt_mask", "img_shapes", "rope")
BATCHED = ("bias", "cond")  # of check_inputs' outputs, split over "dp" with x, t, txt


def check_inputs(params, x, t, txt, cond, *, txt_mask=None, img_shapes=None, rope=None) -> dict:
    """Checks the inputs (full view) and returns `forward`'s keywords. x, t, txt, txt_mask,
    img_shapes, rope: as `qwenimage.check_inputs` (what the transformer gets at the same
    step). ``cond``: the control latents packed as x, (B, S_img, in_channels +
    extra_condition_channels)."""
    base = qwenimage.check_inputs(params, x, t, txt, txt_mask=txt_mask, img_shapes=img_shapes, rope=rope)
    leaf = reference_leaf(params, "img_in.weight")
    c = params.config
    check_tensor("cond", cond, (*x.shape[:2], c.in_channels + c.extra_condition_channels), leaf.dtype, leaf.device)
    return dict(pe=base["pe"], bias=base["bias"], cond=cond)


def forward(params, x, t, txt, *, pe, bias, cond, scale: float = 1.0):
    """The ControlNet on this rank's batch: returns ((block residuals,), each (B, S_img, C)
    sharded over "sp", or None when there are no blocks; S_img)."""
    D, S = params.config.attention_head_dim, x.shape[1]
    img = L.linear(params["img_in"], x)
    img = img + L.linear(params["controlnet_x_embedder"], cond)
    # diffusers embeds the timestep as given (not first cast to the model dtype, as the transformer does)
    temb = L.mlp_embed(params["time_text_embed"]["timestep_embedder"], qwenimage.timestep_proj(t).to(img.dtype))
    txt = L.linear(params["txt_in"], L.rms_norm_fp32(params["txt_norm"], txt))
    txt, img, pe, key_bias = L.shard_joint(txt, img, pe, bias)
    blocks = ordered_blocks(params, "transformer_blocks")
    mods = L.modulations([(b["img_mod"]["1"], 6) for b in blocks] + [(b["txt_mod"]["1"], 6) for b in blocks], temb)
    samples = []
    for p, im, tm in zip(blocks, mods[: len(blocks)], mods[len(blocks) :]):
        img, txt = qwenimage.block(p, img, txt, im, tm, pe, D, key_bias)
        samples.append(img)
    out = [L.linear(p, s) * scale for p, s in zip(ordered_blocks(params, "controlnet_blocks"), samples)]
    return (out or None,), S


def fd_apply_args(samples: tuple, params) -> dict:
    """The keywords of `fd.apply` (and the stock transformer's forward) these residuals are."""
    return {"controlnet_block_samples": samples[0]}

"""Tiny Qwen-Image configs and example inputs, shared by the parity, sharding and weights tests."""

from __future__ import annotations

import torch

import functional_dit as fd

TINY = fd.PRESETS["qwen-image-tiny"]  # Qwen-Image: 4 heads x 16, patch 2, 2 layers
TINY_EDIT = fd.QwenImageConfig(  # Edit-2511 style: zero_cond_t; patch 1, out_channels None
    patch_size=1,
    in_channels=8,
    out_channels=None,
    num_layers=1,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=12,
    axes_dims_rope=(2, 2, 4),
    zero_cond_t=True,
)
TINY_LAYERED = fd.QwenImageConfig(  # Layered style: additional_t_cond and layer-3D RoPE
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=16,
    axes_dims_rope=(2, 2, 4),
    use_additional_t_cond=True,
    use_layer3d_rope=True,
)


def default_img_shapes(config) -> list[tuple[int, int, int]]:
    """One batch item's img_shapes as the matching pipeline builds them: Qwen-Image one
    target; Edit the target then reference images; Layered (layers + 1) outputs then the
    condition image."""
    if config.use_layer3d_rope:
        return [(1, 2, 3)] * 3 + [(1, 4, 3)]
    if config.zero_cond_t:
        return [(1, 3, 4), (1, 2, 3)]
    return [(1, 3, 4)]


def text_mask(batch: int, txt_len: int, ragged: bool = True, holes: bool = False):
    """(B, S_txt) mask. ``ragged``: item b keeps its first max(1, S_txt - 3b) tokens (a long
    0/1 mask, as the pipelines pass); ``holes``: also drops interior tokens (a bool mask)."""
    keep = torch.ones(batch, txt_len, dtype=torch.long)
    for b in range(batch):
        if ragged:
            keep[b, max(1, txt_len - 3 * b) :] = 0
        if holes:
            keep[b, b + 1 : txt_len - 1 : 2] = 0
    return keep.bool() if holes else keep


def inputs(
    config,
    batch: int = 2,
    txt_len: int = 7,
    img_shapes=None,
    seed: int = 0,
    dtype=torch.float32,
    ragged: bool = True,
    holes: bool = False,
    mask: bool = True,
) -> dict:
    """Keyword arguments for `fd.apply` (x, t, txt, txt_mask, img_shapes and, for Layered,
    additional_t_cond). Padded text tokens hold random values, not zeros, so a leak through
    the mask would show. ``mask=False`` passes txt_mask=None (all tokens real)."""
    g = torch.Generator().manual_seed(seed)
    shapes = list(img_shapes or default_img_shapes(config))
    S = sum(f * h * w for f, h, w in shapes)
    kw = dict(
        x=torch.randn(batch, S, config.in_channels, generator=g).to(dtype),
        t=torch.rand(batch, generator=g),
        txt=torch.randn(batch, txt_len, config.joint_attention_dim, generator=g).to(dtype),
        txt_mask=text_mask(batch, txt_len, ragged, holes) if mask else None,
        img_shapes=[shapes] * batch,
    )
    if config.use_additional_t_cond:
        kw["additional_t_cond"] = torch.arange(batch) % 2  # 0 = RGB, 1 = the other branch
    return kw


def diffusers_kwargs(kw: dict) -> dict:
    """The same inputs under `QwenImageTransformer2DModel.forward`'s argument names."""
    out = dict(
        hidden_states=kw["x"],
        encoder_hidden_states=kw["txt"],
        encoder_hidden_states_mask=kw.get("txt_mask"),
        timestep=kw["t"],
        img_shapes=kw["img_shapes"],
        return_dict=False,
    )
    if kw.get("additional_t_cond") is not None:
        out["additional_t_cond"] = kw["additional_t_cond"]
    return out

"""Tiny FLUX.1 configs and example inputs, shared by the parity, sharding and weights tests."""

from __future__ import annotations

import torch

import functional_dit as fd

TINY = fd.PRESETS["flux1-tiny"]  # guidance-distilled, 2 heads x 16
TINY_SCHNELL = fd.Flux1Config(
    in_channels=8,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=12,
    pooled_projection_dim=10,
    guidance_embeds=False,
    axes_dims_rope=(2, 2, 4),
)


def inputs(
    config,
    batch: int = 2,
    txt_len: int = 7,
    h: int = 3,
    w: int = 4,
    seed: int = 0,
    dtype=torch.float32,
    ids_3d: bool = False,
) -> dict:
    """Keyword arguments for `fd.apply` (x, t, txt, pooled, guidance, img_ids, txt_ids) on an
    h x w latent grid; ids are random, not zero, so RoPE is exercised on every axis."""
    g = torch.Generator().manual_seed(seed)
    S = h * w
    img_ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(h) * 1.0, torch.arange(w) * 1.0, indexing="ij"), -1
    ).reshape(S, 3)
    img_ids = img_ids + torch.randn(S, 3, generator=g)
    txt_ids = torch.randn(txt_len, 3, generator=g) * 3
    if ids_3d:
        img_ids, txt_ids = img_ids.expand(batch, -1, -1), txt_ids.expand(batch, -1, -1)
    kw = dict(
        x=torch.randn(batch, S, config.in_channels, generator=g).to(dtype),
        t=torch.rand(batch, generator=g),
        txt=torch.randn(batch, txt_len, config.joint_attention_dim, generator=g).to(dtype),
        pooled=torch.randn(batch, config.pooled_projection_dim, generator=g).to(dtype),
        img_ids=img_ids,
        txt_ids=txt_ids,
    )
    if config.guidance_embeds:
        kw["guidance"] = 1 + 4 * torch.rand(batch, generator=g)
    return kw


def diffusers_kwargs(kw: dict) -> dict:
    """The same inputs under `FluxTransformer2DModel.forward`'s argument names."""
    return dict(
        hidden_states=kw["x"],
        timestep=kw["t"],
        encoder_hidden_states=kw["txt"],
        pooled_projections=kw["pooled"],
        guidance=kw.get("guidance"),
        img_ids=kw["img_ids"],
        txt_ids=kw["txt_ids"],
        return_dict=False,
    )

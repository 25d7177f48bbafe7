"""Tiny FLUX.3 configs and example inputs, shared by the parity, sharding and weights tests."""

from __future__ import annotations

import torch

import functional_dit as fd

TINY = fd.PRESETS["flux3-tiny"]  # a flow map (like flux-3-image-klein), 4 heads x 16
TINY_BASE = fd.Flux3Config(  # like klein-base: no flow map; odd sizes everywhere else
    in_channels=12,
    cond_in_channels=20,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=12,
    num_attention_heads=2,
    joint_attention_dim=20,
    timestep_channels=16,
    mlp_ratio=2.5,  # int(24 * 2.5) = 60
    axes_dims_rope=(2, 4, 2, 4),
    rope_theta=2000,
    eps=1e-5,
)


def _grid_ids(t: float, h: int, w: int, g: torch.Generator) -> torch.Tensor:
    """(h*w, 4) ids (t, row, col, 0) plus noise, so RoPE sees every axis."""
    rows, cols = torch.meshgrid(torch.arange(h) * 1.0, torch.arange(w) * 1.0, indexing="ij")
    ids = torch.stack([torch.full_like(rows, t), rows, cols, torch.zeros_like(rows)], -1).reshape(h * w, 4)
    return ids + torch.randn(ids.shape, generator=g)


def inputs(config, batch=2, txt_len=7, h=3, w=4, ref_hw=None, seed=0, dtype=torch.float32) -> dict:
    """Keyword arguments for `fd.apply`: x, t, txt, ids, reference tokens when ``ref_hw``
    (their ids at t = 10) and target_timestep for a flow map."""
    g = torch.Generator().manual_seed(seed)
    txt_ids = torch.stack([torch.zeros(txt_len)] * 3 + [torch.arange(txt_len) * 1.0], -1)
    kw = dict(
        x=torch.randn(batch, h * w, config.in_channels, generator=g).to(dtype),
        t=torch.rand(batch, generator=g),
        txt=torch.randn(batch, txt_len, config.joint_attention_dim, generator=g).to(dtype),
        img_ids=_grid_ids(0, h, w, g),
        txt_ids=txt_ids + torch.randn(txt_ids.shape, generator=g),
    )
    if ref_hw is not None:
        n = ref_hw[0] * ref_hw[1]
        kw["image_cond"] = torch.randn(batch, n, config.cond_in_channels, generator=g).to(dtype)
        kw["image_cond_ids"] = _grid_ids(10, *ref_hw, g)
    if config.flow_map:
        kw["target_timestep"] = kw["t"] * torch.rand(batch, generator=g)
    return kw


def diffusers_kwargs(kw: dict) -> dict:
    """The same inputs under `Flux3Transformer2DModel.forward`'s argument names."""
    return dict(
        hidden_states=kw["x"],
        encoder_hidden_states=kw["txt"],
        timestep=kw["t"],
        img_ids=kw["img_ids"],
        txt_ids=kw["txt_ids"],
        image_cond_hidden_states=kw.get("image_cond"),
        image_cond_ids=kw.get("image_cond_ids"),
        target_timestep=kw.get("target_timestep"),
        return_dict=False,
    )

"""Tiny FLUX.2 configs and example inputs, shared by the parity, sharding and weights tests."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_flux2 import (
    Flux2KVAttnProcessor,
    Flux2KVCache,
    Flux2KVParallelSelfAttnProcessor,
)

import functional_dit as fd

TINY = fd.PRESETS["flux2-tiny"]  # guidance-distilled (like dev), 4 heads x 16
TINY_KLEIN = fd.Flux2Config(  # like klein: no guidance; also odd sizes everywhere else
    patch_size=2,
    in_channels=12,
    out_channels=3,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=12,
    num_attention_heads=2,
    joint_attention_dim=20,
    timestep_guidance_channels=16,
    mlp_ratio=2.5,  # int(24 * 2.5) = 60
    axes_dims_rope=(2, 4, 2, 4),
    rope_theta=10000,
    eps=1e-5,
    guidance_embeds=False,
)


def _grid_ids(t: float, h: int, w: int) -> torch.Tensor:
    """(h*w, 4) ids (t, row, col, 0) as diffusers' Flux2 pipelines build them."""
    rows, cols = torch.meshgrid(torch.arange(h) * 1.0, torch.arange(w) * 1.0, indexing="ij")
    return torch.stack([torch.full_like(rows, t), rows, cols, torch.zeros_like(rows)], -1).reshape(h * w, 4)


def _ids(base: torch.Tensor, batch: int, ids_3d: bool, g: torch.Generator) -> torch.Tensor:
    """Grid ids plus noise, so RoPE sees non-zero values on every axis. 3-D ids differ
    per batch item: diffusers (and `fd.apply`) use the first item only."""
    ids = base + torch.randn(base.shape, generator=g)
    if not ids_3d:
        return ids
    return torch.stack([ids] + [ids + torch.randn(base.shape, generator=g) for _ in range(batch - 1)])


def inputs(
    config,
    batch: int = 2,
    txt_len: int = 7,
    h: int = 3,
    w: int = 4,
    seed: int = 0,
    dtype=torch.float32,
    ids_3d: bool = False,
    ref_hw: tuple[int, int] | None = None,
    ref_fixed_timestep: float | None = None,
) -> dict:
    """Keyword arguments for `fd.apply` on an h x w latent grid (x, t, txt, img_ids, txt_ids
    and guidance when the model embeds it). With ``ref_hw`` a reference image of that grid
    is prepended to x and img_ids (its ids at t=10, as the klein pipelines do) and the
    arguments ask for ``kv_cache="extract"``; `next_step` builds the following cached step."""
    g = torch.Generator().manual_seed(seed)
    img_ids = _grid_ids(0, h, w)
    txt_base = torch.stack([torch.zeros(txt_len)] * 3 + [torch.arange(txt_len) * 1.0], -1)
    S = h * w
    kw = {}
    if ref_hw is not None:
        img_ids = torch.cat([_grid_ids(10, *ref_hw), img_ids])
        S += ref_hw[0] * ref_hw[1]
        kw = dict(kv_cache="extract", num_ref_tokens=ref_hw[0] * ref_hw[1])
        if ref_fixed_timestep is not None:
            kw["ref_fixed_timestep"] = ref_fixed_timestep
    kw = dict(
        x=torch.randn(batch, S, config.in_channels, generator=g).to(dtype),
        t=torch.rand(batch, generator=g),
        txt=torch.randn(batch, txt_len, config.joint_attention_dim, generator=g).to(dtype),
        img_ids=_ids(img_ids, batch, ids_3d, g),
        txt_ids=_ids(txt_base, batch, ids_3d, g),
        **kw,
    )
    if config.guidance_embeds:
        kw["guidance"] = 1 + 4 * torch.rand(batch, generator=g)
    return kw


def next_step(kw: dict, cache, seed: int = 1) -> dict:
    """The cached step after an extract step ``kw``: new latents and timestep over the img
    tokens only (the reference rows dropped from x and img_ids), ``kv_cache=cache``."""
    g = torch.Generator().manual_seed(seed)
    R = kw["num_ref_tokens"]
    x = kw["x"][:, R:]
    rest = {k: v for k, v in kw.items() if k not in ("kv_cache", "num_ref_tokens", "ref_fixed_timestep")}
    return {
        **rest,
        "x": torch.randn(x.shape, generator=g).to(x.dtype),
        "t": kw["t"] * torch.rand(kw["t"].shape, generator=g),
        "img_ids": kw["img_ids"][..., R:, :],
        "kv_cache": cache,
    }


def to_diffusers_cache(cache: fd.Flux2KVCache) -> Flux2KVCache:
    """Our cache as diffusers' ``Flux2KVCache`` object (sharing storage)."""
    c = cache.config
    out = Flux2KVCache(c.num_layers, c.num_single_layers)
    out.num_ref_tokens = cache.num_ref_tokens
    for kind, layers in (
        ("transformer_blocks", out.double_block_caches),
        ("single_transformer_blocks", out.single_block_caches),
    ):
        for i, layer in enumerate(layers):
            layer.store(cache[kind][str(i)]["k"], cache[kind][str(i)]["v"])
    return out


def use_kv_processors(module) -> None:
    """What ``Flux2KleinKVPipeline.__init__`` does to its transformer: KV-cache-aware attention."""
    for block in module.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in module.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())


def diffusers_kwargs(kw: dict, kv_cache=None) -> dict:
    """The same inputs under `Flux2Transformer2DModel.forward`'s argument names. A cached
    step passes ``kv_cache`` (diffusers' object) or converts ours with `to_diffusers_cache`;
    the module needs `use_kv_processors` for either KV mode."""
    out = dict(
        hidden_states=kw["x"],
        timestep=kw["t"],
        encoder_hidden_states=kw["txt"],
        guidance=kw.get("guidance"),
        img_ids=kw["img_ids"],
        txt_ids=kw["txt_ids"],
        return_dict=False,
    )
    if kw.get("kv_cache") == "extract":
        out.update(kv_cache_mode="extract", num_ref_tokens=kw["num_ref_tokens"])
        if kw.get("ref_fixed_timestep") is not None:
            out["ref_fixed_timestep"] = kw["ref_fixed_timestep"]
    elif kw.get("kv_cache") is not None:
        out.update(kv_cache_mode="cached", kv_cache=kv_cache or to_diffusers_cache(kw["kv_cache"]))
    return out

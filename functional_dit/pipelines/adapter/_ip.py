"""FLUX.1's IP-Adapter on `fd.DiffusersTransformer`, over `flux1`'s ``ip_adapter`` input.

``_load_ip_adapter_weights`` (what ``FluxPipeline.load_ip_adapter`` calls) is the stock
loader run on the adapter: it builds the stock weight holders — a
``FluxIPAdapterAttnProcessor`` per double block (``to_k_ip`` / ``to_v_ip`` per adapter,
``scale``) set through ``set_attn_processor``, and ``encoder_hid_proj`` (the image
projections) — so ``attn_processors``, the pipelines' ``set_ip_adapter_scale`` and
``unload_ip_adapter`` see what they see on the stock module. Nothing in them computes:
a forward given ``joint_attention_kwargs={"ip_adapter_image_embeds": ...}`` reads their
weights and scales into `flux1.check_ip_adapter`'s dict, and `fd.apply` computes the
image-prompt attention (`flux1.ip_attention`). Their parameters stay out of
``adapter.params`` (the base model's tree). FLUX.1 only, not on a mesh; step caches take it.
"""

from __future__ import annotations

import torch
from diffusers.loaders.transformer_flux import FluxTransformer2DLoadersMixin
from diffusers.models.embeddings import ImageProjection
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

from ..families import product as _product

IP_KEYS = ("encoder_hid_proj.", ".processor.")  # parameter names of the IP weight holders


def is_ip_weight(name: str) -> bool:
    """Whether a parameter name belongs to IP-Adapter's weight holders, not the base model."""
    return name.startswith(IP_KEYS[0]) or IP_KEYS[1] in name


def _linear(m: torch.nn.Linear) -> dict:
    return {"weight": m.weight, "bias": m.bias}


class IPAdapterMixin:
    """See the module docstring."""

    # the stock converters the stock loader calls (they build the stock weight holders)
    _convert_ip_adapter_attn_to_diffusers = FluxTransformer2DLoadersMixin._convert_ip_adapter_attn_to_diffusers
    _convert_ip_adapter_image_proj_to_diffusers = (
        FluxTransformer2DLoadersMixin._convert_ip_adapter_image_proj_to_diffusers
    )

    @property
    def inner_dim(self) -> int:
        """The stock classes' attention width (what the stock IP loader reads)."""
        return self.config.num_attention_heads * self.config.attention_head_dim

    def _load_ip_adapter_weights(self, state_dicts, low_cpu_mem_usage: bool = True) -> None:
        if not _product(self._family_name).IP_ADAPTER:
            raise ValueError(
                f"_load_ip_adapter_weights: {type(self).__name__} (functional_dit) has no IP-Adapter support; "
                "IP-Adapter is FLUX.1's (FluxTransformer2DModel)"
            )
        if self.layerwise_hook() is not None:
            raise ValueError("_load_ip_adapter_weights: layerwise casting is enabled; load IP-Adapter before it")
        FluxTransformer2DLoadersMixin._load_ip_adapter_weights(self, state_dicts, low_cpu_mem_usage=low_cpu_mem_usage)

    def _ip_processors(self) -> list:
        """The double blocks' IP-Adapter processors, in block order (empty without IP-Adapter)."""
        return ip_processors(self)

    def ip_adapter_input(self, embeds) -> dict | None:
        """`flux1.check_ip_adapter`'s dict for ``ip_adapter_image_embeds`` (`ip_adapter_input`)."""
        return ip_adapter_input(self, embeds)


def ip_processors(module) -> list:
    """A FLUX.1 transformer's (stock or adapter) double-block IP-Adapter processors, in block
    order (empty without IP-Adapter)."""
    procs = [b.attn.get_processor() for b in getattr(module, "transformer_blocks", [])]
    return procs if procs and all(isinstance(p, FluxIPAdapterAttnProcessor) for p in procs) else []


def ip_adapter_input(module, embeds) -> dict | None:
    """`flux1.check_ip_adapter`'s dict for ``ip_adapter_image_embeds`` (a list of one
    (B, I, E) tensor per adapter, or one (B, E) tensor, as the stock projection takes),
    from the IP-Adapter loaded on ``module`` (a stock ``FluxTransformer2DModel`` or the
    adapter)."""
    procs, proj = ip_processors(module), getattr(module, "encoder_hid_proj", None)
    if embeds is None:
        if procs:
            raise ValueError(
                "ip_adapter_image_embeds: IP-Adapter is loaded, so joint_attention_kwargs needs "
                "{'ip_adapter_image_embeds': [...]} (the stock module fails without it); unload_ip_adapter() first"
            )
        return None
    if not procs or proj is None:
        raise ValueError(
            f"ip_adapter_image_embeds: no IP-Adapter is loaded on this {type(module).__name__} "
            "(pipe.load_ip_adapter(...) first)"
        )
    if not isinstance(embeds, list):
        embeds = [embeds.unsqueeze(1)]  # the stock projection's (deprecated) single-tensor form
    layers = list(proj.image_projection_layers)
    if len(embeds) != len(layers) or not all(type(p) is ImageProjection for p in layers):
        raise ValueError(
            f"ip_adapter_image_embeds: expected {len(layers)} tensors (one per loaded IP-Adapter, each with an "
            f"ImageProjection), got {len(embeds)}"
        )
    return dict(
        image_proj=[{"image_embeds": _linear(p.image_embeds), "norm": _linear(p.norm)} for p in layers],
        tokens=[p.num_image_text_embeds for p in layers],
        image_embeds=list(embeds),
        layers=[[{"to_k_ip": _linear(k), "to_v_ip": _linear(v)} for k, v in zip(p.to_k_ip, p.to_v_ip)] for p in procs],
        scale=[list(p.scale) for p in procs],
    )

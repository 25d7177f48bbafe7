"""FLUX.1's text-to-image sampling steps (``FluxPipeline``), which its image jobs build on."""

from __future__ import annotations

import torch

from .... import flux1
from ..internal import NO_TABLES, Prompt, Steps, grid_ids, pack_2x2, tables, unpack_2x2


class _Flux1(Steps):
    """FluxPipeline: T5 + CLIP pooled text, 2x2-packed 16-channel latents, 3-axis ids."""

    fixed_graph = True  # one fixed device graph per step (`sampler_xla`)
    packs_sizes = True  # items of several sizes in one call (`sampler._packing`)
    GUIDANCE = 3.5  # FluxPipeline's guidance_scale default
    CONTROLNET, CONTROL_GUIDANCE = True, 7.0  # FluxControlNetPipeline's guidance_scale default

    def __init__(self, params, pipe):
        self.pipe, self.c = pipe, params.config

    def encode(self, run, prompts, msl, prompt_2=None, lora_scale=None):
        """CLIP's pooled vector of ``prompts``, T5's text of ``prompt_2`` (None: ``prompts``),
        with the text encoders' LoRA at ``lora_scale``: the pipeline's ``encode_prompt``."""
        kw = dict(prompt_2=prompt_2, max_sequence_length=msl or 512, lora_scale=lora_scale)
        txt, pooled, _ = self.pipe.encode_prompt(prompt=prompts, **kw)
        return Prompt(txt, pooled)

    def encode_embeds(self, run, msl, prompt_embeds, pooled_prompt_embeds):
        return Prompt(prompt_embeds, pooled_prompt_embeds)

    def noise_shape(self, B, h, w):
        return (B, self.c.in_channels // 4, h, w)

    pack = staticmethod(pack_2x2)
    take = staticmethod(lambda latents: latents)  # the pipeline's latents= are packed

    def rope(self, cond: Prompt, h, w, device, ref_ids=None):
        """The RoPE table of the latents (and reference tokens after them) and the text."""
        img_ids = grid_ids(h // 2, w // 2, 3, torch.float32, device)
        img_ids = img_ids if ref_ids is None else torch.cat([img_ids, ref_ids])
        txt_ids = torch.zeros(cond.txt.shape[1], 3, device=device)
        return flux1.rope_table(self.c, img_ids, txt_ids)

    def prepare(self, run, cond: Prompt, h, w, guidance, device):
        return tables(rope=self.rope(cond, h, w, device), guidance=self.GUIDANCE if guidance is None else guidance)

    def predict(self, params, tab, x, t, cond: Prompt, apply, **extra):
        g = torch.full((x.shape[0],), float(tab["guidance"]), device=x.device) if self.c.guidance_embeds else None
        return apply(params, x, t, cond.txt, pooled=cond.pooled, guidance=g, rope=tab["rope"]), NO_TABLES

    @staticmethod
    def control_pixels(pixels):
        """A control image's pixels as the VAE encodes them."""
        return pixels

    def control_latents(self, z):
        """A control image's posterior sample as FluxControlNetPipeline normalises and packs it."""
        vae = self.pipe.vae
        return self.pack((z - vae.config.shift_factor) * vae.config.scaling_factor)

    def control_kwargs(self, params, mode, tab, B: int, cond: Prompt, device) -> dict:
        """A ControlNet's family keywords at this step (its guidance, its Union mode)."""
        g = torch.full((B,), float(tab["guidance"]), device=device) if params.config.guidance_embeds else None
        mode = None if mode is None else torch.full((B, 1), mode, dtype=torch.long, device=device)
        return dict(pooled=cond.pooled[:B], guidance=g, rope=tab["rope"], **({} if mode is None else {"mode": mode}))

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        return unpack_2x2(x, h, w) / vae.config.scaling_factor + vae.config.shift_factor

"""FLUX.2's text-to-image sampling steps with reference images (``Flux2Pipeline``,
``Flux2KleinPipeline``, ``Flux2KleinKVPipeline``), which klein inpainting builds on."""

from __future__ import annotations

import torch

from .... import flux2
from ..internal import NO_TABLES, Prompt, Steps, _batch, flux2_vae_input, grid_ids, tables


class _Flux2(Steps):
    """Flux2Pipeline / Flux2KleinPipeline / Flux2KleinKVPipeline: stacked text-encoder
    layers, patchified 2x2 latents packed as tokens, 4-axis ids, reference images."""

    fixed_graph = True  # one fixed device graph per step (`sampler_xla`)
    packed_latents = False  # latents= given as the unpacked (B, C, h/2, w/2) noise
    packs_sizes = True  # items of several sizes in one call (`sampler._packing`), without references

    def packs(self, tab):
        """Text to image only: an item with reference images (its rows after the latents,
        or the klein KV cache's extract and cached calls) keeps a call per size."""
        return tab.get("ref") is None

    def __init__(self, params, pipe, kv_cache: bool):
        self.pipe, self.c, self.kv = pipe, params.config, kv_cache

    def encode(self, run, prompts, msl, **layers):
        """The pipeline's ``encode_prompt`` (``text_encoder_out_layers`` in ``layers`` if given)."""
        txt, txt_ids = self.pipe.encode_prompt(prompt=prompts, max_sequence_length=msl or 512, **layers)
        return Prompt(txt, txt_ids=txt_ids[0])

    def encode_embeds(self, run, msl, prompt_embeds):
        return Prompt(prompt_embeds, txt_ids=self.pipe._prepare_text_ids(prompt_embeds)[0].to(prompt_embeds.device))

    def noise_shape(self, B, h, w):
        return (B, self.c.in_channels, h // 2, w // 2)

    @staticmethod
    def pack(z):
        """(B, C, h/2, w/2) -> (B, h/2 · w/2, C): row-major tokens (also the pipeline's latents= layout)."""
        return z.reshape(*z.shape[:2], -1).permute(0, 2, 1)

    take = pack

    def images(self, images, B, device):
        """Reference images -> the run's packed latents (B, R, C) and ids (R, 4), the pipeline's way."""
        pipe, multiple = self.pipe, self.pipe.vae_scale_factor * 2
        processed = []
        for img in images:
            pipe.image_processor.check_image_input(img)
            w, h = img.size
            if w * h > 1024 * 1024:
                img = pipe.image_processor._resize_to_target_area(img, 1024 * 1024)
                w, h = img.size
            w, h = w // multiple * multiple, h // multiple * multiple
            processed.append(pipe.image_processor.preprocess(img, height=h, width=w, resize_mode="crop"))
        ref, ids = pipe.prepare_image_latents(processed, B, None, device, pipe.vae.dtype)
        return tables(ref=ref, ref_ids=ids[0])

    def prepare(self, run, cond: Prompt, h, w, guidance, device):
        """RoPE (with the references' rows), guidance; klein KV: the later steps' RoPE
        without the reference rows, and no cache yet (the first step extracts it)."""
        ref = run.get("ref")
        img_ids = grid_ids(h // 2, w // 2, 4, torch.int64, device)
        if ref is not None:
            img_ids = torch.cat([run["ref_ids"], img_ids] if self.kv else [img_ids, run["ref_ids"]])
        rope = flux2.rope_table(self.c, img_ids, cond.txt_ids)
        out = dict(rope=rope, cache=None)
        if self.kv and ref is not None:  # later steps: no reference rows
            n, S = cond.txt_ids.shape[0], img_ids.shape[0] - ref.shape[1]
            out["rope_cached"] = tuple(torch.cat([a[:n], a[a.shape[0] - S :]]) for a in rope)
        out["guidance"] = (4.0 if guidance is None else guidance) if self.c.guidance_embeds else None
        return tables(**out)

    def predict(self, params, tab, x, t, cond: Prompt, apply, **extra):
        """The prediction (and with the klein KV cache, the cache the first step extracts)."""
        B, S = x.shape[:2]
        g = None if tab["guidance"] is None else torch.full((B,), float(tab["guidance"]), device=x.device)
        kw, ref = dict(guidance=g), tab.get("ref")
        if ref is None:
            return apply(params, x, t, cond.txt, rope=tab["rope"], **kw), NO_TABLES
        ref = _batch(ref, B).to(x.dtype)
        if not self.kv:
            return apply(params, torch.cat([x, ref], 1), t, cond.txt, rope=tab["rope"], **kw)[:, :S], NO_TABLES
        if tab["cache"] is None:
            x = torch.cat([ref, x], 1)
            extract = dict(kv_cache="extract", num_ref_tokens=ref.shape[1])
            out, cache = apply(params, x, t, cond.txt, rope=tab["rope"], **extract, **kw)
            return out, tables(cache=cache)
        return apply(params, x, t, cond.txt, rope=tab["rope_cached"], kv_cache=tab["cache"], **kw), NO_TABLES

    def latent_output(self, x, h, w):
        """``output_type="latent"`` as the stock pipeline returns it: FLUX.2-dev the packed
        tokens, klein (every klein pipeline) the VAE's input (unpacked, de-normalised)."""
        return x if type(self.pipe).__name__ == "Flux2Pipeline" else self.decode_latents(x, h, w)

    def decode_latents(self, x, h, w):
        return flux2_vae_input(self.pipe.vae, x, h, w)

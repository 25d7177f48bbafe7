"""Each family's sampling steps for `fd.sample` (`Steps` subclasses: FLUX.1, FLUX.2,
Qwen-Image) and the latent helpers they share with the image jobs: 2x2 packing, position
ids, the CFG combination."""

from __future__ import annotations

import math

import torch

from .. import flux1, flux2
from .. import qwenimage as _qwen
from ._steps import Prompt, Steps


def pack_2x2(z: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 · W/2, 4C): 2x2 patches, channels first (FLUX.1, Qwen-Image)."""
    B, C, H, W = z.shape
    return z.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // 2) * (W // 2), C * 4)


def unpack_2x2(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack_2x2` for a latent of h x w (before packing)."""
    B, _, C4 = x.shape
    return x.view(B, h // 2, w // 2, C4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C4 // 4, h, w)


def grid_ids(h: int, w: int, n_axes: int, dtype, device, t: int = 0) -> torch.Tensor:
    """(h·w, n_axes) positions of an h x w token grid: axis 0 = t, 1 = row, 2 = col, rest 0."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.zeros(h * w, n_axes, dtype=torch.int64)
    ids[:, 0], ids[:, 1], ids[:, 2] = t, rows.reshape(-1), cols.reshape(-1)
    return ids.to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- families


class _Flux1(Steps):
    """FluxPipeline: T5 + CLIP pooled text, 2x2-packed 16-channel latents, 3-axis ids."""

    def __init__(self, params, pipe):
        self.params, self.pipe, self.c = params, pipe, params.config

    def encode(self, prompts, msl, prompt_2=None, lora_scale=None):
        """CLIP's pooled vector of ``prompts``, T5's text of ``prompt_2`` (None: ``prompts``),
        with the text encoders' LoRA at ``lora_scale``: the pipeline's ``encode_prompt``."""
        kw = dict(prompt_2=prompt_2, max_sequence_length=msl or 512, lora_scale=lora_scale)
        txt, pooled, _ = self.pipe.encode_prompt(prompt=prompts, **kw)
        return Prompt(txt, pooled)

    def encode_embeds(self, msl, prompt_embeds, pooled_prompt_embeds):
        return Prompt(prompt_embeds, pooled_prompt_embeds)

    def noise_shape(self, B, h, w):
        return (B, self.c.in_channels // 4, h, w)

    pack = staticmethod(pack_2x2)
    take = staticmethod(lambda latents: latents)  # the pipeline's latents= are packed

    def prepare(self, cond: Prompt, h, w, guidance, device):
        img_ids = grid_ids(h // 2, w // 2, 3, torch.float32, device)
        txt_ids = torch.zeros(cond.txt.shape[1], 3, device=device)
        self.rope = flux1.rope_table(self.c, img_ids, txt_ids)
        self.guidance = 3.5 if guidance is None else guidance

    def __call__(self, x, t, cond: Prompt):
        g = torch.full((x.shape[0],), float(self.guidance), device=x.device) if self.c.guidance_embeds else None
        return self.apply(self.params, x, t, cond.txt, pooled=cond.pooled, guidance=g, rope=self.rope)

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        return unpack_2x2(x, h, w) / vae.config.scaling_factor + vae.config.shift_factor


class _Flux2(Steps):
    """Flux2Pipeline / Flux2KleinPipeline / Flux2KleinKVPipeline: stacked text-encoder
    layers, patchified 2x2 latents packed as tokens, 4-axis ids, reference images."""

    def __init__(self, params, pipe, kv_cache: bool):
        self.params, self.pipe, self.c, self.kv = params, pipe, params.config, kv_cache
        self.ref = self.ref_ids = self.cache = None

    def encode(self, prompts, msl, **layers):
        """The pipeline's ``encode_prompt`` (``text_encoder_out_layers`` in ``layers`` if given)."""
        txt, txt_ids = self.pipe.encode_prompt(prompt=prompts, max_sequence_length=msl or 512, **layers)
        return Prompt(txt, txt_ids=txt_ids[0])

    def encode_embeds(self, msl, prompt_embeds):
        return Prompt(prompt_embeds, txt_ids=self.pipe._prepare_text_ids(prompt_embeds)[0].to(prompt_embeds.device))

    def noise_shape(self, B, h, w):
        return (B, self.c.in_channels, h // 2, w // 2)

    @staticmethod
    def pack(z):
        """(B, C, h/2, w/2) -> (B, h/2 · w/2, C): row-major tokens (also the pipeline's latents= layout)."""
        return z.reshape(*z.shape[:2], -1).permute(0, 2, 1)

    take = pack

    def images(self, images, B, device):
        """Reference images -> packed latents (B, R, C) and ids (R, 4), the pipeline's way."""
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
        self.ref, self.ref_ids = ref, ids[0]

    def prepare(self, cond: Prompt, h, w, guidance, device):
        img_ids = grid_ids(h // 2, w // 2, 4, torch.int64, device)
        if self.ref is not None:
            img_ids = torch.cat([self.ref_ids, img_ids] if self.kv else [img_ids, self.ref_ids])
        self.rope = flux2.rope_table(self.c, img_ids, cond.txt_ids)
        if self.kv and self.ref is not None:  # later steps: no reference rows
            n, S = cond.txt_ids.shape[0], img_ids.shape[0] - self.ref.shape[1]
            self.rope_cached = tuple(torch.cat([a[:n], a[a.shape[0] - S :]]) for a in self.rope)
        self.guidance = (4.0 if guidance is None else guidance) if self.c.guidance_embeds else None
        self.cache = None  # a new batch extracts its own reference KV cache

    def __call__(self, x, t, cond: Prompt):
        B, S = x.shape[:2]
        g = None if self.guidance is None else torch.full((B,), float(self.guidance), device=x.device)
        kw = dict(guidance=g)
        if self.ref is None:
            return self.apply(self.params, x, t, cond.txt, rope=self.rope, **kw)
        ref = _batch(self.ref, B).to(x.dtype)
        if not self.kv:
            return self.apply(self.params, torch.cat([x, ref], 1), t, cond.txt, rope=self.rope, **kw)[:, :S]
        if self.cache is None:
            x = torch.cat([ref, x], 1)
            out, self.cache = self.apply(
                self.params, x, t, cond.txt, rope=self.rope, kv_cache="extract", num_ref_tokens=ref.shape[1], **kw
            )
            return out
        return self.apply(self.params, x, t, cond.txt, rope=self.rope_cached, kv_cache=self.cache, **kw)

    def latent_output(self, x, h, w):
        """``output_type="latent"`` as the stock pipeline returns it: FLUX.2-dev the packed
        tokens, klein (every klein pipeline) the VAE's input (unpacked, de-normalised)."""
        return x if type(self.pipe).__name__ == "Flux2Pipeline" else self.decode_latents(x, h, w)

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        B, _, C = x.shape
        z = x.permute(0, 2, 1).reshape(B, C, h // 2, w // 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        z = z * std + mean
        return z.reshape(B, C // 4, 2, 2, h // 2, w // 2).permute(0, 1, 4, 2, 5, 3).reshape(B, C // 4, h, w)


class _Qwen(Steps):
    """QwenImagePipeline / QwenImageEditPipeline: Qwen2.5-VL text (ragged, masked),
    2x2-packed latents with a frame axis, RoPE from img_shapes, normalised true CFG."""

    normalise_cfg = True

    def __init__(self, params, pipe):
        self.params, self.pipe, self.c = params, pipe, params.config
        self.ref = self.prompt_image = None
        self.ref_shape = None

    def encode(self, prompts, msl):
        kw = {} if self.prompt_image is None else {"image": self.prompt_image}
        txt, mask = self.pipe.encode_prompt(prompt=prompts, max_sequence_length=msl or 512, **kw)
        return Prompt(txt, mask=mask)

    def encode_embeds(self, msl, prompt_embeds, prompt_embeds_mask=None):
        """As the pipeline's encode_prompt with embeddings: cut to ``msl``, all-real mask -> None."""
        txt, mask = prompt_embeds[:, : msl or 512], prompt_embeds_mask
        mask = None if mask is None or bool(mask[:, : txt.shape[1]].all()) else mask[:, : txt.shape[1]]
        return Prompt(txt, mask=mask)

    def noise_shape(self, B, h, w):
        return (B, 1, self.c.in_channels // 4, h, w)

    pack = staticmethod(lambda z: pack_2x2(z[:, 0]))
    take = staticmethod(lambda latents: latents)  # the pipeline's latents= are packed

    def images(self, images, B, device):
        """The Edit pipeline's reference: resized to about 1024² (multiple of 32), VAE-encoded
        (distribution mode), normalised, packed; also the image its text encoder sees."""
        if len(images) != 1:
            raise ValueError(f"image: QwenImageEditPipeline takes one reference image, got {len(images)}")
        pipe, img = self.pipe, images[0]
        w, h = _qwen_edit_size(img.size)
        self.prompt_image = pipe.image_processor.resize(img, h, w)
        pixels = pipe.image_processor.preprocess(self.prompt_image, h, w).unsqueeze(2)
        z = pipe._encode_vae_image(pixels.to(device=device, dtype=pipe.vae.dtype), generator=None)
        self.ref = _batch(pack_2x2(z[:, :, 0]), B)
        self.ref_shape = (1, z.shape[3] // 2, z.shape[4] // 2)

    def prepare(self, cond: Prompt, h, w, guidance, device):
        self.shapes = [(1, h // 2, w // 2)] + ([self.ref_shape] if self.ref is not None else [])
        self.rope = _qwen.pos_embed(self.shapes, cond.txt.shape[1], self.c.axes_dims_rope, device=device)

    def __call__(self, x, t, cond: Prompt):
        B, S = x.shape[:2]
        if self.ref is not None:
            x = torch.cat([x, _batch(self.ref, B).to(x.dtype)], 1)
        out = self.apply(self.params, x, t, cond.txt, txt_mask=cond.mask, img_shapes=[self.shapes] * B, rope=self.rope)
        return out[:, :S]

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        z = unpack_2x2(x, h, w)[:, :, None].to(vae.dtype)  # (B, C, 1, h, w)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        return z / std + mean


def _qwen_edit_size(size) -> tuple[int, int]:
    """(width, height) of about 1024² pixels with the image's aspect ratio, multiples of 32."""
    ratio = size[0] / size[1]
    w = math.sqrt(1024 * 1024 * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


def _batch(t: torch.Tensor, B: int) -> torch.Tensor:
    """Repeat a batch of b to B rows (B a multiple of b), as the pipelines repeat references."""
    return t if t.shape[0] == B else t.repeat(B // t.shape[0], *([1] * (t.ndim - 1)))


# ----------------------------------------------------------------------------- CFG


def combine(pred: torch.Tensor, scale: float, normalise: bool) -> torch.Tensor:
    """[cond; uncond] predictions -> ``uncond + scale (cond - uncond)``; Qwen-Image rescales
    each token to the conditional prediction's norm (``normalise``)."""
    cond, uncond = pred.chunk(2)
    out = uncond + scale * (cond - uncond)
    if normalise:
        out = out * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(out, dim=-1, keepdim=True))
    return out


# ----------------------------------------------------------------------------- the loop

"""Qwen-Image's text-to-image and Edit sampling steps (``QwenImagePipeline``,
``QwenImageEditPipeline``), which its other image jobs build on."""

from __future__ import annotations

import math

import torch

from .... import qwenimage as _qwen
from ..internal import NO_TABLES, Prompt, Steps, _batch, pack_2x2, tables, unpack_2x2


class _Qwen(Steps):
    """QwenImagePipeline / QwenImageEditPipeline: Qwen2.5-VL text (ragged, masked),
    2x2-packed latents with a frame axis, RoPE from img_shapes, normalised true CFG."""

    fixed_graph = True  # one fixed device graph per step (`sampler_xla`)
    CONTROLNET = True

    normalise_cfg = True
    packs_sizes = masks_text = True  # items of several sizes and text lengths in one call (`sampler._packing`)

    def __init__(self, params, pipe):
        self.pipe, self.c = pipe, params.config

    def encode(self, run, prompts, msl):
        image = run.get("prompt_image")
        kw = {} if image is None else {"image": image}
        txt, mask = self.pipe.encode_prompt(prompt=prompts, max_sequence_length=msl or 512, **kw)
        return Prompt(txt, mask=mask)

    def encode_embeds(self, run, msl, prompt_embeds, prompt_embeds_mask=None):
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
        prompt_image = pipe.image_processor.resize(img, h, w)
        pixels = pipe.image_processor.preprocess(prompt_image, h, w).unsqueeze(2)
        z = pipe._encode_vae_image(pixels.to(device=device, dtype=pipe.vae.dtype), generator=None)
        ref_shapes = [(1, z.shape[3] // 2, z.shape[4] // 2)]
        return tables(prompt_image=prompt_image, ref=_batch(pack_2x2(z[:, :, 0]), B), ref_shapes=ref_shapes)

    def prepare(self, run, cond: Prompt, h, w, guidance, device):
        shapes = [(1, h // 2, w // 2), *run.get("ref_shapes", ())]
        return tables(
            shapes=shapes, rope=_qwen.pos_embed(shapes, cond.txt.shape[1], self.c.axes_dims_rope, device=device)
        )

    def predict(self, params, tab, x, t, cond: Prompt, apply, **extra):
        B, S = x.shape[:2]
        if tab.get("ref") is not None:
            x = torch.cat([x, _batch(tab["ref"], B).to(x.dtype)], 1)
        kw = dict(txt_mask=cond.mask, img_shapes=[tab["shapes"]] * B, rope=tab["rope"])
        return apply(params, x, t, cond.txt, **kw)[:, :S], NO_TABLES

    @staticmethod
    def control_pixels(pixels):
        """A control image's pixels as the VAE encodes them (a frame axis)."""
        return pixels.unsqueeze(2)

    def control_latents(self, z):
        """A control image's posterior sample as QwenImageControlNetPipeline normalises and packs it."""
        vae = self.pipe.vae
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device)
        return self.pack(((z - mean) * inv_std).permute(0, 2, 1, 3, 4))

    @staticmethod
    def control_kwargs(params, mode, tab, B: int, cond: Prompt, device) -> dict:
        """A ControlNet's family keywords at this step (the text mask, the layout, RoPE)."""
        mask = None if cond.mask is None else cond.mask[:B]
        return dict(txt_mask=mask, img_shapes=[tab["shapes"]] * B, rope=tab["rope"])

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

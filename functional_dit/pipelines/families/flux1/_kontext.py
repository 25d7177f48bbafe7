"""FLUX.1 Kontext for `fd.sample` (diffusers' ``FluxKontextPipeline``, ``pipeline_flux_kontext.py``).

What the stock pipeline adds around the text-to-image loop of `functional_dit.pipelines.families.flux1._Flux1`:

- the output size is rescaled to about ``max_area`` pixels (1024² by default) at the asked
  aspect ratio, each side a multiple of the VAE scale x 2;
- the reference image is resized to the preferred Kontext resolution nearest its aspect
  ratio (the stock ``_auto_resize``), VAE-encoded in distribution mode (its generator
  draws nothing), normalised and packed; its tokens go after the latents at position ids
  ``(1, row, col)`` and are fed again every step; only the latents' prediction is kept.
"""

from __future__ import annotations

import torch
from PIL import Image

from ..internal import _batch, grid_ids, refuse_max_area, tables
from ._base import _Flux1

MAX_AREA = 1024**2  # FluxKontextPipeline's default


def _is_kontext(pipe) -> bool:
    return type(pipe).__name__ == "FluxKontextPipeline"


def _positive(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def size(pipe, height, width, max_area) -> tuple:
    """(height, width) as ``FluxKontextPipeline`` rescales them to ``max_area``; unchanged
    for other pipelines (which take no ``max_area``)."""
    if not _is_kontext(pipe):
        refuse_max_area(max_area)
        return height, width
    area = MAX_AREA if max_area is None else max_area
    for name, v in (("height", height), ("width", width), ("max_area", area)):
        if not _positive(v):
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    ratio, multiple = width / height, pipe.vae_scale_factor * 2
    w = round((area * ratio) ** 0.5) // multiple * multiple
    h = round((area / ratio) ** 0.5) // multiple * multiple
    if h < 1 or w < 1:
        raise ValueError(
            f"max_area: expected room for at least {multiple}x{multiple} pixels at {width}:{height}, got {area}"
        )
    return h, w


def _preferred(img, pipe, auto_resize: bool = True) -> tuple[int, int]:
    """(height, width) of the reference: the Kontext resolution nearest its aspect ratio
    (the stock ``_auto_resize=True``), or its own size (False); floored to the VAE multiple."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    h, w = pipe.image_processor.get_default_height_width(img)
    if auto_resize:
        _, w, h = min((abs(w / h - rw / rh), rw, rh) for rw, rh in PREFERRED_KONTEXT_RESOLUTIONS)
    multiple = pipe.vae_scale_factor * 2
    return h // multiple * multiple, w // multiple * multiple


class Flux1Kontext(_Flux1):
    """`_Flux1` with the Kontext reference tokens after the latents (the run's tables)."""

    def __init__(self, params, pipe, auto_resize: bool = True):
        super().__init__(params, pipe)
        self.auto_resize = auto_resize

    def images(self, images, B, device):
        """Encode the one reference image (distribution mode) and its ids ``(1, row, col)``."""
        if len(images) != 1 or not isinstance(images[0], Image.Image):
            raise ValueError(f"image: a FluxKontextPipeline takes one PIL reference image, got {images!r:.80}")
        pipe, vae = self.pipe, self.pipe.vae
        h, w = _preferred(images[0], pipe, self.auto_resize)
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(images[0], h, w), h, w)
        z = vae.encode(pixels.to(device=device, dtype=vae.dtype)).latent_dist.mode()
        z = (z - vae.config.shift_factor) * vae.config.scaling_factor
        ref_ids = grid_ids(z.shape[2] // 2, z.shape[3] // 2, 3, torch.float32, device, t=1)
        return tables(ref=self.pack(z), ref_ids=ref_ids)

    def prepare(self, run, cond, h, w, guidance, device):
        tab = super().prepare(run, cond, h, w, guidance, device)
        if run.get("ref") is None:
            return tab
        return tables(tab, rope=self.rope(cond, h, w, device, run["ref_ids"]))

    def predict(self, params, tab, x, t, cond, apply, **extra):
        if tab.get("ref") is None:
            return super().predict(params, tab, x, t, cond, apply)
        S = x.shape[1]
        x = torch.cat([x, _batch(tab["ref"], x.shape[0]).to(x.dtype)], 1)
        out, updates = super().predict(params, tab, x, t, cond, apply)
        return out[:, :S], updates

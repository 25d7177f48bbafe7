"""FLUX.2-klein inpainting for `fd.sample` (diffusers' ``Flux2KleinInpaintPipeline``,
``pipeline_flux2_klein_inpaint.py``).

What the stock pipeline adds around klein's text-to-image loop (`functional_dit.pipelines.families.flux2._Flux2`):

- the output size is the init image's: resized to about 1024² if larger, then floored to
  multiples of the VAE scale x 2; the ``height`` and ``width`` given are ignored, as stock;
- the init image is VAE-encoded in *argmax* mode (no draw: the noise is klein's own),
  patchified and batch-normalised; those latents are also the first reference image
  (ids ``t = 10``), an optional ``image_reference`` the second (``t = 20``);
- the schedule is the full one cut by ``strength`` (`schedule.t_start`, 0.8 by default as
  stock), started from ``scale_noise(image latents, first timestep, noise)``; given
  ``latents=`` are the start as they are and the noise of the blend;
- after every step ``(1 - m) · image latents noised to the next timestep + m · latents``,
  the mask binarised and *bilinear*-resized to the token grid (one value per token);
  ``padding_mask_crop`` crops image and mask around the mask and pastes the result back
  (``output_type="pil"`` only, as the stock pipeline).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ...schedule import blend, noised_start
from ..internal import _batch, check_crop, check_strength, cut, one_image, tables
from ._base import _Flux2

NAME = "Flux2KleinInpaintPipeline"
STRENGTH = 0.8  # the stock pipeline's default (FLUX.1's and Qwen-Image's is schedule.STRENGTH)
MAX_AREA = 1024 * 1024  # larger images are resized to about this many pixels, as stock


@dataclasses.dataclass(frozen=True)
class Inpaint:
    """A checked klein inpainting job: init image, mask, optional reference, strength, crop."""

    image: object
    mask: object
    reference: object | None
    strength: float
    pad: int | None


def _fit(pipe, img):
    """(the image, height, width) as the stock pipeline sizes it: resized to about
    `MAX_AREA` if larger, the size floored to multiples of the VAE scale x 2."""
    multiple = pipe.vae_scale_factor * 2
    h, w = img.height, img.width
    if h * w > MAX_AREA:
        scale = math.sqrt(MAX_AREA / (h * w))
        img = pipe.image_processor.resize(img, int(h * scale), int(w * scale))
        h, w = img.height, img.width
    return img, h // multiple * multiple, w // multiple * multiple


def size(pipe, height, width, image) -> tuple:
    """(height, width) of the output: the init image's for a klein inpainting pipeline
    (the given ones ignored, as stock), else as given."""
    if type(pipe).__name__ != NAME or image is None:
        return height, width
    _, h, w = _fit(pipe, one_image(image, "image"))
    if h < 1 or w < 1:
        raise ValueError(f"image: expected at least {pipe.vae_scale_factor * 2} pixels each way, got {image.size}")
    return h, w


def check(pipe, steps, image, mask_image, image_reference, strength, padding_mask_crop, output_type, kv_cache):
    """The checked `Inpaint` of a ``Flux2KleinInpaintPipeline``; raises before any encoding."""
    for name, v in (("image", image), ("mask_image", mask_image)):
        if v is None:
            raise ValueError(f"{name}: a {NAME} needs one (a PIL image), got None")
    if kv_cache:
        raise ValueError(f"kv_cache: a {NAME} feeds its references every step; expected None or False, got True")
    img, mask = one_image(image, "image"), one_image(mask_image, "mask_image")
    ref = None if image_reference is None else one_image(image_reference, "image_reference")
    strength = check_strength(STRENGTH if strength is None else strength, steps)
    if padding_mask_crop is not None:
        check_crop(padding_mask_crop, mask, output_type)
    return Inpaint(img, mask, ref, strength, padding_mask_crop)


class Flux2Inpaint(_Flux2):
    """`_Flux2` started from the noised init image, on a cut schedule, the encoded init
    image (and ``image_reference``) as references, the mask blended in after every step:
    all of them the run's tables (``init_latents``), the blend's inputs the item's."""

    blends_steps = True

    def __init__(self, params, pipe, job: Inpaint):
        super().__init__(params, pipe, False)
        self.job, self.strength = job, job.strength
        self.settings = {"inpaint": True, "padding_mask_crop": job.pad, "image_reference": job.reference is not None}

    def images(self, images, B, device):
        """Nothing yet: the init image is encoded at the output size (`init_latents`)."""
        return tables()

    def checked(self, run) -> dict:
        """The inputs every rank of a group must hold the same (`sampler._check_ranks`)."""
        return {**super().checked(run), "image latents (image)": run["init"], "mask (mask_image)": run["mask"]}

    def init_latents(self, run, req, height: int, width: int, device, dtype):
        """Encode the init image (argmax: no draw) and the reference, and the mask, at the
        output size; the request is unchanged (the noise is drawn as for text to image)."""
        pipe, job = self.pipe, self.job
        raw, _, _ = _fit(pipe, job.image)
        mode = "default" if job.pad is None else "fill"
        crop = None if job.pad is None else pipe.mask_processor.get_crop_region(job.mask, width, height, pad=job.pad)
        kw = dict(crops_coords=crop, resize_mode=mode)
        pixels = pipe.image_processor.preprocess(raw, height, width, **kw)
        pixels = pixels.to(device=pipe.vae.device, dtype=dtype)  # the VAE's device (the CPU, with the params on xla)
        z = pipe._encode_vae_image(pixels, generator=None).to(device)  # (1, C, h/2, w/2)
        refs = [z] + ([] if job.reference is None else [self._reference(job.reference)])
        ref, ids = pipe.prepare_image_latents(refs, 1, None, device, dtype)
        m = pipe.mask_processor.preprocess(job.mask, height=height, width=width, **kw)
        mask = pipe.prepare_mask_latents(m, 1, 1, height, width, dtype, device)  # (1, S, 1)
        given = req.noise[0] == "latents"  # the start latents as given, and the blend's noise
        out = dict(given=given, crop=crop, init=self.pack(z), raw=raw, ref=ref, ref_ids=ids[0], mask=mask)
        return tables(run, **out), req

    def _reference(self, img) -> torch.Tensor:
        """``image_reference`` as the stock pipeline preprocesses it (pixels, encoded later)."""
        img, h, w = _fit(self.pipe, img)
        return self.pipe.image_processor.preprocess(img, h, w, resize_mode="crop")

    def schedule(self, tab, sched):
        return cut(sched, self.strength)

    def begin(self, tab, sched, x, images):
        """Start from the image latents noised to the cut schedule's first timestep (or the
        given ``latents=`` as they are); the blend's inputs as the item's ``cur``."""
        cur = (_batch(tab["init"], x.shape[0]).to(x.dtype), x)
        x = x if tab["given"] else noised_start(sched, cur[0], x)
        return x, tables(tab, cur=cur)

    def after_step(self, tab, i: int, sched, x: torch.Tensor) -> torch.Tensor:
        """Keep the image outside the mask, noised to the next timestep (unnoised after the last)."""
        init, noise = tab["cur"]
        return blend(sched, i, init, noise, tab["mask"], x)

    def blend_parts(self, tab):
        return (*tab["cur"], tab["mask"])

    def overlay(self, tab, images):
        """``padding_mask_crop``: each output pasted into the init image, as the pipeline."""
        if tab["crop"] is None:
            return images
        return [self.pipe.image_processor.apply_overlay(self.job.mask, tab["raw"], im, tab["crop"]) for im in images]

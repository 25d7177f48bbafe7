"""FLUX.1 image-to-image and inpainting for `fd.sample` (diffusers' ``FluxImg2ImgPipeline``
and ``FluxInpaintPipeline``, ``pipeline_flux_img2img.py`` / ``pipeline_flux_inpaint.py``).

What the two stock pipelines add around the text-to-image loop of `functional_dit.pipelines.families.flux1._Flux1`:

- the init image is preprocessed and VAE-encoded in *sample* mode, so its posterior draw
  takes the image's generator before the noise does;
- the schedule is the full one cut by ``strength`` (``t_start = int(steps - steps·strength)``,
  ``set_begin_index(t_start)``), and the start latents are ``scale_noise(image latents,
  first timestep, noise)``;
- inpainting then blends after every step: ``(1 - mask) · image latents noised to the
  next timestep + mask · latents`` (the mask binarised and resized to the latent grid);
  ``padding_mask_crop`` crops image and mask around the mask and pastes the result back
  (``output_type="pil"`` only, as in the stock pipeline).

Image ``i``'s generator draws its posterior sample and then its noise: what the stock
pipelines draw when called with ``image=[img] * n`` and one generator per image. One
``torch.Generator`` (``seed=gen``) draws the posterior of the one image and then the whole
batch's noise, as the stock pipelines do with ``image=img, generator=gen``.
docs/sampling.md lists the defaults (``strength`` 0.6, ``guidance`` 7.0).
"""

from __future__ import annotations

import dataclasses

import torch

from ...schedule import STRENGTH, blend, noised_start
from ..internal import check_crop, check_strength, copy_generator, cut, one_image, refuse, tables
from ._base import _Flux1

GUIDANCE = 7.0  # their guidance_scale default (FluxPipeline's is 3.5)


@dataclasses.dataclass(frozen=True)
class Edit:
    """An img2img (``mask`` None) or inpainting job: the init image, how much of the
    schedule to run, the mask and its crop padding, and the output size."""

    image: object
    strength: float
    mask: object | None
    pad: int | None
    size: tuple[int, int]  # (height, width) in pixels


# ----------------------------------------------------------------------------- checks


# The stock pipelines that need an init image (and a mask), by class name.
NEEDS = {"FluxImg2ImgPipeline": ("image",), "FluxInpaintPipeline": ("image", "mask_image")}


def check(pipe, steps: int, image, strength, mask_image, padding_mask_crop, output_type, latents, size):
    """The checked `Edit` of a FLUX.1 ``image`` (None: text to image). Raises before any
    encoding for arguments the job does not take or values out of range."""
    for name in NEEDS.get(type(pipe).__name__, ()):
        if {"image": image, "mask_image": mask_image}[name] is None:
            raise ValueError(f"{name}: a {type(pipe).__name__} needs one (a PIL image), got None")
    wanted = type(pipe).__name__ in NEEDS or strength is not None or mask_image is not None
    wanted = wanted and type(pipe).__name__ != "FluxKontextPipeline"  # its image is a reference
    if image is None or not wanted:
        return refuse("flux1", strength, mask_image, padding_mask_crop, "FLUX.1 img2img and inpainting")
    img = one_image(image, "image")
    mask = None if mask_image is None else one_image(mask_image, "mask_image")
    strength = check_strength(STRENGTH if strength is None else strength, steps)
    if padding_mask_crop is not None:
        check_crop(padding_mask_crop, mask, output_type)
    if mask is not None and latents is not None:
        raise ValueError("latents: inpainting draws its image latents with the seed; expected None, got a tensor")
    return Edit(img, strength, mask, padding_mask_crop, size)


# ----------------------------------------------------------------------------- the model


def _processors(pipe):
    """The stock img2img/inpaint pipelines' image and mask processors."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.image_processor import VaeImageProcessor

    kw = dict(vae_scale_factor=pipe.vae_scale_factor * 2, vae_latent_channels=pipe.vae.config.latent_channels)
    mask = VaeImageProcessor(**kw, do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    return VaeImageProcessor(**kw), mask


class Flux1Image(_Flux1):
    """`_Flux1` started from a noised init image, on a cut schedule, with inpainting's
    per-step blend: the init image's posterior and mask are the run's tables (``images``),
    a chunk's posterior draws its tables (``draw``), the blend's inputs the item's
    (``begin``)."""

    blends_steps = True
    GUIDANCE = GUIDANCE

    def __init__(self, params, pipe, edit: Edit):
        super().__init__(params, pipe)
        self.edit, self.strength = edit, edit.strength
        self.proc, self.mask_proc = _processors(pipe)
        self.settings = {"strength": edit.strength, "inpaint": edit.mask is not None, "padding_mask_crop": edit.pad}
        self.inpaints = edit.mask is not None  # takes masked_image_latents (`sampler._stock_args`)
        self.latent_channels = self.c.in_channels // 4  # 16: FluxInpaintPipeline hard-codes it (FLUX.1's latents)

    def images(self, images, B, device):
        """Preprocess and encode the init image once (its posterior), and the mask."""
        (H, W), e, vae = self.edit.size, self.edit, self.pipe.vae
        crop = None if e.pad is None else self.mask_proc.get_crop_region(e.mask, W, H, pad=e.pad)
        mode = "default" if crop is None else "fill"
        pixels = self.proc.preprocess(e.image, height=H, width=W, crops_coords=crop, resize_mode=mode)
        posterior = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist  # drawn from in `draw`
        ref = [self.pack(posterior.mean).to(device)]  # compared across ranks before the first step
        mask = None
        if e.mask is not None:
            m = self.mask_proc.preprocess(e.mask, height=H, width=W, resize_mode=mode, crops_coords=crop)
            h, w = posterior.mean.shape[2:]
            m = torch.nn.functional.interpolate(m, size=(h, w)).to(device)
            mask = self.pack(m.repeat(1, self.c.in_channels // 4, 1, 1))
            ref.append(mask)
        return tables(crop=crop, posterior=posterior, ref=ref, mask=mask)

    def _latents(self, post: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        return (post - vae.config.shift_factor) * vae.config.scaling_factor

    def draw(self, run, noise: tuple, images, shape_of, dtype, device, draw):
        """(packed noise of ``images``, the chunk's tables: its packed image latents, the
        posterior draws, for `begin`). Each generator draws its posterior sample first,
        then its noise."""
        kind, src = noise[:2]
        pack, posterior = self.pack, run["posterior"]
        if kind == "latents":  # the stock img2img starts from given latents as they are
            return self.take(src[list(images)].to(device=device, dtype=dtype)), tables(drawn=None)
        if kind == "batch":  # one posterior for the one image, then the batch's noise
            g = copy_generator(src)
            post = posterior.sample(generator=g).expand(len(images), -1, -1, -1)
            z = torch.randn(shape_of(noise[2]), generator=g, dtype=dtype)[list(images)]
        else:
            gens = (
                [torch.Generator().manual_seed(src[i]) for i in images] if kind == "seeds" else [src[i] for i in images]
            )
            post = torch.cat([posterior.sample(generator=g) for g in gens])
            z = torch.cat([torch.randn(shape_of(1), generator=g, dtype=dtype) for g in gens])
        return pack(z.to(device)), tables(drawn=pack(self._latents(post).to(device=device, dtype=dtype)))

    def schedule(self, tab, sched):
        return cut(sched, self.strength)

    def begin(self, tab, sched, x, images):
        """The start latents: the image latents noised to the cut schedule's first
        timestep; the blend's inputs (image latents, noise) as the item's ``cur``."""
        init = tab["drawn"]
        if init is None:
            return x, tables(tab, cur=None)
        return noised_start(sched, init, x), tables(tab, cur=(init, x))

    def after_step(self, tab, i: int, sched, x: torch.Tensor) -> torch.Tensor:
        """Inpainting: keep the image outside the mask, noised to the next timestep."""
        if self.edit.mask is None:
            return x
        init, noise = tab["cur"]
        return blend(sched, i, init, noise, tab["mask"], x)

    def blend_parts(self, tab):
        return None if self.edit.mask is None or tab["cur"] is None else (*tab["cur"], tab["mask"])

    def overlay(self, tab, images):
        """``padding_mask_crop``: paste each generated crop back into the init image."""
        if tab["crop"] is None:
            return images
        e = self.edit
        return [self.proc.apply_overlay(e.mask, e.image, im, tab["crop"]) for im in images]

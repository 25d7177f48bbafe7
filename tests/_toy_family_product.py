"""The toy family's product module (`functional_dit.pipelines.families.HOOKS`): FLUX.1's
sampling steps, adapter argument map, tiny recipes and bench inputs, taken as they are,
the toy's stock class, the oracle a new family gets from diffusers (here diffusers'
FLUX.1 transformer under the toy's name; the test sets it on ``diffusers``), and an image
job of its own, written only here: img2img (``fd.sample(image=, strength=)``) as one
variant of the text-to-image steps whose hooks return tables (docs/adding-a-family.md).
"""

from __future__ import annotations

import copy

import diffusers
import torch
from diffusers.image_processor import VaeImageProcessor

from functional_dit.pipelines.families import tables
from functional_dit.pipelines.families.flux1 import *  # noqa: F403  (every hook of FLUX.1's product)
from functional_dit.pipelines.families.flux1 import TextToImage
from functional_dit.pipelines.schedule import noised_start, t_start

BENCH_CACHE = None  # no step-cache bench row of its own


class ToyTransformer2DModel(diffusers.FluxTransformer2DModel):
    """The toy's stock diffusers class: FLUX.1's transformer under the toy's name."""


# ----------------------------------------------------------------------------- its image job


class Img2Img(TextToImage):
    """img2img over the toy's text-to-image steps: the init image's VAE posterior is the
    run's table, each image's posterior draw (its generator: the draw, then the noise) the
    chunk's, the last ``steps · strength`` steps of the schedule started from the drawn
    image latents noised to the first of them."""

    GUIDANCE = 7.0  # the stock img2img pipelines' default

    def __init__(self, params, pipe, image, strength: float, size: tuple):
        super().__init__(params, pipe)
        self.image, self.strength, self.size = image, strength, size
        self.settings = {"strength": strength}

    def images(self, images, B, device):
        vae, (H, W) = self.pipe.vae, self.size
        proc = VaeImageProcessor(vae_scale_factor=self.pipe.vae_scale_factor * 2)
        pixels = proc.preprocess(self.image, height=H, width=W)
        posterior = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist
        return tables(posterior=posterior, ref=self.pack(posterior.mean).to(device))

    def draw(self, run, noise, images, shape_of, dtype, device, draw):
        kind, src = noise[:2]
        if kind not in ("seeds", "generators"):
            raise ValueError(f"seed: the toy's img2img takes an int seed or generators per image, got {kind}")
        gens = [torch.Generator().manual_seed(src[i]) if kind == "seeds" else src[i] for i in images]
        post = torch.cat([run["posterior"].sample(generator=g) for g in gens])
        z = torch.cat([torch.randn(shape_of(1), generator=g, dtype=dtype) for g in gens])
        cfg = self.pipe.vae.config
        drawn = self.pack(((post - cfg.shift_factor) * cfg.scaling_factor).to(device=device, dtype=dtype))
        return self.pack(z.to(device)), tables(drawn=drawn)

    def schedule(self, tab, sched):
        start = t_start(len(sched.timesteps), self.strength)
        sched = copy.copy(sched)
        sched.timesteps = sched.timesteps[start:]
        sched.set_begin_index(start)
        return sched

    def begin(self, tab, sched, x, images):
        return noised_start(sched, tab["drawn"], x), tab


def _img2img(pipe, call):
    """The toy's img2img with an image (text to image without one)."""
    if call.image is None:
        return None
    for name in ("mask_image", "padding_mask_crop", "latents", "layers", "image_reference"):
        if getattr(call, name) is not None:
            raise ValueError(f"{name}: the toy's img2img takes none; expected None")
    image, strength, size = call.image, 0.6 if call.strength is None else call.strength, (call.height, call.width)
    return lambda params, pipe: Img2Img(params, pipe, image, strength, size)


JOBS = {"FluxPipeline": _img2img}  # its image jobs by stock pipeline class name


def image_job(pipe, call):
    return pipe, JOBS[type(pipe).__name__](pipe, call)

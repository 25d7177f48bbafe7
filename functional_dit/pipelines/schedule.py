"""The partial schedule of the image-to-image jobs (img2img, inpainting), as every stock
img2img/inpainting pipeline computes it: ``strength`` of the steps run, from ``t_start``."""

from __future__ import annotations

STRENGTH = 0.6  # FluxImg2Img/FluxInpaint's and QwenImageImg2Img/QwenImageInpaint's default


def t_start(steps: int, strength: float) -> int:
    """The first step run at ``strength`` (diffusers' ``get_timesteps``)."""
    return int(max(steps - min(steps * strength, steps), 0))


def blend(sched, i: int, init, noise, mask, x):
    """Inpainting after step ``i``: the image latents outside ``mask`` (noised to the next
    timestep, unnoised after the last), the generated ones inside it."""
    if i < len(sched.timesteps) - 1:
        init = sched.scale_noise(init, sched.timesteps[i + 1 : i + 2], noise)
    mask = mask.to(x.dtype)
    return (1 - mask) * init + mask * x

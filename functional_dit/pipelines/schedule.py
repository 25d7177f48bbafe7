"""The partial schedule of the image-to-image jobs (img2img, inpainting), as every stock
img2img/inpainting pipeline computes it: ``strength`` of the steps run, from ``t_start``."""

from __future__ import annotations

import torch

STRENGTH = 0.6  # FluxImg2Img/FluxInpaint's and QwenImageImg2Img/QwenImageInpaint's default


def t_start(steps: int, strength: float) -> int:
    """The first step run at ``strength`` (diffusers' ``get_timesteps``)."""
    return int(max(steps - min(steps * strength, steps), 0))


def blend(sched, i: int, init, noise, mask, x):
    """Inpainting after step ``i``: the image latents outside ``mask`` (noised to the next
    timestep, unnoised after the last), the generated ones inside it."""
    if i < len(sched.timesteps) - 1:
        init = sched.scale_noise(init, sched.timesteps[i + 1 : i + 2], noise)
    return _masked(init, mask, x)


def noised_start(sched, init, noise):
    """The start latents of a cut schedule, ``scale_noise(init, its first timestep, noise)``
    with the sigma read on the host and moved as one (1, 1, 1) value: the same arithmetic,
    and on a lazy device the same graph for every step count (the scheduler moves its
    whole sigma table to the device)."""
    sigma = sched.sigmas.to(init.dtype)[sched.begin_index or 0].reshape(1, 1, 1).to(init.device)
    return _noised(sigma, init, noise)


def blend_plan(sched, dtype) -> list[torch.Tensor]:
    """`blend`'s noise level after each step as data, (1, 1, 1) each: the sigma
    ``scale_noise`` reads after step ``i`` (the scheduler's step index then is
    ``begin_index + i + 1``), 0 after the last (the image latents as they are)."""
    sigmas, b, n = sched.sigmas.to(dtype), sched.begin_index or 0, len(sched.timesteps)
    return [(sigmas[b + i + 1] if i < n - 1 else torch.zeros((), dtype=dtype)).reshape(1, 1, 1) for i in range(n)]


def blend_at(x, sigma, init, noise, mask):
    """`blend` with the noise level ``sigma`` as a tensor (`blend_plan`): the same
    arithmetic as ``scale_noise`` and `blend`, and none of their host-side indexing."""
    return _masked(_noised(sigma, init, noise), mask, x)


def _noised(sigma, init, noise):
    """``scale_noise``'s arithmetic with the noise level as a tensor."""
    return sigma * noise + (1.0 - sigma) * init


def _masked(init, mask, x):
    """The inpainting blend: the (noised) image outside the mask, the latents inside."""
    mask = mask.to(x.dtype)
    return (1 - mask) * init + mask * x

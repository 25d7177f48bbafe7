"""The partial schedule of the image-to-image jobs (img2img, inpainting), as every stock
img2img/inpainting pipeline computes it: ``strength`` of the steps run, from ``t_start``."""

from __future__ import annotations

STRENGTH = 0.6  # FluxImg2Img/FluxInpaint's and QwenImageImg2Img/QwenImageInpaint's default


def t_start(steps: int, strength: float) -> int:
    """The first step run at ``strength`` (diffusers' ``get_timesteps``)."""
    return int(max(steps - min(steps * strength, steps), 0))

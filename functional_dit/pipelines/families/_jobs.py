"""The checks and the schedule cut the families' image jobs share (img2img, inpainting,
references): one PIL image, ``strength``, ``padding_mask_crop``, the refusals of a job's
arguments where a pipeline takes none, and the cut schedule."""

from __future__ import annotations

import copy
from typing import NamedTuple

from PIL import Image

from ..schedule import t_start


class ImageInputs(NamedTuple):
    """What a stock pipeline does with images, as the CLI (``--image``, ``--mask``,
    ``--strength``) and the server's edits check them before anything runs: one entry of
    a family's ``IMAGE_INPUTS`` table, keyed by the pipeline's class name."""

    what: str  # the job, in messages
    images: int  # the most images one request takes
    # "init": img2img's start image (with ``strength``); "reference": optional references; "edit": the image it edits
    role: str
    needs: bool = False  # an image is required (the image jobs' own pipeline classes)
    mask: str = "none"  # "optional" (with one: inpainting), "required" or "none"
    area: bool = False  # the output rescaled to ``max_area`` (Kontext): a requested size's area is its max_area


def _is_pil(v) -> bool:
    return isinstance(v, Image.Image)


def one_image(value, name: str):
    """One PIL image (or a list of one), else a ValueError naming ``name``."""
    v = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
    if not _is_pil(v):
        raise ValueError(f"{name}: expected one PIL image, got {value!r:.80}")
    return v


def check_strength(strength, steps: int) -> float:
    """``strength`` in [0, 1] leaving at least one step of ``steps`` (the stock checks)."""
    ok = isinstance(strength, (int, float)) and not isinstance(strength, bool) and 0 <= strength <= 1
    if not ok:
        raise ValueError(f"strength: expected a number in [0, 1], got {strength!r}")
    if steps - t_start(steps, strength) < 1:
        raise ValueError(
            f"strength: expected a value > 0 (it runs the last ⌈steps · strength⌉ of the steps, as the "
            f"stock pipelines do), got steps={steps}, strength={strength}: 0 steps"
        )
    return float(strength)


def refuse(fam: str, strength, mask_image, padding_mask_crop, why: str | None = None) -> None:
    """The image jobs' arguments, refused by name where no FLUX.1 job takes them."""
    given = {"strength": strength, "mask_image": mask_image, "padding_mask_crop": padding_mask_crop}
    for name, v in given.items():
        if v is not None:
            why = why or f"FLUX.1 (not {fam})"
            raise ValueError(f"{name}: fd.sample takes it for {why} with an image; expected None, got {v!r:.80}")


def check_crop(pad, mask, output_type) -> None:
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
        raise ValueError(f"padding_mask_crop: expected None or a non-negative int (pixels), got {pad!r}")
    if mask is None:
        raise ValueError("padding_mask_crop: crops around the mask; expected it with a mask_image, got no mask_image")
    if output_type != "pil":
        raise ValueError(
            f"output_type: expected 'pil' with padding_mask_crop (as FluxInpaintPipeline), got {output_type!r}"
        )


def cut(sched, strength: float):
    """A copy of a set scheduler that runs only the last ``steps · strength`` steps, as the
    stock pipelines do."""
    start = t_start(len(sched.timesteps), strength)
    sched = copy.copy(sched)
    sched.timesteps = sched.timesteps[start:]
    sched.set_begin_index(start)
    return sched


def refuse_reference(image_reference) -> None:
    """``image_reference`` belongs to the klein inpainting pipeline only."""
    if image_reference is not None:
        raise ValueError(
            f"image_reference: only a Flux2KleinInpaintPipeline takes it; expected None, got {image_reference!r:.80}"
        )


def refuse_max_area(max_area) -> None:
    """``max_area`` belongs to the Kontext pipeline only."""
    if max_area is not None:
        raise ValueError(f"max_area: only a FluxKontextPipeline takes it; expected None, got {max_area!r}")


def refuse_layers(pipe, layers) -> None:
    """``layers`` belongs to the Qwen-Image-Layered pipeline only."""
    if layers is not None:
        name = type(pipe).__name__
        raise ValueError(f"layers: only a QwenImageLayeredPipeline takes layers; expected None for a {name}")


def refuse_args(pipe, strength, mask_image, padding_mask_crop) -> None:
    """img2img's and inpainting's arguments refused by name for a pipeline of the Qwen-Image
    families that takes none of them."""
    name = type(pipe).__name__
    extra = dict(strength=strength, mask_image=mask_image, padding_mask_crop=padding_mask_crop)
    for arg, v in extra.items():
        if v is not None:
            raise ValueError(f"{arg}: a {name} takes no {arg} (img2img and inpainting do); expected None")

"""Checks of the command line made before anything heavy loads: the device, reference
images, and a transformer checkpoint against the pipeline that will run it (its
headers, family and keys; `weights.inspect` reads no tensor). Each failure is one
`CLIError` line naming the flag."""

from __future__ import annotations

import os

import torch
from PIL import Image

import weights

from .. import families as _families
from ..pipelines import families
from ._args import CLIError


def check_device(text: str | None, flag: str = "--device") -> torch.device | None:
    """``text`` as a torch.device this torch can use, else one line saying why not."""
    if text is None:
        return None
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        raise CLIError(f"{flag}: expected a device such as cpu, cuda, cuda:1, xla or neuron, got {text!r}") from None
    kind = device.type
    if kind in ("xla", "neuron"):
        module = "torch_neuronx" if kind == "neuron" else "torch_xla"
        try:
            __import__(module)
        except ImportError:
            raise CLIError(f"{flag}: {text} needs {module}, which is not installed in this environment") from None
        return device
    backend = getattr(torch, kind, None)
    if kind != "cpu" and not (backend is not None and hasattr(backend, "is_available") and backend.is_available()):
        build = f"torch {torch.__version__}" + (" has no CUDA" if kind == "cuda" and not torch.version.cuda else "")
        raise CLIError(f"{flag}: {text} is not available here ({build}; no {kind} device found); try --device cpu")
    return device


def open_images(paths, flag: str = "--image") -> list | None:
    """The ``flag`` files as RGB images; a missing or unreadable file is one line."""
    if not paths:
        return None
    images = []
    for p in paths:
        if not os.path.isfile(p):
            raise CLIError(f"{flag}: {p} does not exist")
        try:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise CLIError(f"{flag}: {p} is not an image PIL can read ({type(e).__name__})") from None
    return images


def check_images(pipeline: str, images, edit: bool = False) -> None:
    """Reference images where the pipeline takes them (``edit``: an init image), and one
    where it needs it (its family's `ImageInputs`; a pipeline without one is left to
    ``fd.sample``'s checks)."""
    inputs = families.image_inputs(pipeline)
    if inputs is None:
        return
    if images and inputs.role == "init" and not (inputs.needs or edit):
        raise CLIError(
            f"--image: a {pipeline} takes no reference image; drop --image or use an edit pipeline "
            "(img2img / inpainting: add --strength / --mask)"
        )
    if not images and inputs.needs:
        raise CLIError(f"--image: a {pipeline} edits a reference image; pass one with --image")


def check_edit(pipeline: str, images, args):
    """``--strength`` / ``--mask`` (img2img, inpainting): one init image, a FLUX.1 or Qwen-Image pipeline,
    strength in (0, 1]. Returns the mask image (or None) and whether it is an edit job."""
    strength, mask = getattr(args, "strength", None), getattr(args, "mask", None)
    inputs = families.image_inputs(pipeline)
    init = inputs is not None and inputs.role == "init"
    if not (strength is not None or mask is not None or (init and inputs.needs)):
        return None, False
    flag = "--mask" if mask is not None else "--strength"
    if not init:
        raise CLIError(f"{flag}: img2img and inpainting run on {', '.join(edit_pipelines())}; this is a {pipeline}")
    if getattr(args, "prompts", None) is not None:
        raise CLIError(f"{flag}: img2img and inpainting run with --prompt (one image), not --prompts")
    if not images or len(images) != 1:
        raise CLIError(f"--image: img2img and inpainting take one init image, got {len(images or [])}")
    if strength is not None and not 0 < strength <= 1:
        raise CLIError(f"--strength: expected a number in (0, 1] (the share of --steps run), got {strength}")
    if mask is None and inputs.mask == "required":
        raise CLIError(f"--mask: a {pipeline} inpaints; pass the mask image with --mask")
    if mask is not None and inputs.mask == "none":
        raise CLIError(f"--mask: a {pipeline} takes no mask (img2img); drop --mask or use an inpainting pipeline")
    return None if mask is None else open_images([mask], "--mask")[0], True


def edit_pipelines() -> list[str]:
    """The stock pipelines whose --image is an init image (img2img, inpainting)."""
    return [n for n in _families.PIPELINES if getattr(families.image_inputs(n), "role", None) == "init"]


def check_guidance(config, args) -> None:
    """Flags the model would ignore are refused rather than silently dropped."""
    if args.guidance is not None and not getattr(config, "guidance_embeds", False):
        raise CLIError(
            f"--guidance: this {type(config).__name__} has no embedded guidance (guidance_embeds is false), "
            "so it would be ignored; use --true-cfg for classifier-free guidance"
        )
    if args.negative_prompt is not None and not (args.true_cfg is not None and args.true_cfg > 1):
        raise CLIError("--negative-prompt: used only with classifier-free guidance; add --true-cfg > 1")


def check_checkpoint(model: str, config, pipeline: str, flag: str):
    """The transformer's config after `weights.inspect`'s checks, and that the pipeline
    (``flag`` names where it comes from) runs that family."""
    try:
        config = weights.inspect(model, config=config)
    except ValueError as e:
        raise CLIError(f"--model: {str(e).splitlines()[0]}") from None
    family, runs = _families.key(config), _families.of_pipeline(pipeline).KEY
    if runs != family:
        raise CLIError(
            f"{flag}: a {pipeline} runs a {runs} transformer, but --model {model} is {family} "
            f"({type(config).__name__}); pass a --base of the same family"
        )
    return config

"""Checks of the command line made before anything heavy loads: the device, reference
images, and a transformer checkpoint against the pipeline that will run it (its
headers, family and keys; `weights.inspect` reads no tensor). Each failure is one
`CLIError` line naming the flag."""

from __future__ import annotations

import os

import torch

from .. import families
from . import CLIError

# `fd.sample`'s pipelines: which take reference images (None: optional), by class name.
_IMAGES = {"FluxPipeline": False, "QwenImagePipeline": False, "QwenImageEditPipeline": True}


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


def open_images(paths) -> list | None:
    """The ``--image`` files as RGB images; a missing or unreadable file is one line."""
    if not paths:
        return None
    from PIL import Image

    images = []
    for p in paths:
        if not os.path.isfile(p):
            raise CLIError(f"--image: {p} does not exist")
        try:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise CLIError(f"--image: {p} is not an image PIL can read ({type(e).__name__})") from None
    return images


def check_images(pipeline: str, images) -> None:
    """Reference images where the pipeline takes them, and one where it needs it."""
    needs = _IMAGES.get(pipeline)
    if images and needs is False:
        raise CLIError(f"--image: a {pipeline} takes no reference image; drop --image or use an edit pipeline")
    if not images and needs:
        raise CLIError(f"--image: a {pipeline} edits a reference image; pass one with --image")


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
    import weights

    try:
        config = weights.inspect(model, config=config)
    except ValueError as e:
        raise CLIError(f"--model: {str(e).splitlines()[0]}") from None
    family, runs = families.key(config), families.of_pipeline(pipeline).KEY
    if runs != family:
        raise CLIError(
            f"{flag}: a {pipeline} runs a {runs} transformer, but --model {model} is {family} "
            f"({type(config).__name__}); pass a --base of the same family"
        )
    return config

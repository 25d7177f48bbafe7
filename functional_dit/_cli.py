"""The commands: argument parsing for ``demo`` and ``generate`` (the work is in `_demo`
and `_generate`); ``bench`` and ``check`` register their own arguments (`bench`, `check`:
``add_arguments(parser)`` and ``run(args) -> int``)."""

from __future__ import annotations

import argparse
import importlib


class CLIError(Exception):
    """An expected failure: printed as one line (``error: ...``), exit status 2."""


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return v


def _cache_spec(text: str):
    from ._cache import parse  # imported on use: `--help` stays fast

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run_demo(args) -> int:
    from . import _demo  # imported on use: `--help` stays fast

    return _demo.run(args)


def _run_generate(args) -> int:
    from . import _generate

    return _generate.run(args)


MODULE_COMMANDS = {  # name -> (module with add_arguments / run, one-line help)
    "bench": ("functional_dit.bench", "speed and memory side by side with diffusers; --out FILE writes a report"),
    "check": ("functional_dit.check", "hardware check: fd.apply on a device vs CPU eager at a tiny config"),
}


def _run_module(args) -> int:
    return importlib.import_module(args._module).run(args)


def add_commands(sub) -> None:
    for name, (module, help_text) in MODULE_COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module, run=_run_module)
        importlib.import_module(module).add_arguments(p)
    demo = sub.add_parser(
        "demo",
        help="tiny offline models: one image per family with fd.sample, compared with diffusers",
        description="Builds the tiny offline model set, generates one image per family with fd.sample, "
        "compares the latents with the stock diffusers pipeline at the same seed, runs FLUX.1 again on "
        "2 local CPU ranks with tp=2, writes PNGs and a contact sheet, and prints a table.",
    )
    demo.add_argument("--out", default="demo_out", help="output folder (default: demo_out)")
    demo.add_argument("--steps", type=_positive, default=4, help="denoising steps (default: 4)")
    demo.add_argument("--size", type=_positive, default=64, help="image height and width in pixels (default: 64)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--only", nargs="+", default=None, metavar="NAME", help="run only these rows (e.g. flux1-dev qwen-image)"
    )
    demo.add_argument("--ranks", type=int, default=2, help="CPU ranks for the tp run (0 skips it; default: 2)")
    demo.set_defaults(run=_run_demo)

    gen = sub.add_parser(
        "generate",
        help="an image from a checkpoint (diffusers pipeline folder, or a transformer file + --base)",
        description="Generate an image with fd.sample. Under torchrun, --tp/--sp/--dp shard the model "
        "over the ranks (tp*sp*dp = the number of ranks); rank 0 shows progress and writes the image.",
    )
    gen.add_argument(
        "--model",
        required=True,
        help="a diffusers pipeline folder, a transformer folder or "
        ".safetensors file (with --base), or a preset name with weights in the Hugging Face cache",
    )
    gen.add_argument("--base", default=None, help="pipeline folder for the text encoders, VAE and scheduler")
    gen.add_argument("--config", default=None, help="preset for a single transformer file without a config")
    gen.add_argument("--prompt", default=None, help="one prompt (with --out)")
    gen.add_argument(
        "--prompts",
        default=None,
        help="a file of prompts, one a line, or JSON lines with prompt, seed, size, steps, guidance, "
        "true_cfg, negative_prompt (with --out-dir; resumable)",
    )
    gen.add_argument("--negative-prompt", default=None)
    gen.add_argument(
        "--image", nargs="+", default=None, help="reference image(s) (FLUX.2, Qwen-Image-Edit); FLUX.1: the init image"
    )
    gen.add_argument("--mask", default=None, help="FLUX.1 inpainting: the mask image (white = repaint), with --image")
    gen.add_argument(
        "--strength", type=float, default=None, help="FLUX.1 img2img/inpainting: share of the steps run (default 0.6)"
    )
    gen.add_argument("--height", type=_positive, default=1024)
    gen.add_argument("--width", type=_positive, default=1024)
    gen.add_argument("--steps", type=_positive, default=28)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--guidance", type=float, default=None, help="embedded guidance (FLUX.1-dev, FLUX.2-dev)")
    gen.add_argument("--true-cfg", type=float, default=None, help="classifier-free guidance scale (> 1 enables)")
    gen.add_argument(
        "--cache",
        type=_cache_spec,
        default=None,
        help="step caching: fbcache:THRESHOLD, taylorseer:interval=N,warmup=N,order=N, magcache:THRESHOLD",
    )
    gen.add_argument("--tp", type=_positive, default=1)
    gen.add_argument("--sp", type=_positive, default=1)
    gen.add_argument("--dp", type=_positive, default=1)
    gen.add_argument("--device", default=None, help="cpu, cuda, ... (default: the accelerator, else cpu)")
    gen.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16 on an accelerator, float32 on the CPU",
    )
    gen.add_argument("--out", default=None, help="the image file to write (.png, .jpg, .webp)")
    gen.add_argument("--out-dir", default=None, help="with --prompts: the folder for NNNNN.png and manifest.jsonl")
    gen.add_argument("--batch-size", type=_positive, default=1, help="with --prompts: images per model call")
    gen.set_defaults(run=_run_generate)

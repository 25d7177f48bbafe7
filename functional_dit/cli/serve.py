"""``python -m functional_dit serve``: the OpenAI-compatible image server
(`functional_dit.serve`; docs/serving.md)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util

import torch

import weights

from .. import serve
from . import generate
from ._args import CLIError, finite, positive
from ._quiet import loading as quiet_loading

DESCRIPTION = (
    "An OpenAI-compatible image server (POST /v1/images/generations) with step-level continuous batching "
    "and a LoRA per request. --model flux serves the tiny offline FLUX.1 pipeline."
)


def _seconds(text: str) -> float:
    """A positive finite number of seconds."""
    v = finite(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def _padding(text: str) -> float:
    """A finite ratio of at least 1."""
    v = finite(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a ratio of padded to real tokens >= 1, got {text!r}")
    return v


def add_arguments(p) -> None:
    """The model and its adapters, where to listen, the batching and request limits, the ranks."""
    _model_arguments(p)
    _limit_arguments(p)
    _rank_arguments(p)
    _xla_arguments(p)


def _model_arguments(p) -> None:
    """The model, its adapters (fixed or changed at run time) and the address served."""
    p.add_argument("--model", required=True, help="a tiny pipeline name (flux, ...), checkpoint or preset")
    p.add_argument("--base", default=None, help="the pipeline folder for a transformer-only --model (as generate)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="a LoRA file served as NAME")
    p.add_argument("--lora-dir", default=None, metavar="DIR", help="POST /v1/loras loads adapters from files under DIR")
    p.add_argument(
        "--admin-token",
        default=None,
        metavar="T",
        help="POST / DELETE /v1/loras need 'Authorization: Bearer T' (default: $FD_SERVE_ADMIN_TOKEN, "
        "which ps does not show; neither: adapters are fixed)",
    )
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")


def _limit_arguments(p) -> None:
    """Batching, priorities, and what one request may ask for."""
    p.add_argument("--max-batch", type=positive, default=8, help="images per running batch (1: batching off)")
    p.add_argument("--max-queue", type=positive, default=64, help="images waiting; more is a 429")
    p.add_argument(
        "--mixed-resolution",
        choices=("on", "off"),
        default="on",
        help="images of several sizes in one model call (padded; FLUX.1, Qwen-Image); off: one call per size",
    )
    p.add_argument(
        "--max-padding",
        type=_padding,
        default=None,
        metavar="R",
        help="a mixed-resolution call's padded tokens over its real ones, at most (>= 1; default 1.10)",
    )
    p.add_argument(
        "--aging",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="seconds of waiting worth one priority level: priority p goes before lower ones that arrived "
        "less than p*S s earlier (no request starves)",
    )
    p.add_argument("--max-images", type=positive, default=4, help="the largest n of one request")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request gets 504")
    p.add_argument("--steps", type=positive, default=28, help="the steps of a request that names none")
    p.add_argument("--size", default="1024x1024", help="the size of a request that names none, WxH")
    p.add_argument("--max-steps", type=positive, default=200, help="the most steps a request may ask for (more: 400)")
    p.add_argument("--max-size", type=positive, default=2048, help="the largest width or height served")
    p.add_argument("--max-upload-bytes", type=positive, default=16 * 2**20, help="an edits request's body, bytes")
    p.add_argument("--max-upload-pixels", type=positive, default=4096 * 4096, help="each uploaded image's pixels")
    p.add_argument("--max-sequence-length", type=positive, default=None, help="text tokens (default: the model's)")


def _rank_arguments(p) -> None:
    """The mesh under torchrun and the journal of accepted requests."""
    p.add_argument("--tp", type=positive, default=1, help="tensor parallel degree (under torchrun)")
    p.add_argument("--sp", type=positive, default=1, help="sequence parallel degree, Ulysses (under torchrun)")
    p.add_argument("--dp", type=positive, default=1, help="dp groups, each running its own batches (under torchrun)")
    p.add_argument("--rank-timeout", type=float, default=60.0, help="seconds before a silent rank fails the server")
    p.add_argument("--journal", default=None, help="a JSONL file: every accepted request is written before it runs")
    p.add_argument(
        "--resume-journal",
        action="store_true",
        help="re-run the journal's unfinished requests",
    )


def _xla_arguments(p) -> None:
    """The fixed-shape step graphs of lazy devices (docs/xla.md "Serving")."""
    p.add_argument(
        "--device", choices=("cpu", "xla"), default="cpu", help="where the transformer runs (xla: torch_xla)"
    )
    p.add_argument(
        "--xla-buckets",
        default=None,
        metavar="N,N,...",
        help="batch sizes each step is padded to, one graph each (--device xla's default: 1,2,4,8; "
        "on the cpu: the same padded steps, eager)",
    )
    p.add_argument("--xla-warmup", action="store_true", help="compile every bucket and --xla-sizes before listening")
    p.add_argument("--xla-strict", action="store_true", help="a size not warmed is a 400 naming size")
    p.add_argument("--xla-sizes", default=None, metavar="WxH,...", help="the sizes warmed (default: --size)")
    p.add_argument("--xla-cache", default=None, metavar="DIR", help="torch_xla's persistent compilation cache folder")


MISSING = 'serve needs starlette and uvicorn: pip install -e ".[serve]"'
MISSING_MULTIPART = 'serve needs python-multipart (the edits uploads): pip install -e ".[serve]"'


def run(args) -> int:
    try:  # before anything loads: one line, not a traceback from deep inside
        importlib.import_module("starlette")
        importlib.import_module("uvicorn")
    except ImportError:
        raise CLIError(MISSING) from None
    try:
        importlib.import_module("python_multipart")
    except ImportError:
        raise CLIError(MISSING_MULTIPART) from None
    if args.device == "xla" and args.tp * args.sp != 1:
        raise CLIError(serve.XLA_SHARDED.format(tp=args.tp, sp=args.sp))
    if args.device == "xla" and importlib.util.find_spec("torch_xla") is None:
        raise CLIError(serve.XLA_MISSING)

    return serve.run(args, load_model)


def load_model(spec: str, base: str | None = None, dtype=None):
    """(params, pipe) for ``--model``: every name ``generate`` takes, resolved by its own
    functions — a tiny pipeline name (``flux``, ``tiny:qwen-image``, ...: the offline model
    at seed 0, `functional_dit.cli._models`), or a checkpoint / preset
    (`functional_dit.cli.generate.resolve`, ``base`` for a transformer-only file)."""
    dtype = dtype or torch.float32
    args = argparse.Namespace(model=spec, base=base, config=None)
    tiny = generate._tiny_name(args)
    with quiet_loading():  # the libraries' loading notices and bars held back, as generate does
        if tiny is not None:
            pipe, params = generate._load_tiny(tiny, None, "cpu", dtype)
            return params, pipe
        # diffusers: seconds to import, loaded when first used
        import diffusers

        model, folder, config = generate.resolve(args)
        pipe = diffusers.DiffusionPipeline.from_pretrained(folder, transformer=None, dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        return weights.load(model, config=config, dtype=dtype), pipe

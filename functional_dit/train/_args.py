"""The trainer's options and their checks: each bad value exits naming the option, the
expected and the actual value, before anything loads."""

from __future__ import annotations

import argparse
import importlib.util
import os

from ._cache import check_step
from ._checkpoint import checkpoint_step, has_ema, latest_checkpoint, previous_run
from ._data import FLOW_MAP, IMAGES, METADATA, MODULAR_INDEX, TINY_KINDS, check_resolution, find_items, tiny_family
from ._optim import SCHEDULES


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawTextHelpFormatter):
    """``--help`` with every option's default, the description's lines kept as written."""


def parser(description: str = "LoRA fine-tuning, fully sharded") -> argparse.ArgumentParser:
    """The trainer's own parser (examples/train_lora.py), every default in ``--help``."""
    p = argparse.ArgumentParser(description=description, formatter_class=_Help)
    add_arguments(p)
    return p


def _with_default(p: argparse.ArgumentParser):
    """``p.add_argument`` with `` (default: %(default)s)`` after each help (not for
    required options)."""

    def arg(*names, **kw):
        if kw.get("default") is not argparse.SUPPRESS:
            kw["help"] += " (default: %(default)s)"
        p.add_argument(*names, **kw)

    return arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The trainer's options on ``p`` (its own parser, or the CLI's ``train`` command),
    each help ending with its default (both parsers show it)."""
    arg = _with_default(p)
    need = dict(required=True, default=argparse.SUPPRESS)  # (no "default: None" in --help)
    arg("--data", **need, help="folder of images with same-name .txt captions or a metadata.jsonl")
    arg("--output-dir", **need, help="cache, checkpoints, logs and the LoRA file")
    arg(
        "--pipeline",
        default="tiny",
        help="a FLUX.1 / FLUX.2 / klein / Qwen-Image / FLUX.3 (base) / Qwen-Image 2.1 pipeline folder, or tiny[:kind]",
    )
    arg("--resolution", type=int, default=512, help="buckets of about this squared pixels; a multiple of 16")
    arg("--trigger", default=None, help="a word put before every caption")
    arg("--caption-dropout", type=float, default=0.0, help="probability of the empty caption per item")
    arg("--max-sequence-length", type=int, default=512, help="text tokens per caption")
    arg("--rank", type=int, default=16, help="LoRA rank")
    arg("--alpha", type=float, default=None, help="LoRA alpha (None: the rank)")
    arg("--targets", nargs="+", default=None, help="module suffixes to adapt (None: attention)")
    arg("--lr", type=float, default=1e-4, help="AdamW learning rate")
    arg("--weight-decay", type=float, default=1e-4, help="AdamW weight decay")
    arg("--batch-size", type=int, default=1, help="global batch per forward (split over dp x fsdp)")
    arg("--grad-accum", type=int, default=1, help="forwards per step: a batch of --batch-size x this")
    arg("--lr-scheduler", choices=SCHEDULES, default="constant", help="learning rate over the steps")
    arg("--warmup-steps", type=int, default=0, help="steps of linear warmup from 0")
    arg("--max-grad-norm", type=float, default=None, help="clip by the global gradient norm (None: no)")
    arg("--ema-decay", type=float, default=None, help="keep an EMA of the LoRA, written to ema/ (None: no)")
    arg("--steps", type=int, default=1000, help="train until this step (with --resume: the new end)")
    arg("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    arg("--timesteps", choices=("logit_normal", "uniform"), default="logit_normal", help="t's law")
    arg("--guidance", type=float, default=1.0, help="guidance input of guidance-distilled models")
    arg("--seed", type=int, default=0, help="LoRA init, data order, noise and t")
    arg("--fsdp", type=int, default=1, help="fully sharded degree")
    arg("--tp", type=int, default=1, help="tensor-parallel degree")
    arg("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="frozen weights, autocast")
    arg("--reshard-after-forward", action="store_true", help="re-gather weights in backward (fsdp)")
    arg("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    arg("--overwrite", action="store_true", help="start over in an --output-dir that holds a run (its files removed)")
    arg("--no-progress", action="store_true", help="no progress bar")
    arg("--report-to", choices=("none", "tensorboard"), default="none", help="also log to TensorBoard (tensorboard/)")
    _validation_and_memory_arguments(arg)


def _validation_and_memory_arguments(arg) -> None:
    """The buckets and cache options, the validation-image options (`_validate`), --dora,
    --checkpoint-blocks and --base-dtype."""
    arg("--bucket-step", type=int, default=64, help="bucket sides are multiples of this (of 16; 32 for Qwen-Image 2.1)")
    arg("--max-aspect-ratio", type=float, default=2.0, help="longest bucket side over shortest (1: one square bucket)")
    arg("--cache-dir", default=None, help="latent and text-embedding cache (None: OUTPUT_DIR/cache)")
    arg("--validation-prompt", action="append", default=None, help="a prompt sampled with seed i (repeatable)")
    arg("--validation-every", type=int, default=100, help="steps between validation grids (samples/)")
    arg("--validation-size", type=int, default=None, help="validation image side (None: --resolution)")
    arg("--validation-sampling-steps", type=int, default=20, help="denoising steps per validation image")
    arg("--validation-guidance", type=float, default=None, help="guidance-distilled models' (None: fd.sample's)")
    arg("--dora", action="store_true", help="DoRA: a trained magnitude per output row (PEFT's use_dora)")
    arg("--checkpoint-blocks", action="store_true", help="recompute each block's activations in backward")
    arg("--base-dtype", choices=("fp8",), default=None, help="store the frozen weights in fp8, read in --dtype per op")


def check_args(argv=None, description: str = "LoRA fine-tuning, fully sharded") -> argparse.Namespace:
    """The parsed arguments, each checked (argparse's exit 2 naming it) before anything loads."""
    p = parser(description)
    a = p.parse_args(argv)
    check(a, p.error)
    return a


def check(a: argparse.Namespace, error) -> None:
    """Every value of ``a`` checked; ``error(message)`` does not return (``p.error``, or a
    raise for the CLI)."""

    def bad(name: str, expected: str, got) -> None:
        error(f"{name}: expected {expected}, got {got!r}")

    if not os.path.isdir(a.data):
        bad("--data", "a folder of images and captions", a.data)
    try:
        found = find_items(a.data)
    except ValueError as e:
        error(f"--data: {e}")
    if not found:
        bad("--data", f"images ({', '.join(IMAGES)}) each with a same-name .txt caption or in {METADATA}", a.data)
    tiny = ("tiny", *(f"tiny:{k}" for k in TINY_KINDS))
    if a.pipeline == "tiny:flux3-distilled":
        error(f"--pipeline: {FLOW_MAP}, got {a.pipeline!r}")
    indexed = any(os.path.isfile(os.path.join(a.pipeline, n)) for n in ("model_index.json", MODULAR_INDEX))
    if a.pipeline not in tiny and not indexed:
        bad("--pipeline", f"one of {tiny} or a diffusers pipeline folder (with model_index.json)", a.pipeline)
    _check_numbers(a, bad)
    try:  # (a folder's family: checked once loaded)
        fam = tiny_family(a.pipeline) if a.pipeline in tiny else None
        check_resolution(fam, a.resolution)
        check_step(fam, a.bucket_step)
    except ValueError as e:
        error(str(e))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.fsdp * a.tp != world:
        bad("--fsdp x --tp", f"the world size {world} (WORLD_SIZE)", f"{a.fsdp} x {a.tp} = {a.fsdp * a.tp}")
    _check_run(a, bad, error)


def _check_numbers(a, bad) -> None:
    for name, low in (("resolution", 16), ("max_sequence_length", 1), ("rank", 1), ("batch_size", 1)):
        if getattr(a, name) < low:
            bad("--" + name.replace("_", "-"), f"an int >= {low}", getattr(a, name))
    if a.resolution % 16:
        bad("--resolution", "a multiple of 16 (the VAE's 8 x FLUX's 2x2 packing)", a.resolution)
    if a.bucket_step < 16 or a.bucket_step % 16:
        bad("--bucket-step", "a multiple of 16 (>= 16)", a.bucket_step)
    if not a.max_aspect_ratio >= 1:
        bad("--max-aspect-ratio", "a float >= 1", a.max_aspect_ratio)
    if a.cache_dir is not None and os.path.exists(a.cache_dir) and not os.path.isdir(a.cache_dir):
        bad("--cache-dir", "a folder (new or existing)", a.cache_dir)
    for name in ("steps", "checkpoint_every", "fsdp", "tp", "grad_accum"):
        if getattr(a, name) < 1:
            bad("--" + name.replace("_", "-"), "a positive int", getattr(a, name))
    if not a.lr > 0:
        bad("--lr", "a positive float", a.lr)
    if a.weight_decay < 0:
        bad("--weight-decay", "a float >= 0", a.weight_decay)
    if a.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        bad("--report-to", "'none' unless the tensorboard package is installed (pip install tensorboard)", a.report_to)
    if not 0 <= a.caption_dropout <= 1:
        bad("--caption-dropout", "a probability in [0, 1]", a.caption_dropout)
    if a.warmup_steps < 0:
        bad("--warmup-steps", "an int >= 0", a.warmup_steps)
    if a.max_grad_norm is not None and not a.max_grad_norm > 0:
        bad("--max-grad-norm", "a positive float", a.max_grad_norm)
    if a.ema_decay is not None and not 0 < a.ema_decay < 1:
        bad("--ema-decay", "a float in (0, 1)", a.ema_decay)
    _check_validation(a, bad)


def _check_validation(a, bad) -> None:
    for name in ("validation_every", "validation_sampling_steps"):
        if getattr(a, name) < 1:
            bad("--" + name.replace("_", "-"), "a positive int", getattr(a, name))
    if a.validation_size is not None and (a.validation_size < 16 or a.validation_size % 16):
        bad("--validation-size", "a multiple of 16 (>= 16)", a.validation_size)
    if a.validation_prompt is not None and not all(p.strip() for p in a.validation_prompt):
        bad("--validation-prompt", "non-empty prompts", a.validation_prompt)


def _check_run(a, bad, error) -> None:
    """--output-dir against --resume / --overwrite / --steps: continue a run, start one in
    a folder without one, or start over only when asked."""
    if os.path.exists(a.output_dir) and not os.path.isdir(a.output_dir):
        bad("--output-dir", "a folder (new or existing)", a.output_dir)
    if a.resume and a.overwrite:
        error("--resume, --overwrite: expected one of them (one continues the run, the other starts over), got both")
    if a.resume:
        ckpt = latest_checkpoint(a.output_dir)
        if ckpt is None:
            bad("--resume", f"a complete checkpoint in {os.path.join(a.output_dir, 'checkpoints')}", None)
        if a.steps < (step := checkpoint_step(ckpt)):
            bad("--steps", f"an int >= {step} (the step of {ckpt}, which --resume continues)", a.steps)
        if a.ema_decay is not None and not has_ema(ckpt):
            bad("--ema-decay", f"None: {ckpt}, which --resume continues, was saved without an EMA", a.ema_decay)
    elif not a.overwrite and (found := previous_run(a.output_dir)):
        error(
            f"--output-dir: expected a folder without a previous run, got {a.output_dir!r} holding "
            f"{', '.join(found)}: pass --resume to continue that run or --overwrite to start over"
        )

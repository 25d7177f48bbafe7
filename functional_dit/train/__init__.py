"""LoRA fine-tuning of a FLUX.1 / FLUX.2 / klein / Qwen-Image / FLUX.3 / Qwen-Image 2.1 transformer on an
image-caption folder, fully sharded: ``python -m functional_dit train``.

    torchrun --nproc-per-node 2 -m functional_dit train --data my_images --output-dir run \\
        --fsdp 2 --steps 500 --checkpoint-every 100            # add --resume to continue
    python -m functional_dit train --data my_images --output-dir run --pipeline /path/to/FLUX.1-dev

(``examples/train_lora.py`` is the same trainer as a script.) The data folder holds images
(``.png``, ``.jpg``, ``.jpeg``, ``.webp``) and their captions: a ``metadata.jsonl`` of
``{"file_name", "text"}`` lines (the diffusers image-folder layout) or, next to each image,
a caption with the same name and ``.txt``; ``--trigger`` puts a word before each.
``--pipeline`` is a diffusers FluxPipeline, Flux2Pipeline, Flux2KleinPipeline or
QwenImagePipeline folder (read offline) or ``tiny`` (default:
`functional_dit.tiny.pipeline("flux")`, random tiny weights, for trying the trainer and for
the tests; ``tiny:flux2-klein``, ``tiny:qwen-image`` the other tiny ones).

What it does, in order (docs/training.md says more):

1. Checks every argument (a bad one exits naming it, the expected and the actual value)
   before anything is loaded; an ``--output-dir`` holding an earlier run is refused unless
   ``--resume`` continues it or ``--overwrite`` starts over.
2. Each image goes to the aspect-ratio bucket nearest its own (sizes of about
   ``--resolution``² pixels, sides multiples of ``--bucket-step``, within
   ``--max-aspect-ratio``), resized to cover it and centre-cropped; the buckets and their
   counts are printed. Rank 0 encodes what the cache (``<output-dir>/cache`` or
   ``--cache-dir``: one safetensors file per latent and per caption, named by the hash of
   what it depends on) does not hold yet; the other ranks wait; the VAE and text encoders
   are then dropped, and each step reads its own items' files.
3. The frozen transformer (``--dtype``; ``--base-dtype fp8``: stored in float8) and a fresh
   fp32 LoRA (``lora.init``) are sharded over ``sharding.make_mesh(fsdp=--fsdp, tp=--tp)``;
   AdamW updates each rank's shards.
4. Each step: the rectified-flow loss on the step's ``--batch-size`` x ``--grad-accum``
   items, all of one bucket (a seeded plan per epoch; ``--grad-accum`` forwards, gradients
   summed), with noise,
   ``t`` and ``--caption-dropout``'s empty captions from the seeded generator; gradients
   clipped by their global norm (``--max-grad-norm``), the rate of ``--lr-scheduler`` after
   ``--warmup-steps``, an EMA of the factors (``--ema-decay``, written to ``ema/``).
5. Every ``--checkpoint-every`` steps and after the last, a DCP checkpoint that ``--resume``
   continues bitwise, written atomically.
6. ``losses.jsonl`` (loss and learning rate per step), ``loss.png`` (redrawn at each
   checkpoint, with matplotlib), TensorBoard events (``--report-to tensorboard``),
   ``eval.json`` (a fixed-noise eval loss before and after) and the LoRA file
   ``<output-dir>/pytorch_lora_weights.safetensors`` that the stock pipeline's
   ``load_lora_weights(<output-dir>)`` reads; each rank prints its peak memory.
7. With ``--validation-prompt`` (repeatable), every ``--validation-every`` steps and after
   the last: ``fd.sample`` with the current LoRA on the fly, prompt ``i`` with seed ``i``,
   every rank sampling, rank 0 writing one row ``<output-dir>/samples/step_<n>.png``.

FLUX.3 (the base model) and Qwen-Image 2.1 train as the others do.
"""

from __future__ import annotations

import os

from ._args import add_arguments, check, check_args, parser
from ._checkpoint import finished
from ._loop import train

DESCRIPTION = __doc__.split("\n\n")[0]


def main(argv=None, description: str = DESCRIPTION) -> dict:
    """The trainer from a command line (``argv``; bad arguments: argparse's exit 2 naming
    them); returns what rank 0 logged."""
    return _run(check_args(argv, description))


def run(args) -> int:
    """``python -m functional_dit train``: the CLI's parsed ``args``, checked (a bad value
    raises ``ValueError`` naming it: the CLI's one error line, exit 2), then trained."""

    def error(message: str):
        raise ValueError(message)

    check(args, error)
    _run(args)
    return 0


def _run(a) -> dict:
    done = finished(a)
    if done is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(done, flush=True)
        return {"losses": [], "start": a.steps}
    return train(a)


__all__ = ["DESCRIPTION", "add_arguments", "check_args", "main", "parser", "run", "train"]

"""Validation images: every ``--validation-every`` steps, ``fd.sample`` with the current LoRA
applied on the fly (``lora=``, nothing merged) on each ``--validation-prompt`` with seed ``i``
for prompt ``i``, written by rank 0 as one PNG row ``OUT/samples/step_NNNNNNNN.png``."""

from __future__ import annotations

import os

import torch
from PIL import Image

import functional_dit as fd
from functional_dit import tiny

SAMPLES = "samples"


def sample_path(output_dir: str, step: int) -> str:
    """Where the grid of step ``step`` goes."""
    return os.path.join(output_dir, SAMPLES, f"step_{step:08d}.png")


def due(a, step: int) -> bool:
    """Whether the step just finished (``step`` done) gets validation images: every
    ``--validation-every`` steps and after the last, when there are prompts."""
    if not a.validation_prompt:
        return False
    return step % a.validation_every == 0 or step == a.steps


def load_encoders(path: str):
    """The pipeline's text encoders and VAE for ``fd.sample`` (its transformer not loaded):
    the tiny pipeline as `_data.load_pipeline` makes it, or the folder without its
    transformer."""
    if path.startswith("tiny"):
        return tiny.pipeline(path.partition(":")[2] or "flux", seed=0)
    # diffusers: seconds to import, loaded when first used
    import diffusers

    return diffusers.DiffusionPipeline.from_pretrained(
        path, transformer=None, torch_dtype=torch.float32, local_files_only=True
    )


def images(params, adapter, encoders, a, device) -> list:
    """The validation images (PIL) of ``adapter`` now: every rank calls (fsdp/tp meshes
    all-gather inside ``fd.apply``), prompt ``i`` with seed ``i``."""
    size = a.validation_size or a.resolution
    kw = dict(height=size, width=size, steps=a.validation_sampling_steps, seed=list(range(len(a.validation_prompt))))
    kw |= dict(max_sequence_length=a.max_sequence_length, guidance=a.validation_guidance)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.dtype == "bfloat16"):
        return fd.sample(params, encoders, list(a.validation_prompt), lora=[(adapter, 1.0)], **kw)


def grid(tiles: list):
    """The images side by side, left to right in prompt order (one row)."""
    out = Image.new("RGB", (sum(t.width for t in tiles), max(t.height for t in tiles)))
    x = 0
    for t in tiles:
        out.paste(t, (x, 0))
        x += t.width
    return out


def validate(r, a, encoders, step: int) -> str | None:
    """Step ``step``'s validation grid: sampled on every rank, written by rank 0 (atomically);
    its path on rank 0, else None."""
    tiles = images(r.params, r.adapter, encoders, a, r.device)
    if r.rank != 0:
        return None
    path = sample_path(a.output_dir, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    grid(tiles).save(path + ".tmp.png")
    os.replace(path + ".tmp.png", path)
    return path

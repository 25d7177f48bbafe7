"""The training data: the image-caption folder, the pipeline and its family's encode steps
(what `_cache` stores on disk), and caption dropout."""

from __future__ import annotations

import json
import os

import torch

from functional_dit import families as _families
from functional_dit import tiny

from ..pipelines.families import product

IMAGES = (".png", ".jpg", ".jpeg", ".webp")


TINY_KINDS = ("flux", "flux2-klein", "qwen-image", "flux3", "qwen-image-2.1")  # --pipeline tiny[:kind]


METADATA = "metadata.jsonl"  # the diffusers / datasets image-folder captions: {"file_name", "text"}


def find_items(folder: str) -> list[tuple[str, str]]:
    """``(image path, caption)`` of every captioned image, sorted by name: the caption from
    ``metadata.jsonl`` (``{"file_name": ..., "text": ...}`` lines, as the diffusers /
    ``datasets`` image-folder layout) where it names the image, else from a same-name
    ``.txt``; images with neither are left out. A bad ``metadata.jsonl`` raises
    ``ValueError`` naming the line."""
    captions = _metadata(folder)
    out = []
    for name in sorted(os.listdir(folder)):
        stem, ext = os.path.splitext(name)
        txt = os.path.join(folder, stem + ".txt")
        if ext.lower() not in IMAGES or not (name in captions or os.path.isfile(txt)):
            continue
        if name not in captions:
            with open(txt, encoding="utf-8") as f:
                captions[name] = f.read()
        out.append((os.path.join(folder, name), captions[name].strip()))
    return out


def _metadata(folder: str) -> dict[str, str]:
    """``{file name: caption}`` from ``folder/metadata.jsonl`` (empty without one)."""
    path = os.path.join(folder, METADATA)
    if not os.path.isfile(path):
        return {}
    out = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not (
                isinstance(row, dict) and isinstance(row.get("file_name"), str) and isinstance(row.get("text"), str)
            ):
                raise ValueError(
                    f'{path} line {n}: expected {{"file_name": str, "text": str}}, got {line.strip()[:80]!r}'
                )
            name = row["file_name"]
            if os.path.basename(name) != name or os.path.splitext(name)[1].lower() not in IMAGES:
                raise ValueError(f"{path} line {n}: expected an image file name ({', '.join(IMAGES)}), got {name!r}")
            if not os.path.isfile(os.path.join(folder, name)):
                raise ValueError(f"{path} line {n}: expected an image in {folder}, got {name!r} (not found)")
            out[row["file_name"]] = row["text"]
    return out


def with_trigger(items: list[tuple[str, str]], trigger: str | None) -> list[tuple[str, str]]:
    """``items`` with ``trigger`` put before each caption (``"TRIGGER caption"``)."""
    if not trigger:
        return items
    return [(path, f"{trigger} {caption}".strip()) for path, caption in items]


def caption_rows(idx: list[int], p: float, gen: torch.Generator, empty: int) -> list[int]:
    """The text-embedding row of each item of ``idx``: its own, or with probability ``p``
    the empty caption's (row ``empty``), drawn from ``gen`` (nothing drawn when ``p`` is 0,
    so a run without dropout draws what it drew before)."""
    if p <= 0:
        return list(idx)
    drop = torch.rand(len(idx), generator=gen) < p
    return [empty if d else i for i, d in zip(idx, drop.tolist())]


MODULAR_INDEX = "modular_model_index.json"  # a modular pipeline's folder (FLUX.3), in place of model_index.json


def load_pipeline(path: str):
    """The pipeline at ``path`` (fp32; a modular one where the folder has `MODULAR_INDEX`),
    or a tiny one (``tiny``: FLUX.1, ``tiny:flux2-klein``, ...)."""
    if path.startswith("tiny"):
        return check_trainable(tiny.pipeline(path.partition(":")[2] or "flux", seed=0))
    # diffusers: seconds to import, loaded when first used
    import diffusers

    if os.path.isfile(os.path.join(path, MODULAR_INDEX)):  # FLUX.3's modular pipelines
        pipe = diffusers.ModularPipeline.from_pretrained(path)
        pipe.load_components(torch_dtype=torch.float32)
        return check_trainable(pipe)
    pipe = diffusers.DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float32, local_files_only=True)
    return check_trainable(pipe)


FLOW_MAP = (
    "FLUX.3's flow map (step-distilled, flow_map=True) is not trainable here: it learns jumps to a "
    "target timestep, not the velocity this loss fits; expected the base model (Flux3ModularPipeline, tiny:flux3)"
)


def trainable() -> tuple[str, ...]:
    """The stock pipelines whose encode steps a family writes (its ``TRAIN_PIPELINES``)."""
    return tuple(n for f in _families.BY_KEY.values() for n in product(f).TRAIN_PIPELINES)


def family(pipe):
    """The family (`functional_dit.families`) whose product module writes the encode steps
    that train ``pipe`` (a subclass of a trainable pipeline too: FLUX.3's distilled one),
    else a ``ValueError`` naming --pipeline."""
    for cls in type(pipe).__mro__:
        if cls.__name__ in _families.PIPELINES:
            fam = _families.of_pipeline(cls.__name__)
            if cls.__name__ in product(fam).TRAIN_PIPELINES:
                return fam
    raise ValueError(f"--pipeline: expected one of {trainable()}, got a {type(pipe).__name__}")


def tiny_family(path: str):
    """The family of ``tiny[:kind]``, known before anything loads."""
    return _families.TINY_KINDS[path.partition(":")[2] or "flux"][0]


def check_trainable(pipe):
    """``pipe`` if its family's encode steps are written (`family`), else a ``ValueError``
    naming --pipeline (FLUX.3's flow map: `FLOW_MAP`)."""
    family(pipe)
    if getattr(pipe.transformer.config, "flow_map", False):
        raise ValueError(f"--pipeline: {FLOW_MAP}, got a {type(pipe).__name__} with flow_map=True")
    return pipe


def check_resolution(fam, resolution: int) -> None:
    """A ``ValueError`` naming --resolution unless the family's latent fits it
    (its product's ``TRAIN_LATENT_MULTIPLE``: 32 for Qwen-Image 2.1's x16 VAE and 2x2
    image slots; the others' 16, checked with the arguments). ``fam``: a family, or None
    (a folder's, not known before it loads)."""
    multiple = latent_multiple(fam)
    if resolution % multiple:
        raise ValueError(f"--resolution: expected a multiple of {multiple} for {fam.NAME}, got {resolution}")


def latent_multiple(fam) -> int:
    """The pixel multiple family ``fam``'s latent needs (None: 16, what every family takes)."""
    return 16 if fam is None else product(fam).TRAIN_LATENT_MULTIPLE


def encode_texts(pipe, fam, captions: list[str], every: list[str], max_len: int) -> list[tuple]:
    """The embeddings of ``captions`` (each: (L, D), its pooled vector or mask or None, its
    position inputs) as the pipeline makes them (the family's ``train_texts``; FLUX.3's
    encoded together with ``every`` caption of the run)."""
    return product(fam).train_texts(pipe, captions, every, max_len)


def encode_latent(pipe, fam, image: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One image's (1, 3, H, W) packed latent (S, C) and its position inputs, as the
    pipeline prepares them (the family's ``train_latent``)."""
    return product(fam).train_latent(pipe, image)

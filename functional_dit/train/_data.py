"""The training data: the image-caption folder, the pipeline and its family's encode steps
(what `_cache` stores on disk), and caption dropout."""

from __future__ import annotations

import json
import os
import types

import torch

from functional_dit import tiny

from ..pipelines.families.flux3 import Flux3

IMAGES = (".png", ".jpg", ".jpeg", ".webp")


TINY_KINDS = ("flux", "flux2-klein", "qwen-image", "flux3", "qwen-image-2.1")  # --pipeline tiny[:kind]


PIPELINES = (
    "FluxPipeline",
    "Flux2Pipeline",
    "Flux2KleinPipeline",
    "QwenImagePipeline",
    "Flux3ModularPipeline",
    "QwenImage21Pipeline",
)  # the encode steps written here (FLUX.3: the base model; its flow map is refused, `check_trainable`)


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


def check_trainable(pipe):
    """``pipe`` if its family's encode steps are written here, else a ``ValueError`` naming
    --pipeline (FLUX.3's flow map: `FLOW_MAP`)."""
    kind = type(pipe).__name__
    if not any(c.__name__ in PIPELINES for c in type(pipe).__mro__):  # (FLUX.3's distilled one: a subclass)
        raise ValueError(f"--pipeline: expected one of {PIPELINES}, got a {kind}")
    if getattr(pipe.transformer.config, "flow_map", False):
        raise ValueError(f"--pipeline: {FLOW_MAP}, got a {kind} with flow_map=True")
    return pipe


def check_resolution(kind: str, resolution: int) -> None:
    """A ``ValueError`` naming --resolution unless the family's latent fits it: Qwen-Image
    2.1's x16 VAE and one image slot per 2x2 latent patch need a multiple of 32 (its
    pipeline's check); the others' a multiple of 16 (checked with the arguments)."""
    if kind == "QwenImage21Pipeline" and resolution % 32:
        expected = "a multiple of 32 for Qwen-Image 2.1 (its x16 VAE, 2x2 image slots)"
        raise ValueError(f"--resolution: expected {expected}, got {resolution}")


def encode_texts(pipe, kind: str, captions: list[str], every: list[str], max_len: int) -> list[tuple]:
    """The embeddings of ``captions`` (each: (L, D), its FLUX.1 pooled vector or Qwen-Image
    mask or None, its position inputs) as the pipeline makes them; FLUX.3's encoded
    together with ``every`` caption of the run (all at the longest one's padded length)."""
    if kind == "Flux3ModularPipeline":
        rows = dict(zip(every, _flux3_texts(pipe, every, max_len)))
        return [rows[c] for c in captions]
    return [_text(pipe, kind, c, max_len) for c in captions]


def encode_latent(pipe, kind: str, image: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One image's (1, 3, H, W) packed latent (S, C) and its position inputs, as the
    pipeline prepares them (`_latent`)."""
    return _latent(pipe, kind, image)


def _latent(pipe, kind: str, image: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One image's packed latent (S, C) and its position inputs (the same for every image)."""
    if kind == "FluxPipeline":  # shifted and scaled, packed 2x2
        z = pipe.vae.encode(image).latent_dist.mode()
        z = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        _, c, h, w = z.shape
        ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
        return pipe._pack_latents(z, 1, c, h, w)[0], {"img_ids": ids}
    if kind in ("QwenImagePipeline", "QwenImage21Pipeline"):  # a one-frame video latent, normalised
        if kind == "QwenImage21Pipeline":  # RGBA, as its pipeline converts images: opaque
            image = torch.cat([image, torch.ones_like(image[:, :1])], 1)
        z = pipe.vae.encode(image[:, :, None]).latent_dist.mode()
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(pipe.vae.config.latents_mean).view(shape)
        z = (z - mean) / torch.tensor(pipe.vae.config.latents_std).view(shape)
        _, c, _, h, w = z.shape  # Qwen-Image packs 2x2; 2.1 takes it unpatched (its _pack_latents: a flatten)
        side = (h // 2, w // 2) if kind == "QwenImagePipeline" else (h, w)
        return pipe._pack_latents(z, 1, c, h, w)[0], {"img_shapes": [(1, *side)]}
    if kind == "Flux3ModularPipeline":
        return _flux3_latent(pipe, image)
    z = pipe._encode_vae_image(image, generator=None)  # FLUX.2: patchified 2x2, batch-normed
    return pipe._pack_latents(z)[0], {"img_ids": pipe._prepare_latent_ids(z)[0]}


def _flux3_latent(pipe, image: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """FLUX.3's latent as its VAE encoder step makes a reference's (patchified 2x2,
    batch-normed) packed as the sampler packs (one token per patch), and its 4-axis ids
    (image H/W scaled by 0.5, as Flux3PrepareLatentsStep)."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep

    vae = pipe.vae
    z = Flux3VaeEncoderStep._patchify_latents(vae.encode(image).latent_dist.mode())
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    z = (z - mean) / torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    _, _, h, w = z.shape
    rows, cols = torch.meshgrid(torch.arange(h) * 1.0, torch.arange(w) * 1.0, indexing="ij")
    zeros = torch.zeros(rows.numel())
    ids = torch.stack([zeros, rows.reshape(-1) * Flux3.ROPE_SCALE, cols.reshape(-1) * Flux3.ROPE_SCALE, zeros], -1)
    return Flux3.pack(z)[0], {"img_ids": ids}


def _flux3_texts(pipe, captions: list[str], max_len: int) -> list[tuple]:
    """FLUX.3's caption embeddings through its pipeline's encoder (stacked Qwen3-VL layers,
    right-padded to a multiple of 80 tokens, as `fd.sample` encodes), all at one length: a
    caption whose padded length is shorter than the longest's is padded to it with the
    same pad tokens (FLUX.3 attends to them: no mask to stack captions with instead)."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    layers = Flux3(types.SimpleNamespace(config=pipe.transformer.config), pipe)._layers()
    embed = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds

    def run(caption: str, multiple: int) -> torch.Tensor:
        kw = dict(max_sequence_length=max_len, pad_multiple=multiple, hidden_states_layers=layers)
        return embed(pipe.text_encoder, pipe.tokenizer, caption, **kw)[0]

    embeds = [run(c, Flux3.PAD_MULTIPLE) for c in captions]
    T = max(len(e) for e in embeds)
    embeds = [e if len(e) == T else run(c, T) for c, e in zip(captions, embeds)]
    ids = torch.stack([torch.zeros(T), torch.zeros(T), torch.zeros(T), torch.arange(T) * 1.0], -1)
    return [(e, None, {"txt_ids": ids}) for e in embeds]


def _text(pipe, kind: str, caption: str, max_len: int) -> tuple[torch.Tensor, object, dict]:
    """One caption's embeddings (L, D), its FLUX.1 pooled vector or Qwen-Image mask (else
    None) and its position inputs."""
    if kind == "FluxPipeline":  # T5 + CLIP pooled
        e, p, txt_ids = pipe.encode_prompt(caption, prompt_2=None, max_sequence_length=max_len)
        return e[0], p[0], {"txt_ids": txt_ids}
    if kind == "QwenImagePipeline":
        e, m = pipe.encode_prompt(caption, max_sequence_length=max_len)
        return e[0], (torch.ones(e.shape[1], dtype=torch.long) if m is None else m[0].long()), {}
    if kind == "QwenImage21Pipeline":  # its own template and length (no max_sequence_length); text only
        e, m, _ = pipe.encode_prompt(caption, device=torch.device("cpu"))
        return e[0], (torch.ones(e.shape[1], dtype=torch.long) if m is None else m[0].long()), {}
    e, txt_ids = pipe.encode_prompt(caption, max_sequence_length=max_len)  # FLUX.2
    return e[0], None, {"txt_ids": txt_ids[0]}

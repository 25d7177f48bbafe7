"""The training data: the image-caption folder, the pipeline that encodes it, the cache of
latents and text embeddings on disk, and each step's items."""

from __future__ import annotations

import json
import os

import torch

IMAGES = (".png", ".jpg", ".jpeg", ".webp")


CACHE = "cache.pt"


TINY_KINDS = ("flux", "flux2-klein", "qwen-image")  # --pipeline tiny[:kind]


PIPELINES = (
    "FluxPipeline",
    "Flux2Pipeline",
    "Flux2KleinPipeline",
    "QwenImagePipeline",
)  # the encode steps written here


def find_items(folder: str) -> list[tuple[str, str]]:
    """``(image path, caption)`` of every image with a same-name ``.txt``, sorted by name."""
    out = []
    for name in sorted(os.listdir(folder)):
        stem, ext = os.path.splitext(name)
        caption = os.path.join(folder, stem + ".txt")
        if ext.lower() in IMAGES and os.path.isfile(caption):
            with open(caption, encoding="utf-8") as f:
                out.append((os.path.join(folder, name), f.read().strip()))
    return out


def load_pipeline(path: str):
    """The pipeline at ``path`` (offline, fp32), or a tiny one (``tiny``: FLUX.1,
    ``tiny:flux2-klein``)."""
    if path.startswith("tiny"):
        from functional_dit import tiny

        return tiny.pipeline(path.partition(":")[2] or "flux", seed=0)
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float32, local_files_only=True)
    if type(pipe).__name__ not in PIPELINES:
        raise ValueError(f"--pipeline: expected one of {PIPELINES}, got a {type(pipe).__name__}")
    return pipe


def image_tensor(path: str, size: int) -> torch.Tensor:
    """The image resized (shorter side to ``size``, bicubic) and centre-cropped, as
    (3, size, size) in [-1, 1]."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    scale = size / min(img.size)
    img = img.resize((max(size, round(img.width * scale)), max(size, round(img.height * scale))), Image.BICUBIC)
    left, top = (img.width - size) // 2, (img.height - size) // 2
    img = img.crop((left, top, left + size, top + size))
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3)
    return x.permute(2, 0, 1).float() / 127.5 - 1


@torch.no_grad()
def encode(pipe, items, resolution: int, max_len: int) -> dict:
    """The training tensors of ``items`` as the pipeline prepares them: ``latents`` (N, S, C)
    packed, ``txt`` (N, L, D) text embeddings, and what the family's transformer takes
    besides: FLUX.1 ``pooled`` (N, P) and position ids, FLUX.2 position ids, Qwen-Image
    ``txt_mask`` (N, L) (captions padded to the longest) and ``img_shapes``."""
    kind = type(pipe).__name__
    out: dict = {"latents": [], "txt": [], "key": cache_key_of(items, resolution, max_len)}
    pooled, masks = [], []
    for path, caption in items:
        image = image_tensor(path, resolution)[None]
        if kind == "FluxPipeline":  # shifted and scaled, packed 2x2; T5 + CLIP pooled
            z = pipe.vae.encode(image).latent_dist.mode()
            z = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
            _, c, h, w = z.shape
            out["latents"].append(pipe._pack_latents(z, 1, c, h, w)[0])
            e, p, out["txt_ids"] = pipe.encode_prompt(caption, prompt_2=None, max_sequence_length=max_len)
            pooled.append(p[0])
            out["img_ids"] = pipe._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
        elif kind == "QwenImagePipeline":  # a one-frame video latent, normalised, packed 2x2
            z = pipe.vae.encode(image[:, :, None]).latent_dist.mode()
            shape = (1, -1, 1, 1, 1)
            z = (z - torch.tensor(pipe.vae.config.latents_mean).view(shape)) / torch.tensor(
                pipe.vae.config.latents_std
            ).view(shape)
            _, c, _, h, w = z.shape
            out["latents"].append(pipe._pack_latents(z, 1, c, h, w)[0])
            e, m = pipe.encode_prompt(caption, max_sequence_length=max_len)
            masks.append(torch.ones(e.shape[1], dtype=torch.long) if m is None else m[0].long())
            out["img_shapes"] = [(1, h // 2, w // 2)]
        else:  # FLUX.2: patchified 2x2 and batch-normed (_encode_vae_image), packed
            z = pipe._encode_vae_image(image, generator=None)
            out["latents"].append(pipe._pack_latents(z)[0])
            e, txt_ids = pipe.encode_prompt(caption, max_sequence_length=max_len)
            out["img_ids"], out["txt_ids"] = pipe._prepare_latent_ids(z)[0], txt_ids[0]
        out["txt"].append(e[0])
    if masks:  # captions of different lengths: padded with zeros, masked out
        L = max(len(m) for m in masks)
        out["txt"] = [torch.nn.functional.pad(e, (0, 0, 0, L - len(e))) for e in out["txt"]]
        out["txt_mask"] = torch.stack([torch.nn.functional.pad(m, (0, L - len(m))) for m in masks])
    if pooled:
        out["pooled"] = torch.stack(pooled)
    return {**out, "latents": torch.stack(out["latents"]), "txt": torch.stack(out["txt"])}


def cache_key_of(items, resolution: int, max_len: int) -> str:
    stamp = [(os.path.basename(p), os.path.getmtime(p), c) for p, c in items]
    return json.dumps([stamp, resolution, max_len])


def prepare(a, rank: int, barrier):
    """The cached training tensors (rank 0 encodes them once) and the transformer params
    (fp32, full) from the pipeline."""
    import functional_dit as fd

    os.makedirs(a.output_dir, exist_ok=True)
    items = find_items(a.data)
    path = os.path.join(a.output_dir, CACHE)
    pipe = load_pipeline(a.pipeline)
    if rank == 0:
        cached = torch.load(path) if os.path.isfile(path) else None
        if cached is None or cached["key"] != cache_key_of(items, a.resolution, a.max_sequence_length):
            tmp = path + ".tmp"
            torch.save(encode(pipe, items, a.resolution, a.max_sequence_length), tmp)
            os.replace(tmp, path)
    barrier()
    data = torch.load(path)
    return data, fd.from_diffusers(pipe.transformer)


def batch_indices(step: int, batch: int, n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """The items of ``step``: the next ``batch`` of a permutation per epoch (seeded by
    ``seed`` and the epoch), continuing into the next epoch; and the step's epoch order."""
    out, order = [], None
    for c in range(step * batch, (step + 1) * batch):
        epoch, pos = divmod(c, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append(int(order[pos]))
    return out, order

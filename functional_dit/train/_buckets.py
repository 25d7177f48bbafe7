"""Aspect-ratio buckets: the training sizes of about ``--resolution``² pixels, the bucket of
each image (the nearest aspect ratio), the image resized to cover it and centre-cropped, and
each step's batch, all from one bucket."""

from __future__ import annotations

import math

import torch
from PIL import Image, ImageOps


def make_buckets(resolution: int, step: int, max_ratio: float) -> list[tuple[int, int]]:
    """The buckets ``(height, width)``: for each width a multiple of ``step``
    (--bucket-step, itself a multiple of the family's latent multiple, `_data.latent_multiple`), the largest
    height, a multiple too, with ``height * width <= resolution²``, kept where the longer
    side is at most ``max_ratio`` times the shorter (--max-aspect-ratio); the square
    ``resolution²`` always one of them, and of two of one aspect ratio the larger. Sorted
    by aspect ratio (width / height), ascending."""
    out = {(resolution, resolution)}
    for width in range(step, resolution * resolution // step + 1, step):
        height = resolution * resolution // width // step * step
        if height >= step and max(height, width) <= max_ratio * min(height, width):
            out.add((height, width))
    best = {}  # one bucket per aspect ratio: the largest
    for h, w in out:
        r = w / h
        if r not in best or h * w > best[r][0] * best[r][1]:
            best[r] = (h, w)
    return sorted(best.values(), key=lambda hw: hw[1] / hw[0])


def nearest_bucket(size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest (in log) to that of an image of ``size``
    ``(width, height)`` (PIL's order); a tie goes to the first in ``buckets``."""
    width, height = size
    aspect = math.log(width / height)
    return min(buckets, key=lambda hw: abs(math.log(hw[1] / hw[0]) - aspect))


def upright_size(img) -> tuple[int, int]:
    """A PIL image's (width, height) once its EXIF orientation is applied (rotated a
    quarter turn by tags 5-8), without decoding it."""
    rotated = img.getexif().get(0x0112, 1) in (5, 6, 7, 8)
    return (img.height, img.width) if rotated else img.size


def image_tensor(path: str, hw: tuple[int, int]) -> torch.Tensor:
    """The image turned upright (its EXIF orientation), resized (bicubic) to cover ``hw`` =
    (height, width), its aspect kept, and centre-cropped to it (as diffusers' training
    scripts' ``center_crop``), as (3, height, width) in [-1, 1]."""
    height, width = hw
    img = ImageOps.exif_transpose(Image.open(path)).convert("RGB")  # (upright, as diffusers' scripts)
    scale = max(width / img.width, height / img.height)
    size = (max(width, round(img.width * scale)), max(height, round(img.height * scale)))
    img = img.resize(size, Image.BICUBIC)
    left, top = (img.width - width) // 2, (img.height - height) // 2
    img = img.crop((left, top, left + width, top + height))
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(height, width, 3)
    return x.permute(2, 0, 1).float() / 127.5 - 1


def epoch_plan(epoch: int, n: int, groups: list[list[int]], seed: int) -> torch.Tensor:
    """The batches of an epoch, (K, n) item indices: each group (a bucket's items) in a
    seeded permutation, cut into ``ceil(len / n)`` batches of ``n`` (the last completed
    from the group's start: every item at least once per epoch, no batch mixes groups),
    the K batches of all groups then in a seeded order. A function of its arguments only,
    so a resumed run draws the same batches."""
    batches = []
    for j, group in enumerate(groups):
        g = torch.Generator().manual_seed(seed * 100003 + epoch * 1009 + j + 1)
        perm = [group[int(i)] for i in torch.randperm(len(group), generator=g)]
        for k in range(math.ceil(len(group) / n)):
            batches.append([perm[(k * n + i) % len(perm)] for i in range(n)])
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return torch.tensor(batches, dtype=torch.long)[order]


def batch_indices(step: int, n: int, groups: list[list[int]], seed: int) -> tuple[list[int], torch.Tensor]:
    """The ``n`` items of step ``step`` (0-based), all from one group, and its epoch's plan
    (`epoch_plan`; the checkpoint keeps it to check a resumed run's data)."""
    per_epoch = sum(math.ceil(len(g) / n) for g in groups)
    epoch, pos = divmod(step, per_epoch)
    plan = epoch_plan(epoch, n, groups, seed)
    return plan[pos].tolist(), plan


def describe(buckets: list[tuple[int, int]], counts: dict, resolution: int, step: int) -> str:
    """The line printed at start: each bucket with images and its count."""
    used = ", ".join(f"{h}x{w}: {counts[(h, w)]}" for h, w in buckets if counts.get((h, w)))
    return (
        f"buckets (height x width: images): {used} "
        f"(of {len(buckets)} buckets of about {resolution}^2 pixels, multiples of {step})"
    )

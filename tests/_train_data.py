"""What the trainer's tests share: a folder of small random PNGs with same-name captions,
and one intra-op thread for the tiny models."""

from __future__ import annotations

import pathlib

import numpy as np
import torch


def image_folder(folder, captions, hw=(40, 48), seed: int = 0, tint: bool = True) -> str:
    """``len(captions)`` random ``hw`` PNGs ``i.png`` in ``folder`` with ``i.txt`` captions;
    ``tint``: image i's channel ``i % 3`` set to 200, so the images differ in colour."""
    from PIL import Image

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, caption in enumerate(captions):
        arr = (rng.random((*hw, 3)) * 255).astype(np.uint8)
        if tint:
            arr[:, :, i % 3] = 200
        Image.fromarray(arr).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(caption)
    return str(folder)


def one_thread():
    """A fixture body: one intra-op thread while the test runs. The tiny models' small ops run
    ~15x slower with 2 threads on a loaded 2-core machine (OpenMP contention; torchrun's ranks
    get OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

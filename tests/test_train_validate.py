"""The trainer's validation images (``--validation-prompt``, ``--validation-every``), in
process on the tiny FLUX.1 pipeline, fp32: the grid of each step is written under
``OUT/samples/`` and each of its tiles is ``fd.sample`` with the LoRA of that step *merged*
(`lora.merge`) into the weights, to one uint8 level (the trainer applies the LoRA on the
fly: the same sums in another order, fp32 ~1e-6 on the image, which a PNG's rounding turns
into at most one level where a value sits at a rounding boundary); and it is not the image
without the LoRA. Under fsdp=2 (2 gloo ranks, slow) every rank joins the sampling and rank
0 alone writes the same grid, to one uint8 level (fsdp's gathered sums in another order)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _dist import spawn
from _train_data import image_folder, one_thread

from functional_dit.train import main

PROMPTS = ["a red square", "a blue circle"]
ARGS = ["--resolution", "32", "--max-sequence-length", "64", "--rank", "2", "--alpha", "4", "--batch-size", "2"]
ARGS += ["--lr", "3e-2", "--checkpoint-every", "2", "--steps", "2", "--dtype", "float32", "--no-progress"]
VALIDATION = ["--validation-every", "1", "--validation-size", "32", "--validation-sampling-steps", "2"]
VALIDATION += [x for p in PROMPTS for x in ("--validation-prompt", p)]


@pytest.fixture
def data(tmp_path) -> str:
    return image_folder(tmp_path / "images", ("a red square", "a blue circle", "a green stripe"), hw=(32, 32))


one_thread = pytest.fixture(one_thread)


def _merged_tiles(folder: str, lora_file_folder: str | None) -> list[np.ndarray]:
    """``fd.sample`` on the prompts (seed i for prompt i) with the LoRA merged (or none)."""
    import functional_dit as fd
    import functional_dit.lora as lora
    from functional_dit import tiny

    pipe = tiny.pipeline("flux", seed=0)
    params = fd.from_diffusers(pipe.transformer)
    if lora_file_folder is not None:
        params = lora.merge(params, lora.load(lora_file_folder, params))
    kw = dict(height=32, width=32, steps=2, seed=[0, 1], max_sequence_length=64)
    return [np.asarray(im, dtype=np.int16) for im in fd.sample(params, pipe, PROMPTS, **kw)]


def test_validation_grids_equal_sampling_with_the_merged_lora(data, tmp_path, one_thread, capsys):
    out = str(tmp_path / "run")
    main(["--data", data, "--output-dir", out, *ARGS, *VALIDATION])
    assert sorted(os.listdir(os.path.join(out, "samples"))) == ["step_00000001.png", "step_00000002.png"]
    assert "samples/step_00000002.png" in capsys.readouterr().out
    from PIL import Image

    grid = np.asarray(Image.open(os.path.join(out, "samples", "step_00000002.png")), dtype=np.int16)
    assert grid.shape == (32, 64, 3)  # one row: prompt i in column i
    tiles = [grid[:, 32 * i : 32 * (i + 1)] for i in range(len(PROMPTS))]
    merged = _merged_tiles(data, out)  # the LoRA file of the last step (2): the grid's step
    base = _merged_tiles(data, None)
    for i, (tile, want, plain) in enumerate(zip(tiles, merged, base)):
        diff = np.abs(tile - want).max()
        assert diff <= 1, f"prompt {i}: the tile differs from the merged LoRA's image by {diff} uint8 levels"
        assert np.abs(tile - plain).max() >= 5, f"prompt {i}: the LoRA does not change the image"


def _fsdp_run(rank, world, data, out):
    main(["--data", data, "--output-dir", out, *ARGS, *VALIDATION, "--validation-every", "2", "--fsdp", "2"])
    return sorted(os.listdir(os.path.join(out, "samples")))


@pytest.mark.slow
def test_validation_under_fsdp2_every_rank_samples_rank_0_writes(data, tmp_path, one_thread, monkeypatch):
    from PIL import Image

    fsdp = str(tmp_path / "fsdp")
    assert spawn(_fsdp_run, 2, data, fsdp, timeout=600) == [["step_00000002.png"]] * 2
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one = str(tmp_path / "one")
    main(["--data", data, "--output-dir", one, *ARGS, *VALIDATION, "--validation-every", "2"])
    a, b = (np.asarray(Image.open(os.path.join(d, "samples", "step_00000002.png")), np.int16) for d in (fsdp, one))
    assert a.shape == b.shape == (32, 64, 3) and np.abs(a - b).max() <= 1, np.abs(a - b).max()

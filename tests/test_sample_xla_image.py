"""The fixed-graph loop (`functional_dit.pipelines.sampler_xla`) for the image jobs, on
the CPU: FLUX.1, FLUX.2-klein and Qwen-Image inpainting blend on the device with the
noise levels moved once (`schedule.blend_plan`), and every cut schedule (img2img,
inpainting) steps from ``begin_index`` on: the same latents as the usual loop, with no
host read inside a step."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

import functional_dit as fd
from functional_dit import tiny
from functional_dit.pipelines import sampler_xla as _sample_xla
from functional_dit.pipelines.schedule import blend_at as _blend_at


def picture(w=48, h=40, seed=0) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def mask(w=48, h=40, box=(28, 8, 44, 24)) -> Image.Image:
    a = np.zeros((h, w), dtype="uint8")
    a[box[1] : box[3], box[0] : box[2]] = 255
    return Image.fromarray(a)


def _pipe(kind, cls):
    base = tiny.pipeline(kind)
    return getattr(diffusers, cls).from_pipe(base), fd.init(tiny.transformer_config(kind), seed=0)


INPAINT = dict(image=picture(), mask_image=mask(), strength=0.6)  # 3 of 4 steps: a cut schedule
# (name, tiny kind, pipeline class, fd.sample kwargs); img2img's cut schedule is inpainting's
CASES = [
    ("flux1-inpaint", "flux", "FluxInpaintPipeline", INPAINT),
    ("klein-inpaint", "flux2-klein", "Flux2KleinInpaintPipeline", INPAINT),
    ("qwen-inpaint", "qwen-image", "QwenImageInpaintPipeline", INPAINT),
]


@pytest.mark.parametrize("name, kind, cls, kw", CASES, ids=[c[0] for c in CASES])
def test_fixed_loop_equals_usual_loop(name, kind, cls, kw, monkeypatch):
    pipe, params = _pipe(kind, cls)
    blends = []  # the device blend (`schedule.blend_at`), not a host-side step hook
    monkeypatch.setattr(_sample_xla._schedule, "blend_at", lambda *a: blends.append(1) or _blend_at(*a))
    args = dict(height=32, width=32, output_type="latent", steps=4, seed=3, **kw)
    want = fd.sample(params, pipe, "a red cube", **args)
    record = []
    with _sample_xla.static(strict=True, record=record):  # any host read inside a step raises
        got = fd.sample(params, pipe, "a red cube", **args)
    assert len(record) == 1 and record[0]["steps"] == 3, "the fixed loop ran the cut schedule (strength 0.6 of 4 steps)"
    assert len(blends) == 3, "the fixed loop blended on the device after each step"
    # Bitwise as values: the same kernels in the same order; after the last step the
    # device blend adds 0 · noise to the image latents (only a zero's sign may differ).
    torch.testing.assert_close(got, want, rtol=0, atol=0)

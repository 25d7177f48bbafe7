"""``fd.sample`` as a loop over the sampling state (`functional_dit.pipelines.sampler._state`):
each chunk of images is one item whose steps change nothing shared. The family's steps
object (the context's) is the same, attribute for attribute, before the first step and
after the last, for text to image with CFG, a LoRA and a step cache, the image jobs, the
KV caches and ControlNet; and a run of several chunks makes each chunk's images as that
chunk alone (Qwen-Image 2.1's CFG branches were once shared between chunks)."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import controlnet as C
from functional_dit import tiny
from functional_dit.pipelines.sampler import _state

SIZE = dict(height=32, width=32, steps=3, output_type="pt")


def image(w=56, h=72, seed=0) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def mask(w=56, h=72) -> Image.Image:
    m = np.zeros((h, w), "uint8")
    m[10:40, 8:30] = 255
    return Image.fromarray(m)


def _snapshot(model) -> dict:
    """Each attribute's identity, and a container's items' identities."""
    out = {}
    for k, v in vars(model).items():
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, (list, tuple)) else ()
        out[k] = (id(v), tuple((kk, id(x)) for kk, x in items))
        if hasattr(v, "inner") and k == "inner":
            out["inner."] = _snapshot(v)
    return out


def _case(name):
    if name == "flux-cfg-lora-cache":
        pipe = tiny.pipeline("flux")
        params = fd.from_diffusers(pipe.transformer)
        a = lora.init(params, rank=2, seed=1, zero_b=False)
        kw = dict(true_cfg=2.0, negative_prompt="x", lora=[(a, 0.5)], cache=fd.FirstBlockCache(threshold=0.2))
        return params, pipe, kw
    if name == "flux-inpaint":
        base = tiny.pipeline("flux")
        pipe = diffusers.FluxInpaintPipeline.from_pipe(base)
        pipe.set_progress_bar_config(disable=True)
        kw = dict(image=image(), mask_image=mask(), height=64, width=48, batch_size=1)
        return fd.from_diffusers(base.transformer), pipe, kw
    if name == "klein-kv-reference":
        pipe = tiny.pipeline("flux2-klein-kv")
        return fd.from_diffusers(pipe.transformer), pipe, dict(image=image(80, 64), batch_size=1)
    if name == "qwen-image-2.1-cfg":
        pipe = tiny.pipeline("qwen-image-2.1")
        return fd.from_diffusers(pipe.transformer), pipe, dict(true_cfg=3.0, negative_prompt=["x", "blurry bad"])
    if name == "qwen-image-edit-plus":
        pipe = tiny.pipeline("qwen-image-edit-plus")
        kw = dict(image=[image(48, 40)], true_cfg=2.0, negative_prompt="x", batch_size=1, height=32, width=48)
        return fd.from_diffusers(pipe.transformer), pipe, kw
    pipe = tiny.pipeline("flux-controlnet")
    cn = C.from_diffusers(pipe.controlnet)
    return fd.from_diffusers(pipe.transformer), pipe, dict(controlnet=(cn, image(32, 32), 0.8), batch_size=1)


CASES = ["flux-cfg-lora-cache", "flux-inpaint", "klein-kv-reference", "qwen-image-2.1-cfg", "qwen-image-edit-plus",
         "flux-controlnet"]  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_the_steps_object_is_unchanged_by_the_steps(name, monkeypatch):
    params, pipe, kw = _case(name)
    prompts = ["a red cube", "a red cube"] if name == "qwen-image-edit-plus" else ["a red cube", "a blue ball on grass"]
    seen, start = {}, _state.start

    def recording(ctx, fork, *args, **kwargs):
        seen.setdefault("before", _snapshot(ctx.model))
        seen["ctx"] = ctx
        return start(ctx, fork, *args, **kwargs)

    monkeypatch.setattr(_state, "start", recording)
    fd.sample(params, pipe, prompts, seed=3, **{**SIZE, **kw})
    assert _snapshot(seen["ctx"].model) == seen["before"]


@pytest.mark.parametrize("kind", ["qwen-image-2.1", "flux", "flux2-klein", "qwen-image", "flux3"])
def test_chunks_with_cfg_each_equal_that_chunk_alone(kind):
    """Several prompts over one image per model call, with and without true CFG: each
    image bitwise as its prompt alone."""
    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    prompts, negatives = ["a cat", "a much longer prompt about a dog on a sunny hill"], ["x", "blurry low quality bad"]
    for kw in (dict(true_cfg=3.0, negative_prompt=negatives), {}):
        both = fd.sample(params, pipe, prompts, seed=[1, 2], batch_size=1, **kw, **SIZE)
        for i, p in enumerate(prompts):
            one = {k: v[i] if k == "negative_prompt" else v for k, v in kw.items()}
            assert torch.equal(both[i : i + 1], fd.sample(params, pipe, p, seed=1 + i, **one, **SIZE)), (p, kw)

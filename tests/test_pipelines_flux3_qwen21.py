"""FLUX.3 and Qwen-Image 2.1 in the stock pipelines, built offline by `functional_dit.tiny`:
`fd.DiffusersTransformer` gives the stock transformer's latents at the same seed (the
modular Flux3 pipelines with their guider; QwenImage21Pipeline with true CFG and its
prefix KV cache, extract then cached), and `fd.sample`'s own loop gives the stock
pipelines' latents. One pipeline per kind, its transformer swapped for the adapter."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import functional_dit as fd
from functional_dit import tiny

# docs/architecture.md#numerics: fp32 parity; through a few sampler steps the errors stay ~1e-6
FP32 = dict(rtol=1e-5, atol=1e-5)

CALLS = {
    "flux3": dict(height=32, width=32, num_inference_steps=3, text_encoder_out_layers=tiny.FLUX3_LAYERS),
    "flux3-distilled": dict(height=32, width=32, num_inference_steps=3, text_encoder_out_layers=tiny.FLUX3_LAYERS),
    "qwen-image-2.1": dict(height=64, width=64, num_inference_steps=3),
}


@functools.cache
def _pipe(kind):
    return tiny.pipeline(kind, seed=0)


@contextlib.contextmanager
def _transformer(pipe, module):
    """``pipe`` with its transformer swapped for ``module`` while inside."""
    stock = pipe.transformer
    swap = pipe.update_components if hasattr(pipe, "update_components") else pipe.register_modules
    swap(transformer=module)
    try:
        yield pipe
    finally:
        swap(transformer=stock)


def _latents(pipe, kind, **extra):
    out = pipe(
        prompt="a red cube", output_type="latent", generator=torch.Generator().manual_seed(0), **CALLS[kind], **extra
    )
    return out.get("latents").flatten(2).transpose(1, 2) if kind.startswith("flux3") else out.images


ADAPTER_CASES = [
    ("flux3", {}),
    ("flux3-distilled", {}),
    ("qwen-image-2.1", dict(negative_prompt="blur", true_cfg_scale=3.0)),
]


@pytest.mark.parametrize("kind,extra", ADAPTER_CASES)
def test_adapter_in_pipeline_matches_stock(kind, extra):
    pipe = _pipe(kind)
    ref = _latents(pipe, kind, **extra)
    with _transformer(pipe, fd.DiffusersTransformer(fd.from_diffusers(pipe.transformer))):
        out = _latents(pipe, kind, **extra)
    assert out.shape == ref.shape and ref.abs().max() > 0.1
    torch.testing.assert_close(out, ref, **FP32)


SAMPLE_CASES = [  # (kind, pipeline kwargs, fd.sample kwargs)
    ("qwen-image-2.1", {}, {}),  # the prefix KV cache on (the pipeline's default)
    ("qwen-image-2.1", dict(negative_prompt="blur", true_cfg_scale=3.0), dict(negative_prompt="blur", true_cfg=3.0)),
    ("qwen-image-2.1", dict(use_kv_cache=False), dict(kv_cache=False)),
    # the base model's guider: CFG 3.5 with the negative prompt "" (here one batch of 2, the
    # guider's two calls of 1: GEMMs of other sizes, ~3e-6)
    ("flux3", {}, dict(true_cfg=3.5, negative_prompt="")),
    ("flux3-distilled", {}, {}),  # the flow map: target timesteps, no CFG
]


@pytest.mark.parametrize("kind,pipe_kw,sample_kw", SAMPLE_CASES)
def test_sample_matches_stock_pipeline(kind, pipe_kw, sample_kw):
    """fd.sample's own loop (text to image) equals the stock pipeline with the stock transformer."""
    pipe = _pipe(kind)
    ref = _latents(pipe, kind, **pipe_kw)
    size = {k: CALLS[kind][k] for k in ("height", "width")}
    out = fd.sample(fd.from_diffusers(pipe.transformer), pipe, "a red cube", steps=3, seed=0, **size, **sample_kw,
                    output_type="latent")  # fmt: skip
    torch.testing.assert_close(out, ref, **FP32)


def test_qwen21_image_does_not_depend_on_its_batch():
    """Qwen-Image 2.1 lays a batch out by its first prompt, so two prompts of different
    lengths in one call move each other's tokens (stock too: 0.048 on image 0 here). fd.sample
    makes one image per call for this family by default, so image 0 is the prompt alone's
    (bitwise: the same calls); an explicit larger batch_size warns and shows the difference."""
    pipe = _pipe("qwen-image-2.1")
    params = fd.from_diffusers(pipe.transformer)
    prompts = ["a cat", "a red cube on a wooden table under a warm lamp, photo"]
    kw = dict(steps=2, seed=0, height=64, width=64, output_type="latent", kv_cache=False)
    alone = fd.sample(params, pipe, prompts[:1], **kw)
    assert torch.equal(fd.sample(params, pipe, prompts, **kw)[:1], alone)
    with pytest.warns(UserWarning, match="batch_size=2 with Qwen-Image 2.1"):
        batched = fd.sample(params, pipe, prompts, batch_size=2, **kw)
    assert (batched[:1] - alone).abs().max() > 1e-3

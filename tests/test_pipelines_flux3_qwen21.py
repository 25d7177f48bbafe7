"""`fd.DiffusersTransformer` in the stock FLUX.3 and Qwen-Image 2.1 pipelines, built
offline by `functional_dit.tiny`: the same latents as the stock transformer at the same
seed (the modular Flux3 pipelines with their guider; QwenImage21Pipeline with true CFG
and its prefix KV cache, extract then cached)."""

from __future__ import annotations

import pytest
import torch

import functional_dit as fd
from functional_dit import _tiny_next, tiny

# docs/architecture.md#numerics: fp32 parity; through a few sampler steps the errors stay ~1e-6
FP32 = dict(rtol=1e-5, atol=1e-5)

CALLS = {
    "flux3": dict(height=32, width=32, num_inference_steps=2, text_encoder_out_layers=_tiny_next.FLUX3_LAYERS),
    "flux3-distilled": dict(
        height=32, width=32, num_inference_steps=2, text_encoder_out_layers=_tiny_next.FLUX3_LAYERS
    ),
    "qwen-image-2.1": dict(height=64, width=64, num_inference_steps=3, negative_prompt="blur", true_cfg_scale=3.0),
}


def _latents(pipe, kind):
    out = pipe(prompt="a red cube", output_type="latent", generator=torch.Generator().manual_seed(0), **CALLS[kind])
    return out.get("latents") if kind.startswith("flux3") else out.images


@pytest.mark.parametrize("kind", list(CALLS))
def test_adapter_in_pipeline_matches_stock(kind):
    stock = tiny.pipeline(kind, seed=0)
    ref = _latents(stock, kind)
    adapter = fd.DiffusersTransformer(fd.from_diffusers(stock.transformer))
    out = _latents(tiny.pipeline(kind, seed=0, transformer=adapter), kind)
    assert out.shape == ref.shape and ref.abs().max() > 0.1
    torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.parametrize(
    "pipe_kw,sample_kw",
    [
        ({}, {}),  # the prefix KV cache on (the pipeline's default)
        (dict(negative_prompt="blur", true_cfg_scale=3.0), dict(negative_prompt="blur", true_cfg=3.0)),
        (dict(use_kv_cache=False), dict(kv_cache=False)),
    ],
)
def test_sample_matches_qwenimage21_pipeline(pipe_kw, sample_kw):
    """fd.sample's own loop equals QwenImage21Pipeline with the stock transformer."""
    pipe = tiny.pipeline("qwen-image-2.1", seed=0)
    params = fd.from_diffusers(pipe.transformer)
    kw = dict(height=64, width=64, output_type="latent")
    ref = pipe(prompt="a red cube", num_inference_steps=3, generator=torch.Generator().manual_seed(0), **kw, **pipe_kw)
    out = fd.sample(params, pipe, "a red cube", steps=3, seed=0, **kw, **sample_kw)
    torch.testing.assert_close(out, ref.images, **FP32)


@pytest.mark.parametrize("kind,sample_kw", [("flux3", dict(true_cfg=3.5, negative_prompt="")), ("flux3-distilled", {})])
def test_sample_matches_flux3_modular_pipeline(kind, sample_kw):
    """fd.sample, text to image, equals the modular pipeline with the stock transformer: the
    base model with its guider's CFG (3.5, negative ""), the flow map with its target timesteps.
    CFG here is one batch of 2, the guider's two calls of 1 (GEMMs of other sizes: ~3e-6)."""
    pipe = tiny.pipeline(kind, seed=0)
    params = fd.from_diffusers(pipe.transformer)
    ref = pipe(
        prompt="a red cube",
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **{**CALLS[kind], "num_inference_steps": 3},
    ).get("latents")
    out = fd.sample(params, pipe, "a red cube", height=32, width=32, steps=3, seed=0, output_type="latent", **sample_kw)
    torch.testing.assert_close(out, ref.flatten(2).transpose(1, 2), **FP32)

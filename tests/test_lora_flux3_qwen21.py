"""LoRA in the PEFT/diffusers layout on FLUX.3 and Qwen-Image 2.1, against diffusers +
PEFT (``load_lora_adapter``) at the same weights: on the fly and merged, every linear
layer adapted by one adapter and the attention projections by another."""

from __future__ import annotations

import importlib

import peft  # noqa: F401  (diffusers.load_lora_adapter needs it)
import pytest
import torch
from oracle import diffusers_model

import functional_dit as fd
import functional_dit.lora as lora

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md: fp32 parity with diffusers


@pytest.mark.parametrize("name", ["flux3", "qwenimage21"])
def test_peft_lora_matches_diffusers(name, tmp_path):
    cases = importlib.import_module(f"cases_{name}")
    module, params = diffusers_model(cases.TINY, seed=3)
    a = lora.init(params, rank=4, targets=tuple(lora.linear_modules(params.config)), alpha=8.0, seed=1, zero_b=False)
    b = lora.init(params, rank=2, alpha=1.0, seed=2, zero_b=False)
    for tag, ad in (("a", a), ("b", b)):
        lora.save(ad, tmp_path / f"{tag}.safetensors")
        module.load_lora_adapter(
            str(tmp_path), weight_name=f"{tag}.safetensors", prefix="transformer", adapter_name=tag
        )
    la, lb = (lora.load(tmp_path / f"{t}.safetensors", params) for t in "ab")
    module.set_adapters(["a", "b"], [0.8, 0.5])
    kw = cases.inputs(cases.TINY)
    with torch.no_grad():
        ref = module(**cases.diffusers_kwargs(kw))[0]
        fly = fd.apply(params, **kw, lora=[(la, 0.8), (lb, 0.5)])
        merged = fd.apply(lora.merge(lora.merge(params, la, 0.8), lb, 0.5), **kw)
        base = fd.apply(params, **kw)
    assert (ref - base).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(fly, ref, **FP32)
    torch.testing.assert_close(merged, ref, **FP32)

"""LoRA in diffusers pipelines through `fd.DiffusersTransformer`, against the stock
transformer with PEFT: ``pipe.load_lora_weights`` on both, the LoRA ``scale`` the
pipelines pass in ``joint_attention_kwargs`` / ``attention_kwargs``, and the adapter's
own ``set_lora``. Tiny offline pipelines (`functional_dit.tiny`), two steps, latents out.
"""

from __future__ import annotations

import inspect

import peft  # noqa: E402,F401  (a dev dependency: diffusers.load_lora_adapter needs it)
import pytest
import torch

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import tiny

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md: fp32 parity with diffusers


def _run(pipe, scale):
    names = inspect.signature(type(pipe).__call__).parameters
    key = "joint_attention_kwargs" if "joint_attention_kwargs" in names else "attention_kwargs"
    kw = dict(prompt="a red cube", height=32, width=32, num_inference_steps=2, output_type="latent")
    extra = {} if scale is None else {key: {"scale": scale}}
    with torch.no_grad():
        return pipe(**kw, **extra, generator=torch.Generator().manual_seed(0)).images


@pytest.mark.parametrize("kind", ["flux", "flux2", "qwen-image"])
def test_pipeline_lora_matches_stock_peft(kind, tmp_path):
    stock = tiny.pipeline(kind, seed=0)
    params = fd.from_diffusers(stock.transformer)
    ad = lora.init(params, rank=4, targets=lora.linear_modules(params.config), alpha=8.0, seed=1, zero_b=False)
    lora.save(ad, tmp_path / "pytorch_lora_weights.safetensors")
    ours = tiny.pipeline(kind, seed=0, transformer=fd.DiffusersTransformer(params))
    base = _run(ours, None)
    stock.load_lora_weights(str(tmp_path))
    ours.load_lora_weights(str(tmp_path))
    assert len(ours.transformer.get_lora()) == 1
    ref, got = _run(stock, 0.6), _run(ours, 0.6)
    torch.testing.assert_close(got, ref, **FP32)
    assert (got - base).abs().max() > 1e-3  # the LoRA changes the latents
    assert (got - _run(ours, 1.0)).abs().max() > 1e-4  # and the scale is honoured
    # the documented call: the same adapter and scale, set directly
    direct = tiny.pipeline(kind, seed=0, transformer=fd.DiffusersTransformer(params))
    direct.transformer.set_lora([(lora.load(tmp_path, params), 0.6)])
    torch.testing.assert_close(_run(direct, None), ref, **FP32)
    direct.transformer.set_lora(None)
    torch.testing.assert_close(_run(direct, None), base, rtol=0, atol=0)


def test_attention_kwargs_other_than_scale_are_refused():
    params = fd.init(fd.PRESETS["flux1-tiny"])
    adapter = fd.DiffusersTransformer(params)
    with pytest.raises(ValueError, match="expected None, {} or {'scale': float}"):
        adapter._lora_scale("joint_attention_kwargs", {"ip_adapter_image_embeds": 1})
    with pytest.raises(ValueError, match="'scale' must be a real number"):
        adapter._lora_scale("joint_attention_kwargs", {"scale": "big"})
    with pytest.raises(ValueError, match="the adapter was made for"):
        adapter.set_lora([(lora.init(fd.PRESETS["flux2-tiny"]), 1.0)])

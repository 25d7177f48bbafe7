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


def _flux3_bfl_name(module: str) -> str:
    """The BFL name of a FLUX.3 block module, written out by hand (not from our tables)."""
    name = "content_" + module if module.startswith("mode_blocks.") else module
    name = name.replace("single_transformer_blocks.", "single_blocks.")
    for ours, bfl in ((".attn.to_out.0", ".attn_out"), (".ff.linear_in", ".mlp_in"), (".ff.linear_out", ".mlp_out")):
        name = name.replace(ours, bfl)
    return name.replace(".attn.to_q", ".q_proj").replace(".attn.to_k", ".k_proj").replace(".attn.to_v", ".v_proj")


def test_flux3_bfl_names_match_diffusers_converter():
    """A FLUX.3 LoRA under BFL names (``diffusion_model.content_mode_blocks.image.0.q_proj``)
    reads through the checkpoint table `weights` has for FLUX.3; the oracle is diffusers'
    ``_convert_non_diffusers_flux3_lora_to_diffusers``, over every block module it renames."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_flux3_lora_to_diffusers

    config = fd.PRESETS["flux3-tiny"]
    g = torch.Generator().manual_seed(6)
    state = {}
    for m, spec in lora.linear_modules(config).items():
        if "blocks." in m:
            out_dim, in_dim = spec.shape
            name = "diffusion_model." + _flux3_bfl_name(m)
            state[f"{name}.lora_A.weight"] = torch.randn(3, in_dim, generator=g)
            state[f"{name}.lora_B.weight"] = torch.randn(out_dim, 3, generator=g)
    theirs = _convert_non_diffusers_flux3_lora_to_diffusers(dict(state))
    with pytest.warns(UserWarning, match="assuming alpha = rank"):
        ours = lora.from_state_dict(state, config)
    assert {m for m, *_ in ours.config.modules} == {
        k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in theirs if ".lora_A." in k
    }
    for m, *_ in ours.config.modules:
        A, B = ours.factors(m)
        assert torch.equal(A, theirs[f"transformer.{m}.lora_A.weight"]), m  # a rename: the same tensors
        assert torch.equal(B, theirs[f"transformer.{m}.lora_B.weight"]), m

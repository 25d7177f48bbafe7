"""`fd.DiffusersTransformer` as the ``transformer`` of every supported diffusers pipeline.

Each pipeline runs twice at the same prompt and seed, once with the stock diffusers
transformer and once with the adapter over the same randomised weights (`fd.init`,
not diffusers' default init); the latents must agree within 1e-5 in fp32. Also:
bf16, CPU offload, ``pipe.to(bfloat16)``, save / load round trips through stock
diffusers, and the errors for wrong use. The tiny pipelines come from
`functional_dit.tiny`; tensor parallelism is in test_adapter_dist.py.
"""

from __future__ import annotations

import json

import diffusers
import numpy as np
import PIL.Image
import pytest
import torch

import functional_dit as fd
from functional_dit import tiny

SEED = 3  # transformer weights; the other components use the same seed
FP32 = 1e-5  # adapter vs stock through a whole pipeline (measured: 0 for FLUX, <= 5e-7 for Qwen-Image)


def _image(seed: int, size: int = 64) -> PIL.Image.Image:
    """A random RGB image (FLUX.2 refuses references under 64 px)."""
    return PIL.Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))


PROMPT = "a red cube on a wooden table"
# Byte-level tokens: 64 hold the prompt for FLUX.1's T5 and klein's Qwen3 chat template
# (the defaults, 512, only cost time); FLUX.2's Mistral system prompt alone is ~190 tokens.
SHORT = dict(max_sequence_length=64)
CASES = {  # name -> (kind, call arguments beyond the common ones)
    "flux-true-cfg": ("flux", dict(prompt=PROMPT, negative_prompt="blurry", true_cfg_scale=2.0, **SHORT)),
    "flux-kontext-reference": (
        "flux-kontext",
        dict(prompt=PROMPT, image=_image(0), max_area=32 * 32, _auto_resize=False, **SHORT),
    ),
    "flux2-reference": ("flux2", dict(prompt=PROMPT, image=_image(0), max_sequence_length=256)),
    "flux2-klein-cfg-reference": ("flux2-klein", dict(prompt=PROMPT, image=_image(0), guidance_scale=2.0, **SHORT)),
    "flux2-klein-kv-3-steps": ("flux2-klein-kv", dict(prompt=PROMPT, image=_image(0), num_inference_steps=3, **SHORT)),
    # one negative prompt for two prompts: the pipeline sends a batch-1 text stream
    "qwen-image-ragged-true-cfg": (
        "qwen-image",
        dict(prompt=["a cat", PROMPT + " under a lamp"], negative_prompt="blurry", true_cfg_scale=2.0),
    ),
    "qwen-image-edit": ("qwen-image-edit", dict(prompt=PROMPT, image=_image(0))),
    "qwen-image-edit-plus-two-images": ("qwen-image-edit-plus", dict(prompt=PROMPT, image=[_image(0), _image(1)])),
}


def run(pipe, **kwargs) -> torch.Tensor:
    args = dict(height=32, width=32, num_inference_steps=2, output_type="latent")
    args.update(kwargs)
    return pipe(generator=torch.Generator().manual_seed(0), **args).images


def adapter(kind: str, dtype=torch.float32) -> fd.DiffusersTransformer:
    return fd.DiffusersTransformer(fd.init(tiny.transformer_config(kind), seed=SEED, dtype=dtype))


def max_err(a, b) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_latents_equal_stock(case):
    kind, kwargs = CASES[case]
    stock = run(tiny.pipeline(kind, seed=SEED), **kwargs)
    ours = run(tiny.pipeline(kind, seed=SEED, transformer=adapter(kind)), **kwargs)
    assert stock.abs().max() > 0.1  # a real result, not an empty one
    assert max_err(ours, stock) <= FP32


@pytest.mark.parametrize("kind", ["flux", "flux2-klein", "qwen-image"])
def test_pipeline_bf16_equal_stock(kind):
    # bf16: same kernels on the same inputs; measured bitwise on CPU, checked at 1e-5.
    bf16 = dict(seed=SEED, dtype=torch.bfloat16)
    stock = run(tiny.pipeline(kind, **bf16), prompt=PROMPT, **SHORT)
    ours = run(tiny.pipeline(kind, **bf16, transformer=adapter(kind, torch.bfloat16)), prompt=PROMPT, **SHORT)
    assert ours.dtype == torch.bfloat16
    assert max_err(ours, stock) <= FP32


def test_cpu_offload_and_to_bf16():
    pipe = tiny.pipeline("flux", seed=SEED, transformer=adapter("flux"))
    plain = run(pipe, prompt=PROMPT, **SHORT)
    pipe.enable_model_cpu_offload(device="cpu")
    assert max_err(run(pipe, prompt=PROMPT, **SHORT), plain) == 0.0

    pipe = tiny.pipeline("flux", seed=SEED, transformer=adapter("flux")).to(torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in pipe.transformer.params.leaves())
    stock = tiny.pipeline("flux", seed=SEED).to(torch.bfloat16)
    assert max_err(run(pipe, prompt=PROMPT, **SHORT), run(stock, prompt=PROMPT, **SHORT)) <= FP32


def test_module_surface():
    ad = adapter("flux2-klein-kv")
    stock = tiny.stock_transformer("flux2-klein-kv", seed=SEED)
    assert isinstance(ad, fd.DiffusersTransformer) and type(ad).__name__ == "Flux2Transformer2DModel"
    assert {k: v for k, v in ad.config.items() if not k.startswith("_")} == {
        k: v for k, v in stock.config.items() if not k.startswith("_")
    }
    assert ad.state_dict().keys() == stock.state_dict().keys()
    assert all(p.requires_grad for p in ad.parameters())  # as a freshly built stock module's
    assert ad.dtype == torch.float32 and ad.device == torch.device("cpu")
    shared = fd.from_diffusers(ad)  # the adapter is a module with the diffusers names
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(shared.leaves(), ad.params.leaves()))
    with ad.cache_context("cond"):
        pass
    assert len(ad.transformer_blocks) == 2 and len(ad.single_transformer_blocks) == 2


def test_return_types():
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
    from diffusers.models.transformers import transformer_flux2 as stock_flux2

    cfg = tiny.transformer_config("flux2-klein")
    ad, stock = adapter("flux2-klein"), tiny.stock_transformer("flux2-klein", seed=SEED)
    for block in stock.transformer_blocks:  # as Flux2KleinKVPipeline does: the stock class
        block.attn.set_processor(stock_flux2.Flux2KVAttnProcessor())  # ignores kv_cache_mode otherwise
    for block in stock.single_transformer_blocks:
        block.attn.set_processor(stock_flux2.Flux2KVParallelSelfAttnProcessor())
    gen = torch.Generator().manual_seed(0)
    x, txt = (
        torch.randn(1, 6, cfg.in_channels, generator=gen),
        torch.randn(1, 5, cfg.joint_attention_dim, generator=gen),
    )
    ids = torch.stack(torch.meshgrid(*(torch.arange(n) for n in (1, 2, 3, 1)), indexing="ij"), -1).reshape(1, 6, 4)
    tids = torch.zeros(1, 5, 4, dtype=torch.long)
    tids[..., 3] = torch.arange(5)
    args = dict(hidden_states=x, encoder_hidden_states=txt, timestep=torch.tensor([0.5]), img_ids=ids, txt_ids=tids)
    out = ad(**args)
    assert type(out) is stock_flux2.Flux2Transformer2DModelOutput and torch.equal(out.sample, stock(**args).sample)
    out, cache = ad(**dict(args, return_dict=False, kv_cache_mode="extract", num_ref_tokens=2))
    ref, ref_cache = stock(**dict(args, return_dict=False, kv_cache_mode="extract", num_ref_tokens=2))
    assert max_err(out, ref) <= FP32  # the extract path's attention is split differently: not bitwise
    rest = dict(args, hidden_states=x[:, 2:], img_ids=ids[:, 2:], return_dict=False, kv_cache_mode="cached")
    assert max_err(ad(**dict(rest, kv_cache=cache))[0], stock(**dict(rest, kv_cache=ref_cache))[0]) <= FP32
    cache.clear()
    with pytest.raises(ValueError, match="kv_cache: expected the cache"):
        ad(**dict(rest, kv_cache=cache))

    q = adapter("qwen-image")
    qx = torch.randn(1, 4, 16, generator=gen)
    qout = q(
        hidden_states=qx,
        encoder_hidden_states=torch.randn(1, 3, 32),
        timestep=torch.tensor([0.5]),
        img_shapes=[[(1, 2, 2)]],
    )
    assert type(qout) is Transformer2DModelOutput and qout.sample.shape == (1, 4, 16)


# ---------------------------------------------------------------- save / load


def _flux_inputs(kind: str, gen):
    cfg = tiny.transformer_config(kind)
    if kind == "flux":
        return dict(
            hidden_states=torch.randn(1, 4, cfg.in_channels, generator=gen),
            encoder_hidden_states=torch.randn(1, 5, cfg.joint_attention_dim, generator=gen),
            pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=gen),
            timestep=torch.tensor([0.4]),
            guidance=torch.tensor([3.5]),
            img_ids=torch.randn(4, 3, generator=gen),
            txt_ids=torch.zeros(5, 3),
            return_dict=False,
        )
    if kind == "flux2":
        return dict(
            hidden_states=torch.randn(1, 4, cfg.in_channels, generator=gen),
            encoder_hidden_states=torch.randn(1, 5, cfg.joint_attention_dim, generator=gen),
            timestep=torch.tensor([0.4]),
            guidance=torch.tensor([3.5]),
            img_ids=torch.randint(0, 4, (1, 4, 4), generator=gen),
            txt_ids=torch.randint(0, 4, (1, 5, 4), generator=gen),
            return_dict=False,
        )
    return dict(
        hidden_states=torch.randn(2, 4, cfg.in_channels, generator=gen),
        encoder_hidden_states=torch.randn(2, 5, cfg.joint_attention_dim, generator=gen),
        encoder_hidden_states_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
        timestep=torch.tensor([0.4, 0.4]),
        img_shapes=[[(1, 2, 2)]] * 2,
        return_dict=False,
    )


@pytest.mark.parametrize("kind", ["flux", "flux2", "qwen-image"])
def test_save_pretrained_loads_as_stock(tmp_path, kind):
    ad = adapter(kind)
    ad.save_pretrained(tmp_path)
    stock_class = getattr(diffusers, fd.config_to_diffusers(tiny.transformer_config(kind))["_class_name"])
    stock = stock_class.from_pretrained(tmp_path).eval()
    assert stock.state_dict().keys() == ad.state_dict().keys()
    assert all(torch.equal(t, ad.state_dict()[k]) for k, t in stock.state_dict().items())  # bitwise weights
    # Bitwise outputs need equally aligned weights: MKL's one-row GEMV (the modulation
    # linears) sums in another order for an 8-byte-aligned weight on some CPUs (AMD EPYC:
    # 9.5e-7 here). weights.save lays the data out 64-byte aligned, so stock diffusers'
    # mmap'ed tensors are as aligned as allocated ones (docs/numerics.md).
    assert all(t.data_ptr() % 64 == 0 for t in stock.state_dict().values())
    args = _flux_inputs(kind, torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(stock(**args)[0], tiny.stock_transformer(kind, seed=SEED)(**args)[0])
        assert max_err(ad(**args)[0], stock(**args)[0]) <= FP32  # FLUX: 0; Qwen-Image: fp32 rounding

    again = fd.DiffusersTransformer.from_pretrained(tmp_path)  # and back through weights.load
    assert type(again) is type(ad) and torch.equal(again(**args)[0], ad(**args)[0])


def test_from_pretrained_of_stock_folder(tmp_path):
    stock = tiny.stock_transformer("qwen-image", seed=SEED)
    stock.save_pretrained(tmp_path / "transformer")
    ad = fd.DiffusersTransformer.from_pretrained(tmp_path, subfolder="transformer", dtype=torch.bfloat16)
    assert ad.dtype == torch.bfloat16
    for name, p in ad.state_dict().items():
        assert torch.equal(p, stock.state_dict()[name].to(torch.bfloat16)), name


def test_pipeline_save_reloads_with_stock_diffusers(tmp_path):
    pipe = tiny.pipeline("flux", seed=SEED, transformer=adapter("flux"))
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    reloaded = diffusers.DiffusionPipeline.from_pretrained(tmp_path)
    assert type(reloaded) is diffusers.FluxPipeline
    assert type(reloaded.transformer) is diffusers.FluxTransformer2DModel
    reloaded.set_progress_bar_config(disable=True)
    assert all(t.data_ptr() % 64 == 0 for t in reloaded.transformer.state_dict().values())  # weights.save's layout
    # Not bitwise by construction: the text encoders and VAE are written by transformers /
    # diffusers (data 8-byte aligned), and MKL may sum an unaligned operand in another
    # order (docs/numerics.md); measured 0 on AMD EPYC and on Intel, bounded at fp32 rounding.
    assert max_err(run(reloaded, prompt=PROMPT, **SHORT), run(pipe, prompt=PROMPT, **SHORT)) <= FP32


# ---------------------------------------------------------------- bad use


def test_wrong_family_in_pipeline_names_both():
    with pytest.raises(ValueError, match=r"pooled_projections.*Flux2Transformer2DModel.*FluxTransformer2DModel"):
        run(tiny.pipeline("flux", seed=SEED, transformer=adapter("flux2")), prompt=PROMPT, **SHORT)
    with pytest.raises(
        ValueError,
        match=r"(encoder_hidden_states_mask|img_shapes): this FluxTransformer2DModel.*QwenImageTransformer2DModel",
    ):
        pipe = tiny.pipeline("qwen-image", seed=SEED, transformer=adapter("flux"))
        run(pipe, prompt=PROMPT, guidance_scale=1.0)  # the pipeline reads guidance_embeds (True) first
    with pytest.raises(ValueError, match=r"pooled_projections: FluxTransformer2DModel.*FLUX.1.*FluxPipeline"):
        run(tiny.pipeline("flux2-klein", seed=SEED, transformer=adapter("flux")), prompt=PROMPT, **SHORT)
    with pytest.raises(ValueError, match=r"processor: QwenImageTransformer2DModel.*Flux2KVAttnProcessor"):
        tiny.pipeline("flux2-klein-kv", seed=SEED, transformer=adapter("qwen-image"))


def test_unsupported_arguments_raise():
    ad = adapter("flux")
    args = _flux_inputs("flux", torch.Generator().manual_seed(1))
    with torch.no_grad():  # a LoRA scale is honoured (tests/test_lora_pipeline.py); with no LoRA it changes nothing
        torch.testing.assert_close(ad(**args, joint_attention_kwargs={"scale": 0.5})[0], ad(**args)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="ip_adapter_image_embeds"):
        ad(**args, joint_attention_kwargs={"ip_adapter_image_embeds": [torch.zeros(1)]})
    with pytest.raises(ValueError, match=r"controlnet_block_samples\[0\]: expected shape"):  # test_controlnet.py
        ad(**args, controlnet_block_samples=[torch.zeros(1)])
    with pytest.raises(ValueError, match="bogus: not supported"):
        ad(**args, bogus=None)
    ad(**args, controlnet_block_samples=None, controlnet_blocks_repeat=False)  # stock defaults are fine
    with pytest.raises(TypeError):  # keyword-only past encoder_hidden_states: stock orders differ per class
        ad(args["hidden_states"], args["encoder_hidden_states"], args["pooled_projections"])
    with pytest.raises(ValueError, match="kv_cache: this FluxTransformer2DModel"):
        ad(**args, kv_cache="extract")
    q = adapter("qwen-image")
    with pytest.raises(ValueError, match=r"attention_kwargs: expected None, \{\} or \{'scale': float\}"):
        q(**_flux_inputs("qwen-image", torch.Generator().manual_seed(1)), attention_kwargs={"foo": 1.0})
    with pytest.raises(ValueError, match="processor: FluxTransformer2DModel computes attention as one of"):
        ad.transformer_blocks[0].attn.set_processor(diffusers.models.attention_processor.AttnProcessor2_0())
    with pytest.raises(ValueError, match="params: expected functional_dit.Params, got dict"):
        fd.DiffusersTransformer({})


def test_readme_swap_runs():
    """The README's three-line swap and tiny-pipeline examples, run as written."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("### diffusers pipelines: the three-line swap") : text.index("## What works")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    scope: dict = {}
    exec(blocks[0], scope)  # the swap
    assert isinstance(scope["pipe"].transformer, fd.DiffusersTransformer) and scope["latents"].shape == (1, 4, 16)
    exec("import functional_dit as fd\n" + blocks[-1], scope)  # the tiny pipelines
    assert type(scope["pipe"]).__name__ == "QwenImagePipeline" and scope["latents"].shape == (1, 4, 16)

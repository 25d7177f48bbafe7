"""`fd.DiffusersTransformer` as diffusers' ``CacheMixin``, against the stock FLUX.1 module
(the attention-level caches also against FLUX.2's and Qwen-Image's), and the stock
``pos_embed`` per family.

What diffusers' cache test mixins check of a transformer class, covered with our own
tests: ``issubclass(..., CacheMixin)``, ``enable_cache`` / ``is_cache_enabled`` /
``disable_cache`` (the hook registered under the stock name and removed), a second
``enable_cache`` refused, ``cache_context`` isolating states, ``_reset_stateful_cache``
starting afresh; beyond them, each config's outputs step by step equal the stock
module's under the same config (both CFG contexts interleaved as the pipelines call
them) — First-Block Cache, TaylorSeer in both modes (on the output, on the attention
modules, with a skipped module), MagCache, FasterCache with its timestep and weight
callbacks —, and every config the adapter cannot honour is a ValueError naming it. A
cache with an on-the-fly LoRA (``set_lora``) equals the stock pipeline with the PEFT LoRA
and `fd.sample` with the same ``lora=`` and ``cache=``.
"""

from __future__ import annotations

import dataclasses

import cases_flux1
import cases_flux2
import cases_qwenimage
import diffusers
import pytest
import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    MagCacheConfig,
    SeaCacheConfig,
    TaylorSeerCacheConfig,
    TextKVCacheConfig,
)
from diffusers.models.cache_utils import CacheMixin

import functional_dit as fd
from functional_dit import flux1, flux2, qwenimage

FLUX1 = fd.PRESETS["flux1-tiny"]
STEPS = 5
# Adapter vs stock in fp32: the same maths (bitwise equal on the AMD EPYC this was written
# on); the bound is the plain forward's, for GEMM paths that round differently; a skipped
# step reuses residuals computed that way.
FP32 = dict(rtol=1e-5, atol=1e-5)
# diffusers' cache configs the adapter honours, each set so that some of the STEPS calls
# compute and some skip (checked below against the uncached outputs).
CONFIGS = {
    "fbc": lambda: FirstBlockCacheConfig(threshold=0.3),
    "taylorseer": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, use_lite_mode=True),
    # the default mode, on every attention module; fp32 factors, so that outputs that agree
    # to fp32 rounding cannot round to different bf16 factors
    "taylorseer-attention": lambda: TaylorSeerCacheConfig(2, 1, taylor_factors_dtype=torch.float32),
    # second order, one module giving zeros on predicted steps (stock: skip beats cache)
    "taylorseer-skip": lambda: TaylorSeerCacheConfig(
        2, 2, max_order=2, taylor_factors_dtype=torch.float32, skip_predict_identifiers=[r"single_\w+\.1\.attn"]
    ),
    "magcache": lambda: MagCacheConfig(
        mag_ratios=[1.0, 1.01, 1.02, 0.99, 1.0], num_inference_steps=STEPS, threshold=0.06, retention_ratio=0.2
    ),
}


# fam: (tiny config, the family's test cases: inputs and their diffusers names)
FAMILIES = {
    "flux1": (FLUX1, cases_flux1),
    "flux2": (cases_flux2.TINY, cases_flux2),  # guidance-distilled, as FLUX.2-dev
    "qwen-image": (cases_qwenimage.TINY, cases_qwenimage),
    "qwen-image-edit": (cases_qwenimage.TINY_EDIT, cases_qwenimage),  # zero_cond_t: per-token t / t = 0 modulation
}


def pair(seed: int = 0, fam: str = "flux1"):
    """(the family's stock transformer, adapter over its weights)."""
    cfg = fd.config_to_diffusers(FAMILIES[fam][0])
    torch.manual_seed(seed)
    stock = getattr(diffusers, cfg.pop("_class_name"))(**cfg).eval()
    return stock, fd.DiffusersTransformer(fd.from_diffusers(stock))


def step_inputs(seed: int, fam: str = "flux1") -> list[dict]:
    """STEPS forward calls of a denoising run: latents drifting a little, timesteps falling."""
    config, cases = FAMILIES[fam]
    kw = cases.diffusers_kwargs(cases.inputs(config, seed=seed))
    g = torch.Generator().manual_seed(seed + 100)
    noise = torch.randn(kw["hidden_states"].shape, generator=g)
    return [
        dict(kw, hidden_states=kw["hidden_states"] + 0.02 * i * noise, timestep=kw["timestep"] * (1 - 0.1 * i))
        for i in range(STEPS)
    ]


@torch.no_grad()
def run(model, calls: dict[str, list[dict]], before=None) -> dict[str, list[torch.Tensor]]:
    """Per context name its outputs, the contexts interleaved step by step (as CFG does);
    ``before(i)`` is called before the calls of step i."""
    outs = {name: [] for name in calls}
    for i in range(STEPS):
        if before is not None:
            before(i)
        for name, steps in calls.items():
            with model.cache_context(name):
                outs[name].append(model(**steps[i])[0])
    return outs


# The attention-level configs on the other families; the skip_predict case on FLUX.2 (its
# pattern names a single block's Flux2ParallelSelfAttention).
ATTENTION_CASES = [
    ("flux2", "taylorseer-attention"),
    ("flux2", "taylorseer-skip"),
    ("qwen-image", "taylorseer-attention"),
    ("qwen-image-edit", "taylorseer-attention"),
]


@pytest.mark.parametrize("fam, name", [("flux1", n) for n in sorted(CONFIGS)] + ATTENTION_CASES, ids=lambda v: str(v))
def test_each_config_equals_stock(fam, name):
    stock, ad = pair(fam=fam)
    calls = {"cond": step_inputs(1, fam), "uncond": step_inputs(2, fam)}
    plain = run(ad, calls)  # no cache: every call computes
    for model in (stock, ad):
        model.enable_cache(CONFIGS[name]())
    want, got = run(stock, calls), run(ad, calls)
    skipped = 0
    for ctx in calls:
        for i in range(STEPS):
            torch.testing.assert_close(got[ctx][i], want[ctx][i], **FP32)
            skipped += not torch.allclose(got[ctx][i], plain[ctx][i], **FP32)
    assert 0 < skipped < 2 * STEPS - 2  # the cache took effect on some calls, not on all
    # _reset_stateful_cache (what the pipelines call after a run): the next call computes again
    for model in (stock, ad):
        model._reset_stateful_cache()
    with torch.no_grad(), ad.cache_context("cond"):
        torch.testing.assert_close(ad(**calls["cond"][0])[0], plain["cond"][0], **FP32)
    assert ad.step_cache_hook().state_manager._state_cache.keys() == {"cond"}


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_faster_cache_equals_stock(fam):
    """FasterCacheConfig of a guidance-distilled model, step by step against the stock
    module: attention outputs computed at every 2nd call inside the timestep range and
    extrapolated between, one state for both contexts (as the stock hooks hold), the weight
    callback given each attention module (the adapter's, by its stock name)."""
    stock, ad = pair(fam=fam)
    calls = {"cond": step_inputs(1, fam), "uncond": step_inputs(2, fam)}
    now, given = [0.0], {"stock": [], "ad": []}

    def config(who):
        weight = lambda module: given[who].append(module) or 0.3  # noqa: E731
        return FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 901),  # step 0 (t = 1000) computes: stock needs it
            current_timestep_callback=lambda: now[0],
            attention_weight_callback=weight,
            is_guidance_distilled=True,
            tensor_format="BCHW",
        )

    at = lambda i: now.__setitem__(0, 1000.0 - 150 * i)  # noqa: E731
    plain = run(ad, calls)
    stock.enable_cache(config("stock"))
    ad.enable_cache(config("ad"))
    want, got = run(stock, calls, at), run(ad, calls, at)
    skipped = 0
    for ctx in calls:
        for i in range(STEPS):
            torch.testing.assert_close(got[ctx][i], want[ctx][i], **FP32)
            skipped += not torch.allclose(got[ctx][i], plain[ctx][i], **FP32)
    assert 0 < skipped < 2 * STEPS - 2
    attention = [m for m in ad.modules() if hasattr(m, "set_processor")]
    assert len(given["ad"]) == len(given["stock"]) > 0 and {id(m) for m in given["ad"]} == {id(m) for m in attention}
    ad._reset_stateful_cache()  # the pipelines' reset: the next call computes again
    now[0] = 500.0
    with torch.no_grad():
        torch.testing.assert_close(ad(**calls["cond"][0])[0], plain["cond"][0], **FP32)
    ad.disable_cache()
    assert not ad.is_cache_enabled and ad._diffusers_hook.get_hook("faster_cache_denoiser") is None


def test_cache_mixin_surface():
    """What diffusers' cache test mixins check: the class, the enabled state, the hook
    under the stock name and its removal, a second enable refused, the context's error."""
    stock, ad = pair()
    assert issubclass(type(ad), CacheMixin) and isinstance(ad, CacheMixin)
    kw = step_inputs(1)[0]
    for name, hook in (("fbc", "fbc_leader_block_hook"), ("taylorseer", "taylorseer_cache")):
        assert not ad.is_cache_enabled
        ad.enable_cache(CONFIGS[name]())
        assert ad.is_cache_enabled and ad._diffusers_hook.get_hook(hook) is ad.step_cache_hook()
        with pytest.raises(ValueError, match="Caching has already been enabled"):
            ad.enable_cache(CONFIGS[name]())
        stock.enable_cache(CONFIGS[name]())
        for model in (stock, ad):  # as the stock hooks: FBC and TaylorSeer need a context
            with pytest.raises(ValueError, match="No cache context is set"):
                model(**kw)
        stock.disable_cache()
        ad.disable_cache()
        assert not ad.is_cache_enabled and ad._diffusers_hook.get_hook(hook) is None
        assert ad.step_cache_hook() is None
        torch.testing.assert_close(ad(**kw)[0], stock(**kw)[0], **FP32)  # plain forward again
    # MagCache without a context uses "inference", as the stock hook does
    for model in (stock, ad):
        model.enable_cache(CONFIGS["magcache"]())
    with torch.no_grad():
        for kw in step_inputs(3):
            torch.testing.assert_close(ad(**kw)[0], stock(**kw)[0], **FP32)


def test_taylorseer_lite_mode_overrides_patterns_as_stock(caplog):
    """Lite mode with identifier patterns: the stock warning, the patterns ignored (the
    outputs those of lite mode without them)."""
    stock, ad = pair()
    kw = dict(cache_interval=2, disable_cache_before_step=1, use_lite_mode=True)
    calls = {"cond": step_inputs(1)}
    ad.enable_cache(TaylorSeerCacheConfig(**kw))
    want = run(ad, calls)
    ad.disable_cache()
    with caplog.at_level("WARNING", logger="diffusers.hooks.taylorseer_cache"):
        ad.enable_cache(TaylorSeerCacheConfig(**kw, cache_identifiers=[r"transformer_blocks\.0\.attn"]))
    assert "Lite mode overrides user patterns." in caplog.text
    got = run(ad, calls)
    for a, b in zip(got["cond"], want["cond"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "config, match",
    [
        (
            TaylorSeerCacheConfig(cache_identifiers=[r"transformer_blocks\.0\.ff"]),
            r"pattern 'transformer_blocks\\\\.0\\\\.ff' matches 'transformer_blocks.0.ff', which is not an attention",
        ),
        (TaylorSeerCacheConfig(cache_identifiers=["attn"]), r"patterns \['attn'\] match none of the attention"),
        (MagCacheConfig(calibrate=True), r"config: MagCacheConfig\(calibrate=True\) is not supported"),
        (
            FasterCacheConfig(current_timestep_callback=lambda: 500),
            r"config: FasterCacheConfig\(is_guidance_distilled=False\) is not supported",
        ),
        (FasterCacheConfig(is_guidance_distilled=True, tensor_format="BSC"), "`tensor_format` must be one of"),
        (SeaCacheConfig(), "config: SeaCacheConfig is not supported"),
        (TextKVCacheConfig(), "config: TextKVCacheConfig is not supported"),
    ],
)
def test_refuses_configs_it_cannot_honour(config, match):
    """Configs the stock FLUX.1 honours but the adapter does not: a ValueError naming the
    config, nothing enabled (never a silent no-op)."""
    _, ad = pair()
    with pytest.raises(ValueError, match=match):
        ad.enable_cache(config)
    assert not ad.is_cache_enabled and ad.step_cache_hook() is None


# ---------------------------------------------------------------- pos_embed


def _stock_and_adapter(config, seed: int = 0):
    cfg = fd.config_to_diffusers(config)
    torch.manual_seed(seed)
    stock = getattr(diffusers, cfg.pop("_class_name"))(**cfg)
    return stock, fd.DiffusersTransformer(fd.from_diffusers(stock))


def _complex_to_cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' complex Qwen RoPE (S, D/2) as our interleaved (cos, sin) (S, D)."""
    return freqs.real.repeat_interleave(2, -1), freqs.imag.repeat_interleave(2, -1)


@pytest.mark.parametrize("layered", [False, True])
def test_qwen_pos_embed_is_stock_and_fd_apply_tables(layered):
    """Qwen-Image's ``pos_embed`` is the stock class's module (``QwenEmbedLayer3DRope`` for
    Layered), adds nothing to ``state_dict()`` / ``parameters()``, and gives the tables
    `fd.apply` builds for the same image shapes and text length."""
    config = fd.PRESETS["qwen-image-tiny"]
    if layered:
        config = dataclasses.replace(config, use_additional_t_cond=True, use_layer3d_rope=True)
    stock, ad = _stock_and_adapter(config)
    assert type(ad.pos_embed) is type(stock.pos_embed)
    assert type(ad.pos_embed).__name__ == ("QwenEmbedLayer3DRope" if layered else "QwenEmbedRope")
    assert ad.state_dict().keys() == stock.state_dict().keys()
    assert [n for n, _ in ad.named_parameters()] == [n for n, _ in stock.named_parameters()]
    assert [n for n, _ in ad.named_buffers()] == [n for n, _ in stock.named_buffers()]
    shapes, txt_len = [(1, 2, 4)] * 3 if layered else [(1, 4, 6)], 5  # Layered: 2 layers and the condition
    img, txt = ad.pos_embed([shapes], max_txt_seq_len=txt_len, device=torch.device("cpu"))
    stock_img, stock_txt = stock.pos_embed([shapes], max_txt_seq_len=txt_len, device=torch.device("cpu"))
    assert torch.equal(img, stock_img) and torch.equal(txt, stock_txt)
    cos, sin = qwenimage.pos_embed(shapes, txt_len, config.axes_dims_rope, layered)  # what fd.apply uses
    want = [torch.cat(p) for p in zip(_complex_to_cos_sin(txt), _complex_to_cos_sin(img))]
    # the stock tables are polar(1, angle) in fp32, ours cos/sin of the same fp32 angles:
    # equal up to the rounding of each (|error| measured <= 6e-8)
    torch.testing.assert_close(cos, want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want[1], rtol=0, atol=1e-6)


def test_flux_pos_embed_is_stock_and_fd_apply_tables():
    """FLUX.1 / FLUX.2 ``pos_embed``: the stock module, nothing in ``state_dict()``, and
    calling it on the ids gives `fd.apply`'s RoPE table (`rope_table`)."""
    g = torch.Generator().manual_seed(0)
    for config, mod in ((FLUX1, flux1), (fd.PRESETS["flux2-tiny"], flux2)):
        stock, ad = _stock_and_adapter(config)
        assert type(ad.pos_embed) is type(stock.pos_embed)
        assert ad.state_dict().keys() == stock.state_dict().keys()
        assert [n for n, _ in ad.named_parameters()] == [n for n, _ in stock.named_parameters()]
        n_axes = len(config.axes_dims_rope)
        img_ids, txt_ids = torch.randn(6, n_axes, generator=g) * 4, torch.randn(3, n_axes, generator=g) * 4
        want = mod.rope_table(config, img_ids, txt_ids)
        if mod is flux1:  # the stock FLUX.1 forward embeds the joint (txt; img) ids at once
            got = ad.pos_embed(torch.cat([txt_ids, img_ids]))
        else:  # the stock FLUX.2 forward embeds image and text ids apart, txt first in attention
            got = [torch.cat(p) for p in zip(ad.pos_embed(txt_ids), ad.pos_embed(img_ids))]
        for a, b in zip(got, want):
            # both take fp64 angles to fp32 (bitwise equal here); the bound allows another libm
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("preset", ["flux1-tiny", "flux2-tiny", "qwen-image-tiny", "flux3-tiny", "qwen-image-2.1-tiny"])
def test_pos_embed_is_the_stock_module(preset):
    """Every family: the stock class's RoPE module with the stock settings, and the stock
    ``state_dict()`` and parameter names (pos_embed holds no parameter or buffer)."""
    stock, ad = _stock_and_adapter(fd.PRESETS[preset])
    assert type(ad.pos_embed) is type(stock.pos_embed)
    settings = ("theta", "axes_dim", "scale_rope")
    assert {k: getattr(ad.pos_embed, k, None) for k in settings} == {
        k: getattr(stock.pos_embed, k, None) for k in settings
    }
    assert ad.state_dict().keys() == stock.state_dict().keys()
    assert [n for n, _ in ad.named_parameters()] == [n for n, _ in stock.named_parameters()]
    # (Qwen-Image 2.1's stock time embedding holds a non-persistent buffer the adapter
    # does not: outside pos_embed, not in state_dict)
    assert [n for n, _ in ad.pos_embed.named_buffers()] == [n for n, _ in stock.pos_embed.named_buffers()] == []


# ---------------------------------------------------------------- step caching with on-the-fly LoRA

# (diffusers config, our cache) per method; FBC's threshold lies between the step metrics this
# LoRA gives (decisions the same for thresholds 0.85 to 0.90), TaylorSeer decides by step count.
LORA_CACHES = {
    "fbc": (lambda: FirstBlockCacheConfig(threshold=0.88), lambda: fd.FirstBlockCache(0.88)),
    "taylorseer": (
        lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, use_lite_mode=True),
        lambda: fd.TaylorSeer(cache_interval=2, disable_cache_before_step=2),
    ),
}


@pytest.mark.parametrize("name", sorted(LORA_CACHES))
def test_cache_with_on_the_fly_lora_equals_stock_peft_and_fd_sample(name, tmp_path):
    """``adapter.set_lora(...)`` with ``adapter.enable_cache(...)`` (refused before), through
    the tiny ``FluxPipeline`` with true CFG: the stock pipeline's latents with the same LoRA
    loaded by PEFT on the stock transformer (applied on the fly too) and the same cache config,
    and `fd.sample`'s with the same ``lora=`` and ``cache=`` (both CFG halves batched, decided
    per half), with some steps skipped; the LoRA and the cache each change the result."""
    import peft  # noqa: F401  (a dev dependency: the stock load_lora_weights needs it)

    import functional_dit.lora as lora
    from functional_dit import tiny

    stock, ours = tiny.pipeline("flux"), tiny.pipeline("flux")
    params = fd.from_diffusers(ours.transformer)
    ours.transformer = fd.DiffusersTransformer(params)
    ad = lora.init(params, rank=4, targets=lora.linear_modules(params.config), alpha=8.0, seed=1, zero_b=False)
    lora.save(ad, tmp_path / "pytorch_lora_weights.safetensors")
    stock.load_lora_weights(str(tmp_path))  # weight 1, PEFT layers: the LoRA on the fly
    config, cache = LORA_CACHES[name]
    call = dict(prompt="a red cube", negative_prompt="blurry", true_cfg_scale=2.0, max_sequence_length=16)
    call.update(height=32, width=32, num_inference_steps=STEPS + 1, output_type="latent")

    def latents(pipe):
        return pipe(**call, generator=torch.Generator().manual_seed(3)).images

    ours.transformer.enable_cache(config())
    no_lora = latents(ours)
    ours.transformer.set_lora([(ad, 1.0)])
    got = latents(ours)
    stock.transformer.enable_cache(config())
    torch.testing.assert_close(got, latents(stock), **FP32)
    run = fd.CacheRun(cache())
    kw = dict(true_cfg=2.0, negative_prompt="blurry", steps=STEPS + 1, seed=3, height=32, width=32)
    sampled = fd.sample(params, ours, "a red cube", lora=[(ad, 1.0)], cache=run, output_type="latent",
                        max_sequence_length=16, **kw)  # fmt: skip
    torch.testing.assert_close(got, sampled, **FP32)
    assert run.skipped() > 0
    ours.transformer.disable_cache()
    assert (got - latents(ours)).abs().max() > 1e-3 and (got - no_lora).abs().max() > 1e-3

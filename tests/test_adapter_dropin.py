"""What diffusers' pipeline tests ask of a ``transformer`` beyond the model tests, on
`fd.DiffusersTransformer` against the stock classes (issue: "the drop-in must accept what
the stock classes accept"): pickled weights written and read back (loading only with
``torch.load(weights_only=True)``), ``set_default_attn_processor``, batch-1 conditioning
broadcast, per-batch ``img_shapes`` / ``img_mask``, Kohya ``.alpha`` entries in PEFT-keyed
LoRA files. Each through ``pipe(...)`` on the tiny pipelines, adapter vs stock at fp32.
"""

from __future__ import annotations

import os
import pickle
import re

import diffusers
import pytest
import torch

import functional_dit as fd
from functional_dit import tiny

SEED = 3
FP32 = 1e-5  # adapter vs stock through a whole pipeline (FLUX: 0; Qwen-Image: fp32 rounding)
PROMPT = "a red cube on a wooden table"
SHORT = dict(max_sequence_length=64)


def run(pipe, **kwargs) -> torch.Tensor:
    args = dict(height=32, width=32, num_inference_steps=2, output_type="latent")
    args.update(kwargs)
    if type(pipe).__name__ == "QwenImageLayeredPipeline":
        args = {k: v for k, v in args.items() if k not in ("height", "width")}
    return pipe(generator=torch.Generator().manual_seed(0), **args).images


def adapter(kind: str) -> fd.DiffusersTransformer:
    return fd.DiffusersTransformer(fd.init(tiny.transformer_config(kind), seed=SEED))


def max_err(a, b) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------- pickled weights


def test_pipeline_save_pickled_reloads(tmp_path):
    """``pipe.save_pretrained(safe_serialization=False)`` writes the stock ``.bin`` files
    (the names the stock method writes), stock diffusers loads the pipeline back, and the
    adapter reads them with ``torch.load(weights_only=True)``."""
    pipe = tiny.pipeline("flux", seed=SEED, transformer=adapter("flux"))
    pipe.save_pretrained(tmp_path / "ours", safe_serialization=False)
    tiny.pipeline("flux", seed=SEED).save_pretrained(tmp_path / "stock", safe_serialization=False)
    assert sorted(os.listdir(tmp_path / "ours" / "transformer")) == sorted(
        os.listdir(tmp_path / "stock" / "transformer")
    )
    assert sorted(os.listdir(tmp_path / "ours" / "transformer")) == ["config.json", "diffusion_pytorch_model.bin"]
    reloaded = diffusers.FluxPipeline.from_pretrained(tmp_path / "ours")
    assert type(reloaded.transformer) is diffusers.FluxTransformer2DModel
    reloaded.set_progress_bar_config(disable=True)
    expected = run(pipe, prompt=PROMPT, **SHORT)
    assert max_err(run(reloaded, prompt=PROMPT, **SHORT), expected) <= FP32
    again = fd.DiffusersTransformer.from_pretrained(tmp_path / "ours", subfolder="transformer")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in pipe.transformer.state_dict().items())
    reloaded.transformer = again  # a pipeline over the adapter read from the pickle
    assert max_err(run(reloaded, prompt=PROMPT, **SHORT), expected) <= FP32


@pytest.mark.parametrize("kw", [dict(variant="fp16"), dict(max_shard_size=20_000)])
def test_save_pickled_variant_and_shards(tmp_path, kw):
    ad = adapter("qwen-image")
    ad.save_pretrained(tmp_path / "ours", safe_serialization=False, **kw)
    tiny.stock_transformer("qwen-image", seed=SEED).save_pretrained(tmp_path / "stock", safe_serialization=False, **kw)
    names, stock_names = sorted(os.listdir(tmp_path / "ours")), sorted(os.listdir(tmp_path / "stock"))
    if "variant" in kw:
        assert names == stock_names == ["config.json", "diffusion_pytorch_model.fp16.bin"]
    else:  # the same index and shard names (weights.save groups the tensors into shards its own way)
        assert (
            "diffusion_pytorch_model.bin.index.json" in names
            and "diffusion_pytorch_model.bin.index.json" in stock_names
        )
        pattern = re.compile(r"diffusion_pytorch_model-\d{5}-of-\d{5}\.bin")
        assert all(pattern.fullmatch(n) for n in names + stock_names if n.endswith(".bin"))
    back = fd.DiffusersTransformer.from_pretrained(tmp_path / "ours", variant=kw.get("variant"), use_safetensors=False)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ad.state_dict().items())
    if "variant" in kw:  # stock diffusers reads the single-file pickle (it cannot read sharded .bin at all)
        stock = diffusers.QwenImageTransformer2DModel.from_pretrained(tmp_path / "ours", variant="fp16")
        assert all(torch.equal(stock.state_dict()[k], v) for k, v in ad.state_dict().items())


class _Boom:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickled_weights_load_weights_only(tmp_path):
    adapter("flux").save_pretrained(tmp_path, safe_serialization=False)
    state = torch.load(tmp_path / "diffusion_pytorch_model.bin", weights_only=True)
    marker = tmp_path / "unpickled"
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps({**state, "x": _Boom(str(marker))}))
    with pytest.raises(ValueError, match=r"diffusion_pytorch_model.bin: not a weights-only pickle"):
        fd.DiffusersTransformer.from_pretrained(tmp_path)
    assert not marker.exists()
    with pytest.raises(OSError, match=r"no file named diffusion_pytorch_model.fp16.bin"):
        fd.DiffusersTransformer.from_pretrained(tmp_path, variant="fp16", use_safetensors=False)


# ---------------------------------------------------------------- set_default_attn_processor


def test_set_default_attn_processor_is_the_default_maths():
    """diffusers' pipeline tests call ``set_default_attn_processor()`` on every component
    that has it; the adapter's default maths is already `fd.apply`'s, so it changes nothing."""
    pipe = tiny.pipeline("flux", seed=SEED, transformer=adapter("flux"))
    before = pipe.transformer.attn_processors
    pipe.transformer.set_default_attn_processor()
    assert all(a is b for a, b in zip(pipe.transformer.attn_processors.values(), before.values()))
    stock = run(tiny.pipeline("flux", seed=SEED), prompt=PROMPT, **SHORT)
    assert max_err(run(pipe, prompt=PROMPT, **SHORT), stock) <= FP32


# ---------------------------------------------------------------- batch-1 conditioning


def _flux1_call(gen):
    cfg = tiny.transformer_config("flux")
    return dict(
        hidden_states=torch.randn(2, 4, cfg.in_channels, generator=gen),
        encoder_hidden_states=torch.randn(2, 5, cfg.joint_attention_dim, generator=gen),
        pooled_projections=torch.randn(2, cfg.pooled_projection_dim, generator=gen),
        timestep=torch.tensor([0.4, 0.7]),
        guidance=torch.tensor([3.5, 2.0]),
        img_ids=torch.randn(4, 3, generator=gen),
        txt_ids=torch.zeros(5, 3),
        return_dict=False,
    )


@pytest.mark.parametrize(
    "one", ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance", "all-conditioning"]
)
def test_flux1_batch1_inputs_broadcast_as_stock(one):
    """``FluxTransformer2DModel`` broadcasts each of these with batch 1 against the others
    (its embeddings are summed and its modulations applied by torch broadcasting)."""
    args = _flux1_call(torch.Generator().manual_seed(1))
    names = (
        ["encoder_hidden_states", "pooled_projections", "timestep", "guidance"] if one == "all-conditioning" else [one]
    )
    args.update({k: args[k][:1] for k in names})
    stock, ad = tiny.stock_transformer("flux", seed=SEED), adapter("flux")
    if one == "all-conditioning":  # then the text stream stays batch 1 in the stock module: not broadcastable
        with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
            stock(**args)
        with pytest.raises(ValueError, match=r"expected shape \(2, "):
            ad(**args)
        return
    with torch.no_grad():
        ref, out = stock(**args)[0], ad(**args)[0]
    assert out.shape == ref.shape == (2, 4, tiny.transformer_config("flux").in_channels)
    # the stock module broadcasts inside its GEMMs' epilogues, the adapter expands first: fp32 rounding (<= 1.5e-6)
    assert max_err(out, ref) <= FP32


def _rgb(seed: int, size: int = 32):
    import numpy as np
    import PIL.Image

    return PIL.Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))


@pytest.mark.parametrize("name", ["FluxPipeline", "FluxInpaintPipeline", "FluxKontextPipeline"])
def test_flux1_two_prompts_one_negative_true_cfg(name):
    """Two prompts and one negative prompt under true CFG: the unconditional call gets a
    batch-1 text stream and pooled embedding (before: ``pooled: expected shape (2, 24), got (1, 24)``)."""
    kw = dict(prompt=["a cat", PROMPT], negative_prompt="blurry", true_cfg_scale=2.0, **SHORT)
    if name == "FluxInpaintPipeline":
        kw.update(image=_rgb(0), mask_image=_rgb(1).convert("L"))
    if name == "FluxKontextPipeline":
        kw.update(image=_rgb(0), max_area=32 * 32, _auto_resize=False)
    out = {}
    for side, tr in (("stock", tiny.stock_transformer("flux", seed=SEED)), ("ours", adapter("flux"))):
        pipe = getattr(diffusers, name)(**tiny.components("flux", seed=SEED), transformer=tr)
        pipe.set_progress_bar_config(disable=True)
        out[side] = run(pipe, **kw)
    assert out["stock"].shape[0] == 2 and out["stock"].abs().max() > 0.1
    assert max_err(out["ours"], out["stock"]) <= FP32  # measured <= 1.2e-6 (see the module test above)


# ---------------------------------------------------------------- Qwen-Image per-batch layout


def _qwen_cases():
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_sample_qwen_image import layered_pipeline, start_image

    two = dict(num_images_per_prompt=2, height=32, width=32, output_type="latent")
    return {  # one img_shapes / img_mask / additional_t_cond entry per prompt, two images per prompt
        "qwen-image-two-prompts": (
            lambda: tiny.pipeline("qwen-image", seed=SEED),
            dict(prompt=["a cat", PROMPT], **two),
        ),
        "qwen-image-edit-plus": (
            lambda: tiny.pipeline("qwen-image-edit-plus", seed=SEED),
            dict(prompt=PROMPT, image=start_image(), **two),
        ),
        "qwen-image-layered": (layered_pipeline, dict(prompt=PROMPT, image=start_image(), layers=2, **two)),
        "qwen-image-2.1": (
            lambda: tiny.pipeline("qwen-image-2.1", seed=SEED),
            dict(two, prompt=PROMPT, height=64, width=64),
        ),
        "qwen-image-2.1-no-kv-cache": (
            lambda: tiny.pipeline("qwen-image-2.1", seed=SEED),
            dict(two, prompt=PROMPT, height=64, width=64, use_kv_cache=False),
        ),
    }


QWEN_CASES = [
    "qwen-image-two-prompts",
    "qwen-image-edit-plus",
    "qwen-image-layered",
    "qwen-image-2.1",
    "qwen-image-2.1-no-kv-cache",
]


@pytest.mark.parametrize("case", QWEN_CASES)
def test_qwen_num_images_per_prompt(case, monkeypatch):
    """The stock pipelines send one ``img_shapes`` (and 2.1's ``img_mask``, Layered's
    ``additional_t_cond``) entry per prompt for ``num_images_per_prompt`` images; the stock
    transformers read entry 0 for every image (before: ``img_shapes: expected a list of 2
    items``, ``img_mask: expected shape (2, *), got (1, 49)``)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as layered

    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 64 * 64)  # small references: seconds, not a minute
    size = layered.calculate_dimensions
    monkeypatch.setattr(layered, "calculate_dimensions", lambda area, ratio: size(48 * 48, ratio))
    build, kw = _qwen_cases()[case]
    if case == "qwen-image-layered":  # sized by calculate_dimensions; stock output_type="latent" fails in 0.42.1
        kw = dict(kw, output_type="pt")
    pipe = build()
    ref = run(pipe, **kw)
    pipe.transformer = fd.DiffusersTransformer(fd.from_diffusers(pipe.transformer))
    out = run(pipe, **kw)
    flat = lambda v: torch.cat([torch.as_tensor(x).flatten() for x in v]) if isinstance(v, list) else v  # noqa: E731
    ref, out = flat(ref), flat(out)  # Layered: a list of per-image layer stacks
    assert ref.abs().max() > 0.1
    assert max_err(out, ref) <= FP32  # measured <= 1e-6


# ---------------------------------------------------------------- LoRA alphas in the state dict


def _peft_lora_with_alphas(pipe, tmp_path):
    """diffusers' ``test_with_alpha_in_state_dict``: a PEFT LoRA saved by the pipeline, read
    back with ``<key>.alpha`` entries (random, per ``to_k`` factor) added, as Kohya-derived
    files carry them."""
    import safetensors.torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False)
    pipe.transformer.add_adapter(cfg)
    pipe.save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    pipe.unload_lora_weights()
    state = safetensors.torch.load_file(tmp_path / "pytorch_lora_weights.safetensors")
    gen = torch.Generator().manual_seed(5)
    alphas = {f"{k}.alpha": float(torch.randint(10, 100, (), generator=gen)) for k in state if "to_k.lora_A" in k}
    return state, alphas


def test_lora_alpha_entries_as_stock(tmp_path):
    out = {}
    for side in ("stock", "ours"):
        pipe = tiny.pipeline("flux", seed=SEED, transformer=None if side == "stock" else adapter("flux"))
        state, alphas = _peft_lora_with_alphas(pipe, tmp_path / side)
        pipe.load_lora_weights(dict(state))
        plain = run(pipe, prompt=PROMPT, **SHORT)
        pipe.unload_lora_weights()
        pipe.load_lora_weights({**state, **alphas})
        out[side] = run(pipe, prompt=PROMPT, **SHORT)
        assert max_err(out[side], plain) > 1e-3  # the alphas change the result (diffusers' test asks this)
    assert max_err(out["ours"], out["stock"]) <= FP32  # measured 4.8e-7


def test_lora_load_reads_alpha_on_a_factor():
    """`functional_dit.lora` reads ``<module>.lora_A.weight.alpha`` as the module's alpha
    (scale alpha / r), as ``<module>.alpha``."""
    import functional_dit.lora as lora

    params = fd.init(tiny.transformer_config("flux"), seed=SEED)
    ad = lora.init(params, rank=4, targets=["transformer_blocks.0.attn.to_k"], alpha=4.0, seed=1, zero_b=False)
    base = {k: v for k, v in lora.to_state_dict(ad).items() if not k.endswith(".alpha")}
    on_factor = lora.from_state_dict(
        {**base, "transformer_blocks.0.attn.to_k.lora_A.weight.alpha": torch.tensor(12.0)}, params
    )
    on_module = lora.from_state_dict({**base, "transformer_blocks.0.attn.to_k.alpha": torch.tensor(12.0)}, params)
    assert on_factor.config == on_module.config and on_factor.config.modules[0][2] == 12.0


# ---------------------------------------------------------------- MagCache per CFG branch


def test_magcache_true_cfg_without_cache_context_decides_per_branch(caplog):
    """FluxInpaintPipeline (as Kontext) opens no ``cache_context``: the stock MagCache hook
    then shares one state between the cond and uncond calls. Per CFG branch is what
    `fd.sample` does and what the stock hook does where a pipeline opens "cond" / "uncond";
    the adapter decides per branch too, and warns that the stock transformer differs here."""
    import numpy as np
    import PIL.Image
    from diffusers.hooks import MagCacheConfig

    from functional_dit.pipelines import cache as fd_cache

    steps = 6
    kw = dict(mag_ratios=fd_cache.FLUX_MAG_RATIOS, num_inference_steps=steps, threshold=0.06)
    mask = PIL.Image.fromarray(((np.random.RandomState(1).rand(32, 32) > 0.5) * 255).astype("uint8"))
    call = dict(prompt=PROMPT, negative_prompt="blurry", true_cfg_scale=2.0, image=_rgb(0), mask_image=mask,
                num_inference_steps=steps, strength=1.0, **SHORT)  # fmt: skip

    def pipe(transformer):
        p = diffusers.FluxInpaintPipeline(**tiny.components("flux", seed=SEED), transformer=transformer)
        p.set_progress_bar_config(disable=True)
        return p

    stock = tiny.stock_transformer("flux", seed=SEED)
    params = fd.from_diffusers(stock)
    stock.enable_cache(MagCacheConfig(**kw))
    shared = run(pipe(stock), **call)  # the stock pipeline as it is: one state for both calls
    forward, calls = stock.forward, []

    def per_branch(*args, **kwargs):  # the stock hook with the contexts FluxPipeline opens
        calls.append(None)
        with stock.cache_context("cond" if len(calls) % 2 else "uncond"):
            return forward(*args, **kwargs)

    stock.forward = per_branch
    branch = run(pipe(stock), **call)
    ad = fd.DiffusersTransformer(params)
    ad.enable_cache(MagCacheConfig(**kw))
    with caplog.at_level("WARNING"):
        ours = run(pipe(ad), **call)
    assert "MagCache with true CFG and no cache_context" in caplog.text
    sampled = fd.sample(params, pipe(tiny.stock_transformer("flux", seed=SEED)), PROMPT, negative_prompt="blurry",
                        true_cfg=2.0, image=_rgb(0), mask_image=mask, steps=steps, seed=0, height=32, width=32,
                        strength=1.0, output_type="latent", cache=fd.MagCache(**kw), **SHORT)  # fmt: skip
    assert max_err(ours, branch) <= FP32  # measured 0
    assert max_err(sampled, ours) <= FP32  # measured 7.7e-7: one batched call vs two
    assert max_err(shared, branch) > 0.1  # the stock sharing is another result (measured 0.91)


# ---------------------------------------------------------------- Pyramid Attention Broadcast


@pytest.mark.parametrize("kind", ["flux", "qwen-image"])
def test_pyramid_attention_broadcast_equals_stock(kind, caplog):
    """``enable_cache(PyramidAttentionBroadcastConfig(...))`` (diffusers' pipeline-test
    config) on the adapter: the stock PAB hooks' latents through the pipeline; FLUX.1 with
    true CFG (both calls share the stock PAB state, as ours); Qwen-Image without (its cond and
    uncond texts differ in length, and the stock shared state then crashes reusing one
    call's attention output in the other: a size mismatch); ``disable_cache`` gives the plain run."""
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    call = dict(prompt=PROMPT, num_inference_steps=4)  # t = 1000, 750, 500, 250: three steps in (100, 800)
    call.update(dict(negative_prompt="blurry", true_cfg_scale=2.0, **SHORT) if kind == "flux" else {})
    out = {}
    for side in ("stock", "ours"):
        pipe = tiny.pipeline(kind, seed=SEED, transformer=None if side == "stock" else adapter(kind))
        plain = run(pipe, **call)
        config = PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(100, 800),
            spatial_attention_block_identifiers=["transformer_blocks"],
            current_timestep_callback=lambda pipe=pipe: pipe.current_timestep,
        )
        pipe.transformer.enable_cache(config)
        out[side] = run(pipe, **call)
        assert max_err(out[side], plain) > 1e-3  # attention was reused
    pipe.transformer.disable_cache()  # the adapter's: back to the plain forward
    assert not pipe.transformer.is_cache_enabled and max_err(run(pipe, **call), plain) == 0
    assert max_err(out["ours"], out["stock"]) <= FP32


# ---------------------------------------------------------------- diffusers' hook objects

# What diffusers' pipeline tests inspect (tests/pipelines/testing_utils/cache.py:
# test_pyramid_attention_broadcast_layers, test_faster_cache_state): the configs they use,
# the hook names they look up and the stock class each must be an instance of.
PAB, FASTER_DENOISER, FASTER_BLOCK = "pyramid_attention_broadcast", "faster_cache_denoiser", "faster_cache_block"


def _pab_config(pipe):
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    return PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(100, 800),
        spatial_attention_block_identifiers=["transformer_blocks"],
        current_timestep_callback=lambda: pipe.current_timestep,
    )


def _faster_config(pipe):
    from diffusers.hooks import FasterCacheConfig

    return FasterCacheConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 901),
        unconditional_batch_skip_range=2,
        attention_weight_callback=lambda _: 0.5,
        is_guidance_distilled=True,  # FLUX.1-dev, FLUX.2-dev: as diffusers' FLUX test config
        current_timestep_callback=lambda: pipe.current_timestep,
    )


def _hooks(denoiser) -> dict:
    """{(module name, hook name): hook} of the stock cache hook names registered under ``denoiser``."""
    return {
        (n, h): m._diffusers_hook.get_hook(h)
        for n, m in denoiser.named_modules()
        if hasattr(m, "_diffusers_hook")
        for h in (PAB, FASTER_DENOISER, FASTER_BLOCK)
        if m._diffusers_hook.get_hook(h) is not None
    }


def _snapshot(hooks: dict) -> dict:
    """Each hook's state as values: the fields the tests read, tensors cloned."""
    fields = ("iteration", "cache", "batch_size", "low_frequency_delta", "high_frequency_delta")

    def copy(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        return type(v)(copy(x) for x in v) if isinstance(v, (tuple, list)) else v

    return {k: {f: copy(getattr(h.state, f)) for f in fields if hasattr(h.state, f)} for k, h in hooks.items()}


def _assert_same_state(got, want) -> None:
    assert type(got) is type(want) or (got is None) == (want is None), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=FP32)
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same_state(g, w)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _assert_same_state(got[k], want[k])
    else:
        assert got == want


def _inspected(kind: str, side: str, config, steps: int) -> tuple:
    """(hooks after enable_cache, their states at every step's callback, after the run) of
    the tiny ``kind`` pipeline with the stock transformer or the adapter over the same weights."""
    pipe = tiny.pipeline(kind, seed=SEED, transformer=None if side == "stock" else adapter(kind))
    pipe.transformer.enable_cache(config(pipe))
    hooks, seen = _hooks(pipe.transformer), []

    def on_step(p, i, t, kw):
        seen.append(_snapshot(_hooks(pipe.transformer)))
        return {}

    run(pipe, prompt=PROMPT, num_inference_steps=steps, callback_on_step_end=on_step, **SHORT)
    return hooks, seen, _snapshot(_hooks(pipe.transformer))


@pytest.mark.parametrize("kind", ["flux", "flux2", "qwen-image"])
def test_pyramid_attention_broadcast_hooks_as_stock(kind):
    """``test_pyramid_attention_broadcast_layers``'s checks on the adapter through ``pipe(...)``:
    a ``PyramidAttentionBroadcastHook`` on each of the 2 + 2 attention modules (Qwen-Image: 2;
    none on the model), ``state.cache`` None before, set during the run with ``state.iteration == i + 1``
    at step i's callback, reset to None / 0 after; beyond them, each state equal to the stock
    hook's on the stock transformer (the modules' last outputs, fp32)."""
    from diffusers.hooks.pyramid_attention_broadcast import PyramidAttentionBroadcastHook

    (want, want_steps, want_after), (got, got_steps, got_after) = (
        _inspected(kind, side, _pab_config, 2) for side in ("stock", "ours")
    )
    lists = ("transformer_blocks",) if kind == "qwen-image" else ("transformer_blocks", "single_transformer_blocks")
    names = [(f"{b}.{i}.attn", PAB) for b in lists for i in (0, 1)]
    assert sorted(got) == sorted(want) == sorted(names)  # on the attention modules only
    assert all(isinstance(h, PyramidAttentionBroadcastHook) and h.state.cache is None for h in got.values())
    assert len(got_steps) == 2
    for i, states in enumerate(got_steps):
        assert all(s["cache"] is not None and s["iteration"] == i + 1 for s in states.values())
    assert all(s["cache"] is None and s["iteration"] == 0 for s in got_after.values())
    _assert_same_state([got_steps, got_after], [want_steps, want_after])
    ad = adapter(kind)
    ad.enable_cache(_pab_config(None))
    assert ad.step_cache_hook() is not None and ad._diffusers_hook.get_hook(PAB) is None  # none on the model, as stock
    ad.disable_cache()
    assert _hooks(ad) == {} and ad.step_cache_hook() is None and not ad.is_cache_enabled


@pytest.mark.parametrize("kind", ["flux", "flux2"])
def test_faster_cache_hooks_as_stock(kind):
    """``test_faster_cache_state``'s checks on the adapter through ``pipe(...)``: a
    ``FasterCacheDenoiserHook`` on the model, a ``FasterCacheBlockHook`` on each of the 2 + 2
    attention modules and on no other module; at step i's callback every ``state.iteration``
    is i + 1 and each block's ``state.cache`` holds 2 outputs; after the run iteration 0,
    the deltas, ``batch_size`` and ``cache`` None; beyond them, each state equal to the stock
    hook's on the stock transformer (fp32)."""
    from diffusers.hooks.faster_cache import FasterCacheBlockHook, FasterCacheDenoiserHook

    (want, want_steps, want_after), (got, got_steps, got_after) = (
        _inspected(kind, side, _faster_config, 4) for side in ("stock", "ours")
    )
    blocks = [
        (f"{b}.{i}.attn", FASTER_BLOCK) for b in ("transformer_blocks", "single_transformer_blocks") for i in (0, 1)
    ]
    assert sorted(got) == sorted(want) == sorted([("", FASTER_DENOISER), *blocks])
    assert isinstance(got["", FASTER_DENOISER], FasterCacheDenoiserHook)
    assert all(isinstance(got[k], FasterCacheBlockHook) for k in blocks)
    ad = adapter(kind)  # no other module of the adapter carries a registry once the cache is on
    ad.enable_cache(_faster_config(None))
    assert sorted(n for n, m in ad.named_modules() if n and hasattr(m, "_diffusers_hook")) == sorted(
        n for n, _ in blocks
    )
    ad.disable_cache()  # diffusers' disable_cache: every hook gone, ours too
    assert _hooks(ad) == {} and ad.step_cache_hook() is None and not ad.is_cache_enabled
    for i, states in enumerate(got_steps):
        assert all(s["iteration"] == i + 1 for s in states.values())
        assert all(len(states[k]["cache"]) == 2 for k in blocks)
    assert all(set(s.values()) == {0, None} for s in got_after.values())
    _assert_same_state([got_steps, got_after], [want_steps, want_after])

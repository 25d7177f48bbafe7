"""Step caching (`functional_dit.pipelines.cache`) against diffusers' own cache hooks: `fd.sample`
with a cache takes the same skip decisions and gives the same latents as the stock
pipeline with the stock transformer and the same ``enable_cache`` config, per family,
with true CFG (diffusers keeps separate "cond"/"uncond" states; we batch them and decide
per half). Also: no-op equality with the cache off, the adapter's ``enable_cache``, bad
configs.

Stock defects worked around here, and only here (docs/caching.md):
- FLUX.2: diffusers' First-Block Cache crashes in its tail hook (``Tensor - list``: the
  single blocks return the merged (txt; img) stream); `fixed_fbc_tail` makes that one
  subtraction take the merged stream's image and text rows, the evident intent.
- ``Flux2Pipeline`` opens no ``cache_context``, so FBC and TaylorSeer refuse it; their
  FLUX.2 oracle is ``Flux2KleinPipeline`` (which opens one), MagCache's (which needs none)
  ``Flux2Pipeline``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _dist import spawn
from diffusers.hooks import FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks import faster_cache as faster_hooks
from diffusers.hooks import first_block_cache as fbc_hooks
from diffusers.hooks import mag_cache as mag_hooks
from diffusers.hooks import taylorseer_cache as ts_hooks
from test_sample import stock_latents

import functional_dit as fd
import sharding
from functional_dit import tiny
from functional_dit.pipelines import cache as fd_cache

FP32 = dict(rtol=1e-5, atol=1e-5)  # the bound for fp32 latents
SIZE = dict(height=32, width=32)
STEPS = 6

# fam: (tiny kind, stock kwargs, fd.sample kwargs). FLUX pad the prompt to
# max_sequence_length: 16 keeps the tiny runs fast (Qwen-Image's prompts are not padded).
MSL = dict(max_sequence_length=16)
FAMILIES = {
    "flux1": (
        "flux",
        dict(true_cfg_scale=2.0, negative_prompt="blurry", **MSL),
        dict(true_cfg=2.0, negative_prompt="blurry", **MSL),
    ),
    "flux2-klein": ("flux2-klein", dict(guidance_scale=4.0, **MSL), dict(true_cfg=4.0, **MSL)),
    "flux2-dev": ("flux2", dict(guidance_scale=3.0, **MSL), dict(guidance=3.0, **MSL)),  # embedded guidance, no CFG
    "qwen-image": (
        "qwen-image",
        dict(true_cfg_scale=4.0, negative_prompt="blurry"),
        dict(true_cfg=4.0, negative_prompt="blurry"),
    ),
}
# Thresholds between the metrics these random tiny models give at step 1 (cond, uncond):
# FLUX.1 (0.841, 0.992), klein (1.091, 1.056), Qwen (1.0701, 1.0677), so that the two CFG
# halves decide differently there and some steps skip; each is >= 1e-3 relative from any
# metric of the run (the metrics agree with diffusers' to ~1e-7).
FBC_THRESHOLD = {"flux1": 0.9, "flux2-klein": 1.07, "qwen-image": 1.069}
CFG_FAMILIES = ["flux1", "flux2-klein", "qwen-image"]


@pytest.fixture
def recorder(monkeypatch):
    """Records each stock cache decision as (context name, computed) in call order."""
    seen = []

    def wrap(cls, name, decision):
        orig = getattr(cls, name)

        def patched(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            seen.append((self.state_manager._context.name, decision(self, out)))
            return out

        monkeypatch.setattr(cls, name, patched)

    wrap(fbc_hooks.FBCHeadBlockHook, "_should_compute_remaining_blocks", lambda self, out: out)
    wrap(mag_hooks.MagCacheHeadHook, "new_forward", lambda self, out: self.state_manager.get_state().should_compute)
    wrap(ts_hooks.TaylorSeerCacheHook, "_measure_should_compute", lambda self, out: out[0])
    return seen


@pytest.fixture
def fixed_fbc_tail(monkeypatch):
    """diffusers' FBC tail hook with its FLUX.2 subtraction fixed: a merged (txt; img)
    output is split into its image and text rows before the head outputs are subtracted."""
    orig = fbc_hooks.FBCBlockHook.new_forward

    def new_forward(self, module, *args, **kwargs):
        state = self.state_manager.get_state()
        if not (self.is_tail and state.should_compute and isinstance(state.head_block_output, list)):
            return orig(self, module, *args, **kwargs)
        out = self.fn_ref.original_forward(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return orig(self, module, *args, **kwargs)
        img, txt = state.head_block_output
        state.tail_block_residuals = (out[:, -img.shape[1] :] - img, out[:, : txt.shape[1]] - txt)
        return out

    monkeypatch.setattr(fbc_hooks.FBCBlockHook, "new_forward", new_forward)


def per_step(seen, hooks_per_call: int = 1) -> tuple:
    """Stock decisions (one per hooked module per call, cond then uncond each step) as
    per-step (cond, uncond) tuples; every hook of one call must agree."""
    calls = [seen[i : i + hooks_per_call] for i in range(0, len(seen), hooks_per_call)]
    assert all(len({d for _, d in c}) == 1 for c in calls), calls
    names = [c[0][0] for c in calls]
    assert names == ["cond", "uncond"] * (len(calls) // 2), names
    flags = [bool(c[0][1]) for c in calls]
    return tuple(zip(flags[::2], flags[1::2]))


def run_both(fam, stock_config, ours, seen):
    """(stock latents, stock decisions, our latents, our CacheRun) at STEPS steps, seed 3."""
    kind, stock_kw, our_kw = FAMILIES[fam]
    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    pipe.transformer.enable_cache(stock_config)
    expected = stock_latents(pipe, 3, prompt="a red cube", num_inference_steps=STEPS, **SIZE, **stock_kw)
    run = fd.CacheRun(ours)
    got = fd.sample(params, pipe, "a red cube", steps=STEPS, seed=3, output_type="latent", cache=run, **SIZE, **our_kw)
    return expected, list(seen), got, run


@pytest.mark.parametrize("fam", CFG_FAMILIES)
def test_first_block_cache_equals_diffusers(fam, recorder, fixed_fbc_tail):
    thr = FBC_THRESHOLD[fam]
    expected, seen, got, run = run_both(fam, FirstBlockCacheConfig(threshold=thr), fd.FirstBlockCache(thr), recorder)
    stock = per_step([(n, d) for n, d in seen])
    assert run.decisions == stock
    assert run.skipped() > 0 and any(c != u for c, u in stock)  # skips, and the halves disagree somewhere
    torch.testing.assert_close(got, expected, **FP32)


TAYLOR = {  # diffusers' lite mode = TaylorSeer on the model output; bf16 factors by default
    "flux1": dict(cache_interval=2, disable_cache_before_step=2, max_order=1),
    "flux2-klein": dict(cache_interval=3, disable_cache_before_step=1, max_order=2, taylor_factors_dtype=torch.float32),
    "qwen-image": dict(cache_interval=2, disable_cache_before_step=2, disable_cache_after_step=5, max_order=1),
}


@pytest.mark.parametrize("fam", CFG_FAMILIES)
def test_taylorseer_equals_diffusers(fam, recorder):
    kw = TAYLOR[fam]
    expected, seen, got, run = run_both(
        fam, TaylorSeerCacheConfig(use_lite_mode=True, **kw), fd.TaylorSeer(**kw), recorder
    )
    n_hooks = len(seen) // (2 * STEPS)  # one per block and the final projection
    assert run.decisions == per_step(seen, n_hooks) and run.skipped() > 0
    torch.testing.assert_close(got, expected, **FP32)


def n_attention(fam: str) -> int:
    """The number of attention modules (one per block) of the family's tiny transformer."""
    c = tiny.transformer_config(FAMILIES[fam][0])
    return c.num_layers + getattr(c, "num_single_layers", 0)


@pytest.mark.parametrize("fam", CFG_FAMILIES)
def test_taylorseer_on_attention_equals_diffusers(fam, recorder):
    """TaylorSeer's default mode: every attention module's output extrapolated, the rest of
    each block computed (true CFG). fp32 factors: outputs that agree to fp32 rounding could
    round to different bf16 factors."""
    kw = dict(cache_interval=2, disable_cache_before_step=2, max_order=2, taylor_factors_dtype=torch.float32)
    ours = fd.TaylorSeer(**kw, modules=fd_cache.ATTENTION)
    expected, seen, got, run = run_both(fam, TaylorSeerCacheConfig(**kw), ours, recorder)
    n_hooks = len(seen) // (2 * STEPS)  # one per attention module
    assert n_hooks == n_attention(fam) and run.decisions == per_step(seen, n_hooks) and run.skipped() > 0
    torch.testing.assert_close(got, expected, **FP32)


@pytest.fixture
def faster_recorder(monkeypatch):
    """Records each stock FasterCache attention call as (iteration, computed) in call order."""
    seen, approximated = [], [0]
    block_hook = faster_hooks.FasterCacheBlockHook
    orig_forward, orig_approx = block_hook.new_forward, block_hook._compute_approximated_attention_output

    def approx(self, *args, **kwargs):
        approximated[0] += 1
        return orig_approx(self, *args, **kwargs)

    def new_forward(self, module, *args, **kwargs):
        before, iteration = approximated[0], self.state.iteration
        out = orig_forward(self, module, *args, **kwargs)
        seen.append((iteration, approximated[0] == before))
        return out

    monkeypatch.setattr(block_hook, "_compute_approximated_attention_output", approx)
    monkeypatch.setattr(block_hook, "new_forward", new_forward)
    return seen


def faster_steps(seen, n_hooks: int) -> tuple:
    """Stock FasterCache decisions as per-step 1-tuples; every module of one call agrees."""
    calls = [seen[i : i + n_hooks] for i in range(0, len(seen), n_hooks)]
    assert all(len({d for _, d in c}) == 1 and len({n for n, _ in c}) == 1 for c in calls), calls
    return tuple((c[0][1],) for c in calls)


def faster_config(pipe) -> FasterCacheConfig:
    """diffusers' FasterCache for a guidance-distilled model, the timestep the pipeline's."""
    return FasterCacheConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 950),  # the first step (t = 1000) computes, as stock needs
        current_timestep_callback=lambda: pipe.current_timestep,
        attention_weight_callback=lambda _: 0.3,
        is_guidance_distilled=True,
        tensor_format="BCHW",
    )


# FasterCache runs: one transformer call per step. FLUX.1 and FLUX.2-dev embed guidance;
# Qwen-Image runs without true CFG (no negative prompt): stock FasterCache keeps one state
# for all calls, so true CFG's cond and uncond calls would share (and advance) it, while ours
# batches the two halves into one call; the two are comparable only without CFG.
FASTER_RUNS = {
    "flux1": ("flux", MSL, MSL),
    "flux2-dev": FAMILIES["flux2-dev"],  # Flux2Pipeline: stock FasterCache needs no cache_context
    "qwen-image": ("qwen-image", {}, {}),
}


@pytest.mark.parametrize("fam", list(FASTER_RUNS))
def test_fastercache_equals_diffusers(fam, faster_recorder):
    """FasterCache without true CFG (one call per step): the stock pipeline's latents and
    decisions; ours reads the timestep from t (t x 1000)."""
    kind, stock_kw, our_kw = FASTER_RUNS[fam]
    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    pipe.transformer.enable_cache(faster_config(pipe))
    expected = stock_latents(pipe, 3, prompt="a red cube", num_inference_steps=STEPS, **SIZE, **stock_kw)
    run = fd.CacheRun(fd.FasterCache(2, (-1, 950), weight=0.3))
    sample = lambda **kw: fd.sample(  # noqa: E731
        params, pipe, "a red cube", steps=STEPS, seed=3, output_type="latent", **SIZE, **our_kw, **kw
    )
    got = sample(cache=run)
    assert run.decisions == faster_steps(faster_recorder, n_attention(fam)) and run.skipped() > 0
    if fam == "flux1":  # step 0 (t = 1000) lies outside the range; inside it every 2nd call (2, 4) computes
        assert run.decisions == ((True,), (False,), (True,), (False,), (True,), (False,))
    torch.testing.assert_close(got, expected, **FP32)
    assert not torch.allclose(got, sample(), **FP32)


@pytest.mark.parametrize("fam", ["flux1", "flux2-dev", "qwen-image"])  # Flux2Pipeline needs no cache_context here
def test_magcache_equals_diffusers(fam, recorder):
    kw = dict(mag_ratios=fd_cache.FLUX_MAG_RATIOS, num_inference_steps=STEPS, threshold=0.06)
    expected, seen, got, run = run_both(fam, MagCacheConfig(**kw), fd.MagCache(**kw), recorder)
    stock = tuple((d,) for _, d in seen) if fam == "flux2-dev" else per_step(seen)
    assert run.decisions == stock and run.skipped() > 0
    torch.testing.assert_close(got, expected, **FP32)


def test_adapter_honours_enable_cache(recorder, fixed_fbc_tail):
    """pipe.transformer.enable_cache(...) on fd.DiffusersTransformer: the stock pipeline's
    latents with the stock transformer and the same config (FLUX.1, true CFG: per-context
    states), for First-Block Cache and TaylorSeer; the state is dropped after each run."""
    kind, stock_kw, _ = FAMILIES["flux1"]
    stock = tiny.pipeline(kind)
    ours = tiny.pipeline(kind, transformer=fd.DiffusersTransformer(fd.from_diffusers(stock.transformer)))
    kw = dict(prompt="a red cube", num_inference_steps=STEPS, **SIZE, **stock_kw)
    configs = (
        FirstBlockCacheConfig(FBC_THRESHOLD["flux1"]),
        TaylorSeerCacheConfig(2, 2, use_lite_mode=True),
        TaylorSeerCacheConfig(2, 2, taylor_factors_dtype=torch.float32),  # on the attention modules
    )
    for config in configs:
        for pipe in (stock, ours):
            pipe.transformer.enable_cache(config)
        expected = stock_latents(stock, 3, **kw)
        torch.testing.assert_close(stock_latents(ours, 3, **kw), expected, **FP32)
        assert ours.transformer.step_cache_hook().state_manager._state_cache == {}  # dropped after the run, as stock
        for pipe in (stock, ours):
            pipe.transformer.disable_cache()
    # FasterCache (one state for all contexts, as stock): without true CFG, as it serves FLUX.1-dev
    kw = dict(prompt="a red cube", num_inference_steps=STEPS, **SIZE, **MSL)
    for pipe in (stock, ours):
        pipe.transformer.enable_cache(faster_config(pipe))
    expected = stock_latents(stock, 3, **kw)
    torch.testing.assert_close(stock_latents(ours, 3, **kw), expected, **FP32)
    assert ours.transformer.step_cache_hook().shared.value.iteration == 0  # reset after the run, as stock


@pytest.mark.parametrize(
    "config, match",
    [
        (MagCacheConfig(calibrate=True), r"config: MagCacheConfig\(calibrate=True\) is not supported"),
        (FasterCacheConfig(), r"config: FasterCacheConfig\(is_guidance_distilled=False\) is not supported"),
    ],
)
def test_adapter_refuses_unsupported_configs(config, match):
    adapter = fd.DiffusersTransformer(fd.init(tiny.transformer_config("flux"), seed=0))
    with pytest.raises(ValueError, match=match):
        adapter.enable_cache(config)
    assert not adapter.is_cache_enabled


def test_cache_off_is_the_plain_sampler_and_on_with_zero_threshold_too():
    """cache=None runs fd.apply's loop unchanged; FBC at threshold -1 (always compute) and
    an all-compute TaylorSeer give those latents bitwise (the staged forward is the
    family's forward)."""
    pipe = tiny.pipeline("flux")
    params, kw = fd.from_diffusers(pipe.transformer), dict(steps=3, seed=1, output_type="latent", **SIZE, **MSL)
    plain = fd.sample(params, pipe, "a cube", true_cfg=2.0, **kw)
    assert torch.equal(plain, fd.sample(params, pipe, "a cube", true_cfg=2.0, cache=None, **kw))
    for cache in ("fbcache:0", fd.TaylorSeer(cache_interval=1)):
        run = fd.CacheRun(cache)
        got = fd.sample(params, pipe, "a cube", true_cfg=2.0, cache=run, **kw)
        assert run.skipped() == 0 and torch.equal(got, plain), cache


def test_labels_read_back():
    for spec in (
        "fbcache:0.08",
        "taylorseer:interval=4,warmup=2,order=2,until=20,dtype=float32",
        "taylorseer:interval=4,warmup=2,attention=1",
        "magcache:0.1,max_skip=2",
        "fastercache:skip=3,weight=0.4,low=100,high=700",
    ):
        cache = fd_cache.parse(spec)
        assert fd_cache.parse(fd_cache.label(cache)) == cache


@pytest.mark.parametrize(
    "cache, match",
    [
        ("fbcache:x", "cache: threshold='x' is not a number"),
        ("teacache:0.1", r"cache: expected one of \['fastercache', 'fbcache', 'magcache', 'taylorseer'\]"),
        ("taylorseer:order=-1", "max_order: expected an int >= 0, got -1"),
        ("taylorseer:dtype=half4", "taylor_factors_dtype: expected a floating torch.dtype or None, got 'half4'"),
        (0.1, "cache: expected FirstBlockCache, TaylorSeer, MagCache or a spec"),
        ("fastercache:skip=0", "block_skip_range: expected an int >= 1, got 0"),
    ],
)
def test_bad_cache_argument(cache, match):
    pipe = tiny.pipeline("flux")
    with pytest.raises(ValueError, match=match):
        fd.sample(fd.from_diffusers(pipe.transformer), pipe, "x", steps=1, seed=0, cache=cache, **SIZE)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: fd.FasterCache(timestep_skip_range=(1,)), r"timestep_skip_range: expected \(low, high\) numbers"),
        (lambda: fd.FasterCache(weight="0.5"), "weight: expected a number or a function of the module name"),
        (lambda: fd.FasterCache(timestep=500), "timestep: expected None or a function"),
        (lambda: fd.FasterCache(modules="attn"), "modules: expected a sequence of regex strings"),
        (lambda: fd.TaylorSeer(modules=("(",)), r"modules: '\(' is not a regex"),
        (lambda: fd.TaylorSeer(skip_modules=("x",)), r"skip_modules: needs attention modules \(modules=...\)"),
    ],
)
def test_bad_attention_cache_configs(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_attention_patterns_matching_no_module():
    """Patterns that hook no attention module: a ValueError listing the model's, not an
    uncached run."""
    pipe = tiny.pipeline("flux")
    run = fd.CacheRun(fd.TaylorSeer(modules=(r"blocks\.99\.attn",)))
    with pytest.raises(ValueError, match=r"matches none of the model's attention modules \(transformer_blocks.0.attn"):
        fd.sample(fd.from_diffusers(pipe.transformer), pipe, "x", steps=1, seed=0, cache=run, **SIZE)


# ----------------------------------------------------------------------------- ranks


def _cached_on_meshes(rank, world):
    """FLUX.1 with true CFG and First-Block Cache, single process then tp=2, sp=2 (9 image
    tokens: one padded row) and dp=2 (CFG parallel: a rank per half); TaylorSeer on sp=2;
    TaylorSeer on the attention modules and FasterCache on tp=2 and sp=2, for FLUX.1 and
    FLUX.2-klein. Records every First-Block metric as reduced and as this rank alone would see it."""
    pipe = tiny.pipeline("flux")
    params = fd.from_diffusers(pipe.transformer)
    kw = dict(height=48, width=48, steps=STEPS, seed=5, true_cfg=2.0, negative_prompt="blurry", output_type="latent")
    kw.update(MSL)
    sums, orig = [], fd_cache.branch_sums

    def spy(r, prev, info, seq, reduce=True):
        local = orig(r, prev, info, seq, reduce=False)
        out = orig(r, prev, info, seq, reduce)
        sums.append(((local[0] / local[1]).tolist(), (out[0] / out[1]).tolist()))
        return out

    fd_cache.branch_sums = spy
    out = {}
    try:
        for name, axes in (("single", None), ("tp", dict(tp=2)), ("sp", dict(sp=2)), ("dp", dict(dp=2))):
            p = params if axes is None else sharding.shard_params(params, sharding.make_mesh(**axes, device_type="cpu"))
            sums.clear()
            run = fd.CacheRun(fd.FirstBlockCache(FBC_THRESHOLD["flux1"]))
            out[name] = (fd.sample(p, pipe, "a red cube", cache=run, **kw), run.decisions, list(sums))
        mesh = sharding.make_mesh(sp=2, device_type="cpu")
        for name, p in (("ts-single", params), ("ts-sp", sharding.shard_params(params, mesh))):
            run = fd.CacheRun(fd.TaylorSeer(cache_interval=2, disable_cache_before_step=2))
            out[name] = (fd.sample(p, pipe, "a red cube", cache=run, **kw), run.decisions, [])
        # the attention-level caches: each rank extrapolates its local part of each attention
        # output (tp: its heads of the single blocks' attention; sp: its rows). fp32 factors:
        # bf16 ones would round outputs that differ in fp32 rounding (the ranks' matmul
        # orders) a bf16 step apart (seen: 9e-4 at sp=2)
        tp = sharding.shard_params(params, sharding.make_mesh(tp=2, device_type="cpu"))
        sp = sharding.shard_params(params, mesh)
        attention = fd.TaylorSeer(2, 2, taylor_factors_dtype=torch.float32, modules=fd_cache.ATTENTION)
        for cache, tag in ((attention, "tsa"), (fd.FasterCache(2, (-1, 950), weight=0.3), "fc")):
            for name, p in (("single", params), ("tp", tp), ("sp", sp)):
                run = fd.CacheRun(cache)
                out[f"{tag}-{name}"] = (fd.sample(p, pipe, "a red cube", cache=run, **kw), run.decisions, [])
        # FLUX.2-klein (true CFG): a single block's hooked module is its whole parallel
        # attention (the fused q, k, v + MLP input projection, to_out over [attn, mlp]),
        # whose packed weights tp=2 cuts per segment
        klein = tiny.pipeline("flux2-klein")
        k_params = fd.from_diffusers(klein.transformer)
        k_kw = dict(height=48, width=48, steps=STEPS, seed=5, true_cfg=4.0, output_type="latent", **MSL)
        meshes = [("single", None), ("tp", dict(tp=2)), ("sp", dict(sp=2))]
        for cache, tag in ((attention, "k-tsa"), (fd.FasterCache(2, (-1, 950), weight=0.3), "k-fc")):
            for name, axes in meshes:
                p = (
                    k_params
                    if axes is None
                    else sharding.shard_params(k_params, sharding.make_mesh(**axes, device_type="cpu"))
                )
                run = fd.CacheRun(cache)
                out[f"{tag}-{name}"] = (fd.sample(p, klein, "a red cube", cache=run, **k_kw), run.decisions, [])
    finally:
        fd_cache.branch_sums = orig
    return out | _extract_pass_on_sequence_splits()


# the caches over an extract pass (sp, ring): every skipping one (`SKIPPING`) on Qwen-Image 2.1, two on klein
_TS_ATTENTION = "taylorseer:interval=2,warmup=1,attention=1"
EXTRACT = {
    "qwen-image-2.1": ["fbcache:10", "taylorseer:interval=2,warmup=1", _TS_ATTENTION, "fastercache:skip=2,high=2000",
                       "magcache:10"],
    "flux2-klein-kv": ["fbcache:10", _TS_ATTENTION],
}  # fmt: skip
EXTRACT_ITEMS = [  # Qwen-Image 2.1 per-item caches (`functional_dit.sampling`), the refusal's other site
    dict(prompt="a red car", steps=3, seed=4, true_cfg=3.0, negative_prompt="dark", cache="fbcache:1.5"),
    dict(prompt="a red box", steps=3, seed=6, cache="taylorseer:interval=2,warmup=1,order=1,attention=1"),
]


def _extract_pass_on_sequence_splits() -> dict:
    """Step caches over an extract pass (the first step computes the KV cache: Qwen-Image
    2.1's prefix over the joint sequence, its later steps the target's rows only; klein's
    reference stream) on one process, sp=2 and ring=2: ``fd.sample`` latents and decisions,
    and Qwen-Image 2.1's per-item caches in one `functional_dit.sampling` batch."""
    from functional_dit import sampling

    out = {}
    for name, caches in EXTRACT.items():
        pipe, params, sample = _new_family(name)
        for mesh, axes in (("single", None), ("sp", dict(sp=2)), ("ring", dict(ring=2))):
            p = params if axes is None else sharding.shard_params(params, sharding.make_mesh(**axes, device_type="cpu"))
            for cache in caches:
                run = fd.CacheRun(cache)
                out[f"kv-{name}-{cache}-{mesh}"] = (sample(p, cache=run), run.decisions, [])
            if name == "qwen-image-2.1" and mesh != "ring":
                reqs = [sampling.Request(height=32, width=32, **r) for r in EXTRACT_ITEMS]
                items = sampling.sample(p, sampling.context(p, pipe), reqs, "latent")
                out[f"kv-items-{mesh}"] = (torch.stack(list(items)), [], [])
    return out


@pytest.mark.slow
def test_cached_sampling_on_tp_sp_dp_equals_single_process():
    """Every rank takes the single-process decisions and gives its latents; the First-Block
    metric is summed over the ranks holding parts of it: without that sum the two sp
    ranks (each with half the image rows) would see different metrics and, at the
    threshold, take different decisions. Step caches over an extract pass (Qwen-Image 2.1's
    prefix KV cache, every skipping cache, in `fd.sample` and per item; klein's reference
    KV cache) on sp=2 and ring=2: the single-process decisions and latents (fp32 1e-5:
    the split attention sums in another order); on the extract step a cache keeps the
    target's rows split as the later steps split them."""
    results = spawn(_cached_on_meshes, 2, timeout=600)
    thr = FBC_THRESHOLD["flux1"]
    for r in results:
        latents, decisions, sums = r["single"]
        assert any(not c for d in decisions for c in d) and any(c != u for c, u in decisions)
        for name in ("tp", "sp", "dp"):
            assert r[name][1] == decisions, name
            torch.testing.assert_close(r[name][0], latents, **FP32)
            # reduced metrics: the single-process ones (float64 sums of fp32 residuals that
            # agree to fp32 rounding), the same on every rank
            torch.testing.assert_close(torch.tensor([s[1] for s in r[name][2]]), torch.tensor([s[1] for s in sums]))
        for name in ("ts-sp", "tsa-tp", "tsa-sp", "fc-tp", "fc-sp", "k-tsa-tp", "k-tsa-sp", "k-fc-tp", "k-fc-sp"):
            single = r[name.rsplit("-", 1)[0] + "-single"]
            assert r[name][1] == single[1] and any(not c for d in single[1] for c in d), name
            torch.testing.assert_close(r[name][0], single[0], **FP32)
    for r in results:  # step caches over an extract pass, formerly refused on sp and ring
        for name, caches in EXTRACT.items():
            for cache in caches:
                single = r[f"kv-{name}-{cache}-single"]
                assert any(not c for d in single[1] for c in d), (name, cache)
                for mesh in ("sp", "ring"):
                    got = r[f"kv-{name}-{cache}-{mesh}"]
                    assert got[1] == single[1], (name, cache, mesh)
                    torch.testing.assert_close(got[0], single[0], **FP32)
        torch.testing.assert_close(r["kv-items-sp"][0], r["kv-items-single"][0], **FP32)
    for name in ("tp", "sp", "dp"):
        assert [s[1] for s in results[0][name][2]] == [s[1] for s in results[1][name][2]], name
        assert torch.equal(results[0][name][0], results[1][name][0]), name
    local = [[s[0] for s in r["sp"][2]] for r in results]  # per step, per half, per rank
    alone = [[[m > thr for m in step] for step in rank] for rank in local]
    assert alone[0] != alone[1], local  # sp ranks deciding alone would disagree


def test_generate_cache_flag(tmp_path, capsys):
    """``generate --cache fbcache:0.9`` writes fd.sample's cached image; a bad spec is an
    argument error naming the flag."""
    from PIL import Image

    from functional_dit.__main__ import main

    pipe = tiny.pipeline("flux")
    pipe.save_pretrained(tmp_path / "pipe")
    gen = ["generate", "--model", str(tmp_path / "pipe"), "--prompt", "a cube", "--height", "32", "--width", "32"]
    gen += ["--steps", str(STEPS), "--seed", "3", "--true-cfg", "2.0", "--out", str(tmp_path / "x.png")]
    assert main([*gen, "--cache", "fbcache:0.9"]) == 0
    run = fd.CacheRun("fbcache:0.9")
    want = fd.sample(
        fd.from_diffusers(pipe.transformer), pipe, "a cube", steps=STEPS, seed=3, true_cfg=2.0, cache=run, **SIZE
    )
    assert run.skipped() > 0
    assert (np.asarray(Image.open(tmp_path / "x.png")) == np.asarray(want[0])).all()
    capsys.readouterr()
    assert main([*gen, "--cache", "teacache:0.1"]) == 2  # the CLI's one-line error, before loading
    assert "error: --cache: expected one of" in capsys.readouterr().err


def test_bench_cache_rows():
    """The bench's sampling rows (tiny widths): diffusers' same cache on the stock side gives
    our cached latents; block calls counted from the decisions; FLUX.2's stock First-Block
    Cache is reported as the crash it is, not measured."""
    from functional_dit.cli import _bench_cache

    specs = ["fbcache:0.9", "taylorseer:interval=2,warmup=2", "magcache:0.06"]
    specs += ["taylorseer:interval=2,warmup=2,dtype=float32,attention=1", "fastercache:skip=2,weight=0.3,high=950"]
    caches = [fd_cache.parse(s) for s in specs]
    rows = _bench_cache.family_rows("flux1", tiny.transformer_config("flux"), caches, 4, 32)
    for r in rows:
        assert r["vs_stock_cached"] < 1e-5, r  # the oracle tests' fp32 bound
        assert r["block_calls"] == 4 * 4 and 0 <= r["block_calls_skipped"] < r["block_calls"]
    assert rows[1]["block_calls_skipped"] == 4  # TaylorSeer: steps 0, 1, 3 computed, step 2 predicted
    # the attention-level caches skip attention calls inside the blocks, no block call
    assert [r["steps_computed"] for r in rows[3:]] == [[3], [2]] and rows[3]["block_calls_skipped"] == 0
    assert rows[3]["vs_uncached"] > 1e-6 and rows[4]["vs_uncached"] > 1e-6
    (r,) = _bench_cache.family_rows("flux2-klein", tiny.transformer_config("flux2-klein"), caches[:1], 2, 32)
    assert r["stock_s"] is None and r["vs_stock_cached"].startswith("TypeError"), r
    assert "| flux2-klein | fbcache:0.9 |" in "\n".join(_bench_cache.table([r]))
    # the attention-level caches on the true-CFG families: TaylorSeer against the stock one;
    # FasterCache's stock row not comparable (its one state sees both CFG calls)
    for fam, kind in (("flux2-klein", "flux2-klein"), ("qwenimage", "qwen-image")):
        ts, fc = _bench_cache.family_rows(fam, tiny.transformer_config(kind), caches[3:], 4, 32)
        assert ts["vs_stock_cached"] < 1e-5 and ts["steps_computed"] == [3, 3] and ts["vs_uncached"] > 1e-6, ts
        assert fc["stock_s"] is None and fc["vs_stock_cached"].startswith("n/a: stock FasterCache"), fc
        assert 0 < fc["steps_computed"][0] < 4 and fc["vs_uncached"] > 1e-6, fc
        assert f"| {fam} | fastercache:skip=2," in "\n".join(_bench_cache.table([ts, fc]))


ATTENTION_SPECS = ["taylorseer:interval=2,warmup=1,attention=1", "fastercache:skip=2"]


# Every cache with every block computed: FBC at threshold 0 (the metric is never <= 0 once
# the latents move), TaylorSeer (on the output and on the attention modules) at interval 1,
# FasterCache computing every call, MagCache with every step in its retention phase.
ALL_COMPUTED = [
    "fbcache:0",
    "taylorseer:interval=1,warmup=1",
    "taylorseer:interval=1,warmup=1,attention=1",
    "fastercache:skip=1",
    fd_cache.MagCache(fd_cache.FLUX_MAG_RATIOS, retention_ratio=1.0),
]
SKIPPING = ["fbcache:10", "taylorseer:interval=2,warmup=1", "taylorseer:interval=2,warmup=1,attention=1",
            "fastercache:skip=2,high=2000", "magcache:10"]  # fmt: skip
# (tiny pipeline, fd.sample kwargs): FLUX.3 (its per-mode and single blocks), Qwen-Image 2.1
# with true CFG (one call per branch) and its prefix KV cache (extract, then cached), and
# FLUX.2-klein editing with its reference KV cache.
NEW_FAMILIES = {
    "flux3": ("flux3", {}),
    "qwen-image-2.1": ("qwen-image-2.1", dict(true_cfg=3.0, negative_prompt="blur")),
    "flux2-klein-kv": ("flux2-klein-kv", dict(image="ref", **MSL)),
}


def _new_family(name: str):
    from test_pipelines_flux3_qwen21 import _pipe
    from test_sample import ref_image

    kind, kw = NEW_FAMILIES[name]
    pipe = _pipe(kind) if kind == "qwen-image-2.1" else tiny.pipeline(kind)  # (one Qwen-Image 2.1 per process)
    kw = dict(kw, image=ref_image()) if "image" in kw else kw
    params = fd.from_diffusers(pipe.transformer)
    sample = lambda p=params, **more: fd.sample(  # noqa: E731
        p, pipe, "a red cube", steps=2, seed=1, output_type="latent", **SIZE, **kw, **more
    )
    return pipe, params, sample


@pytest.mark.parametrize("name", list(NEW_FAMILIES))
def test_every_cache_runs_on_the_new_families(name):
    """FLUX.3, Qwen-Image 2.1 (prefix KV cache) and FLUX.2-klein (reference KV cache): each
    cache with every block computed gives the uncached latents bitwise (the staged forward
    is the family's forward), and each skipping config skips and changes them."""
    _, _, sample = _new_family(name)
    plain = sample()
    for cache in ALL_COMPUTED:
        run = fd.CacheRun(cache)
        assert torch.equal(sample(cache=run), plain) and run.skipped() == 0, cache
    branches = 2 if name == "qwen-image-2.1" else 1
    for cache in SKIPPING:
        run = fd.CacheRun(cache)
        got = sample(cache=run)
        assert len(run.decisions) == 2 and all(len(d) == branches for d in run.decisions), (cache, run.decisions)
        assert run.skipped() > 0 and not torch.allclose(got, plain, **FP32), cache


def _stock_and_ours(pipe, params, stock_config, ours, call, sample, recorder=None):
    pipe.transformer.enable_cache(stock_config)
    try:
        with pipe.transformer.cache_context("cond"):  # these pipelines open none; TaylorSeer needs one
            expected = call()
    finally:
        pipe.transformer.disable_cache()
    run = fd.CacheRun(ours)
    return expected, sample(cache=run), run


TS_KW = dict(cache_interval=2, disable_cache_before_step=1, max_order=1, taylor_factors_dtype=torch.float32)


def _faster_pair(pipe):
    return faster_config(pipe), fd.FasterCache(2, (-1, 950), weight=0.3)


def test_new_families_equal_diffusers_hooks(recorder, faster_recorder):
    """Where diffusers 0.42 has the hook for the model class: Qwen-Image 2.1 without its
    prefix KV cache (the stock TaylorSeer fails on the cache's shorter cached steps; FBC and
    MagCache have no QwenImage21 block registered) and FLUX.2-klein with its reference KV
    cache (FasterCache, 4 steps: stock keeps the extract step's attention outputs, with the
    reference rows, and fails where it extrapolates from them; so does its TaylorSeer):
    latents and decisions of the stock hooks; the adapter's ``enable_cache`` in the stock
    pipeline gives the same latents.
    (diffusers' Flux3Transformer2DModel has no enable_cache.)"""
    from test_pipelines_flux3_qwen21 import CALLS, _pipe, _transformer
    from test_sample import ref_image

    pipe = _pipe("qwen-image-2.1")
    params = fd.from_diffusers(pipe.transformer)
    calls = dict(CALLS["qwen-image-2.1"], num_inference_steps=2)
    call = lambda: pipe(prompt="a red cube", output_type="latent", generator=torch.Generator().manual_seed(0),  # noqa: E731
                        use_kv_cache=False, **calls).images  # fmt: skip
    size = dict(height=64, width=64, steps=2, seed=0, output_type="latent", kv_cache=False)
    sample = lambda **kw: fd.sample(params, pipe, "a red cube", **size, **kw)  # noqa: E731
    pairs = [
        (TaylorSeerCacheConfig(use_lite_mode=True, **TS_KW), fd.TaylorSeer(**TS_KW)),
        (TaylorSeerCacheConfig(**TS_KW), fd.TaylorSeer(**TS_KW, modules=fd_cache.ATTENTION)),
        _faster_pair(pipe),
    ]
    for stock, ours in pairs:
        del recorder[:], faster_recorder[:]
        expected, got, run = _stock_and_ours(pipe, params, stock, ours, call, sample)
        stock_steps = sorted({(n, d) for n, d in recorder}) if recorder else None
        assert run.decisions == ((True,), (False,)), (ours, run.decisions, stock_steps)
        if recorder:  # TaylorSeer: the stock hooks computed on step 0 only
            half = len(recorder) // 2
            assert {d for _, d in recorder[:half]} == {True} and {d for _, d in recorder[half:]} == {False}
        torch.testing.assert_close(got, expected, **FP32)
        if isinstance(ours, fd.TaylorSeer) and ours.modules is not None:  # the adapter's enable_cache, the same
            with _transformer(pipe, fd.DiffusersTransformer(params)):
                expected_adapter, _, _ = _stock_and_ours(pipe, params, stock, ours, call, lambda **kw: None)
            torch.testing.assert_close(expected_adapter, expected, **FP32)

    pipe = tiny.pipeline("flux2-klein-kv")
    params = fd.from_diffusers(pipe.transformer)
    kw = dict(prompt="a red cube", image=ref_image(), num_inference_steps=4, height=32, width=32, **MSL)
    call = lambda: stock_latents(pipe, 3, **kw)  # noqa: E731
    mine = dict(steps=4, seed=3, output_type="latent", image=kw["image"], height=32, width=32, **MSL)
    sample = lambda **more: fd.sample(params, pipe, "a red cube", **mine, **more)  # noqa: E731
    del faster_recorder[:]
    expected, got, run = _stock_and_ours(pipe, params, *_faster_pair(pipe), call, sample)
    assert run.decisions == faster_steps(faster_recorder, n_attention("flux2-klein")) and run.skipped() > 0
    torch.testing.assert_close(got, expected, **FP32)
    pipe.transformer = fd.DiffusersTransformer(params)  # the adapter's enable_cache in the KV pipeline, the same
    adapter, _, _ = _stock_and_ours(pipe, params, *_faster_pair(pipe), call, lambda **kw: None)
    torch.testing.assert_close(adapter, expected, **FP32)

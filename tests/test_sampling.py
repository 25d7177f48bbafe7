"""``functional_dit.sampling``: items at different steps, with different adapters, true CFG
and guidance, in one batch; each image equals ``fd.sample`` of that request alone.

The oracle is ``fd.sample`` (itself tested against the stock pipelines). The tiny FLUX.1
pipeline, 32x32 images, a 32-token text limit: a few seconds of model time in all.
Items with their own step caches (every method, with and without CFG and LoRA, and
none) in one batch: each image and its decisions equal ``fd.sample`` alone with that cache.
Also: ``step`` changes nothing it is given; ``merge`` refuses items of another size;
a bad request raises naming its field before any encoder runs. FLUX.3 (base and flow
map) the same way, with LoRA, CFG and caches.
"""

from __future__ import annotations

import dataclasses

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import sampling, tiny

ATTENTION_TAYLOR = "taylorseer:interval=2,warmup=1,order=1,attention=1"
LEVEL = 1 / 255  # the promise: within 1 uint8 level per pixel (measured ≤ 4e-4 levels: batch vs alone GEMMs)
MSL = 32


@pytest.fixture(scope="module")
def flux():
    pipe = tiny.pipeline("flux")
    params = fd.from_diffusers(pipe.transformer)
    a = lora.init(params.config, rank=4, alpha=8.0, seed=1, zero_b=False)
    b = lora.init(params.config, rank=2, seed=2, zero_b=False)
    return params, pipe, a, b


def alone(params, pipe, r: sampling.Request, run=None):
    images = {k: getattr(r, k) for k in ("image", "mask_image", "strength", "sigmas") if getattr(r, k) is not None}
    return fd.sample(
        params, pipe, r.prompt, height=r.height, width=r.width, steps=r.steps, seed=r.seed, guidance=r.guidance,
        true_cfg=r.true_cfg, negative_prompt=r.negative_prompt, lora=list(r.lora) or None, output_type="np",
        max_sequence_length=r.max_sequence_length, cache=run, **images, **(r.embeds or {}),
    )[0]  # fmt: skip


def run_ahead(params, pipe, reqs, ahead: int):
    """The first ``ahead`` requests one step ahead, merged with the rest and stepped until
    every item is done: (finished items in the order they finished, their images)."""
    ctx = sampling.context(params, pipe)
    state = sampling.step(params, sampling.init(params, ctx, reqs[:ahead]))
    state = sampling.merge(state, sampling.init(params, ctx, reqs[ahead:]))
    finished = []
    while state.items:
        done, state = sampling.split(sampling.step(params, state))
        finished += done.items
    return finished, sampling.decode(sampling.State(ctx, tuple(finished)), "np")


def equal_alone(params, pipe, finished, images) -> int:
    """Each image within `LEVEL` of ``fd.sample`` of its request alone, and each cached
    item's decisions equal to that run's; returns the branch-steps the caches skipped."""
    skipped = 0
    for it, img in zip(finished, images):
        run = None if it.request.cache is None else fd.CacheRun(it.request.cache)
        assert np.abs(img - alone(params, pipe, it.request, run)).max() <= LEVEL, it.request.prompt
        if run is not None:
            assert it.cache_state.log == run.decisions, it.request.prompt
            skipped += run.skipped()
    return skipped


def test_items_at_different_steps_with_different_adapters_equal_each_alone(flux):
    params, pipe, a, b = flux
    R = lambda *args, **kw: sampling.Request(*args, max_sequence_length=MSL, **kw)  # noqa: E731
    first = [R("a red cat", 32, 32, 3, seed=1, lora=((a, 0.7),))]
    later = [
        R("a blue dog", 32, 32, 2, seed=2, lora=((b, 1.0), (a, 0.3))),
        R("the sun", 32, 32, 3, seed=3, true_cfg=2.0, negative_prompt="dark", guidance=5.0),
    ]
    ctx = sampling.context(params, pipe)
    state = sampling.step(params, sampling.init(params, ctx, first))  # the first item is one step ahead
    state = sampling.merge(state, sampling.init(params, ctx, later))
    assert [it.i for it in state.items] == [1, 0, 0]
    finished = []
    while state.items:
        before = [(it.i, it.x.clone()) for it in state.items]
        new = sampling.step(params, state)
        assert all(it.i == i and torch.equal(it.x, x) for it, (i, x) in zip(state.items, before))  # pure
        done, state = sampling.split(new)
        finished += done.items
    assert [it.request.prompt for it in finished] == ["a red cat", "a blue dog", "the sun"]  # by steps left
    images = sampling.decode(sampling.State(ctx, tuple(finished)), "np")
    for it, img in zip(finished, images):
        ref = alone(params, pipe, it.request)
        assert np.abs(img - ref).max() <= LEVEL, it.request.prompt


def test_items_with_their_own_step_caches_equal_each_alone_with_that_cache(flux):
    """Per-item caches in one batch (FBC, MagCache with CFG and LoRA, TaylorSeer with
    LoRA, none; attention-level: TaylorSeer on the attention modules, FasterCache with CFG
    and LoRA), the first two items one step ahead: each image and each step's decisions
    equal ``fd.sample`` of that request alone with its cache (a `CacheRun` keeps them)."""
    params, pipe, a, _ = flux
    R = lambda *args, **kw: sampling.Request(*args, max_sequence_length=MSL, **kw)  # noqa: E731
    reqs = [
        R("a red cat", 32, 32, 5, seed=1, cache="fbcache:0.8"),  # 0.8: skips from step 2 on the tiny model
        R("a blue dog", 32, 32, 5, seed=2),
        R("the sun", 32, 32, 5, seed=3, cache="magcache:0.3", true_cfg=2.0, negative_prompt="dark", lora=((a, 0.5),)),
        R("a tree", 32, 32, 6, seed=4, cache="taylorseer:interval=2,warmup=1,order=1", lora=((a, 1.0),)),
        R("a boat", 32, 32, 5, seed=5, cache="taylorseer:interval=2,warmup=1,order=1,attention=1"),
        R(
            "a cloud",
            32,
            32,
            5,
            seed=6,
            cache="fastercache:skip=2",
            true_cfg=2.0,
            negative_prompt="x",
            lora=((a, 0.5),),
        ),
    ]
    skipped = equal_alone(params, pipe, *run_ahead(params, pipe, reqs, 2))
    assert skipped >= 5 * 2, "every cache must have skipped some steps, or the test shows nothing"


@pytest.mark.parametrize("kind", ["flux2", "flux2-klein", "qwen-image"])
def test_other_families_items_with_adapters_cfg_and_a_cache_equal_each_alone(kind):
    """FLUX.2-dev, klein and Qwen-Image: an item a step ahead with a LoRA, one with true CFG,
    one with a First-Block Cache, in one batch; each image and its decisions equal
    ``fd.sample`` alone."""
    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    a = lora.init(params.config, rank=2, seed=1, zero_b=False)
    R = lambda *args, **kw: sampling.Request(*args, max_sequence_length=MSL, **kw)  # noqa: E731
    reqs = [
        R("a red cat", 32, 32, 3, seed=1, lora=((a, 0.7),)),
        R("a blue dog", 32, 32, 4, seed=2, true_cfg=3.0, negative_prompt="dark"),
        R("the sun", 32, 32, 4, seed=3, cache="fbcache:0.8"),
    ]
    equal_alone(params, pipe, *run_ahead(params, pipe, reqs, 1))


@pytest.mark.parametrize("kind", ["flux3", "flux3-distilled"])
def test_flux3_items_with_adapters_cfg_and_caches_equal_each_alone(kind):
    """FLUX.3, the base model and the flow map (whose prediction takes the item's own next
    timestep as its target): items at different steps, with a LoRA, true CFG and their own
    step caches in one batch; each image and its decisions equal ``fd.sample`` alone."""
    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    a = lora.init(params.config, rank=2, seed=1, zero_b=False)
    R = sampling.Request
    reqs = [
        R("a red cat", 32, 32, 4, seed=1, lora=((a, 0.7),), cache="taylorseer:interval=2,warmup=1,order=1"),
        R("a blue dog", 32, 32, 5, seed=2, true_cfg=3.0, negative_prompt="dark", cache="magcache:0.3"),
        R("the sun", 32, 32, 5, seed=3, cache="fbcache:1.5"),
        R("a boat", 32, 32, 3, seed=4, lora=((a, 1.0),)),
    ]
    finished, images = run_ahead(params, pipe, reqs, 2)  # two items one step ahead
    assert sorted(it.request.prompt for it in finished) == sorted(r.prompt for r in reqs)
    skipped = equal_alone(params, pipe, finished, images)
    assert skipped >= 3 * 2, "every cache must have skipped some steps, or the test shows nothing"


def test_qwen_image_21_items_with_their_own_kv_caches_equal_each_alone():
    """Qwen-Image 2.1: each item keeps its CFG branches' prefix KV caches (extracted on its
    first step) in its own tables; the items without a step cache share one padded call
    per CFG branch (tests/test_sampling_mixed.py), those with one take their own calls.
    Items a step apart, with a LoRA, true CFG and step caches (with CFG one state per
    branch call; the first step extracts the prefix cache over the longer sequence): each
    within fp32 1e-5 of ``fd.sample`` alone (a shared call's GEMMs, or the cache's path)
    and deciding as it does; ``step`` leaves the items it is given as they were."""
    pipe = tiny.pipeline("qwen-image-2.1")
    params = fd.from_diffusers(pipe.transformer)
    a = lora.init(params.config, rank=2, seed=1, zero_b=False)
    R = sampling.Request
    reqs = [
        R("a red cat", 32, 32, 3, seed=1, lora=((a, 0.7),)),
        R("a red dog", 32, 32, 4, seed=2, true_cfg=3.0, negative_prompt="dark"),
        R("a red sun", 32, 32, 4, seed=3),
        R("a red car", 32, 32, 4, seed=4, cache="fbcache:1.5"),  # 1.5: skips from step 2 on the tiny model
        R("a red hat", 32, 32, 5, seed=5, true_cfg=3.0, negative_prompt="dark", cache="magcache:0.3"),
        R("a red box", 32, 32, 4, seed=6, cache="taylorseer:interval=2,warmup=1,order=1"),
        R("a red cup", 32, 32, 4, seed=7, true_cfg=3.0, negative_prompt="dark", cache="fbcache:1.5"),
        R("a red pen", 32, 32, 4, seed=8, true_cfg=3.0, negative_prompt="dark", cache=ATTENTION_TAYLOR),
    ]
    ctx = sampling.context(params, pipe)
    state = sampling.step(params, sampling.init(params, ctx, reqs[:1]))
    state = sampling.merge(state, sampling.init(params, ctx, reqs[1:]))
    assert [len(it.tables["caches"]) for it in state.items] == [1] + [0] * 7  # the first extracted its cache
    finished = []
    while state.items:
        before = [(it.i, it.x.clone(), dict(it.tables["caches"])) for it in state.items]
        new = sampling.step(params, state)
        for it, (i, x, kv) in zip(state.items, before):  # pure
            assert it.i == i and torch.equal(it.x, x) and it.tables["caches"] == kv
        done, state = sampling.split(new)
        finished += done.items
    caches = {it.request.prompt: len(it.tables["caches"]) for it in finished}
    assert caches == {"a red cat": 1, "a red dog": 2, "a red sun": 1, "a red car": 1, "a red hat": 2, "a red box": 1,
                      "a red cup": 2, "a red pen": 2}  # one per CFG branch  # fmt: skip
    assert _q21_latents_equal_alone(params, pipe, finished) >= 5 * 2, "every cache must skip, or the test shows nothing"


def _q21_latents_equal_alone(params, pipe, finished) -> int:
    """Each finished Qwen-Image 2.1 item's latents within fp32 1e-5 of ``fd.sample`` of it
    alone (with its cache: its decisions too); the steps the caches skipped."""
    skipped = 0
    for it in finished:
        r = it.request
        run = None if r.cache is None else fd.CacheRun(r.cache)
        kw = dict(true_cfg=r.true_cfg, negative_prompt=r.negative_prompt, lora=list(r.lora) or None, seed=r.seed)
        kw |= dict(height=32, width=32, steps=r.steps, output_type="latent", cache=run)
        want = fd.sample(params, pipe, r.prompt, **kw)
        torch.testing.assert_close(it.x, want, rtol=1e-5, atol=1e-5, msg=r.prompt)
        if run is not None:
            assert sampling.cache_decisions(it.cache_state) == run.decisions, r.prompt
            skipped += run.skipped()
    return skipped


def test_merge_refuses_another_size_and_bad_requests_name_the_field(flux):
    params, pipe, a, _ = flux
    ctx = sampling.context(params, pipe)
    s32 = sampling.init(params, ctx, [sampling.Request("x", 32, 32, 1, max_sequence_length=MSL)])
    s48 = sampling.init(params, ctx, [sampling.Request("x", 48, 32, 1, max_sequence_length=MSL)])
    with pytest.raises(ValueError, match="one key"):
        sampling.merge(s32, s48)
    for bad, field in [
        (sampling.Request("x", 30, 32, 1), "height"),
        (sampling.Request("x", 32, 32, 0), "steps"),
        (sampling.Request("x", 32, 32, 1, max_sequence_length=4096), "max_sequence_length"),
        (sampling.Request("x", 32, 32, 1, lora=(("not an adapter", 1.0),)), "lora"),
        (sampling.Request("x", 32, 32, 1, cache="bogus:1"), "cache"),
        (sampling.Request("x", 32, 32, 1, cache="fbcache:-1"), "threshold"),
        (sampling.Request("x", 32, 32, 1, cache="taylorseer:interval=0"), "cache_interval"),
    ]:
        with pytest.raises(ValueError, match=field):
            sampling.check(ctx, params, bad)


def _picture(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def _mask(w: int, h: int) -> Image.Image:
    m = np.zeros((h, w), "uint8")
    m[h // 4 : h // 2, w // 4 : w // 2] = 255
    return Image.fromarray(m)


CFG_CACHE = dict(true_cfg=2.0, negative_prompt="blurry", cache="fbcache:0.2")
IMAGE_JOBS = {  # per family: image requests (img2img, inpainting with CFG and a cache, references) and text to image
    "flux": [dict(image=_picture(56, 72), strength=0.7), dict(image=_picture(56, 72), mask_image=_mask(56, 72),
             strength=0.8, **CFG_CACHE), {}],
    "qwen-image": [dict(image=_picture(48, 32), strength=0.7), dict(image=_picture(48, 32),
                   mask_image=_mask(48, 32), **CFG_CACHE), {}],
    "flux2-klein": [dict(image=_picture(80, 64)),
                    dict(image=[_picture(80, 64), _picture(64, 64, 1)], cache="fbcache:0.2"), {}],
}  # fmt: skip


@pytest.mark.parametrize("kind", IMAGE_JOBS)
def test_items_with_image_inputs_equal_each_alone(kind):
    """Requests with an image (img2img, inpainting, references), one a step ahead, in one
    state with a text-to-image item: each image job's item takes its own model calls
    (its steps are the job's), so it equals ``fd.sample`` of it alone bitwise, its cache
    decisions too; the text-to-image item within `LEVEL`."""
    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    reqs = [sampling.Request(f"a red cube {i}", 32, 48, 4, seed=5 + i, **kw) for i, kw in enumerate(IMAGE_JOBS[kind])]
    finished, images = run_ahead(params, pipe, reqs, 1)
    assert [it.request for it in finished] == reqs  # the first a step ahead; the same step count
    equal_alone(params, pipe, finished, images)
    for it, img in zip(finished, images):
        if it.request.prepared:
            assert it.own is not None and np.array_equal(img, alone(params, pipe, it.request)), it.request.prompt


def test_image_requests_are_checked_as_fd_sample_checks_them(flux):
    params, pipe, _, _ = flux
    ctx = sampling.context(params, pipe)
    bad = sampling.Request("a cat", 32, 32, 2, image=_picture(32, 32), strength=1.5)
    with pytest.raises(ValueError, match=r"strength: expected a number in \[0, 1\], got 1.5"):
        sampling.init(params, ctx, [bad])
    pipe = tiny.pipeline("flux2-klein")
    params = fd.from_diffusers(pipe.transformer)
    with pytest.raises(ValueError, match="mask_image: .*expected None"):
        sampling.init(
            params, sampling.context(params, pipe), [sampling.Request("a cat", 32, 32, 2, mask_image=_mask(32, 32))]
        )


def _own_pipeline(kind: str):
    if kind == "flux2-klein-inpaint":
        pipe = diffusers.Flux2KleinInpaintPipeline.from_pipe(tiny.pipeline("flux2-klein"))
        pipe.set_progress_bar_config(disable=True)
        return pipe
    return tiny.pipeline(kind)


OWN_PIPELINES = {  # an image job's pipeline of its own: every request through fd.sample's preparation
    "flux-kontext": [dict(image=_picture(56, 72)), dict(image=_picture(56, 72, 1), **CFG_CACHE)],
    "qwen-image-edit": [dict(image=_picture(48, 32)),
                        dict(image=_picture(48, 32, 1), true_cfg=2.0, negative_prompt="x")],
    "flux2-klein-inpaint": [dict(image=_picture(80, 64), mask_image=_mask(80, 64), strength=0.8),
                            dict(image=_picture(80, 64, 1), mask_image=_mask(80, 64), cache="fbcache:0.2")],
}  # fmt: skip
# Kontext sizes its output to max_area (1024² as stock) and the edit pipeline encodes its
# reference at 1024²: tens of seconds each, so slow (the full suite, not the quick subset).
HEAVY = ("flux-kontext", "qwen-image-edit")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in HEAVY else k for k in OWN_PIPELINES])
def test_items_of_an_image_pipeline_of_its_own_equal_each_alone(kind):
    """A context over Kontext, an edit pipeline or klein inpainting: each request a step
    apart, bitwise equal to ``fd.sample`` of it alone (and its cache decisions)."""
    pipe = _own_pipeline(kind)
    params = fd.from_diffusers(pipe.transformer if pipe.transformer is not None else tiny.pipeline(kind).transformer)
    reqs = [
        sampling.Request(f"a red cube {i}", 32, 48, 4, seed=5 + i, **kw) for i, kw in enumerate(OWN_PIPELINES[kind])
    ]
    finished, images = run_ahead(params, pipe, reqs, 1)
    assert [it.request for it in finished] == reqs
    equal_alone(params, pipe, finished, images)
    for it, img in zip(finished, images):
        assert np.array_equal(img, alone(params, pipe, it.request)), it.request.prompt
    with pytest.raises(ValueError, match="encoders: functional_dit.sampling runs text to image"):
        sampling.context(params, pipe, text_to_image=True)


@pytest.mark.parametrize("kind", ["flux", "qwen-image"])
def test_items_with_embeddings_or_sigmas_equal_each_alone(kind):
    """A request with the stock embedding keywords in place of a prompt (with true CFG),
    one with its own sigmas, and a plain one a step ahead: each as ``fd.sample`` alone."""
    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    if kind == "flux":
        pe, pooled, _ = pipe.encode_prompt(prompt=["a cat"], prompt_2=None, max_sequence_length=MSL)
        npe, npooled, _ = pipe.encode_prompt(prompt=["blurry"], prompt_2=None, max_sequence_length=MSL)
        embeds = dict(prompt_embeds=pe, pooled_prompt_embeds=pooled, negative_prompt_embeds=npe,
                      negative_pooled_prompt_embeds=npooled)  # fmt: skip
    else:
        pe, mask = pipe.encode_prompt(prompt=["a cat"])
        npe, nmask = pipe.encode_prompt(prompt=["blurry"])
        embeds = dict(prompt_embeds=pe, prompt_embeds_mask=mask, negative_prompt_embeds=npe,
                      negative_prompt_embeds_mask=nmask)  # fmt: skip
    msl = MSL if kind == "flux" else None
    reqs = [
        sampling.Request("a dog", 32, 32, 3, seed=1, max_sequence_length=msl),
        sampling.Request(None, 32, 32, 3, seed=2, true_cfg=2.0, embeds=embeds, max_sequence_length=msl),
        sampling.Request("a dog", 32, 32, 3, seed=3, sigmas=(1.0, 0.6, 0.25), max_sequence_length=msl),
    ]
    finished, images = run_ahead(params, pipe, reqs, 1)
    equal_alone(params, pipe, finished, images)
    for it, img in zip(finished[1:], images[1:]):
        assert it.own is not None and np.array_equal(img, alone(params, pipe, it.request))
    with pytest.raises(ValueError, match="embeds: expected a dict of embeddings with prompt None"):
        sampling.init(params, sampling.context(params, pipe), [dataclasses.replace(reqs[1], prompt="a cat")])
    with pytest.raises(ValueError, match=r"steps: expected None or len\(sigmas\) = 3, got 2"):
        sampling.init(params, sampling.context(params, pipe), [dataclasses.replace(reqs[2], steps=2)])


def test_items_with_a_controlnet_equal_each_alone():
    """A FLUX.1 ControlNet per request (one with true CFG) over a FluxPipeline, beside a
    plain request a step ahead (a FluxControlNetPipeline's context needs one in every request)."""
    from functional_dit import controlnet as C

    pipe = tiny.pipeline("flux")
    params, cn = fd.from_diffusers(pipe.transformer), C.from_diffusers(tiny.stock_controlnet())
    reqs = [
        sampling.Request("a dog", 32, 32, 3, seed=1, max_sequence_length=MSL),
        sampling.Request("a cat", 32, 32, 3, seed=2, controlnet=(cn, _picture(32, 32), 0.8), max_sequence_length=MSL),
        sampling.Request("a cow", 32, 32, 3, seed=3, controlnet=(cn, _picture(32, 32, 1), 0.5), true_cfg=2.0,
                         negative_prompt="x", max_sequence_length=MSL),
    ]  # fmt: skip
    finished, images = run_ahead(params, pipe, reqs, 1)
    for it, img in zip(finished, images):
        want = fd.sample(
            params, pipe, it.request.prompt, height=32, width=32, steps=3, seed=it.request.seed, output_type="np",
            true_cfg=it.request.true_cfg, negative_prompt=it.request.negative_prompt, max_sequence_length=MSL,
            controlnet=it.request.controlnet,
        )[0]  # fmt: skip
        assert np.array_equal(img, want) if it.request.controlnet else np.abs(img - want).max() <= LEVEL

"""Per-item LoRA: each batch item computes only its own adapters' low-rank updates.

The oracle is the same item run alone with its adapters merged (`lora.merge`):

- ``fd.apply(..., lora=[(a, s, rows), ...])`` on every family equals, row by row, the
  per-row sliced call with the row's adapters merged; rows covering the whole batch are the
  plain form (bitwise), an adapter on no row is none (bitwise); DoRA and a LoRA bias too;
- ``fd.sample(..., lora=...)`` with one list per prompt (different adapters, two on one
  prompt, none on another), with true CFG, ``num_images_per_prompt``, chunks, FLUX.2-klein's
  reference KV cache and a step cache: each image equals that prompt sampled alone with its
  adapters merged; one list for every prompt equals the merged params;
- on 2 gloo ranks (one spawn): tp=2, sp=2 and dp=2 (the batch split inside ``fd.apply``,
  with dp padding, and prompts split over dp groups) equal the single-process references;
- bad ``lora`` (a list per prompt of the wrong length, an adapter of other params, bad
  rows, a per-item adapter on Qwen-Image 2.1's shared timestep row) raises a ValueError
  naming ``lora`` before any encoder runs.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _dist import spawn

import functional_dit as fd
import functional_dit.lora as lora
import sharding
from functional_dit import tiny

FP32 = dict(rtol=1e-5, atol=1e-5)  # the fp32 bound of docs/numerics.md; measured ≤ 3e-6 (batch vs alone GEMMs)
CASES = ["cases_flux1", "cases_flux2", "cases_qwenimage", "cases_flux3", "cases_qwenimage21"]
# Qwen-Image 2.1 (causal) shares one t = 0 timestep row between the items: per-item
# adapters leave its timestep modules out (tested to raise below).
SHARED_ROW = ("timestep_embedder", "modulation", "norm_out")


def call(params, kw, **extra):
    kw = dict(kw)
    return fd.apply(params, kw.pop("x"), kw.pop("t"), kw.pop("txt"), **kw, **extra)


def row(kw: dict, r: int, B: int) -> dict:
    """The fd.apply inputs of batch row ``r`` alone."""
    out = {}
    for k, v in kw.items():
        batched = isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == B and k not in ("img_ids", "txt_ids")
        out[k] = v[r : r + 1] if batched or k == "img_shapes" else v
    return out


def adapters(config, qwen21: bool = False):
    every = tuple(m for m in lora.linear_modules(config) if not (qwen21 and any(s in m for s in SHARED_ROW)))
    a = lora.init(config, rank=4, targets=every, alpha=8.0, seed=1, zero_b=False)
    b = lora.init(config, rank=2, targets=every, seed=2, zero_b=False)
    return a, b


@pytest.mark.parametrize("case", CASES)
def test_apply_rows_equal_each_row_alone_merged(case):
    C = importlib.import_module(case)
    kw = C.inputs(C.TINY, batch=4)
    kw.pop("kv_cache", None)
    p = fd.init(C.TINY, seed=1)
    a, b = adapters(C.TINY, case.endswith("21"))
    per_item = [(a, 1.0, [0, 2]), (b, 0.5, [1, 2])]  # row 2: both; row 3: none
    merged = [lora.merge(p, a, 1.0), lora.merge(p, b, 0.5), lora.merge(lora.merge(p, a, 1.0), b, 0.5), p]
    with torch.no_grad():
        got = call(p, kw, lora=per_item)
        for r, m in enumerate(merged):
            torch.testing.assert_close(got[r : r + 1], call(m, row(kw, r, 4)), **FP32)
        assert torch.equal(call(p, kw, lora=[(a, 1.0, range(4))]), call(p, kw, lora=[(a, 1.0)]))
        assert torch.equal(call(p, kw, lora=[(a, 1.0, [])]), call(p, kw))


@pytest.mark.parametrize("variant", ["use_dora", "lora_bias"])
def test_apply_rows_dora_and_bias(variant):
    C = importlib.import_module("cases_flux1")
    kw = C.inputs(C.TINY, batch=3)
    p = fd.init(C.TINY, seed=1)
    every = tuple(lora.linear_modules(C.TINY))
    a = lora.init(p, rank=4, targets=every, seed=1, zero_b=False, **{variant: True})
    with torch.no_grad():
        got = call(p, kw, lora=[(a, 0.7, [1])])
        torch.testing.assert_close(got[1:2], call(lora.merge(p, a, 0.7), row(kw, 1, 3)), **FP32)
        torch.testing.assert_close(got[0:1], call(p, row(kw, 0, 3)), **FP32)


def test_apply_rows_factor_gradients_equal_the_rows_alone():
    """Training one adapter on rows 1, 2 of a batch (another adapter on row 0): its factors'
    gradients equal those of rows 1, 2 run alone with it on every row."""
    C = importlib.import_module("cases_flux1")
    kw = C.inputs(C.TINY, batch=3)
    p = fd.init(C.TINY, seed=1)
    a, b = adapters(C.TINY)

    def grads(kw, lora_of, rows):
        ad = lora.Adapter(a.config, torch.utils._pytree.tree_map(lambda v: v.clone().requires_grad_(), a.tree))
        (call(p, kw, lora=lora_of(ad))[rows].double() ** 2).mean().backward()
        return {k: v.grad for k, v in ad.flat().items()}

    got = grads(kw, lambda ad: [(ad, 0.7, [1, 2]), (b, 0.5, [0])], slice(1, 3))
    alone = {
        k: torch.cat([row(kw, r, 3)[k] for r in (1, 2)]) if k in ("x", "t", "txt", "pooled", "guidance") else v
        for k, v in kw.items()
    }
    want = grads(alone, lambda ad: [(ad, 0.7)], slice(0, 2))
    for k in want:
        torch.testing.assert_close(got[k], want[k], **FP32)


def test_apply_bad_rows_and_shared_rows():
    C = importlib.import_module("cases_flux1")
    kw = C.inputs(C.TINY, batch=2)
    p = fd.init(C.TINY, seed=1)
    a, _ = adapters(C.TINY)
    for rows in ([0, 2], [1, 1], [True], "01"):
        with pytest.raises(ValueError, match=r"lora\[0\]: rows must be distinct ints in \[0, 2\)"):
            call(p, kw, lora=[(a, 1.0, rows)])
    Q = importlib.import_module("cases_qwenimage21")
    qkw, q = Q.inputs(Q.TINY, batch=2), fd.init(Q.TINY, seed=1)
    qa, _ = adapters(Q.TINY)  # the timestep modules too
    with pytest.raises(ValueError, match="lora: a per-item adapter .* 3 rows, not the batch's 2 items"):
        call(q, qkw, lora=[(qa, 1.0, [0])])


# ----------------------------------------------------------------------------- fd.sample

PROMPTS = ["a red cube", "a green ball", "a dog"]
KW = dict(height=32, width=32, steps=2, output_type="latent")
CFG = dict(true_cfg=2.0, negative_prompt="blurry")


def _flux():
    pipe = tiny.pipeline("flux")
    p = fd.from_diffusers(pipe.transformer)
    a = lora.init(p, rank=4, seed=1, zero_b=False)
    b = lora.init(p, rank=2, targets=["attn.to_q", "ff.net.2", "proj_out"], seed=2, zero_b=False)
    return pipe, p, a, b


def _alone(pipe, p, pairs, prompt, seed, **kw):
    for ad, s in pairs:
        p = lora.merge(p, ad, s)
    return fd.sample(p, pipe, prompt, seed=seed, **KW, **kw)


def _references(pipe, p, per_prompt, seed, n=1, **kw):
    """Image i of the batch alone: its prompt's adapters merged, seeded seed + i."""
    return torch.cat(
        [_alone(pipe, p, per_prompt[i // n], PROMPTS[i // n], seed + i, **kw) for i in range(len(per_prompt) * n)]
    )


@pytest.mark.parametrize("kind", ["flux-cfg", "qwen-cfg", "klein-kv"])
def test_sample_per_prompt_equals_each_alone_merged(kind):
    if kind == "flux-cfg":
        pipe, p, a, b = _flux()
        kw = CFG
    else:
        pipe = tiny.pipeline("qwen-image" if kind == "qwen-cfg" else "flux2-klein-kv")
        p = fd.from_diffusers(pipe.transformer)
        a, b = lora.init(p, rank=4, seed=1, zero_b=False), lora.init(p, rank=2, seed=2, zero_b=False)
        kw = CFG if kind == "qwen-cfg" else dict(image=_image())
    per_prompt = [[(a, 1.0)], [(b, 0.5), (a, 0.3)], []][: 3 if kind == "flux-cfg" else 2]  # fewer calls elsewhere
    got = fd.sample(p, pipe, PROMPTS[: len(per_prompt)], seed=3, lora=per_prompt, **KW, **kw)
    torch.testing.assert_close(got, _references(pipe, p, per_prompt, 3, **kw), **FP32)


def _image():
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype("uint8"))


def test_sample_images_per_prompt_chunks_and_every_prompt():
    pipe, p, a, b = _flux()
    per_prompt = [[(b, 0.5)], []]
    got = fd.sample(p, pipe, PROMPTS[:2], seed=7, lora=per_prompt, num_images_per_prompt=2, batch_size=3, **KW)
    torch.testing.assert_close(got, _references(pipe, p, per_prompt, 7, n=2), **FP32)
    every = fd.sample(p, pipe, PROMPTS[:2], seed=1, lora=[(a, 0.8)], **KW, **CFG)
    torch.testing.assert_close(every, fd.sample(lora.merge(p, a, 0.8), pipe, PROMPTS[:2], seed=1, **KW, **CFG), **FP32)


def test_sample_per_prompt_through_a_step_cache():
    """FirstBlockCache(0.0) computes every step, so it equals the uncached run; the
    adapters reach the model through the cache's stages."""
    pipe, p, a, b = _flux()
    per_prompt = [[(a, 1.0)], [(b, 0.5)]]
    run = fd.CacheRun(fd.FirstBlockCache(0.0))
    got = fd.sample(p, pipe, PROMPTS[:2], seed=3, lora=per_prompt, cache=run, **KW, **CFG)
    assert all(all(d) for d in run.decisions)
    torch.testing.assert_close(got, _references(pipe, p, per_prompt, 3, **CFG), **FP32)


def test_sample_bad_lora_raises_before_encoding():
    pipe, p, a, _ = _flux()
    other = lora.init(fd.init(tiny.transformer_config("qwen-image"), seed=0), rank=2, seed=1)

    def refuse(*args, **kwargs):
        raise AssertionError("the text encoders ran before the lora check")

    pipe.encode_prompt = refuse
    bad = [
        ([[(a, 1.0)], []], r"lora: expected a list of \(adapter, scale\) pairs \(every prompt\) or 3 lists"),
        ([(other, 1.0)], r"lora\[0\]: the adapter was made for QwenImageConfig"),
        ([[(a, 1.0)], [(other, 1.0)], []], r"lora\[1\]\[0\]: the adapter was made for QwenImageConfig"),
        (a, "lora: expected a list of"),
    ]
    for value, match in bad:
        with pytest.raises(ValueError, match=match):
            fd.sample(p, pipe, PROMPTS, seed=0, lora=value, **KW)


# ----------------------------------------------------------------------------- 2 ranks


def _ranks(rank, world, kw_apply, per_row):
    pipe, p, a, b = _flux()
    pa, pb = per_row
    out = {}
    for axes in (dict(tp=2), dict(sp=2), dict(dp=2)):
        mesh = sharding.make_mesh(**axes, device_type="cpu")
        s, sa, sb = (sharding.shard_params(t, mesh) for t in (p, a, b))
        name = next(iter(axes))
        with torch.no_grad():
            out[f"{name} apply"] = call(s, kw_apply, lora=[(sa, 1.0, pa), (sb, 0.5, pb)])
        out[f"{name} sample"] = fd.sample(s, pipe, PROMPTS, seed=3, lora=[[(sa, 1.0)], [(sb, 0.5)], []], **KW, **CFG)
        if name == "dp":  # one prompt with CFG: [cond; uncond] split over dp inside fd.apply
            out["dp one"] = fd.sample(s, pipe, PROMPTS[1], seed=4, lora=[(sb, 0.5)], **KW, **CFG)
    return out


def test_tp2_sp2_dp2_equal_single_process():
    pipe, p, a, b = _flux()
    C = importlib.import_module("cases_flux1")
    kw = C.inputs(fd.from_diffusers(pipe.transformer).config, batch=3)
    per_row = ([0, 2], [2])  # on dp=2: rank 0 holds rows 0, 1 (a on 0 only), rank 1 row 2 and a padding row
    with torch.no_grad():
        want_apply = call(p, kw, lora=[(a, 1.0, per_row[0]), (b, 0.5, per_row[1])])
    want_sample = _references(pipe, p, [[(a, 1.0)], [(b, 0.5)], []], 3, **CFG)
    want_one = _alone(pipe, p, [(b, 0.5)], PROMPTS[1], 4, **CFG)
    results = spawn(_ranks, 2, kw, per_row, init=False, timeout=500)
    for r in results:
        for name in ("tp", "sp", "dp"):
            torch.testing.assert_close(r[f"{name} apply"], want_apply, **FP32)
            torch.testing.assert_close(r[f"{name} sample"], want_sample, **FP32)
        torch.testing.assert_close(r["dp one"], want_one, **FP32)
    assert torch.equal(results[0]["tp sample"], results[1]["tp sample"])

"""The sampler and step caches over fully sharded params (an "fsdp" mesh axis), against
one process.

On ``make_mesh(fsdp=2)`` every rank runs ``fd.sample``'s loop and ``fd.apply`` splits each
call's batch over fsdp (each rank computes its rows, block weights gathered per block);
the step caches run the family's stages with the same per-block gathers. One spawn of 2
gloo ranks on the tiny FLUX.1 pipeline (fp32) checks, against the same calls on one
process: three prompts without CFG with per-prompt LoRA (an odd batch: one padded row);
First-Block Cache with true CFG (one CFG half per rank, the halves deciding apart, so one
rank's items skip while the other's compute and it joins their gathers); First-Block
Cache on one image without CFG (rank 1 holds only the padding row: before, a TypeError
on its first step, on dp=2 too); TaylorSeer on the attention modules; per-item caches
with LoRA through ``functional_dit.sampling``; fp8 layerwise storage, gathered as bytes;
the text encoders fully sharded over the same ranks (``encoder_placement="fsdp"``); and
the feature pairs (`_pairs`): gradients through fp8-stored leaves with a LoRA, a ControlNet
inside ``fd.sample`` and FLUX.2-klein's reference KV cache inside ``fd.sample``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _dist import spawn

import functional_dit as fd
import functional_dit.lora as lora
import sharding
from functional_dit import sampling, tiny
from functional_dit.pipelines import cache as fd_cache

# fp32: the batch split changes each GEMM's row count, hence its blocking (measured ≤ 1.7e-6)
FP32 = dict(rtol=1e-5, atol=1e-5)
KW = dict(height=32, width=32, steps=5, output_type="latent", max_sequence_length=16)
CFG = dict(seed=5, true_cfg=2.0, negative_prompt="blurry", height=48, width=48, steps=6)  # the halves decide apart
NO_CFG = dict(true_cfg=None, negative_prompt=None)
THREE = ["a red cube", "a blue sphere", "a green cone on a table"]


def _caches() -> dict:
    # fp32 Taylor factors: bf16 ones round outputs that differ in fp32 rounding a bf16 step apart
    attention = fd.TaylorSeer(2, 2, taylor_factors_dtype=torch.float32, modules=fd_cache.ATTENTION)
    return {"fbc": fd.FirstBlockCache(0.9), "tsa": attention}  # 0.9: the halves decide differently here


def _requests(adapter) -> list:
    R = lambda *a, **kw: sampling.Request(*a, max_sequence_length=16, **kw)  # noqa: E731
    return [
        R("a red cat", 32, 32, 5, seed=1, cache="fbcache:0.8", lora=((adapter, 0.7),)),
        R("a boat", 32, 32, 5, seed=2, cache="taylorseer:interval=2,warmup=1,order=1,attention=1"),
        R("the sun", 32, 32, 5, seed=3, cache="magcache:0.3", true_cfg=2.0, negative_prompt="dark"),
    ]


def _fp8(params):
    return fd.layerwise_cast(params, torch.float8_e4m3fn)  # every leaf stored fp8, read as fp32


def _run(params, pipe, adapter, fp8=None) -> dict:
    """``fp8``: ``params`` layerwise cast (then sharded, on the ranks)."""
    per_prompt = [[(adapter, 1.0)], [], [(adapter, 0.5)]]  # rows 0 and 2: on the two ranks of the split
    out = {"three": fd.sample(params, pipe, THREE, seed=30, lora=per_prompt, **KW)}
    for name, cache in _caches().items():
        run = fd.CacheRun(cache)
        out[name] = (fd.sample(params, pipe, "a red cube", cache=run, **(KW | CFG)), run.decisions)
    # one image without CFG: rank 1 holds only the padding row of the batch split
    run = fd.CacheRun(fd.FirstBlockCache(0.9))
    out["fbc1"] = (fd.sample(params, pipe, "a red cube", cache=run, **(KW | CFG | NO_CFG)), run.decisions)
    items = sampling.sample(params, sampling.context(params, pipe), _requests(adapter), "pt")
    out["items"] = items
    out["plain"] = fd.sample(params, pipe, "a red cube", seed=3, **KW)
    out["fp8"] = fd.sample(fp8, pipe, "a red cube", seed=3, **KW)  # last: the gathers it sends are checked
    return out


def _setup():
    pipe = tiny.pipeline("flux")
    params = fd.from_diffusers(pipe.transformer)
    adapter = lora.init(params.config, rank=2, seed=1, zero_b=False)
    return pipe, params, adapter


def _rank(rank, world):
    pipe, params, adapter = _setup()
    mesh = sharding.make_mesh(fsdp=2, device_type="cpu")
    sharded = sharding.shard_params(params, mesh)
    sent, start = [], sharding._fsdp._start_block  # what each block's all-gathers send: dtype, elements

    def spy(xs, dims):
        pending = start(xs, dims)
        sent.extend((h.dtype, h.numel()) for _, h in pending)
        return pending

    sharding._fsdp._start_block = spy
    try:
        out = _run(sharded, pipe, sharding.shard_params(adapter, mesh), sharding.shard_params(_fp8(params), mesh))
    finally:
        sharding._fsdp._start_block = start
    out["sent"] = sent
    # the pair: the text encoders fully sharded over the same fsdp ranks (gathered per layer)
    out["encoders"] = fd.sample(sharded, pipe, "a red cube", seed=3, encoder_placement="fsdp", **KW)
    out["pairs"] = _pairs(lambda tree: sharding.shard_params(tree, mesh))
    # fp8 compute (fd.quantize) is refused on fsdp by name: its scales are not gathered yet
    import cases_flux1 as F1

    quant = sharding.shard_params(fd.quantize(fd.init(F1.TINY, seed=7), "fp8-row"), mesh)
    try:
        fd.apply(quant, **F1.inputs(F1.TINY, batch=2, txt_len=5, h=3, w=3, seed=1))
        out["quantize error"] = "no error"
    except ValueError as e:
        out["quantize error"] = str(e)
    return out


@pytest.mark.slow
def test_sample_and_step_caches_on_fsdp2_equal_one_process():
    """Every rank's images and every step's cache decisions equal one process's (fp32
    1e-5: the batch split changes GEMM row counts); the ranks agree bitwise. In the same
    spawn, the feature pairs (`_pairs`): ``.grad`` of the LoRA factors and of every
    fp8-stored base leaf (1e-5 of each gradient's largest entry), and ``fd.sample`` with a
    ControlNet and with klein's reference KV cache (fp32 1e-5)."""
    pipe, params, adapter = _setup()
    want = _run(params, pipe, adapter, _fp8(params))
    want_pairs = _pairs(lambda tree: tree)
    assert any(c != u for c, u in want["fbc"][1]), "the CFG halves must decide apart, or no rank waits alone"
    results = spawn(_rank, 2, timeout=300)
    for r in results:
        torch.testing.assert_close(r["three"], want["three"], **FP32)
        for name in (*_caches(), "fbc1"):
            assert r[name][1] == want[name][1], name
            torch.testing.assert_close(r[name][0], want[name][0], **FP32)
        torch.testing.assert_close(r["items"], want["items"], **FP32)
        torch.testing.assert_close(r["fp8"], want["fp8"], **FP32)
        torch.testing.assert_close(r["encoders"], want["plain"], **FP32)
        # fp8 storage travels as its bytes: the last run's blocks sent uint8 buffers only,
        # the others fp32, and a block's uint8 buffer holds as many bytes (one per element)
        # as the same block's fp32 buffer (without LoRA) held elements
        dtypes, last = [d for d, _ in r["sent"]], [d for d, _ in r["sent"]].index(torch.uint8)
        assert set(dtypes[:last]) == {torch.float32} and set(dtypes[last:]) == {torch.uint8}, dtypes
        sizes = {d: {n for e, n in r["sent"] if e == d} for d in (torch.float32, torch.uint8)}
        assert sizes[torch.uint8] <= sizes[torch.float32], sizes
        _check_pairs(r["pairs"], want_pairs)
        assert "fd.quantize'd (fp8 compute) params do not run on an fsdp axis" in r["quantize error"], r
    assert any(not c for d in want["fbc1"][1] for c in d), "fbc1 must skip some steps"
    for key in ("three", "fbc", "tsa", "fbc1", "items", "fp8", "encoders"):
        a, b = (r[key][0] if isinstance(r[key], tuple) else r[key] for r in results)
        assert torch.equal(a, b), f"{key}: the ranks differ"
    for key in ("controlnet", "klein_kv"):
        assert torch.equal(results[0]["pairs"][key], results[1]["pairs"][key]), f"{key}: the ranks differ"


# ----------------------------------------------------------------------------- feature pairs (one spawn)

REL = 1e-5  # of each gradient's largest entry: fp32 sums in another order (the batch split, the reduce-scatter)


def _picture(seed: int, w: int = 32, h: int = 32):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def _stored_grads(place) -> dict:
    """``.grad`` (whole) of a loss through fd.apply over fp8-stored params (every leaf stored
    fp8, read as fp32; trainable) with a LoRA on the fly: the factors' and the stored leaves'."""
    import cases_flux1 as F1

    kw = F1.inputs(F1.TINY, batch=3, txt_len=5, h=3, w=3, seed=1)
    params = place(_fp8(fd.init(F1.TINY, seed=7)))
    ad = place(lora.init(F1.TINY, rank=2, alpha=4.0, seed=1, zero_b=False))
    leaves = {**{f"base:{k}": v for k, v in params.flat().items()}, **{f"lora:{k}": v for k, v in ad.flat().items()}}
    for v in leaves.values():
        v.requires_grad_()
    w = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(11))
    (fd.apply(params, **kw, lora=[(ad, 0.8)]) * w).sum().backward()
    whole = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g  # noqa: E731
    return {k: None if v.grad is None else whole(v.grad) for k, v in leaves.items()}


def _pairs(place) -> dict:
    """The feature pairs on ``place``d params (``place``: identity on one process,
    `sharding.shard_params` onto the fsdp mesh on the ranks): gradients through fp8-stored
    leaves, a ControlNet inside ``fd.sample`` (true CFG, two prompts: each rank computes
    its rows of the ControlNet's and the transformer's batch) and FLUX.2-klein's reference
    KV cache (extracted on the first step, reused after)."""
    from functional_dit import controlnet as C

    out = {"grads": _stored_grads(place)}
    pipe = tiny.pipeline("flux-controlnet")
    params, cn = place(fd.from_diffusers(pipe.transformer)), place(C.from_diffusers(pipe.controlnet))
    cfg = dict(true_cfg=2.0, negative_prompt=["blurry"] * 2, guidance=5.0, max_sequence_length=16)
    out["controlnet"] = fd.sample(
        params,
        pipe,
        ["a red cube", "a blue ball"],
        seed=3,
        controlnet=(cn, _picture(0), 0.8),
        **(KW | cfg | {"steps": 3}),
    )
    pipe = tiny.pipeline("flux2-klein-kv")
    params = place(fd.from_diffusers(pipe.transformer))
    ref = _picture(1, 80, 64)  # FLUX.2's image processor refuses references under 64 px a side
    kv = dict(height=32, width=32, steps=3, output_type="latent", image=ref, seed=4)
    out["klein_kv"] = fd.sample(params, pipe, ["a red cube", "a cat", "a boat"], **kv)
    return out


def _check_pairs(got: dict, want: dict) -> None:
    """One rank's `_pairs` against one process's."""
    assert got["grads"].keys() == want["grads"].keys()
    missing = [k for k, v in got["grads"].items() if (v is None) != (want["grads"][k] is None)]
    assert not missing, missing[:5]
    errs = {
        k: ((got["grads"][k] - v).abs().max() / v.abs().max().clamp_min(1e-30)).item()
        for k, v in want["grads"].items()
        if v is not None
    }
    worst = max(errs, key=errs.get)
    print(f"fp8-stored leaves and LoRA factors on fsdp=2: worst grad error {errs[worst]:.2e} ({worst})")
    assert errs[worst] < REL, (worst, errs[worst])
    for key in ("controlnet", "klein_kv"):
        torch.testing.assert_close(got[key], want[key], **FP32)

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
the text encoders fully sharded over the same ranks (``encoder_placement="fsdp"``).
"""

from __future__ import annotations

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
    return out


@pytest.mark.slow
def test_sample_and_step_caches_on_fsdp2_equal_one_process():
    """Every rank's images and every step's cache decisions equal one process's (fp32
    1e-5: the batch split changes GEMM row counts); the ranks agree bitwise."""
    pipe, params, adapter = _setup()
    want = _run(params, pipe, adapter, _fp8(params))
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
    assert any(not c for d in want["fbc1"][1] for c in d), "fbc1 must skip some steps"
    for key in ("three", "fbc", "tsa", "fbc1", "items", "fp8", "encoders"):
        a, b = (r[key][0] if isinstance(r[key], tuple) else r[key] for r in results)
        assert torch.equal(a, b), f"{key}: the ranks differ"

"""`fd.DiffusersTransformer` over tensor-parallel params on 2 gloo ranks.

Every rank runs the same stock pipeline call (same prompt, same seed) with the adapter
over `sharding.shard_params(params, make_mesh(tp=2))`; each must give the unsharded
adapter's latents. `DiffusersTransformer.from_pretrained(..., mesh=)` streams each
rank's slices of a stock-saved folder and must give the unsharded outputs too. A step cache
with an on-the-fly LoRA (``set_lora`` + ``enable_cache``) on the sharded adapter gives the
unsharded adapter's latents with the same LoRA and cache.
"""

from __future__ import annotations

import torch
from _dist import spawn
from diffusers.hooks import TaylorSeerCacheConfig
from test_adapter import PROMPT, SEED, SHORT, _flux_inputs, adapter, max_err, run

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import tiny

# Sharded vs unsharded: the row-parallel all-reduce sums partial products in another
# order, so fp32 rounding differs; the fp32 tolerance used for the unsharded comparison.
FP32 = 1e-5
KINDS = {  # the pipelines run sharded, with their call arguments
    "flux": dict(prompt=PROMPT, **SHORT),
    "flux2-klein": dict(prompt=PROMPT, guidance_scale=2.0, **SHORT),
    "qwen-image": dict(prompt=["a cat", PROMPT], negative_prompt=["blurry", "dark"], true_cfg_scale=2.0),
}


def _sharded_work(rank, world, folder, lora_file):
    import sharding

    mesh = sharding.make_mesh(tp=world)
    out = {}
    for kind, kwargs in KINDS.items():
        params = sharding.shard_params(fd.init(tiny.transformer_config(kind), seed=SEED), mesh)
        ad = fd.DiffusersTransformer(params)
        assert ad.params["transformer_blocks"]["0"]["attn"]["to_q"]["weight"].to_local().shape[0] * world == (
            ad.config.num_attention_heads * ad.config.attention_head_dim
        )
        out[kind] = run(tiny.pipeline(kind, seed=SEED, transformer=ad), **kwargs)
    params = sharding.shard_params(fd.init(tiny.transformer_config("flux"), seed=SEED), mesh)
    out["lora+cache"] = _lora_cache_run(params, lambda p: lora.load(lora_file, p))
    loaded = fd.DiffusersTransformer.from_pretrained(folder, mesh=mesh)
    out["from_pretrained"] = loaded(**_flux_inputs("qwen-image", torch.Generator().manual_seed(1)))[0]
    return out


def _lora_adapter(params):
    return lora.init(params, rank=4, targets=lora.linear_modules(params.config), alpha=8.0, seed=1, zero_b=False)


def _lora_cache_run(params, adapter_of, cache: bool = True) -> torch.Tensor:
    """The tiny FluxPipeline (true CFG, 3 steps) with the adapter over ``params``, a LoRA on
    the fly (``adapter_of(params)``) and, with ``cache``, TaylorSeer extrapolating step 2."""
    ad = fd.DiffusersTransformer(params)
    ad.set_lora([(adapter_of(params), 1.0)])
    if cache:
        ad.enable_cache(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, use_lite_mode=True))
    pipe = tiny.pipeline("flux", seed=SEED, transformer=ad)
    return run(pipe, num_inference_steps=3, negative_prompt="blurry", true_cfg_scale=2.0, **KINDS["flux"])


def test_tp2_pipelines_equal_unsharded(tmp_path):
    tiny.stock_transformer("qwen-image", seed=SEED).save_pretrained(tmp_path / "qwen")
    lora_file = tmp_path / "lora.safetensors"
    lora.save(_lora_adapter(fd.init(tiny.transformer_config("flux"), seed=SEED)), lora_file)
    ranks = spawn(_sharded_work, 2, str(tmp_path / "qwen"), str(lora_file), timeout=600)
    for kind, kwargs in KINDS.items():
        want = run(tiny.pipeline(kind, seed=SEED, transformer=adapter(kind)), **kwargs)
        for r, got in enumerate(ranks):
            assert max_err(got[kind], want) <= FP32, (kind, r)
    params = fd.init(tiny.transformer_config("flux"), seed=SEED)
    want = _lora_cache_run(params, _lora_adapter)
    cfg = dict(num_inference_steps=3, negative_prompt="blurry", true_cfg_scale=2.0, **KINDS["flux"])
    plain = run(tiny.pipeline("flux", seed=SEED, transformer=adapter("flux")), **cfg)
    assert max_err(want, plain) > 1e-3  # the LoRA changed the latents
    assert max_err(want, _lora_cache_run(params, _lora_adapter, cache=False)) > 1e-3  # and the cache did
    for got in ranks:
        assert max_err(got["lora+cache"], want) <= FP32
    want = adapter("qwen-image")(**_flux_inputs("qwen-image", torch.Generator().manual_seed(1)))[0]
    for got in ranks:
        assert max_err(got["from_pretrained"], want) <= FP32
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])  # the same result on every rank

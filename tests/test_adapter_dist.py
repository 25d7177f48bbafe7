"""`fd.DiffusersTransformer` over tensor-parallel params on 2 gloo ranks.

Every rank runs the same stock pipeline call (same prompt, same seed) with the adapter
over `sharding.shard_params(params, make_mesh(tp=2))`; each must give the unsharded
adapter's latents. `DiffusersTransformer.from_pretrained(..., mesh=)` streams each
rank's slices of a stock-saved folder and must give the unsharded outputs too.
"""

from __future__ import annotations

import torch
from _dist import spawn
from test_adapter import PROMPT, SEED, SHORT, _flux_inputs, adapter, max_err, run

import functional_dit as fd
from functional_dit import tiny

# Sharded vs unsharded: the row-parallel all-reduce sums partial products in another
# order, so fp32 rounding differs; the fp32 tolerance used for the unsharded comparison.
FP32 = 1e-5
KINDS = {  # the pipelines run sharded, with their call arguments
    "flux": dict(prompt=PROMPT, **SHORT),
    "flux2-klein": dict(prompt=PROMPT, guidance_scale=2.0, **SHORT),
    "qwen-image": dict(prompt=["a cat", PROMPT], negative_prompt=["blurry", "dark"], true_cfg_scale=2.0),
}


def _sharded_work(rank, world, folder):
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
    loaded = fd.DiffusersTransformer.from_pretrained(folder, mesh=mesh)
    out["from_pretrained"] = loaded(**_flux_inputs("qwen-image", torch.Generator().manual_seed(1)))[0]
    return out


def test_tp2_pipelines_equal_unsharded(tmp_path):
    tiny.stock_transformer("qwen-image", seed=SEED).save_pretrained(tmp_path / "qwen")
    ranks = spawn(_sharded_work, 2, str(tmp_path / "qwen"), timeout=600)
    for kind, kwargs in KINDS.items():
        want = run(tiny.pipeline(kind, seed=SEED, transformer=adapter(kind)), **kwargs)
        for r, got in enumerate(ranks):
            assert max_err(got[kind], want) <= FP32, (kind, r)
    want = adapter("qwen-image")(**_flux_inputs("qwen-image", torch.Generator().manual_seed(1)))[0]
    for got in ranks:
        assert max_err(got["from_pretrained"], want) <= FP32
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])  # the same result on every rank

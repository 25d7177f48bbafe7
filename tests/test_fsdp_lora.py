"""LoRA on the fly over fully sharded params (an "fsdp" mesh axis), on CPU gloo ranks.

The adapters are placed by `sharding.shard_params(adapter, mesh)` like the params (each
factor fully sharded on one dim after tp's split), attached as this rank's shards and
all-gathered with their block's weights; their gradients are reduce-scattered back to
each rank's shard. Checked the way users read them, against one process: ``fd.apply``
with two adapters (one on every linear layer, so non-block layers too; per-item rows on
the other) equals the unsharded forward (fp32 1e-5), and ``factor.grad.full_tensor()``
of a loss over the LoRA factors only (base frozen) equals unsharded autograd (1e-5 of
each gradient's largest entry), with the factors' placements. fsdp=2 (2 ranks) and
fsdp=2 x tp=2 (4 ranks, slow). What stays refused (DoRA, ``lora.merge``) raises.
"""

from __future__ import annotations

import pytest
import torch
from _dist import spawn

import functional_dit as fd
import functional_dit.lora as lora
import sharding

SEED = 7
FP32 = dict(rtol=1e-5, atol=1e-5)  # sharded vs unsharded forward: fp32 sums in another order
REL = 1e-5  # of each gradient's largest entry: fp32 sums in another order
MESH = {2: dict(fsdp=2), 4: dict(fsdp=2, tp=2)}


def _case():
    import cases_flux1 as F1

    return F1.TINY, F1.inputs(F1.TINY, batch=3, txt_len=5, h=3, w=3, seed=1)


def _adapters(config):
    every = tuple(lora.linear_modules(config))
    a = lora.init(config, rank=4, targets=every, alpha=8.0, seed=1, zero_b=False, lora_bias=True)
    b = lora.init(config, rank=2, alpha=1.0, seed=2, zero_b=False)
    return a, b


def _weights(kw) -> torch.Tensor:
    B, S, C = kw["x"].shape
    return torch.randn(B, S, C, generator=torch.Generator().manual_seed(11))


def _lora(a, b):
    return [(a, 0.8), (b, 0.5, [0, 2])]  # a on every row, b on rows 0 and 2 (per-item)


def _grads(params, a, b, kw, w) -> dict:
    """``{"A:" / "B:" + factor path: grad}`` (``full_tensor()`` for DTensors) of the loss
    over the factors only, and whether each grad is placed like its factor."""
    for leaf in (*a.leaves(), *b.leaves()):
        leaf.grad = None
        leaf.requires_grad_()
    (fd.apply(params, **kw, lora=_lora(a, b)) * w).sum().backward()
    out, misplaced = {}, []
    for tag, ad in (("a", a), ("b", b)):
        for k, v in ad.flat().items():
            if hasattr(v, "placements") and tuple(v.grad.placements) != tuple(v.placements):
                misplaced.append(f"{tag}:{k}")
            out[f"{tag}:{k}"] = v.grad.full_tensor() if hasattr(v.grad, "full_tensor") else v.grad
    return {"grads": out, "misplaced": misplaced}


def _rank(rank, world):
    config, kw = _case()
    mesh = sharding.make_mesh(**MESH[world])
    params = sharding.shard_params(fd.init(config, seed=SEED), mesh)
    a, b = (sharding.shard_params(ad, mesh) for ad in _adapters(config))
    fsdp = mesh.mesh_dim_names.index("fsdp")
    out = {
        "not_fully": [
            k for ad in (a, b) for k, v in ad.flat().items() if v.ndim == 2 and not v.placements[fsdp].is_shard()
        ]
    }
    with torch.no_grad():
        out["fwd"] = fd.apply(params, **kw, lora=_lora(a, b))
        with sharding.fsdp_options(prefetch=False):
            out["fwd_plain"] = fd.apply(params, **kw, lora=_lora(a, b))
    out.update(_grads(params, a, b, kw, _weights(kw)))
    dora = lora.init(fd.init(config, seed=SEED), rank=2, use_dora=True)
    try:
        fd.apply(params, **kw, lora=[(sharding.shard_params(dora, mesh), 1.0)])
        out["dora_error"] = None
    except ValueError as e:
        out["dora_error"] = str(e)
    return out


def _check(results):
    config, kw = _case()
    p = fd.init(config, seed=SEED)
    a, b = _adapters(config)
    with torch.no_grad():
        ref = fd.apply(p, **kw, lora=_lora(a, b))
    want = _grads(p, a, b, kw, _weights(kw))["grads"]
    for r in results:
        torch.testing.assert_close(r["fwd"], ref, **FP32)
        assert torch.equal(r["fwd"], r["fwd_plain"]), "prefetch changed the output"
        assert torch.equal(r["fwd"], results[0]["fwd"]), "ranks differ"
        assert r["misplaced"] == [], r["misplaced"][:5]
        assert r["not_fully"] == [], f"factors not sharded over fsdp: {r['not_fully'][:5]}"
        assert r["grads"].keys() == want.keys()
        errs = {k: ((r["grads"][k] - v).abs().max() / v.abs().max().clamp_min(1e-30)).item() for k, v in want.items()}
        worst = max(errs, key=errs.get)
        print(f"LoRA factor grads: worst {errs[worst]:.2e} of the largest entry ({worst})")
        assert errs[worst] < REL, (worst, errs[worst])
        assert "DoRA" in r["dora_error"] and "fsdp" in r["dora_error"]


@pytest.mark.slow
def test_lora_on_the_fly_fsdp2():
    _check(spawn(_rank, 2, init=False, timeout=600))


@pytest.mark.slow
def test_lora_on_the_fly_fsdp2_tp2():
    _check(spawn(_rank, 4, init=False, timeout=900))

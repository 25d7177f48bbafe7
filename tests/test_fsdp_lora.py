"""LoRA on the fly over fully sharded params (an "fsdp" mesh axis), on CPU gloo ranks.

The adapters are placed by `sharding.shard_params(adapter, mesh)` like the params (each
factor fully sharded on one dim after tp's split), attached as this rank's shards and
all-gathered with their block's weights; their gradients are reduce-scattered back to
each rank's shard. Checked the way users read them, against one process: ``fd.apply``
with two adapters (one on every linear layer, so non-block layers too; per-item rows on
the other) equals the unsharded forward (fp32 1e-5), and ``factor.grad.full_tensor()``
of a loss over the LoRA factors only (base frozen) equals unsharded autograd (1e-5 of
each gradient's largest entry), with the factors' placements. DoRA on the fly (every
linear layer, magnitudes moved off their initial norms) likewise, forward and the
gradients of its magnitudes and factors. ``lora.merge`` onto the fully sharded params
(plain LoRA with a bias, and DoRA) gives params placed like them whose ``full_tensor()``
equals merging unsharded. Per-item adapters whose rows all sit on one rank's share (the
other used to skip them and hang in the next block's all-gather). fsdp=2 (2 ranks) and
fsdp=2 x tp=2 (4 ranks, slow).
"""

from __future__ import annotations

import pytest
import torch
from _dist import spawn

import functional_dit as fd
import functional_dit.lora as lora
import sharding
from sharding.tree import nest

SEED = 7
FP32 = dict(rtol=1e-5, atol=1e-5)  # sharded vs unsharded forward: fp32 sums in another order
REL = 1e-5  # of each gradient's largest entry: fp32 sums in another order
# DoRA's gradients, of each one's largest entry: the most sensitive leaf (a txt-stream MLP's A,
# whose entries cancel over the tokens) is itself 4.7e-6 from a float64 reference in one fp32
# process, so two fp32 runs summing in other orders differ by up to about twice that.
REL_DORA = 2e-5
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


def _dora(config):
    """DoRA on every linear layer, its magnitudes moved off ``||W + s B A||`` (so ``g != 1``)."""
    every = tuple(lora.linear_modules(config))
    d = lora.init(fd.init(config, seed=SEED), rank=2, targets=every, alpha=3.0, seed=3, zero_b=False, use_dora=True)
    gen = torch.Generator().manual_seed(5)
    flat = {
        k: v * (1 + 0.2 * torch.rand(v.shape, generator=gen)) if k.endswith("magnitude_vector") else v
        for k, v in d.flat().items()
    }
    return d.replace(nest(flat))


def _full(params) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in params.flat().items()}


def _one_rank_rows(d, b):
    """Per-item adapters whose rows all sit on fsdp rank 0's share (rows 0, 1 of 3): rank 1
    attaches them with no rows (it gathers their factors and joins DoRA's norm all the same)."""
    return [(d, 0.7, [0]), (b, 0.5, [1])]


def _lora(a, b):
    return [(a, 0.8), (b, 0.5, [0, 2])]  # a on every row, b on rows 0 and 2 (per-item)


def _grads(params, adapters, lora_arg, kw, w) -> dict:
    """``{tag + ":" + factor path: grad}`` (``full_tensor()`` for DTensors) of the loss over
    the factors only (``adapters``: ``{tag: adapter}``), and whether each grad is placed
    like its factor."""
    for ad in adapters.values():
        for leaf in ad.leaves():
            leaf.grad = None
            leaf.requires_grad_()
    (fd.apply(params, **kw, lora=lora_arg) * w).sum().backward()
    out, misplaced = {}, []
    for tag, ad in adapters.items():
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
    out.update(_grads(params, {"a": a, "b": b}, _lora(a, b), kw, _weights(kw)))
    d = sharding.shard_params(_dora(config), mesh)
    with torch.no_grad():
        out["dora_fwd"] = fd.apply(params, **kw, lora=[(d, 0.7)])
        out["one_rank_rows"] = fd.apply(params, **kw, lora=_one_rank_rows(d, b))
    out["dora"] = _grads(params, {"d": d}, [(d, 0.7)], kw, _weights(kw))
    for tag, ad in (("a", a), ("d", d)):
        merged = lora.merge(params, ad, 0.8)
        out[f"merged_{tag}_misplaced"] = [
            k for k, v in merged.flat().items() if tuple(v.placements) != tuple(params.flat()[k].placements)
        ]
        out[f"merged_{tag}"] = _full(merged)
    return out


def _close_grads(got: dict, want: dict, what: str, rel: float = REL) -> None:
    assert got.keys() == want.keys()
    errs = {k: ((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)).item() for k, v in want.items()}
    worst = max(errs, key=errs.get)
    print(f"{what}: worst {errs[worst]:.2e} of the largest entry ({worst})")
    assert errs[worst] < rel, (worst, errs[worst])


def _check(results):
    config, kw = _case()
    p = fd.init(config, seed=SEED)
    a, b = _adapters(config)
    d = _dora(config)
    with torch.no_grad():
        ref = fd.apply(p, **kw, lora=_lora(a, b))
        ref_dora = fd.apply(p, **kw, lora=[(d, 0.7)])
        ref_rows = fd.apply(p, **kw, lora=_one_rank_rows(d, b))
    want = _grads(p, {"a": a, "b": b}, _lora(a, b), kw, _weights(kw))["grads"]
    want_dora = _grads(p, {"d": d}, [(d, 0.7)], kw, _weights(kw))["grads"]
    merged = {tag: _full(lora.merge(p, ad.replace(ad.tree), 0.8)) for tag, ad in (("a", a), ("d", d))}
    for r in results:
        torch.testing.assert_close(r["fwd"], ref, **FP32)
        assert torch.equal(r["fwd"], r["fwd_plain"]), "prefetch changed the output"
        assert torch.equal(r["fwd"], results[0]["fwd"]), "ranks differ"
        assert r["misplaced"] == [], r["misplaced"][:5]
        assert r["not_fully"] == [], f"factors not sharded over fsdp: {r['not_fully'][:5]}"
        _close_grads(r["grads"], want, "LoRA factor grads")
        torch.testing.assert_close(r["dora_fwd"], ref_dora, **FP32)
        torch.testing.assert_close(r["one_rank_rows"], ref_rows, **FP32)
        assert r["dora"]["misplaced"] == [], r["dora"]["misplaced"][:5]
        _close_grads(r["dora"]["grads"], want_dora, "DoRA magnitude and factor grads", REL_DORA)
        for tag, want_merged in merged.items():
            assert r[f"merged_{tag}_misplaced"] == [], r[f"merged_{tag}_misplaced"][:5]
            assert r[f"merged_{tag}"].keys() == want_merged.keys()
            for k, v in want_merged.items():  # each rank merged its slice: the same fp32 sums, sliced
                torch.testing.assert_close(r[f"merged_{tag}"][k], v, **FP32, msg=lambda m, k=k, t=tag: f"{t}: {k}: {m}")


@pytest.mark.slow
def test_lora_on_the_fly_fsdp2():
    _check(spawn(_rank, 2, init=False, timeout=600))


@pytest.mark.slow
def test_lora_on_the_fly_fsdp2_tp2():
    _check(spawn(_rank, 4, init=False, timeout=900))

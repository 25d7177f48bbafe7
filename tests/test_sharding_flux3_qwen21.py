"""FLUX.3 and Qwen-Image 2.1 sharded: tp (modulations included), Ulysses sp and dp on 2
CPU gloo ranks equal one process; gradients under each equal unsharded autograd; the
per-rank memory of every released preset at tp=8 (meta device, from `param_specs`).

One spawn runs every mesh and case (outputs, KV caches and gradients), so the suite pays
one process start-up. References are computed in the pytest process.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from _dist import spawn

import functional_dit as fd
import sharding

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md#numerics: sharded vs unsharded
REL = 1e-4  # gradients: of each tensor's largest entry (the sums run in another order; as test_grad_sharded)
SEED = 7
MESHES = [dict(tp=2), dict(sp=2), dict(dp=2)]
MOD_LEAVES = (  # the AdaLN modulation projections: sharded per chunk over tp
    "early_stream_modulations.image.linear.weight",
    "single_stream_modulations.txt.linear.weight",
    "norm_out.linear.weight",
    "modulation.1.weight",
)


def _cases() -> list:
    """(name, config, inputs): odd batch and lengths (dp and sp pad), references, ragged masks."""
    import cases_flux3 as F3
    import cases_qwenimage21 as Q

    extract = Q.inputs(Q.TINY, "edit", 3, ragged=True, seed=3)
    cache = fd.apply(fd.init(Q.TINY, seed=SEED), **extract, kv_cache="extract")[1]
    cached = {**extract, "x": extract["x"] * 0.5, "t": extract["t"] * 0.5, "kv_cache": cache}
    return [
        ("flux3/refs", F3.TINY, F3.inputs(F3.TINY, 3, 5, 3, 3, ref_hw=(1, 3), seed=1)),
        ("flux3/base", F3.TINY_BASE, F3.inputs(F3.TINY_BASE, 2, 7, 1, 5, seed=2)),
        ("qwen21/edit", Q.TINY, Q.inputs(Q.TINY, "adjacent", 3, seed=4)),
        ("qwen21/extract", Q.TINY, {**extract, "kv_cache": "extract"}),
        ("qwen21/cached", Q.TINY, cached),
        ("qwen21/no-causal", Q.TINY_NC, Q.inputs(Q.TINY_NC, "text-last", 2, ragged=True, seed=5)),
    ]


def tensors(result) -> list:
    if isinstance(result, torch.Tensor):
        return [result]
    return [result[0]] + list(result[1].flat().values())


def _loss(params, kw, w):
    return (fd.apply(params, **kw) * w).sum()


def _weights(out):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(11))


def reference_grads(config, kw, w) -> dict:
    p = pytree.tree_map(lambda t: t.requires_grad_(), fd.init(config, seed=SEED))
    _loss(p, kw, w).backward()
    return {k: torch.zeros_like(v) if v.grad is None else v.grad for k, v in p.flat().items()}


def _work(rank, world, cases, meshes=MESHES):
    out = {}
    for shape in meshes:
        mesh = sharding.make_mesh(**shape)
        for name, config, kw, w in cases:
            s = sharding.shard_params(fd.init(config, seed=SEED), mesh)
            r = dict(out=tensors(fd.apply(s, **kw)), local_bytes=sharding.local_bytes(s))
            r["mods"] = {k: str(v.placements) for k, v in s.flat().items() if k in MOD_LEAVES}
            if w is not None:
                for leaf in s.leaves():
                    leaf.requires_grad_()
                _loss(s, kw, w).backward()
                grads = pytree.tree_map(lambda t: torch.zeros_like(t) if t.grad is None else t.grad, s)
                r["grads"] = sharding.unshard(grads).flat()
            out[(tuple(shape.items()), name)] = r
    return out


def test_sharded_equals_unsharded_and_grads():
    cases, refs = [], {}
    for name, config, kw in _cases():
        ref = fd.apply(fd.init(config, seed=SEED), **kw)
        w = None if isinstance(ref, tuple) else _weights(ref)  # gradients of the plain cases
        refs[name] = (tensors(ref), None if w is None else reference_grads(config, kw, w))
        cases.append((name, config, kw, w))
    per_rank = spawn(_work, 2, cases, init=False, timeout=600)
    assert len(per_rank[0]) == len(MESHES) * len(cases)
    for key, r in per_rank[0].items():
        shape, name = dict(key[0]), key[1]
        want, want_grads = refs[name]
        assert len(r["out"]) == len(want), key
        for i, (o, ref) in enumerate(zip(r["out"], want)):
            torch.testing.assert_close(o, ref, **FP32, msg=lambda m, k=key, i=i: f"{k} tensor {i}: {m}")
        assert all(torch.equal(a, b) for a, b in zip(per_rank[1][key]["out"], r["out"])), f"{key}: ranks differ"
        config = next(c for n, c, _, _ in cases if n == name)
        assert r["local_bytes"] == sharding.bytes_per_rank(config, None, shape, torch.float32), key
        if shape.get("tp", 1) > 1:
            assert r["mods"] and all("Shard" in p for p in r["mods"].values()), (key, r["mods"])
        if want_grads is not None:
            for k, g in want_grads.items():
                err = (r["grads"][k] - g).abs().max() / g.abs().max().clamp_min(1e-30)
                assert err <= REL, f"{key} grad {k}: off by {err:.2e} of its max"


MESHES_4 = [dict(tp=4), dict(tp=2, sp=2), dict(dp=2, tp=2)]


def test_four_ranks_equal_unsharded():
    """4 gloo ranks: tp=4 (every head on its own rank), tp x sp and dp x tp equal one
    process, the KV-cache cases included; outputs only (the gradients run on 2 ranks)."""
    cases = [(n, c, kw, None) for n, c, kw in _cases() if n in ("flux3/refs", "qwen21/edit", "qwen21/cached")]
    refs = {n: tensors(fd.apply(fd.init(c, seed=SEED), **kw)) for n, c, kw, _ in cases}
    per_rank = spawn(_work, 4, cases, MESHES_4, init=False, timeout=600)
    assert len(per_rank[0]) == len(MESHES_4) * len(cases)
    for key, r in per_rank[0].items():
        for i, (o, ref) in enumerate(zip(r["out"], refs[key[1]], strict=True)):
            torch.testing.assert_close(o, ref, **FP32, msg=lambda m, k=key, i=i: f"{k} tensor {i}: {m}")
        assert all(all(torch.equal(a, b) for a, b in zip(p[key]["out"], r["out"])) for p in per_rank), key
        if dict(key[0]).get("tp", 1) > 1:
            assert r["mods"] and all("Shard" in p for p in r["mods"].values()), (key, r["mods"])


@pytest.mark.parametrize("name", ["flux3-klein-base", "flux3-klein", "qwen-image-2.1"])
def test_tp8_memory_per_rank(name):
    """Every released preset at tp=8 (bf16): per-rank bytes within 1.15 x params / 8,
    from the plan on the meta device (nothing allocated)."""
    config = fd.PRESETS[name]
    per_rank = sharding.bytes_per_rank(config, None, {"tp": 8}, torch.bfloat16)
    ideal = fd.num_params(config) * 2 / 8
    print(f"{name}: {per_rank / 2**30:.3f} GiB per rank = {per_rank / ideal:.3f} x params/8")
    assert per_rank <= 1.15 * ideal

"""Sharded vs unsharded `fd.apply` for every family on CPU gloo ranks: TP, Ulysses SP,
DP and their combinations on one named mesh.

One spawn per world size (2 and 4 ranks) runs every mesh shape and every case inside.
The reference is the unsharded `fd.apply` computed in the pytest process. Per mesh and
case each rank returns its output (compared to the reference at the docs/architecture.md fp32
tolerance and bitwise across ranks), its local parameter bytes, whether
`unshard(shard_params(p))` equals ``p`` exactly and, on TP meshes, an explicit check of
the per-block packed shards.
"""

from __future__ import annotations

import pytest
import torch
from _dist import spawn

import functional_dit as fd
import sharding

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md#numerics: sharded vs unsharded at the fp32 tolerance

SEED = 7  # params seed, the same in the parent (reference) and on every rank
MESHES = {  # world size -> mesh shapes (dp, sp, tp) run in that world's single spawn
    2: [dict(tp=2), dict(sp=2), dict(dp=2)],
    4: [dict(tp=4), dict(tp=2, sp=2), dict(dp=2, sp=2), dict(dp=2, tp=2)],
}


def _flux1_cases():
    import cases_flux1 as C

    return [  # batch 3 does not divide by dp=2; sequence lengths 7 + 9 do not divide by sp
        ("flux1-tiny/odd", C.TINY, lambda: C.inputs(C.TINY, batch=3, txt_len=7, h=3, w=3, seed=1)),
        ("flux1-tiny/even", C.TINY, lambda: C.inputs(C.TINY, batch=2, txt_len=8, h=2, w=4, seed=2)),
        (
            "flux1-schnell-4h/odd",
            C.TINY_SCHNELL,
            lambda: C.inputs(C.TINY_SCHNELL, batch=3, txt_len=5, h=3, w=3, seed=3),
        ),
    ]


def _qwen_cases():
    import cases_qwenimage as C

    return [  # ragged text masks (and holes) under sp; odd text and image lengths
        ("qwen-tiny/ragged", C.TINY, lambda: C.inputs(C.TINY, batch=3, txt_len=7, img_shapes=[(1, 3, 3)], seed=1)),
        (
            "qwen-tiny/holes",
            C.TINY,
            lambda: C.inputs(C.TINY, batch=2, txt_len=9, img_shapes=[(1, 3, 4)], holes=True, seed=2),
        ),
        (
            "qwen-edit/ragged",
            C.TINY_EDIT,
            lambda: C.inputs(C.TINY_EDIT, batch=2, txt_len=5, img_shapes=[(1, 3, 3), (1, 2, 3)], seed=3),
        ),
        ("qwen-layered/ragged", C.TINY_LAYERED, lambda: C.inputs(C.TINY_LAYERED, batch=3, txt_len=7, seed=4)),
    ]


def _flux2_cases():
    import cases_flux2 as C

    config = C.TINY
    return [
        ("flux2-tiny/odd", config, lambda: C.inputs(config, batch=3, txt_len=7, h=3, w=3, seed=1)),
        ("flux2-tiny/even", config, lambda: C.inputs(config, batch=2, txt_len=8, h=2, w=4, seed=2)),
        ("flux2-klein-2h/odd", C.TINY_KLEIN, lambda: C.inputs(C.TINY_KLEIN, batch=3, txt_len=5, h=3, w=3, seed=3)),
        # Reference-token KV cache: the extract step returns (out, cache), the cached step takes a cache.
        ("flux2-tiny/kv-extract", config, lambda: _kv_extract(C, config)),
        ("flux2-tiny/kv-cached", config, lambda: C.next_step(_kv_extract(C, config), _kv_cache(C, config))),
    ]


def _kv_extract(C, config):
    return C.inputs(config, batch=3, txt_len=5, h=3, w=3, ref_hw=(2, 3), ref_fixed_timestep=0.0, seed=4)


def _kv_cache(C, config):
    return fd.apply(fd.init(config, seed=SEED), **_kv_extract(C, config))[1]


def tensors(result) -> list:
    """The output tensor, or for a KV-cache extract step the output then every cache tensor."""
    if isinstance(result, torch.Tensor):
        return [result]
    out, cache = result
    return [out] + list(cache.flat().values())


FAMILIES = ("flux1", "flux2", "qwen")  # name prefixes of the cases; every family must run


def all_cases() -> list:
    """(name, config, inputs builder) for every family: a missing case module fails."""
    return _flux1_cases() + _flux2_cases() + _qwen_cases()


def fits(config, shape) -> bool:
    """Whether the config's heads split over tp, then over sp (Ulysses), and its heads are
    not cut into units under tp (TINY_KLEIN's MLP width 60 is no multiple of its inner
    width 24, so its single blocks cannot shard over tp: `sharding.plan` refuses,
    docs/architecture.md)."""
    tp, sp = shape.get("tp", 1), shape.get("sp", 1)
    whole_units = tp == 1 or getattr(config, "mlp_hidden_dim", 0) % config.inner_dim == 0
    return config.num_attention_heads % (tp * sp) == 0 and whole_units


def _packed_ok(p, s, mesh, shape) -> dict:
    """Explicit per-block check, by index arithmetic independent of `local_slices`:
    rank r holds the r-th slice of every fused block, concatenated."""
    tp, r = shape.get("tp", 1), mesh.get_local_rank("tp")
    checks = {}
    for path, blocks, dim in (
        ("single_transformer_blocks.0.proj_out.weight", "attn,mlp", 1),  # FLUX.1
        ("single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight", "q,k,v,gate,up", 0),  # FLUX.2
        ("single_transformer_blocks.0.attn.to_out.weight", "attn,mlp", 1),  # FLUX.2
        ("transformer_blocks.0.ff.linear_in.weight", "gate,up", 0),  # FLUX.2 SwiGLU
        ("transformer_blocks.0.ff_context.linear_in.weight", "gate,up", 0),
    ):
        full, local = p.flat().get(path), s.flat().get(path)
        if full is None:
            continue
        spec = sharding.specs_of(p)
        for key in path.split("."):
            spec = spec[key]
        sizes = [b.size for b in spec.blocks]  # the blocks, cut into equal units (mlp.0, mlp.1, ...)
        assert len(dict.fromkeys(b.name.split(".")[0] for b in spec.blocks)) == len(blocks.split(","))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        want = torch.cat([full.narrow(dim, a + r * (n // tp), n // tp) for a, n in zip(starts, sizes)], dim)
        checks[path] = torch.equal(local.to_local(), want)
    return checks


def _work(rank, world, mesh_shapes, cases):
    """One rank: every case on every mesh shape; ``cases`` are (name, config, inputs)
    built in the parent, so no rank imports the case modules (FLUX.2's import diffusers)."""
    results = {}
    for shape in mesh_shapes:
        mesh = sharding.make_mesh(**shape)
        for name, config, kw in cases:
            if not fits(config, shape):
                continue
            p = fd.init(config, seed=SEED)
            s = sharding.shard_params(p, mesh)
            local = [x.to_local() for x in s.leaves()]
            u = sharding.unshard(s)
            results[(tuple(shape.items()), name)] = dict(
                out=(out := tensors(fd.apply(s, **kw))),
                # funcol's lazy AsyncCollectiveTensor must not escape apply (torch.save would read it unfilled)
                types=[type(t).__name__ for t in out],
                local_bytes=sharding.local_bytes(s),
                storage_bytes=sum(t.untyped_storage().nbytes() for t in local),
                unshard_exact=[k for k, a in p.flat().items() if not torch.equal(a, u.flat()[k])],
                packed=_packed_ok(p, s, mesh, shape) if shape.get("tp", 1) > 1 else {},
            )
    return results


def expected_bytes(config, shape) -> int:
    """Replicated bytes + sharded bytes / degree, summed by hand over the plan (fp32)."""
    placements = dict(sharding._plan.leaves(sharding.plan(config, shape)))
    rep = sharded = 0
    for path, spec in sharding._plan.leaves(fd.param_specs(config)):
        n = spec.numel * 4
        if isinstance(placements[path], sharding.Replicate):
            rep += n
        else:
            sharded += n
    degree = shape.get("tp", 1)
    assert sharded % degree == 0
    return rep + sharded // degree


@pytest.fixture(scope="module")
def cases():
    """(name, config, inputs, unsharded reference output) for every case."""
    out = []
    for name, config, build in all_cases():
        kw = build()
        out.append((name, config, kw, fd.apply(fd.init(config, seed=SEED), **kw)))
    return out


@pytest.mark.parametrize("world", sorted(MESHES))
def test_sharded_equals_unsharded(world, cases):
    configs = {n: c for n, c, _, _ in cases}
    references = {n: ref for n, _, _, ref in cases}
    per_rank = spawn(_work, world, MESHES[world], [c[:3] for c in cases], init=False, timeout=400)
    keys = per_rank[0].keys()
    assert {n.split("-")[0] for n in configs} == set(FAMILIES)
    for shape in MESHES[world]:  # every family runs on every mesh (some config of it fits)
        ran = {name.split("-")[0] for (s, name) in keys if s == tuple(shape.items())}
        assert ran == set(FAMILIES), (shape, ran)
    for key in keys:
        shape, name = dict(key[0]), key[1]
        outs, ref = [r[key]["out"] for r in per_rank], tensors(references[name])
        assert len(outs[0]) == len(ref)
        for i, (o, want) in enumerate(zip(outs[0], ref)):
            torch.testing.assert_close(o, want, **FP32, msg=lambda m, k=key, i=i: f"{k} tensor {i}: {m}")
        err = max((o - want).abs().max().item() for o, want in zip(outs[0], ref))
        print(f"{key}: max |sharded - unsharded| = {err:.2e}")
        for rank, o in enumerate(outs[1:], 1):
            assert all(torch.equal(a, b) for a, b in zip(o, outs[0])), f"{key}: rank {rank} differs from rank 0"
        want = expected_bytes(configs[name], shape)
        assert want == sharding.bytes_per_rank(configs[name], None, shape, torch.float32)
        for rank, r in enumerate(per_rank):
            assert set(r[key]["types"]) == {"Tensor"}, (key, rank, r[key]["types"])
            assert r[key]["local_bytes"] == want, (key, rank)
            assert r[key]["storage_bytes"] == want, f"{key}: rank {rank} keeps more storage than its shards"
            assert r[key]["unshard_exact"] == [], (key, rank)
            assert all(r[key]["packed"].values()), (key, rank, r[key]["packed"])
            if shape.get("tp", 1) > 1 and not name.startswith("qwen"):  # Qwen-Image has no fused params
                want_paths = 1 if name.startswith("flux1") else 4  # FLUX.1 proj_out; FLUX.2's four
                assert len(r[key]["packed"]) == want_paths, (key, rank, r[key]["packed"])

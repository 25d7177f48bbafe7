"""torch.func transforms of `fd.apply`, unsharded and sharded (CPU gloo ranks).

- ``torch.func.jvp`` (and ``torch.autograd.forward_ad``) w.r.t. t and x equals
  ``torch.autograd.functional.jvp`` (the double-backward trick) in fp64; ``apply`` picks
  the math attention kernel itself while forward AD is active (the reference needs
  ``sdpa_kernel(MATH)``: the fused CPU kernel has no double backward).
- ``torch.func.vmap`` over 3 stacked parameter sets (`fd.stack_params`) equals 3 calls.
- Sharded (tp=2, sp=2, dp=2): jvp w.r.t. t and x and w.r.t. the sharded params equals the
  unsharded jvp; vjp over sharded params gives sharded cotangents equal to the unsharded
  ones; vmap over a stack of inputs equals the loop of sharded calls.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from _dist import spawn
from torch.nn.attention import SDPBackend, sdpa_kernel

import functional_dit as fd
import sharding

FP32 = dict(rtol=1e-5, atol=1e-5)  # the repository's fp32 tolerance (sharded vs unsharded)
# fp64 params and inputs, but RoPE and the timestep embedding compute in fp32 by design
# (as diffusers), so two exact derivatives of the same function agree to ~1e-7, not 1e-15.
FP64 = dict(rtol=1e-6, atol=1e-6)
SEED = 5


def _cases() -> list:
    import cases_flux1 as F1
    import cases_flux2 as F2
    import cases_qwenimage as Q

    return [
        ("flux1", F1.TINY, F1.inputs(F1.TINY, batch=2, txt_len=5, h=3, w=3, seed=1)),
        ("flux2", F2.TINY, F2.inputs(F2.TINY, batch=2, txt_len=5, h=3, w=3, seed=2)),
        ("qwen", Q.TINY, Q.inputs(Q.TINY, batch=2, txt_len=5, img_shapes=[(1, 3, 3)], seed=3)),
    ]


def _fp64(kw: dict) -> dict:
    return pytree.tree_map(lambda a: a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a, kw)


def _tangents(kw: dict, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(kw[n].shape, generator=g, dtype=kw[n].dtype) for n in ("t", "x"))


def _fn(params, kw):
    rest = {k: v for k, v in kw.items() if k not in ("t", "x")}
    return lambda t, x: fd.apply(params, x, t, **rest)


CASES = _cases()


@pytest.mark.parametrize("name,config,kw", CASES, ids=[c[0] for c in CASES])
def test_jvp_equals_autograd_functional(name, config, kw):
    params, kw = fd.init(config, seed=SEED, dtype=torch.float64), _fp64(kw)
    f, primals, tangents = _fn(params, kw), (kw["t"], kw["x"]), _tangents(kw)
    out, jvp = torch.func.jvp(f, primals, tangents)
    with sdpa_kernel([SDPBackend.MATH]):
        ref_out, ref_jvp = torch.autograd.functional.jvp(f, primals, tangents)
    torch.testing.assert_close(out, ref_out, **FP64)
    torch.testing.assert_close(jvp, ref_jvp, **FP64)
    assert jvp.abs().max() > 1e-3  # a real tangent, not zeros
    # t alone and x alone: each direction on its own
    for i in range(2):
        only = tuple(tg if j == i else torch.zeros_like(tg) for j, tg in enumerate(tangents))
        _, part = torch.func.jvp(f, primals, only)
        with sdpa_kernel([SDPBackend.MATH]):
            _, ref_part = torch.autograd.functional.jvp(f, primals, only)
        torch.testing.assert_close(part, ref_part, **FP64)


def test_forward_ad_dual_numbers():
    import torch.autograd.forward_ad as fwAD

    name, config, kw = CASES[0]
    params, kw = fd.init(config, seed=SEED, dtype=torch.float64), _fp64(kw)
    f, tangents = _fn(params, kw), _tangents(kw)
    with fwAD.dual_level():
        dual = [fwAD.make_dual(p, tg) for p, tg in zip((kw["t"], kw["x"]), tangents)]
        jvp = fwAD.unpack_dual(f(*dual)).tangent
    torch.testing.assert_close(jvp, torch.func.jvp(f, (kw["t"], kw["x"]), tangents)[1], **FP64)


@pytest.mark.parametrize("name,config,kw", CASES, ids=[c[0] for c in CASES])
def test_vmap_over_param_sets_equals_calls(name, config, kw):
    sets = [fd.init(config, seed=s) for s in (1, 2, 3)]
    stacked = fd.stack_params(sets)
    outs = torch.func.vmap(lambda p: fd.apply(p, **kw))(stacked)
    assert outs.shape[0] == 3
    for out, p in zip(outs, sets):
        torch.testing.assert_close(out, fd.apply(p, **kw), **FP32)
    for a, b in zip(fd.unstack_params(stacked), sets):
        assert all(torch.equal(x, y) for x, y in zip(a.leaves(), b.leaves()))
    soup = pytree.tree_map(lambda w: w.mean(0), stacked)  # a uniform model soup is a tree_map
    assert soup.config == config and soup.flat().keys() == sets[0].flat().keys()


def test_stack_params_rejects_mismatches():
    import cases_flux1 as F1

    a, b = fd.init(F1.TINY), fd.init(F1.TINY_SCHNELL)
    with pytest.raises(ValueError, match="config"):
        fd.stack_params([a, b])
    with pytest.raises(ValueError, match="float64"):
        fd.stack_params([a, fd.init(F1.TINY, dtype=torch.float64)])
    with pytest.raises(ValueError, match="non-empty"):
        fd.stack_params([])
    with pytest.raises(ValueError, match="leading dim"):
        fd.unstack_params(a)


MESHES = [dict(tp=2), dict(sp=2), dict(dp=2)]


def _sharded_work(rank, world, cases):
    out = {}
    for shape in MESHES:
        mesh = sharding.make_mesh(**shape)
        for name, config, kw in cases:
            s = sharding.shard_params(fd.init(config, seed=SEED), mesh)
            f = _fn(s, kw)
            tangents = _tangents(kw)
            xs = torch.stack([kw["x"], kw["x"] * 0.5, -kw["x"]])
            vm = torch.func.vmap(lambda x, f=f, t=kw["t"]: f(t, x))(xs)
            t_params = sharding.shard_params(fd.init(config, seed=SEED + 1), mesh)  # a tangent / cotangent
            apply = lambda p, kw=kw: fd.apply(p, **kw)  # noqa: E731
            out_s, vjp_fn = torch.func.vjp(apply, s)
            (cot,) = vjp_fn(torch.ones_like(out_s))
            # jvp w.r.t. sharded params runs in the local view: torch.func.jvp's make_dual has no
            # DTensor rule (aten._has_same_storage_numel), so DTensor primals cannot enter it
            (local, _), (t_local, _) = sharding.local_view(s), sharding.local_view(t_params)
            with sharding.bind(mesh):
                params_jvp = torch.func.jvp(apply, (local,), (t_local,))[1]
            out[(tuple(shape.items()), name)] = dict(
                params_jvp=params_jvp,
                params_vjp=sharding.unshard(cot).flat(),
                vjp_placements=all(a.placements == b.placements for a, b in zip(s.leaves(), cot.leaves())),
                jvp=torch.func.jvp(f, (kw["t"], kw["x"]), tangents),
                vmap=vm,
                loop=torch.stack([f(kw["t"], x) for x in xs]),
            )
    return out


def test_sharded_jvp_and_vmap():
    per_rank = spawn(_sharded_work, 2, CASES, init=False, timeout=600)
    for name, config, kw in CASES:
        params = fd.init(config, seed=SEED)
        ref_out, ref_jvp = torch.func.jvp(_fn(params, kw), (kw["t"], kw["x"]), _tangents(kw))
        apply = lambda p, kw=kw: fd.apply(p, **kw)  # noqa: E731
        ref_params_jvp = torch.func.jvp(apply, (params,), (fd.init(config, seed=SEED + 1),))[1]
        out_p, vjp_fn = torch.func.vjp(apply, params)
        ref_vjp = vjp_fn(torch.ones_like(out_p))[0].flat()
        for rank, results in enumerate(per_rank):
            for shape in MESHES:
                r = results[(tuple(shape.items()), name)]
                msg = lambda m, s=shape, k=rank, n=name: f"{n} {s} rank {k}: {m}"  # noqa: E731
                torch.testing.assert_close(r["jvp"][0], ref_out, **FP32, msg=msg)
                # the t-tangent passes through sin(1000 t f): entries reach ~1e3, so the fp32
                # bound is relative to the largest entry (errors seen: ~3e-7 of it)
                err = (r["jvp"][1] - ref_jvp).abs().max() / ref_jvp.abs().max()
                assert err <= 1e-5, msg(f"jvp off by {err:.2e} of its largest entry")
                torch.testing.assert_close(r["vmap"], r["loop"], **FP32, msg=msg)
                torch.testing.assert_close(r["params_jvp"], ref_params_jvp, **FP32, msg=msg)
                assert r["vjp_placements"], msg("vjp cotangents lack the params' placements")
                for k, want in ref_vjp.items():
                    err = (r["params_vjp"][k] - want).abs().max() / want.abs().max().clamp_min(1e-30)
                    assert err <= 1e-4, msg(f"vjp {k} off by {err:.2e} of its largest entry")

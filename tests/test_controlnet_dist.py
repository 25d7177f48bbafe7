"""Sharded ControlNets on 2 CPU gloo ranks: `controlnet.apply` over params sharded by
``sharding.shard_params`` (their `ParamSpec` logical axes: the blocks as the transformer's)
or loaded per rank by ``weights.load(folder, mesh=...)``,
and `fd.apply` of a sharded transformer taking the residuals, on tp=2, sp=2 and dp=2,
equal to one process (the docs/architecture.md fp32 tolerance) and bitwise across ranks.
Odd batch (3 over dp=2), image tokens (9) and text (7; 8 with a Union's mode token) take
the padding paths.
"""

from __future__ import annotations

import torch
from _dist import spawn

import functional_dit as fd
import sharding
from functional_dit import controlnet as C

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md#numerics: sharded vs unsharded at the fp32 tolerance
MESHES = [dict(tp=2), dict(sp=2), dict(dp=2)]
B, T, H, W = 3, 7, 3, 3


def _case(name: str):
    """(ControlNet params, transformer params, shared apply keywords, ControlNet keywords, cond)."""
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    S = H * W
    x, t = r(B, S, 16), torch.rand(B, generator=g)
    if name.startswith("flux"):
        cn, params = C.init(name, seed=1), fd.init("flux1-tiny", seed=2)
        kw = dict(pooled=r(B, 24), guidance=torch.full((B,), 3.5), img_ids=r(S, 3), txt_ids=torch.zeros(T, 3))
        extra = dict(mode=torch.tensor([0, 1, 2])) if cn.config.num_mode else {}
        return cn, params, dict(x=x, t=t, txt=r(B, T, 32), **kw), extra, r(B, S, 16)
    cn, params = C.init(name, seed=1), fd.init("qwen-image-tiny", seed=2)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    kw = dict(txt_mask=mask, img_shapes=[[(1, H, W)]] * B)
    return cn, params, dict(x=x, t=t, txt=r(B, T, 32), **kw), {}, r(B, S, 16)


NAMES = ("flux1-controlnet-union-tiny", "qwen-image-controlnet-tiny")


def _run(cn, params, inp, extra, cond):
    inp = dict(inp)
    x, t, txt = inp.pop("x"), inp.pop("t"), inp.pop("txt")
    res = C.apply(cn, x, t, txt, cond, scale=0.7, **inp, **extra)
    return res, fd.apply(params, x, t, txt, **inp, **res)


def _work(rank, world, folder):
    import weights

    out = {}
    for shape in MESHES:
        mesh = sharding.make_mesh(**shape)
        loaded = weights.load(folder, mesh=mesh)  # each rank reads its own slices of a diffusers ControlNet folder
        want = sharding.shard_params(C.init(NAMES[0], seed=1), mesh)
        out[(str(shape), "load")] = all(
            torch.equal(a.to_local(), b.to_local()) and a.placements == b.placements
            for a, b in zip(loaded.leaves(), want.leaves())
        )
        for name in NAMES:
            cn, params, inp, extra, cond = _case(name)
            sharded = sharding.shard_params(cn, mesh)
            q = sharded["transformer_blocks"]["0"]["attn"]["to_q"]["weight"]  # the blocks shard as the transformer's
            assert q.to_local().shape[0] == cn.config.inner_dim // shape.get("tp", 1)
            res, y = _run(sharded, sharding.shard_params(params, mesh), inp, extra, cond)
            out[(str(shape), name)] = (res, y)
    return out


def test_sharded_controlnet_equals_one_process(tmp_path):
    import weights

    weights.save(C.init(NAMES[0], seed=1), tmp_path)  # a diffusers FluxControlNetModel folder
    ranks = spawn(_work, 2, str(tmp_path))
    assert all(r[(str(shape), "load")] for r in ranks for shape in MESHES)
    for name in NAMES:
        want_res, want = _run(*_case(name))
        for shape in MESHES:
            got = [r[(str(shape), name)] for r in ranks]
            for res, y in got:
                torch.testing.assert_close(y, want, **FP32)
                for k, v in want_res.items():
                    if isinstance(v, list):
                        for a, b in zip(res[k], v):
                            torch.testing.assert_close(a, b, **FP32)
            assert torch.equal(got[0][1], got[1][1])  # every rank holds the same output

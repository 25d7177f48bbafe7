"""Gradients through sharded `fd.apply` equal unsharded autograd, on CPU gloo ranks.

Every family on tp=2, sp=2, dp=2 (2 ranks) and tp=2 x sp=2 (4 ranks): the same inputs
and a loss computed identically on every rank from the replicated output. Each rank
runs ``loss.backward()`` on DTensor leaves (and on ``x``) and ``torch.func.grad`` over
the sharded `Params` and ``x``; the gradients must carry the parameters' placements and,
gathered with `sharding.unshard`, equal the unsharded autograd gradients of every
parameter and of ``x`` to 1e-4 of the tensor's largest entry (fp32: the sharded sums
run in another order, so exact equality is not expected; the errors seen are ~1e-6).
"""

from __future__ import annotations

import os
import runpy

import pytest
import torch
import torch.utils._pytree as pytree
from _dist import spawn

import functional_dit as fd
import sharding

SEED = 7
REL = 1e-4  # of the largest entry of each gradient tensor (the bound)
MESHES = {2: [dict(tp=2), dict(sp=2), dict(dp=2)], 4: [dict(tp=2, sp=2)]}


def _cases(world: int) -> list:
    """(name, config, inputs, loss weights): odd batch and sequence lengths, so dp and sp
    pad; 4-head configs on 4 ranks (tp x sp splits the heads twice)."""
    import cases_flux1 as F1
    import cases_flux2 as F2
    import cases_qwenimage as Q

    f1 = F1.TINY if world == 2 else F1.TINY_SCHNELL
    cases = [
        ("flux1", f1, F1.inputs(f1, batch=3, txt_len=5, h=3, w=3, seed=1)),
        ("flux2", F2.TINY, F2.inputs(F2.TINY, batch=3, txt_len=5, h=3, w=3, seed=2)),
        ("qwen", Q.TINY, Q.inputs(Q.TINY, batch=3, txt_len=5, img_shapes=[(1, 3, 3)], seed=3)),
    ]
    return [(n, c, kw, _weights(c, kw)) for n, c, kw in cases]


def _weights(config, kw) -> torch.Tensor:
    """Fixed random loss weights of the output's shape, so no gradient is trivially uniform."""
    B, S = kw["x"].shape[:2]
    C = fd.param_specs(config)["proj_out"]["weight"].shape[0]
    return torch.randn(B, S, C, generator=torch.Generator().manual_seed(11))


def loss_fn(params, x, kw, w):
    return (fd.apply(params, **{**kw, "x": x}) * w).sum()


def reference(config, kw, w) -> dict:
    """Unsharded autograd gradients: ``{dotted path: grad}`` and ``"x"``."""
    p = pytree.tree_map(lambda t: t.requires_grad_(), fd.init(config, seed=SEED))
    x = kw["x"].clone().requires_grad_()
    loss_fn(p, x, kw, w).backward()
    return {**{k: _grad(v) for k, v in p.flat().items()}, "x": x.grad}


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    """A leaf's .grad; zeros for a parameter the output does not use (Qwen-Image's last
    text-stream MLP), as torch.func.grad gives."""
    return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad


def rel_errors(got: dict, want: dict) -> dict:
    """Per tensor: max |got - want| / max |want|."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return {k: ((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30)).item() for k in want}


def _grads(mesh, config, kw, w) -> dict:
    """On one rank: gathered gradients from loss.backward() and from torch.func.grad, and
    the leaves whose gradient lacks the parameter's DTensor placements."""
    s = sharding.shard_params(fd.init(config, seed=SEED), mesh)
    for leaf in s.leaves():
        leaf.requires_grad_()
    x = kw["x"].clone().requires_grad_()
    loss_fn(s, x, kw, w).backward()
    back = pytree.tree_map(_grad, s)
    s = pytree.tree_map(lambda t: t.detach(), s)
    func, fx = torch.func.grad(loss_fn, argnums=(0, 1))(s, kw["x"], kw, w)
    bad = [
        (name, k)
        for name, g in (("backward", back), ("func.grad", func))
        for (k, a), b in zip(s.flat().items(), g.flat().values())
        if not isinstance(b, type(a)) or tuple(b.placements) != tuple(a.placements)
    ]
    return {
        "backward": {**sharding.unshard(back).flat(), "x": x.grad},
        "func.grad": {**sharding.unshard(func).flat(), "x": fx},
        "placements": bad,
    }


def _work(rank, world, cases):
    out = {}
    for shape in MESHES[world]:
        mesh = sharding.make_mesh(**shape)
        for name, config, kw, w in cases:
            out[(tuple(shape.items()), name)] = _grads(mesh, config, kw, w)
    return out


@pytest.mark.parametrize("world", sorted(MESHES))
def test_sharded_grads_equal_unsharded(world):
    cases = _cases(world)
    refs = {name: reference(c, kw, w) for name, c, kw, w in cases}
    per_rank = spawn(_work, world, cases, init=False, timeout=600)
    assert len(per_rank[0]) == len(MESHES[world]) * len(cases)
    for rank, results in enumerate(per_rank):
        for key, r in results.items():
            assert r["placements"] == [], (rank, key, r["placements"][:5])
            for how in ("backward", "func.grad"):
                errs = rel_errors(r[how], refs[key[1]])
                worst = max(errs, key=errs.get)
                assert errs[worst] <= REL, f"rank {rank} {key} {how}: {worst} off by {errs[worst]:.2e} of its max"


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "finetune_tp.py")


def _finetune_rank(rank, world, path):
    ns = runpy.run_path(path, run_name="__main__")  # the script as torchrun runs it
    params, losses = ns["finetune"](fd.init(ns["CONFIG"], seed=0), mesh=sharding.make_mesh(tp=2))
    DTensor = torch.distributed.tensor.DTensor
    return sharding.unshard(params).flat(), losses, all(isinstance(x, DTensor) for x in params.leaves())


def test_finetune_example_tp2_ends_at_unsharded_weights():
    """examples/finetune_tp.py: 3 SGD steps under tp=2 end at the weights of the same
    steps unsharded (fp32 tolerance), and the params stay sharded."""
    ns = runpy.run_path(EXAMPLE, run_name="finetune_tp")
    start = fd.init(ns["CONFIG"], seed=0)
    plain, plain_losses = ns["finetune"](fd.init(ns["CONFIG"], seed=0))
    moved = max((a - b).abs().max().item() for a, b in zip(plain.leaves(), start.leaves()))
    assert moved > 1e-3  # the steps really change the weights
    for full, losses, sharded in spawn(_finetune_rank, 2, EXAMPLE, init=False, timeout=400):
        assert sharded
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
        for k, w in plain.flat().items():
            torch.testing.assert_close(full[k], w.detach(), rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")

"""Gradients through sharded `fd.apply` equal unsharded autograd, on CPU gloo ranks.

Every family on tp=2, sp=2, dp=2 (2 ranks) and tp=2 x sp=2 (4 ranks): the same inputs
and a loss computed identically on every rank from the replicated output. Each rank
runs ``loss.backward()`` on DTensor leaves (and on ``x``) and ``torch.func.grad`` over
the sharded `Params` and ``x``; the gradients must carry the parameters' placements and,
read as a user reads them (``leaf.grad.full_tensor()``, no `sharding.unshard`), equal the
unsharded autograd gradients of every parameter and of ``x`` to 1e-5 of the tensor's
largest entry (fp32: the sharded sums run in another order, so exact equality is not
expected; the errors seen are ~1e-6, docs/architecture.md). Every sharded leaf's own
``full_tensor()`` is the unsharded parameter bitwise (slicing copies, it computes nothing).
"""

from __future__ import annotations

import dataclasses
import os
import runpy

import pytest
import torch
import torch.utils._pytree as pytree
from _dist import spawn

import functional_dit as fd
import sharding

SEED = 7
REL = 1e-5  # of the largest entry of each gradient tensor: fp32 sums in another order (seen: ~1e-6)
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
        "backward": {**_full(back), "x": x.grad},
        "func.grad": {**_full(func), "x": fx},
        "placements": bad,
        "leaves": _full(s),
    }


def _full(params) -> dict:
    """``{dotted path: leaf.full_tensor()}``: what torch's own DTensor API says each leaf is."""
    return {k: v.full_tensor() for k, v in params.flat().items()}


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
    inits = {name: fd.init(c, seed=SEED).flat() for name, c, _, _ in cases}
    per_rank = spawn(_work, world, cases, init=False, timeout=600)
    assert len(per_rank[0]) == len(MESHES[world]) * len(cases)
    for rank, results in enumerate(per_rank):
        for key, r in results.items():
            assert r["placements"] == [], (rank, key, r["placements"][:5])
            wrong = [k for k, v in inits[key[1]].items() if not torch.equal(r["leaves"][k], v)]
            assert wrong == [], f"rank {rank} {key}: full_tensor() is not the parameter for {wrong}"
            for how in ("backward", "func.grad"):
                errs = rel_errors(r[how], refs[key[1]])
                worst = max(errs, key=errs.get)
                if rank == 0:
                    print(f"worst grad error via full_tensor, {key} {how}: {errs[worst]:.2e} ({worst})")
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


def _compiled_grads(rank, world, kw):
    """Gradients through ``torch.compile(fullgraph=True)`` of a sharded loss vs eager, per mesh."""
    import cases_flux1 as F1

    gaps = {}
    # One block of each kind: every collective's rule is traced, at half the compile time.
    config = dataclasses.replace(F1.TINY, num_layers=1, num_single_layers=1)
    for shape in (dict(tp=2), dict(sp=2)):  # dp traces like sp
        mesh, grads = sharding.make_mesh(**shape), {}
        for mode in ("eager", "compiled"):
            s = sharding.shard_params(fd.init(config, seed=SEED), mesh)
            for leaf in s.leaves():
                leaf.requires_grad_()
            x = kw["x"].clone().requires_grad_()
            f = (
                torch.compile(loss_fn, fullgraph=True, dynamic=False, backend="aot_eager")
                if mode == "compiled"
                else loss_fn
            )
            f(s, x, kw, 1.0).backward()
            grads[mode] = [leaf.grad.to_local() for leaf in s.leaves()] + [x.grad]
        gaps[tuple(shape.items())] = max((a - b).abs().max().item() for a, b in zip(*grads.values()))
    return gaps


def test_compiled_backward_equals_eager():
    """The collectives' autograd rules trace: torch.compile(fullgraph=True) of a sharded
    loss (aot_eager: the same graphs without inductor's slow C++ build) gives the eager
    gradients on tp=2 and sp=2."""
    import cases_flux1 as F1

    kw = F1.inputs(F1.TINY, batch=3, txt_len=5, h=3, w=3, seed=1)
    for gaps in spawn(_compiled_grads, 2, kw, init=False, timeout=600):
        assert len(gaps) == 2 and max(gaps.values()) <= 1e-6, gaps


def _kv_loss(params, inputs, rest):
    """FLUX.2 reference-token KV cache: the loss reads the output and, in extract mode,
    every cache tensor (weighted differently), so gradients flow back through both."""
    result = fd.apply(params, **rest, **inputs)
    if not isinstance(result, tuple):
        return (result**2).sum()
    out, cache = result
    return (out**2).sum() + sum((v * (i + 1)).sum() for i, v in enumerate(cache.flat().values()))


def _kv_grads(params, kw):
    """torch.func.grad w.r.t. params, x, txt and (cached mode) every cache tensor."""
    inputs = {k: kw[k] for k in ("x", "txt")}
    if not isinstance(kw.get("kv_cache"), (str, type(None))):
        inputs["kv_cache"] = kw["kv_cache"]
    rest = {k: v for k, v in kw.items() if k not in inputs}
    g_p, g_in = torch.func.grad(_kv_loss, argnums=(0, 1))(params, inputs, rest)
    g_p = sharding.unshard(g_p) if any(hasattr(t, "placements") for t in params.leaves()) else g_p
    return {**g_p.flat(), **{f"input.{i}": g for i, g in enumerate(pytree.tree_leaves(g_in))}}


def _kv_work(rank, world, cases):
    import cases_flux2 as F2

    out = {}
    for shape in MESHES[world]:
        mesh = sharding.make_mesh(**shape)
        for name, kw in cases:
            out[(tuple(shape.items()), name)] = _kv_grads(sharding.shard_params(fd.init(F2.TINY, seed=SEED), mesh), kw)
    return out


def test_flux2_kv_cache_grads_equal_unsharded():
    """Extract mode (gradients through the returned cache) and cached mode (gradients
    w.r.t. the cache tensors) on tp=2, sp=2, dp=2."""
    import cases_flux2 as F2

    extract = F2.inputs(F2.TINY, batch=3, txt_len=5, h=3, w=3, ref_hw=(2, 3), ref_fixed_timestep=0.0, seed=4)
    cached = F2.next_step(extract, fd.apply(fd.init(F2.TINY, seed=SEED), **extract)[1])
    cases = [("extract", extract), ("cached", cached)]
    refs = {name: _kv_grads(fd.init(F2.TINY, seed=SEED), kw) for name, kw in cases}
    assert len(refs["cached"]) > len(refs["extract"])  # the cache tensors are among the inputs
    for rank, results in enumerate(spawn(_kv_work, 2, cases, init=False, timeout=600)):
        for key, got in results.items():
            errs = rel_errors(got, refs[key[1]])
            worst = max(errs, key=errs.get)
            assert errs[worst] <= REL, f"rank {rank} {key}: {worst} off by {errs[worst]:.2e} of its max"


def _rules(rank, world):
    """Each collective's backward, jvp and vmap on 2 ranks (tp), against the rule it must
    follow; x_r is rank r's local tensor, w a cotangent every rank holds whole."""
    mesh = sharding.make_mesh(tp=2)
    g = torch.Generator().manual_seed(0)
    xs, w, v = torch.randn(2, 3, 4, generator=g), torch.randn(3, 8, generator=g), torch.randn(4, 2, generator=g)
    x = xs[rank]
    out = {}
    with sharding.bind(mesh):
        grad = lambda f, x: torch.func.grad(lambda x: (f(x) * w[..., : f(x).shape[-1]]).sum())(x)  # noqa: E731
        out["all_gather"] = grad(lambda x: sharding.all_gather(x, "tp", 1), x)  # this rank's slice of w
        out["psum"] = grad(lambda x: sharding.psum(x, "tp"), x)  # w itself
        out["pvary"] = grad(lambda x: sharding.pvary(x, "tp") * (rank + 1), x)  # sum over ranks of (r + 1)
        # (2, 4) -> (4, 2): column block c of every rank's x goes to rank c, stacked by rank
        out["all_to_all"] = torch.func.grad(lambda x: (sharding.all_to_all(x, "tp", 1, 0) * v).sum())(x[:2])
        stack = torch.stack([x, 2 * x, -x])
        out["vmap_gather"] = torch.func.vmap(lambda x: sharding.all_gather(x, "tp", 1))(stack)
        out["loop_gather"] = torch.stack([sharding.all_gather(a, "tp", 1) for a in stack])
        out["jvp_psum"] = torch.func.jvp(lambda x: sharding.psum(x, "tp"), (x,), (2 * x,))[1]
        out["psum_2x"] = sharding.psum(2 * x, "tp")
    full = torch.cat(list(xs), 1)
    f = sharding.shard_map(lambda a: a * 3, mesh, (sharding.P(None, "tp"),), sharding.P(None, "tp"))
    out["shard_map"] = torch.func.grad(lambda a: (f(a) * w).sum())(full)  # 3 w
    return out


def test_collective_rules():
    g = torch.Generator().manual_seed(0)
    _, w, v = torch.randn(2, 3, 4, generator=g), torch.randn(3, 8, generator=g), torch.randn(4, 2, generator=g)
    for rank, r in enumerate(spawn(_rules, 2, init=False, timeout=300)):
        torch.testing.assert_close(r["all_gather"], w[:, 4 * rank : 4 * rank + 4])
        torch.testing.assert_close(r["psum"], w[:, :4])
        torch.testing.assert_close(r["pvary"], 3 * w[:, :4])
        # the reverse swap: rank r's column block c gets rows 2r, 2r+1 of rank c's cotangent v
        torch.testing.assert_close(r["all_to_all"], torch.cat([v[2 * rank : 2 * rank + 2]] * 2, 1))
        torch.testing.assert_close(r["vmap_gather"], r["loop_gather"])
        torch.testing.assert_close(r["jvp_psum"], r["psum_2x"])
        torch.testing.assert_close(r["shard_map"], 3 * w)

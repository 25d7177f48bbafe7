"""torch's distributed checkpoint (DCP) of sharded params and an AdamW state over them.

Saved on tp=2 through `sharding.checkpoint_state` (every family: one forward/backward
and an AdamW step, so the moments are real), then loaded into fresh params and zeroed
moments on 1 process (no process group), on tp=2 and on tp=2 x sp=2 (4 ranks): every
tensor, read with ``full_tensor()``, is bitwise the saved one (DCP copies bytes). On the
same tp=2 ranks ``weights.save`` / ``weights.load(mesh=)`` still round-trip bitwise.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from _dist import spawn

import functional_dit as fd
import sharding
import weights

MOMENTS = ("exp_avg", "exp_avg_sq")


def _cases():
    """(name, config, inputs): 4-head configs, so tp=2 x sp=2 can hold them."""
    import cases_flux1 as F1
    import cases_flux2 as F2
    import cases_qwenimage as Q

    return [
        ("flux1", F1.TINY_SCHNELL, F1.inputs(F1.TINY_SCHNELL, batch=1, txt_len=4, h=2, w=2, seed=1)),
        ("flux2", F2.TINY, F2.inputs(F2.TINY, batch=1, txt_len=4, h=2, w=2, seed=2)),
        ("qwen", Q.TINY, Q.inputs(Q.TINY, batch=1, txt_len=4, img_shapes=[(1, 2, 2)], seed=3)),
    ]


def _state(params, opt_state) -> dict:
    """What goes to DCP: the params and each AdamW moment in block form, and the step counts."""
    out = {"params": sharding.checkpoint_state(params)}
    for m in MOMENTS:
        out[m] = sharding.checkpoint_state(params, fd.Params(params.config, _tree_of(params, opt_state, m)))
    out["step"] = {k: opt_state[k]["step"] for k in params.flat()}
    return out


def _tree_of(params, opt_state, name) -> dict:
    return sharding.tree.nest({k: opt_state[k][name] for k in params.flat()})


def _zero(t) -> dict:
    """AdamW's state of one parameter as it creates it (a DTensor's moments are DTensors of
    its placements), zeroed: what a resumed run loads into."""
    return {"step": torch.tensor(0.0), **{m: torch.zeros_like(t.detach()) for m in MOMENTS}}


def _empty_state(params) -> dict:
    return {k: _zero(t) for k, t in params.flat().items()}


def _full(x):
    """A copy of the whole tensor (a replicated DTensor's ``full_tensor()`` is its local tensor, not a copy)."""
    return (x.full_tensor() if hasattr(x, "full_tensor") else x).detach().clone()


def _snapshot(params, opt_state) -> dict:
    out = {f"params.{k}": _full(v) for k, v in params.flat().items()}
    for k, s in opt_state.items():
        out |= {f"{name}.{k}": _full(s[name]) for name in (*MOMENTS, "step")}
    return out


def _load(config, mesh, path) -> dict:
    """Fresh params (another seed) and zeroed moments, sharded over ``mesh`` (or not), loaded from ``path``."""
    params = fd.init(config, seed=99)
    params = params if mesh is None else sharding.shard_params(params, mesh)
    opt_state = _empty_state(params)
    dcp.load(_state(params, opt_state), checkpoint_id=path)
    return _snapshot(params, opt_state)


def _save_rank(rank, world, cases, root):
    mesh, out = sharding.make_mesh(tp=2), {}
    for name, config, kw in cases:
        params = sharding.shard_params(fd.init(config, seed=0), mesh)
        leaves = [t.requires_grad_() for t in params.leaves()]
        opt = torch.optim.AdamW(leaves, lr=1e-2)
        fd.apply(params, **kw).square().mean().backward()
        opt.step()
        # a parameter the loss does not reach (Qwen-Image's last text MLP) has no state yet
        opt_state = {k: opt.state[t] if opt.state.get(t) else _zero(t) for k, t in params.flat().items()}
        dcp.save(_state(params, opt_state), checkpoint_id=os.path.join(root, name))
        weights.save(params, os.path.join(root, f"{name}-weights"))
        back = weights.load(os.path.join(root, f"{name}-weights"), mesh=mesh)
        out[name] = {
            "saved": _snapshot(params, opt_state),
            "tp2": _load(config, mesh, os.path.join(root, name)),
            "weights": {k: v.full_tensor() for k, v in back.flat().items()},
        }
    return out if rank == 0 else None


def _load_rank(rank, world, cases, root):
    mesh = sharding.make_mesh(tp=2, sp=2)
    out = {name: _load(config, mesh, os.path.join(root, name)) for name, config, _ in cases}
    return out if rank == 0 else None


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want))[:5])
    wrong = [k for k in want if not torch.equal(got[k], want[k])]
    assert wrong == [], f"{what}: not bitwise the saved tensors: {wrong[:5]}"


def test_dcp_save_tp2_load_on_1_rank_tp2_and_tp2_sp2(tmp_path):
    cases = _cases()
    saved = spawn(_save_rank, 2, cases, str(tmp_path), init=True, timeout=600)[0]
    for name, config, _ in cases:
        want = saved[name]["saved"]
        assert any(v.abs().max() > 0 for k, v in want.items() if k.startswith("exp_avg_sq."))  # real moments
        _assert_equal(saved[name]["tp2"], want, f"{name} on tp=2")
        _assert_equal(_load(config, None, str(tmp_path / name)), want, f"{name} on 1 process")
        plain = {k[len("params.") :]: v for k, v in want.items() if k.startswith("params.")}
        _assert_equal(saved[name]["weights"], plain, f"{name} weights.save/load on tp=2")
        _assert_equal(weights.load(str(tmp_path / f"{name}-weights")).flat(), plain, f"{name} weights.load")
    four = spawn(_load_rank, 4, cases, str(tmp_path), init=True, timeout=600)[0]
    for name, _, _ in cases:
        _assert_equal(four[name], saved[name]["saved"], f"{name} on tp=2 x sp=2")


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "finetune_tp.py")
REL = 1e-5  # of each gradient's largest entry: fp32 sums in another order under tp (seen: ~1e-6)


def _resume_rank(rank, world, path, folder):
    import runpy

    ns = runpy.run_path(path, run_name="finetune_tp")
    mesh, seen = sharding.make_mesh(tp=2), []

    def record(step, params):  # the params this step's gradients are taken at, and the gradients (copies:
        # the optimizer updates the replicated leaves, whose full_tensor() is the local tensor, in place)
        seen.append(
            (
                step,
                {k: _full(v) for k, v in params.flat().items()},
                {k: _full(v.grad) for k, v in params.flat().items()},
            )
        )

    whole, opt = ns["train"](fd.init(ns["CONFIG"], seed=0), steps=4, mesh=mesh, on_grads=record)
    ns["train"](fd.init(ns["CONFIG"], seed=0), steps=2, mesh=mesh, save=folder)  # interrupted after step 2
    resumed, opt2 = ns["train"](fd.init(ns["CONFIG"], seed=1), steps=4, mesh=mesh, resume=folder)
    pairs = list(zip(whole.leaves(), resumed.leaves()))
    same = [torch.equal(a.to_local(), b.to_local()) for a, b in pairs]
    same += [torch.equal(opt.state[a][m].to_local(), opt2.state[b][m].to_local()) for a, b in pairs for m in MOMENTS]
    same += [torch.equal(opt.state[a]["step"], opt2.state[b]["step"]) for a, b in pairs]
    return {"same": all(same), "count": len(same), "seen": seen} if rank == 0 else None


def test_finetune_example_resumes_from_dcp_bitwise_with_unsharded_grads(tmp_path):
    """examples/finetune_tp.py on tp=2: 4 AdamW steps equal (bitwise: params, both moments,
    step counts) 2 steps, a DCP checkpoint and a resume from it into other params; every
    step's gradients, read with ``.grad.full_tensor()``, equal unsharded autograd at the
    same parameters."""
    import runpy

    import torch.nn.functional as F

    r = spawn(_resume_rank, 2, EXAMPLE, str(tmp_path / "ckpt"), init=True, timeout=600)[0]
    assert r["same"] and r["count"] > 0
    ns = runpy.run_path(EXAMPLE, run_name="finetune_tp")
    assert [s for s, _, _ in r["seen"]] == [0, 1, 2, 3]
    for step, full, grads in r["seen"]:
        params = fd.Params(ns["CONFIG"], sharding.tree.nest({k: v.clone().requires_grad_() for k, v in full.items()}))
        kw, target = ns["batch"](params.config, step)
        F.mse_loss(fd.apply(params, **kw), target).backward()
        for k, leaf in params.flat().items():
            err = ((grads[k] - leaf.grad).abs().max() / leaf.grad.abs().max().clamp_min(1e-30)).item()
            assert err <= REL, f"step {step}: {k} off by {err:.2e} of its max"

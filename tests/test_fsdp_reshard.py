"""``sharding.fsdp_options(reshard_after_forward=True)`` on 2 gloo ranks (fsdp=2).

Autograd then keeps each gathered block weight it saves as the local shard and
all-gathers it again in backward. Checked against the default (gathered weights kept):
every gradient (all params and the LoRA factors of an adapter on the fly), read as
``.grad.full_tensor()``, is bitwise the same; between forward and backward no gathered
block weight's storage is alive (weak references to the storage of every gathered tensor a
block loop got), where
the default keeps them; backward runs all-gathers with the option and none without. With
``fd.apply(checkpoint=True)`` too, the gradients are the same.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.utils._pytree as pytree
from _dist import spawn
from torch.multiprocessing.reductions import StorageWeakRef

import functional_dit as fd
import functional_dit.lora as lora
import sharding

SEED = 7


def _run(params, ad, kw, w, reshard: bool, checkpoint: bool = False) -> dict:
    from sharding import _autodiff, _fsdp

    for leaf in (*params.leaves(), *ad.leaves()):
        leaf.grad = None
        leaf.requires_grad_()
    alive, real = [], _fsdp.GatheredBlock.gathered

    def recording(self, saved=None):
        out = real(self, saved)
        local = {x.untyped_storage().data_ptr() for x in pytree.tree_leaves(self._tree) if isinstance(x, torch.Tensor)}
        gathered = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        alive.extend(
            StorageWeakRef(x.untyped_storage()) for x in gathered if x.untyped_storage().data_ptr() not in local
        )
        return out

    gathers, real_gather = [0], _autodiff._all_gather_dim0

    def counting():
        fn = real_gather()

        def call(*a, **k):
            gathers[0] += 1
            return fn(*a, **k)

        return call

    _fsdp.GatheredBlock.gathered = recording
    try:
        with sharding.fsdp_options(reshard_after_forward=reshard):
            loss = (fd.apply(params, **kw, lora=[(ad, 0.7)], checkpoint=checkpoint) * w).sum()
        gc.collect()
        kept = sum(not r.expired() for r in alive)
        _autodiff._all_gather_dim0 = counting
        loss.backward()
    finally:
        _fsdp.GatheredBlock.gathered = real
        _autodiff._all_gather_dim0 = real_gather
    grads = {f"p:{k}": v.grad.full_tensor() for k, v in params.flat().items() if v.grad is not None}
    grads.update({f"a:{k}": v.grad.full_tensor() for k, v in ad.flat().items()})
    return {"grads": grads, "kept": kept, "gathered": len(alive), "backward_gathers": gathers[0]}


def _rank(rank, world):
    import cases_flux1 as F1

    config = F1.TINY
    kw = F1.inputs(config, batch=2, txt_len=5, h=3, w=3, seed=1)
    w = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(11))
    mesh = sharding.make_mesh(fsdp=world)
    params = sharding.shard_params(fd.init(config, seed=SEED), mesh)
    ad = sharding.shard_params(lora.init(config, rank=2, seed=1, zero_b=False), mesh)
    return {
        "keep": _run(params, ad, kw, w, False),
        "reshard": _run(params, ad, kw, w, True),
        "reshard+checkpoint": _run(params, ad, kw, w, True, checkpoint=True),
    }


@pytest.mark.slow
def test_reshard_after_forward_regathers_in_backward_with_the_same_gradients():
    for r in spawn(_rank, 2, init=False, timeout=600):
        keep, reshard = r["keep"], r["reshard"]
        assert keep["grads"].keys() == reshard["grads"].keys()
        assert all(torch.equal(keep["grads"][k], v) for k, v in reshard["grads"].items())
        assert keep["gathered"] > 0 and keep["kept"] > 0 and keep["backward_gathers"] == 0, keep
        assert reshard["kept"] == 0 and reshard["backward_gathers"] > 0, reshard
        both = r["reshard+checkpoint"]  # the checkpoint holds its gathered inputs; the gradients are the same
        assert all(torch.equal(keep["grads"][k], v) for k, v in both["grads"].items())

"""The FSDP2 oracle: torch's own ``fully_shard`` on the stock diffusers module vs our fsdp.

On 2 gloo ranks, the stock ``FluxTransformer2DModel`` (the tiny config, `fd.init` weights)
gets ``torch.distributed.fsdp.fully_shard`` on every transformer block and on the root,
as torchtitan and diffusers' training scripts apply it; our params (the same weights)
are sharded on ``sharding.make_mesh(fsdp=2)``. The same global batch of 2, the same loss
(a fixed weighting of the output, summed): FSDP2 is data parallel (rank r feeds item r and
its gradients are averaged over ranks), so each rank's loss is scaled by the world size to
make the average the sum our ``fd.apply`` computes over its split batch. Every
parameter's gradient, read as ``.grad.full_tensor()`` on both sides, agrees within 1e-5 of
its largest entry, and the per-rank parameter bytes of both are recorded side by side
(docs/sharding.md, "The FSDP2 oracle").
"""

from __future__ import annotations

import pytest
import torch
from _dist import spawn

import functional_dit as fd
import sharding

SEED = 7
REL = 1e-5  # of each gradient's largest entry: fp32 sums in another order


def _case():
    import cases_flux1 as F1

    config = F1.TINY
    kw = F1.inputs(config, batch=2, txt_len=5, h=3, w=3, seed=1)
    B, S, C = kw["x"].shape
    return config, kw, torch.randn(B, S, C, generator=torch.Generator().manual_seed(11))


def _rank(rank, world):
    import cases_flux1 as F1
    from oracle import diffusers_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config, kw, w = _case()
    module, _ = diffusers_model(config, seed=SEED)
    module.requires_grad_(True)
    mesh1 = init_device_mesh("cpu", (world,))
    for block in (*module.transformer_blocks, *module.single_transformer_blocks):
        fully_shard(block, mesh=mesh1)
    fully_shard(module, mesh=mesh1)
    theirs_bytes = sum(p.to_local().numel() * p.element_size() for p in module.parameters())
    mine = {k: v[rank : rank + 1] if k in ("x", "t", "txt", "pooled", "guidance") else v for k, v in kw.items()}
    out = module(**F1.diffusers_kwargs(mine))[0]
    (world * (out * w[rank : rank + 1]).sum()).backward()  # x world: FSDP2 averages over ranks
    theirs = {k: p.grad.full_tensor() for k, p in module.named_parameters()}

    mesh = sharding.make_mesh(fsdp=world)
    params = sharding.shard_params(fd.init(config, seed=SEED), mesh)
    for leaf in params.leaves():
        leaf.requires_grad_()
    (fd.apply(params, **kw) * w).sum().backward()
    ours = {k: v.grad.full_tensor() for k, v in params.flat().items()}
    return {"theirs": theirs, "ours": ours, "bytes": (theirs_bytes, sharding.local_bytes(params))}


@pytest.mark.slow
def test_fsdp2_fully_shard_on_the_stock_module_gives_our_gradients():
    results = spawn(_rank, 2, init=False, timeout=600)
    config, kw, w = _case()
    n_bytes = fd.num_params(config) * 4
    for r in results:
        assert r["theirs"].keys() == r["ours"].keys()
        errs = {
            k: ((r["ours"][k] - v).abs().max() / v.abs().max().clamp_min(1e-30)).item() for k, v in r["theirs"].items()
        }
        worst = max(errs, key=errs.get)
        assert errs[worst] < REL, (worst, errs[worst])
        theirs, ours = r["bytes"]
        print(
            f"worst gradient error {errs[worst]:.2e} ({worst}); "
            f"per-rank parameter bytes: FSDP2 {theirs:,}, ours {ours:,}"
        )
        assert ours <= 1.02 * n_bytes / 2 and theirs <= 1.02 * n_bytes / 2  # both hold about half

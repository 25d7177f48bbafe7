"""Fine-tuning under tensor parallelism: sharded params, their gradients and an optimizer
step on the local shards; the params stay sharded throughout.

    torchrun --nproc-per-node 2 examples/finetune_tp.py

A tiny FLUX.1 learns a rectified-flow velocity (noise - x0) for a few SGD steps. Every
rank feeds the same batch (same seeds) and so computes the same loss from the
replicated output; ``loss.backward()`` then fills each DTensor leaf's ``.grad`` with a
DTensor of the same placements holding exactly this rank's slice of the unsharded
gradient, and ``torch.optim.SGD`` updates the local shards with no communication. Rank
0 repeats the steps unsharded and prints how far the two end apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import functional_dit as fd
import sharding

CONFIG = fd.PRESETS["flux1-tiny"]


def batch(config, step: int, size: int = 2, txt_len: int = 5, h: int = 3, w: int = 4) -> tuple[dict, torch.Tensor]:
    """Rectified-flow training inputs (the same on every rank: seeded by ``step``) and the
    velocity target."""
    g = torch.Generator().manual_seed(step)
    x0, noise = (torch.randn(size, h * w, config.in_channels, generator=g) for _ in range(2))
    t = torch.rand(size, generator=g)
    rows, cols = torch.meshgrid(torch.arange(h) * 1.0, torch.arange(w) * 1.0, indexing="ij")
    kw = dict(
        x=(1 - t[:, None, None]) * x0 + t[:, None, None] * noise,
        t=t,
        txt=torch.randn(size, txt_len, config.joint_attention_dim, generator=g),
        pooled=torch.randn(size, config.pooled_projection_dim, generator=g),
        guidance=torch.full((size,), 3.5),
        img_ids=torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(h * w, 3),
        txt_ids=torch.zeros(txt_len, 3),
    )
    return kw, noise - x0


def finetune(params, steps: int = 3, lr: float = 0.1, mesh=None) -> tuple[fd.Params, list[float]]:
    """``steps`` SGD steps on `batch`; with ``mesh``, on the params sharded over it.
    Returns the updated params (sharded like the input when ``mesh`` is given) and the losses."""
    if mesh is not None:
        params = sharding.shard_params(params, mesh)
    leaves = [leaf.requires_grad_() for leaf in params.leaves()]
    opt = torch.optim.SGD(leaves, lr=lr)
    losses = []
    for step in range(steps):
        kw, target = batch(params.config, step)
        loss = F.mse_loss(fd.apply(params, **kw), target)
        opt.zero_grad()
        loss.backward()
        opt.step()  # on DTensor leaves: each rank updates its own shard
        losses.append(loss.item())
    return params, losses


def main():
    mesh = sharding.make_mesh(tp=2)
    sharded, losses = finetune(fd.init(CONFIG, seed=0), mesh=mesh)
    assert all(hasattr(leaf, "placements") for leaf in sharded.leaves())  # still DTensors
    full = sharding.unshard(sharded)  # collective: every rank takes part
    if mesh.get_rank() == 0:
        plain, plain_losses = finetune(fd.init(CONFIG, seed=0))
        gap = max((a - b).abs().max().item() for a, b in zip(full.leaves(), plain.leaves()))
        print("losses  tp=2:", " ".join(f"{v:.5f}" for v in losses))
        print("losses  tp=1:", " ".join(f"{v:.5f}" for v in plain_losses))
        print(f"max |w_tp2 - w_tp1| after {len(losses)} steps: {gap:.2e}")


if __name__ == "__main__":
    main()

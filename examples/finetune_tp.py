"""Fine-tuning under tensor parallelism: sharded params, their gradients and an optimizer
step on the local shards; the params stay sharded throughout.

    torchrun --nproc-per-node 2 examples/finetune_tp.py

A tiny FLUX.1 learns a rectified-flow velocity (noise - x0) for a few SGD steps. Every
rank feeds the same batch (same seeds) and so computes the same loss from the
replicated output; ``loss.backward()`` then fills each DTensor leaf's ``.grad`` with a
DTensor of the same placements holding exactly this rank's slice of the unsharded
gradient, and ``torch.optim.SGD`` updates the local shards with no communication. Rank
0 repeats the steps unsharded and prints how far the two end apart.

Checkpoint and resume with torch's distributed checkpoint (`train`): AdamW steps whose
params and optimizer state go to ``torch.distributed.checkpoint`` through
``sharding.checkpoint_state`` (fused parameters in their block form, which DCP can
describe on any mesh). A run stopped after step k and resumed from its checkpoint on
the same mesh continues bitwise as if it had never stopped; the checkpoint also loads on
any other mesh, or in one process.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed.checkpoint as dcp
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


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state, laid out like the parameter


def checkpoint_state(params, opt) -> dict:
    """What DCP saves and loads in place: the params and AdamW's moments, each as
    ``sharding.checkpoint_state`` gives them, and the per-parameter step counts. Before the
    first step the optimizer's state is created zeroed, as AdamW creates it, to load into."""
    paths, leaves = zip(*params.flat().items())
    for leaf in leaves:
        if leaf not in opt.state:
            zeros = torch.zeros_like(leaf.detach())  # a DTensor stays one, same placements
            opt.state[leaf] = {"step": torch.tensor(0.0), **{m: zeros.clone() for m in MOMENTS}}
    state = {"params": sharding.checkpoint_state(params)}
    for m in MOMENTS:
        tree = sharding.tree.nest({p: opt.state[leaf][m] for p, leaf in zip(paths, leaves)})
        state[m] = sharding.checkpoint_state(params, tree)
    state["step"] = {p: opt.state[leaf]["step"] for p, leaf in zip(paths, leaves)}
    return state


def train(params, steps: int, mesh=None, lr: float = 1e-3, resume=None, save=None, on_grads=None):
    """AdamW steps ``start .. steps - 1`` on `batch` (``start``: 0, or where the checkpoint
    ``resume`` left off); with ``mesh``, on the params sharded over it. ``save``: a folder
    to write the DCP checkpoint to after the last step. ``on_grads(step, params)`` sees the
    gradients of each step before the update. Returns the params and the optimizer."""
    if mesh is not None:
        params = sharding.shard_params(params, mesh)
    opt = torch.optim.AdamW([leaf.requires_grad_() for leaf in params.leaves()], lr=lr)
    start = 0
    if resume is not None:
        state = {**checkpoint_state(params, opt), "next": torch.tensor(0)}
        dcp.load(state, checkpoint_id=resume)  # in place, into the (sharded) params and moments
        start = int(state["next"])
    for step in range(start, steps):
        kw, target = batch(params.config, step)
        loss = F.mse_loss(fd.apply(params, **kw), target)
        opt.zero_grad()
        loss.backward()
        if on_grads is not None:
            on_grads(step, params)
        opt.step()
    if save is not None:
        dcp.save({**checkpoint_state(params, opt), "next": torch.tensor(steps)}, checkpoint_id=save)
    return params, opt


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
    with tempfile.TemporaryDirectory() as tmp:  # every rank writes its own shards to one folder
        folder = [tmp]
        torch.distributed.broadcast_object_list(folder, src=0)
        whole, _ = train(fd.init(CONFIG, seed=0), steps=4, mesh=mesh)
        train(fd.init(CONFIG, seed=0), steps=2, mesh=mesh, save=folder[0])  # interrupted after step 2
        resumed, _ = train(fd.init(CONFIG, seed=1), steps=4, mesh=mesh, resume=folder[0])
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(whole.leaves(), resumed.leaves()))
        torch.distributed.barrier()  # rank 0 removes the folder only after every rank has read it
    if mesh.get_rank() == 0:
        print("resumed from a DCP checkpoint after 2 of 4 AdamW steps == uninterrupted:", same)


if __name__ == "__main__":
    main()

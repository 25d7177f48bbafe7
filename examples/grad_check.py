"""Gradient error of sharded `fd.apply` vs unsharded autograd, per family and mesh.

    python examples/grad_check.py            # spawns its own CPU gloo ranks (2, then 4)

For each tiny family model and mesh (tp=2, sp=2, dp=2; tp=2 x sp=2 on 4 ranks) every
rank computes the same loss from the replicated output, takes gradients with
``loss.backward()`` on DTensor leaves and with ``torch.func.grad`` over the sharded
`Params`, gathers them (`sharding.unshard`) and compares with unsharded autograd. Prints,
per family and mesh, the largest error over every parameter and the input x, each
relative to the largest entry of its own gradient (fp32).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp
import torch.utils._pytree as pytree

import functional_dit as fd
import sharding

MESHES = {2: [dict(tp=2), dict(sp=2), dict(dp=2)], 4: [dict(tp=2, sp=2)]}
CONFIGS = {  # 4 heads each, so tp x sp splits them twice
    "flux1": fd.Flux1Config(
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=24,
        pooled_projection_dim=16,
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    ),
    "flux2": fd.PRESETS["flux2-tiny"],
    "qwen-image": fd.PRESETS["qwen-image-tiny"],
}


def inputs(config, batch=3, txt_len=5, h=3, w=3, seed=0) -> dict:
    """Random inputs for any family: odd batch and lengths, so dp and sp pad."""
    g = torch.Generator().manual_seed(seed)
    S = h * w
    kw = dict(
        x=torch.randn(batch, S, config.in_channels, generator=g),
        t=torch.rand(batch, generator=g),
        txt=torch.randn(batch, txt_len, config.joint_attention_dim, generator=g),
    )
    if isinstance(config, fd.QwenImageConfig):
        kw["txt_mask"] = torch.arange(txt_len)[None] < torch.tensor([[txt_len], [txt_len - 2], [2]])[:batch]
        kw["img_shapes"] = [[(1, h, w)]] * batch
        return kw
    n_axes = len(config.axes_dims_rope)
    kw["img_ids"] = torch.randn(S, n_axes, generator=g) * 3
    kw["txt_ids"] = torch.randn(txt_len, n_axes, generator=g) * 3
    if config.guidance_embeds:
        kw["guidance"] = 1 + 4 * torch.rand(batch, generator=g)
    if isinstance(config, fd.Flux1Config):
        kw["pooled"] = torch.randn(batch, config.pooled_projection_dim, generator=g)
    return kw


def loss_fn(params, x, kw, w):
    return (fd.apply(params, **{**kw, "x": x}) * w).sum()


def _grad(leaf):
    return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad


def gradients(params, kw, w) -> dict:
    """Autograd gradients ``{path: grad}`` (and ``"x"``) through ``loss.backward()`` and
    through ``torch.func.grad``; sharded params give sharded grads, gathered here."""
    params = pytree.tree_map(lambda t: t.detach().requires_grad_(), params)
    x = kw["x"].clone().requires_grad_()
    loss_fn(params, x, kw, w).backward()
    back = pytree.tree_map(_grad, params)
    func, fx = torch.func.grad(loss_fn, argnums=(0, 1))(pytree.tree_map(torch.Tensor.detach, params), kw["x"], kw, w)
    full = sharding.unshard if any(hasattr(t, "placements") for t in params.leaves()) else (lambda p: p)
    return {"backward": {**full(back).flat(), "x": x.grad}, "func.grad": {**full(func).flat(), "x": fx}}


def max_rel_error(got: dict, want: dict) -> float:
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30)).item() for k in want)


def _rank(rank, world, port, cases, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    rows = []
    for shape in MESHES[world]:
        mesh = sharding.make_mesh(**shape)
        for name, config, kw, w, ref in cases:
            got = gradients(sharding.shard_params(fd.init(config, seed=0), mesh), kw, w)
            rows += [(name, shape, how, max_rel_error(g, ref)) for how, g in got.items()]
    queue.put((rank, rows))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main():
    cases = []
    for i, (name, config) in enumerate(CONFIGS.items()):
        kw = inputs(config, seed=i)
        w = torch.randn(fd.apply(fd.init(config, seed=0), **kw).shape, generator=torch.Generator().manual_seed(9))
        ref = gradients(fd.init(config, seed=0), kw, w)["backward"]
        cases.append((name, config, kw, w, ref))
    print(f"{'family':<12}{'mesh':<14}{'backward':>12}{'func.grad':>12}   max |g - g_ref| / max |g_ref|, fp32")
    ctx = mp.get_context("spawn")
    for world in MESHES:
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, world, port, cases, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=900) for _ in procs)
        for p in procs:
            p.join()
        worst = {}
        for rows in results.values():  # the worst rank
            for name, shape, how, err in rows:
                key = (name, " x ".join(f"{k}={v}" for k, v in shape.items()))
                worst.setdefault(key, {})[how] = max(err, worst.get(key, {}).get(how, 0.0))
        for (name, mesh), errs in worst.items():
            print(f"{name:<12}{mesh:<14}{errs['backward']:>12.2e}{errs['func.grad']:>12.2e}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""The optimisation around AdamW: the learning-rate schedule, clipping by the global
gradient norm over every shard, and the EMA of the LoRA factors."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import sharding
from functional_dit import lora

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, base: float, schedule: str, warmup: int, total: int) -> float:
    """The learning rate of step ``step`` (0-based) of ``total``: ``warmup`` steps rising
    linearly from 0, then constant, linear to 0 at ``total``, or a half cosine to 0. The
    formulas, float for float, of diffusers' ``get_scheduler`` (``constant_with_warmup``,
    ``linear``, ``cosine``), whose first warmup step has the rate 0."""
    if step < warmup:
        return base * (float(step) / float(max(1, warmup)))
    if schedule == "constant":
        return base * 1.0
    if schedule == "linear":
        return base * max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def _replicas(x) -> int:
    """How many ranks hold each element of ``x`` (a DTensor: the product of its mesh's
    replicated dims; a plain tensor: 1, this process only)."""
    if not isinstance(x, DTensor):
        return 1
    count = 1
    for dim, placement in enumerate(x.placements):
        if isinstance(placement, Replicate):
            count *= x.device_mesh.size(dim)
        elif not isinstance(placement, Shard):
            raise ValueError(f"a gradient: expected Shard or Replicate placements, got {x.placements}")
    return count


def global_norm(grads: list) -> float:
    """The 2-norm of all ``grads`` together, as one process holding them whole would get it
    (to fp64 rounding): each rank's local squares in fp64, each divided by its number of
    replicas, summed over every rank in one all-reduce when the grads are DTensors. A None
    (a factor the loss does not reach, the same on every rank) counts as zero."""
    grads = [g for g in grads if g is not None]
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        total += local.detach().double().square().sum().cpu() / _replicas(g)
    if any(isinstance(g, DTensor) for g in grads):
        device = grads[0].to_local().device
        total = total.to(device)
        dist.all_reduce(total)  # the mesh spans the world (--fsdp x --tp = WORLD_SIZE)
    return math.sqrt(float(total))


def clip_(grads: list, max_norm: float) -> float:
    """Scale ``grads`` in place so that their global norm is at most ``max_norm`` (torch's
    ``clip_grad_norm_`` rule: by ``max_norm / (norm + 1e-6)`` when below 1; Nones skipped);
    returns the norm before clipping."""
    norm = global_norm(grads)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            if g is not None:
                g.mul_(coef)
    return norm


def ema_init(adapter):
    """The EMA of ``adapter``'s factors: an fp32 copy laid out (sharded) like them."""
    return lora.Adapter(adapter.config, sharding.tree.map_tree(lambda _, v: v.detach().clone(), adapter.tree))


@torch.no_grad()
def ema_update_(ema, adapter, decay: float) -> None:
    """``ema = decay * ema + (1 - decay) * factors``, leaf by leaf on each rank's shards."""
    for e, p in zip(ema.leaves(), adapter.leaves(), strict=True):
        e.lerp_(p.detach(), 1.0 - decay)

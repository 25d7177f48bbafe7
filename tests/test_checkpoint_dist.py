"""Gradient checkpointing under tensor parallelism: ``fd.apply(..., checkpoint=True)`` on
params sharded tp=2 over 2 CPU gloo ranks gives the gradients of the plain sharded run.
The recomputation runs in backward, outside `fd.apply`'s mesh binding; the blocks'
all-reduces must run again there (`_layers.recompute_blocks` rebinds the mesh), or the
recomputed activations, and so the gradients, would be every rank's partial sums."""

from __future__ import annotations

import torch.utils._pytree as pytree
from _dist import spawn
from cases_flux2 import TINY, inputs

import functional_dit as fd
import sharding

REL = 1e-6  # of each gradient's largest entry: the same ops recomputed (measured 0)


def _grads(rank, world, kw):
    mesh = sharding.make_mesh(tp=2)
    out = {}
    for ckpt in (False, True):
        s = sharding.shard_params(fd.init(TINY, seed=3), mesh)
        for leaf in s.leaves():
            leaf.requires_grad_()
        fd.apply(s, checkpoint=ckpt, **kw).square().mean().backward()
        out[ckpt] = sharding.unshard(pytree.tree_map(lambda t: t.grad, s)).flat()
    return out


def test_tp2_checkpoint_grads_equal_plain():
    per_rank = spawn(_grads, 2, inputs(TINY, batch=2, txt_len=5, h=3, w=3), init=False, timeout=600)
    for rank, out in enumerate(per_rank):
        for k, want in out[False].items():
            err = (out[True][k] - want).abs().max() / want.abs().max().clamp_min(1e-30)
            assert err <= REL, (rank, k, err.item())

"""Stacks of parameter sets for ``torch.func.vmap``: ensembles and model soups.

    stacked = fd.stack_params([p0, p1, p2])          # every leaf gains a leading dim of 3
    outs = torch.func.vmap(lambda p: fd.apply(p, x, t, txt, **kw))(stacked)  # (3, B, S, C)
    soup = torch.utils._pytree.tree_map(lambda w: w.mean(0), stacked)        # a uniform soup
    p0, p1, p2 = fd.unstack_params(stacked)

As ``torch.func.stack_module_state`` does for modules, as ``jax.tree.map(jnp.stack, ...)``
does for pytrees. Works for plain (unsharded) params of one config.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from sharding.internal import is_dtensor

from .params import Params


def stack_params(params_list) -> Params:
    """One `Params` whose every leaf stacks the matching leaves of ``params_list`` along a
    new leading dim. ValueError when they differ in config, keys, shape, dtype or device."""
    params_list = list(params_list)
    if not params_list or not all(isinstance(p, Params) for p in params_list):
        raise ValueError(f"params_list: expected a non-empty sequence of Params, got {params_list!r:.200}")
    first = params_list[0]
    for i, p in enumerate(params_list[1:], 1):
        if p.config != first.config:
            raise ValueError(f"params_list[{i}]: expected the config of params_list[0], got {p.config}")
        a, b = first.flat(), p.flat()
        if a.keys() != b.keys():
            raise ValueError(f"params_list[{i}]: keys differ from params_list[0]'s: {sorted(set(a) ^ set(b))[:10]}")
        for k in a:
            if (a[k].shape, a[k].dtype, a[k].device) != (b[k].shape, b[k].dtype, b[k].device):
                raise ValueError(
                    f"params_list[{i}]: {k}: expected {tuple(a[k].shape)} {a[k].dtype} on {a[k].device} "
                    f"like params_list[0], got {tuple(b[k].shape)} {b[k].dtype} on {b[k].device}"
                )
    for k, x in first.flat().items():
        if is_dtensor(x):
            raise ValueError(f"params_list[0]: {k} is sharded (a DTensor); stack plain params, then shard")
    return pytree.tree_map(lambda *xs: torch.stack(xs), *params_list)


def unstack_params(stacked: Params) -> list[Params]:
    """The parameter sets of a `stack_params` result (views into it), in order."""
    if not isinstance(stacked, Params):
        raise ValueError(f"stacked: expected Params, got {type(stacked).__name__}")
    sizes = {k: x.shape[0] if x.ndim else None for k, x in stacked.flat().items()}
    n = next(iter(sizes.values()), None)
    odd = {k: s for k, s in sizes.items() if s != n}
    if n is None or odd:
        raise ValueError(
            f"stacked: expected one leading dim shared by every leaf, got {n} and {dict(list(odd.items())[:5])}"
        )
    return [pytree.tree_map(lambda x, i=i: x[i], stacked) for i in range(n)]

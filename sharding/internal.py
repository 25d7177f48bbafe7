"""Names `sharding` shares with the other packages of this repository but not with its
users (the ``equinox.internal`` idea): the one way to ask "is this a DTensor", to build
one placed like another, the checksum `check_replicated` compares ranks by, and the
fully sharded layout's dim rule, its gathers (a leaf's, a block's coalesced one) and a 1-D
mesh over several axes (which the pipelines' text encoder placement reuses on torch modules).

DTensor is imported once, with this module, and only where ``torch.distributed`` exists
(some builds ship without it): a plain tensor is never a DTensor there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _fsdp
from ._fsdp import block_gather as block_gather
from ._fsdp import fsdp_degree as fsdp_degree
from ._fsdp import gather_dims as gather_dims
from ._fsdp import gather_leaf as gather_leaf
from ._fsdp import gathered_blocks as gathered_blocks
from ._fsdp import mesh_fsdp as mesh_fsdp
from ._fsdp import prefetching as prefetching
from ._fsdp import refuse_fsdp as refuse_fsdp
from ._fsdp import stored_block as stored_block
from ._fsdp import wrap_tree as wrap_tree
from ._mesh import flat_mesh as flat_mesh
from ._plan import fsdp_dim as fsdp_dim
from ._replicated import describe

# a block's coalesced all-gather, issued (async) and finished: fd.apply's, and the text encoders' layers'
start_block, finish_block = _fsdp._start_block, _fsdp._finish_block


def _find_dtensor():
    if not dist.is_available():
        return None
    return DTensor


_DTENSOR = _find_dtensor()  # once, at import: a plain global read is what torch.compile traces without a note


def dtensor_cls():
    """``torch.distributed.tensor.DTensor``, or None where torch has no distributed support.
    (Not an ``lru_cache``: dynamo traces through one with a UserWarning per process.)"""
    return _DTENSOR


def is_dtensor(x) -> bool:
    """Whether ``x`` is a DTensor (a sharded leaf)."""
    cls = dtensor_cls()
    return cls is not None and isinstance(x, cls)


def local_tensor(x):
    """This rank's shard of a DTensor ``x`` (no autograd edge: for values, not gradients);
    anything else as it is."""
    return x._local_tensor if is_dtensor(x) else x


def like(local: torch.Tensor, ref):
    """``local`` as a DTensor placed like the DTensor ``ref`` (same mesh, placements,
    global shape and stride; no communication); ``local`` itself when ``ref`` is none."""
    if not is_dtensor(ref):
        return local
    return dtensor_cls().from_local(
        local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride()
    )


__all__ = ["describe", "dtensor_cls", "is_dtensor", "like", "local_tensor"]

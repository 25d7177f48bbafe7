"""Sharding as data: named meshes, placement pytrees and named-axis collectives."""

from ._axes import all_gather, all_to_all, axis_index, axis_size, bind, current_mesh, psum, ulysses
from ._seq import gather, local_len, pad_bias, shard

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "bind",
    "current_mesh",
    "gather",
    "local_len",
    "pad_bias",
    "psum",
    "shard",
    "ulysses",
]

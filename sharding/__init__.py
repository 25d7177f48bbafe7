"""Sharding as data: named meshes, placement pytrees and named-axis collectives."""

from ._axes import all_gather, all_to_all, axis_index, axis_size, bind, current_mesh, psum, ulysses
from ._plan import (
    DEFAULT_RULES,
    Replicate,
    Shard,
    bytes_per_rank,
    local_shape,
    local_slices,
    mesh_sizes,
    plan,
    specs_of,
    take,
)
from ._seq import gather, local_len, pad_bias, shard

__all__ = [
    "DEFAULT_RULES",
    "Replicate",
    "Shard",
    "bytes_per_rank",
    "local_shape",
    "local_slices",
    "mesh_sizes",
    "plan",
    "specs_of",
    "take",
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

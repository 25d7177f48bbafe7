"""Sharding as data: named meshes, placement pytrees and named-axis collectives.

``__all__`` is the user-level surface. `AXES` and `local_shape` stay importable but are
not in it (nothing outside this package uses them); DTensor helpers shared with the
other packages of the repository live in `sharding.internal`."""

from . import tree
from ._autodiff import forward_ad_active
from ._axes import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    bind,
    current_mesh,
    pmax,
    ppermute,
    psum,
    pvary,
    ulysses,
)
from ._checkpoint import checkpoint_state
from ._fsdp import fsdp_options
from ._map import P, shard_map
from ._mesh import AXES as AXES
from ._mesh import backend_for, default_device_type, make_mesh
from ._plan import (
    DEFAULT_RULES,
    FullyShard,
    Replicate,
    Shard,
    bytes_per_rank,
    check_placement,
    local_slices,
    mesh_sizes,
    plan,
    specs_of,
    take,
)
from ._plan import (
    local_shape as local_shape,
)
from ._replicated import check_replicated
from ._ring import merge, ring_attention, sequence_attention
from ._seq import SEQUENCE, chunk_index, gather, local_len, pad_bias, shard, split_size
from ._shard import (
    dtensor_from_local,
    dtensor_placements,
    live_bytes,
    local_bytes,
    local_shards,
    local_view,
    mesh_device,
    placement_of,
    shard_params,
    unshard,
)

__all__ = [
    "DEFAULT_RULES",
    "FullyShard",
    "P",
    "SEQUENCE",
    "Replicate",
    "Shard",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "backend_for",
    "bind",
    "bytes_per_rank",
    "check_placement",
    "check_replicated",
    "chunk_index",
    "checkpoint_state",
    "current_mesh",
    "default_device_type",
    "dtensor_from_local",
    "dtensor_placements",
    "forward_ad_active",
    "fsdp_options",
    "gather",
    "live_bytes",
    "local_bytes",
    "local_len",
    "local_shards",
    "local_slices",
    "local_view",
    "make_mesh",
    "mesh_device",
    "merge",
    "mesh_sizes",
    "pad_bias",
    "placement_of",
    "plan",
    "pmax",
    "ppermute",
    "psum",
    "ring_attention",
    "sequence_attention",
    "pvary",
    "shard",
    "shard_map",
    "shard_params",
    "split_size",
    "specs_of",
    "take",
    "tree",
    "ulysses",
    "unshard",
]

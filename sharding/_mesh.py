"""Named device meshes: ``make_mesh(tp, sp, dp, ring, fsdp)`` -> a ``DeviceMesh`` with dims
("dp", "fsdp", "ring", "sp", "tp"), "fsdp" and "ring" only when above 1.

"tp" is innermost, so a tensor-parallel group is made of neighbouring ranks (the same
node, the fastest links), then "sp" (Ulysses' all-to-all, the next heaviest traffic),
then "ring" (ring attention's neighbour-to-neighbour key/value passes, which tolerate
slower links), then "fsdp" (fully sharded parameters: one all-gather per block, the batch
split like dp), then "dp" — the usual torchtitan / USP / HSDP order. The
process group is initialised when none exists, with the backend that matches the
device and a finite timeout, so a collective whose peer died fails instead of hanging.
"""

from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

AXES = ("dp", "fsdp", "ring", "sp", "tp")
DEFAULT_TIMEOUT_S = 600.0  # long enough for a first XLA/Neuron compile between collectives
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "neuron": "neuron"}


def default_device_type() -> str:
    """The available accelerator's device type (cuda, neuron, tpu, ...), else "cpu"."""
    acc = getattr(torch, "accelerator", None)  # torch >= 2.6
    if acc is not None and hasattr(acc, "current_accelerator"):
        # torch 2.9 reports the build's accelerator even with no device or driver present
        # (a CUDA wheel on a CPU machine), so require a device too.
        dev = acc.current_accelerator()
        present = acc.device_count() > 0 if hasattr(acc, "device_count") else True
        if dev is not None and present and dev.type != "mps":  # mps has no collectives backend
            return dev.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device_type: str) -> str:
    """The process-group backend for ``device_type``: what the device registered with
    torch.distributed, else gloo/nccl/xccl/neuron."""
    lookup = getattr(dist, "get_default_backend_for_device", None)  # torch >= 2.6
    try:
        found = lookup(device_type) if lookup is not None else None
    except (RuntimeError, ValueError):
        found = None
    backend = found or _BACKENDS.get(device_type)
    if backend is None:
        raise ValueError(
            f"device_type: no process-group backend is registered for {device_type!r}; import its torch "
            f"plugin first (e.g. torch_tpu) or call torch.distributed.init_process_group yourself"
        )
    return backend


def _timeout(timeout) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout: expected positive seconds or a timedelta, got {timeout!r}")
    return datetime.timedelta(seconds=timeout)


def _set_device(device_type: str, only_if_unset: bool = False) -> None:
    """Select this process's accelerator from LOCAL_RANK (else RANK), modulo the device
    count; with ``only_if_unset``, only when the device runtime is not initialised yet
    (a device the user chose is kept), as ``init_device_mesh`` does."""
    module = getattr(torch, device_type, None)
    if device_type == "cpu" or module is None or not hasattr(module, "set_device"):
        return
    if only_if_unset and (not hasattr(module, "is_initialized") or module.is_initialized()):
        return
    count = module.device_count() if hasattr(module, "device_count") else 1
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    module.set_device(local % max(count, 1))


def init_process_group(device_type: str, world: int, timeout) -> None:
    """Initialise the default process group from the torchrun environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or a 1-rank group in a plain process."""
    backend, timeout = backend_for(device_type), _timeout(timeout)
    if "WORLD_SIZE" not in os.environ:
        if world != 1:
            raise ValueError(
                f"tp*sp*dp*ring*fsdp: expected 1 in a single process (WORLD_SIZE is unset), got {world}; "
                f"launch with torchrun --nproc-per-node {world}"
            )
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world:
        raise ValueError(f"tp*sp*dp*ring*fsdp: expected the world size WORLD_SIZE={env_world}, got {world}")
    _set_device(device_type)
    dist.init_process_group(backend, timeout=timeout)


def make_mesh(
    tp: int = 1,
    sp: int = 1,
    dp: int = 1,
    device_type: str | None = None,
    timeout=DEFAULT_TIMEOUT_S,
    *,
    ring: int = 1,
    fsdp: int = 1,
):
    """A ``DeviceMesh`` named ("dp", "fsdp", "ring", "sp", "tp") in that order, tp innermost;
    "fsdp" and "ring" only when their degree is above 1 (`mesh_axes`). ``fsdp`` holds
    1/fsdp of every parameter per rank (after tp's split), gathered per block in
    ``fd.apply``, and splits the batch like ``dp``
    (docs/sharding.md, "Fully sharded parameters"). ``sp`` splits the sequence with
    Ulysses' all-to-all (its degree, times tp, must divide the heads); ``ring`` splits it
    further with ring attention (any degree); docs/sharding.md says when to choose which.

    ``device_type`` defaults to the available accelerator, else "cpu". When no process
    group exists one is initialised (gloo, nccl, neuron, ... to match the device) with
    ``timeout`` seconds per collective. Every mesh sub-group gets ``timeout`` too (torch's
    ``init_device_mesh`` would give them its 30-minute default, so a dead peer on a
    tp x sp mesh hung its neighbours for half an hour); a mesh dim that spans the whole
    world reuses the default group and keeps its timeout. ValueError when tp*sp*dp*ring*fsdp != the
    world size.
    """
    for name, n in (("tp", tp), ("sp", sp), ("dp", dp), ("ring", ring), ("fsdp", fsdp)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}: expected a positive int, got {n!r}")
    world = tp * sp * dp * ring * fsdp
    device_type = device_type or default_device_type()
    if not dist.is_initialized():
        init_process_group(device_type, world, timeout)
    elif dist.get_world_size() != world:
        raise ValueError(
            f"tp*sp*dp*ring*fsdp: expected the world size {dist.get_world_size()}, got {tp}*{sp}*{dp}*{ring}*{fsdp} = "
            f"{world} (tp={tp}, sp={sp}, dp={dp}, ring={ring}, fsdp={fsdp})"
        )
    else:  # a group the caller made: pick the device if nobody has yet
        _set_device(device_type, only_if_unset=True)
    sizes = {"dp": dp, "fsdp": fsdp, "ring": ring, "sp": sp, "tp": tp}
    names = mesh_axes(fsdp=fsdp, ring=ring)
    ranks = torch.arange(world).reshape([sizes[n] for n in names])
    groups = [_dim_group(ranks, d, _timeout(timeout)) for d in range(ranks.ndim)]
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)


def mesh_axes(fsdp: int = 1, ring: int = 1) -> tuple[str, ...]:
    """The dims `make_mesh` gives its mesh: "dp", "sp", "tp" always, "fsdp" and "ring" only
    when larger than 1 (an absent axis is size 1 to every named-axis helper). DTensor's
    sharding propagation grows exponentially with the mesh's dims (an optimizer step over
    tp-sharded leaves took 8x as long on a 5-dim mesh as on the 3-dim one), so unused
    axes are left out."""
    return tuple(a for a in AXES if a in ("dp", "sp", "tp") or {"fsdp": fsdp, "ring": ring}[a] > 1)


def _dim_group(ranks: torch.Tensor, dim: int, timeout: datetime.timedelta):
    """This rank's process group along mesh dim ``dim`` (every rank creates every group)."""
    size = ranks.shape[dim]
    if size == ranks.numel():
        return dist.group.WORLD
    rows = ranks.movedim(dim, -1).reshape(-1, size).tolist()
    mine, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout)
    return mine


_FLAT: dict = {}  # (id(mesh), axes) -> (mesh, its flattened 1-D mesh): made once (group creation is collective)


def flat_mesh(mesh, axes: tuple[str, ...], name: str):
    """A 1-D mesh named ``name`` over this rank's ranks of ``mesh`` that differ only in
    ``axes`` (several mesh dims as one group, the first axis major: rank index
    ``i0 * size1 + i1`` for two), e.g. the fsdp x tp plane, so one collective spans them; on
    it ``[Shard(d), Shard(d)]`` on ``mesh[axes]`` is ``Shard(d)``. Creating its process groups
    is collective: every rank of ``mesh`` must call it, in the same order; cached per mesh."""
    key = (id(mesh), tuple(axes))
    if key in _FLAT:
        return _FLAT[key][1]
    names = tuple(mesh.mesh_dim_names)
    keep = [names.index(a) for a in axes]
    ranks = mesh.mesh.permute(*[d for d in range(len(names)) if d not in keep], *keep)
    rows = ranks.reshape(-1, math.prod(ranks.shape[len(names) - len(keep) :])).tolist()
    if len(rows) == 1 and len(rows[0]) == dist.get_world_size():
        group = dist.group.WORLD
    else:
        group, _ = dist.new_subgroups_by_enumeration(rows, timeout=_timeout(DEFAULT_TIMEOUT_S))
    mine = next(r for r in rows if dist.get_rank() in r)
    flat = DeviceMesh.from_group(group, mesh.device_type, mesh=torch.tensor(mine), mesh_dim_names=(name,))
    _FLAT[key] = (mesh, flat)
    return flat

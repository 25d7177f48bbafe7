"""`fd.sample` over ranks: which images each dp group makes, the one agreement check
before the first step, and gathering the images afterwards.

With ``n`` images on a mesh with ``dp`` groups (``n >= dp``), group ``g`` takes a
contiguous share (the first ``n % dp`` groups one image more) and runs it with the mesh's
sp and tp axes only, so its model calls never meet another group's batch. With fewer
images than groups every group runs every image and ``fd.apply`` splits the batch over
dp (CFG parallelism: one branch per group).

Ranks that must compute the same thing (the tp/sp ranks of one dp group, or every rank
when the batch is split inside ``fd.apply``) must agree on every scalar and input tensor;
one ``all_gather_object`` over the world compares them, so a mismatch anywhere is the
same ValueError on every rank, before any collective whose size it could change.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from sharding.internal import describe as _describe


@dataclasses.dataclass(frozen=True)
class Layout:
    """``split``: distinct images per dp group; ``group``: the agreement key (the dp index
    when split, else 0); ``share``: the images this rank computes; ``owned``: those it
    returns with ``local=True`` (each image owned by exactly one dp group); ``mesh``: the
    mesh to bind for model calls on local params when split; ``dp_group``: the process
    group over dp."""

    split: bool
    group: int
    share: tuple[int, ...]
    owned: tuple[int, ...]
    mesh: object = None
    dp_group: object = None


def shares(n: int, dp: int) -> list[range]:
    """Contiguous shares of ``n`` images over ``dp`` groups, the first ``n % dp`` one longer."""
    q, r = divmod(n, dp)
    starts = [g * q + min(g, r) for g in range(dp + 1)]
    return [range(starts[g], starts[g + 1]) for g in range(dp)]


def _dp(mesh) -> tuple[int, int]:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh is None or "dp" not in names:
        return 1, 0
    return mesh.size(names.index("dp")), mesh.get_local_rank("dp")


def layout(mesh, n: int) -> Layout:
    """How ``n`` images are made on ``mesh`` (the params' mesh, or None)."""
    dp, index = _dp(mesh)
    if dp == 1 or n < dp:
        every = tuple(range(n))
        return Layout(False, 0, every, every if index == 0 else ())
    share = tuple(shares(n, dp)[index])
    inner = mesh[tuple(a for a in mesh.mesh_dim_names if a != "dp")]
    return Layout(True, index, share, share, inner, mesh.get_group("dp"))


# ----------------------------------------------------------------------------- agreement


def _world():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def fingerprint(v):
    """A picklable, comparable summary: tensors by (dtype, shape, checksums), lists by item."""
    if isinstance(v, torch.Tensor):
        return _describe(v)
    if isinstance(v, (list, tuple)):
        return tuple(fingerprint(x) for x in v)
    return repr(v)


def _show(v) -> str:
    if isinstance(v, tuple) and len(v) == 3 and isinstance(v[1], tuple) and isinstance(v[2], tuple):
        return f"shape {v[1]} {v[0]} checksum {v[2][0]}"
    if isinstance(v, tuple) and v and all(isinstance(x, tuple) for x in v):
        return f"{len(v)} chunks, the first {_show(v[0])}"
    return str(v)


def check(lay: Layout, values: dict, tensors: dict) -> None:
    """Raise the same ValueError on every rank unless the ranks of each agreement group hold
    equal ``values`` (scalars) and ``tensors`` (names -> tensor or list of chunk tensors)."""
    if _world() == 1:
        return
    named = {k: ("value", fingerprint(v)) for k, v in values.items()}
    named |= {k: ("tensor", fingerprint(v)) for k, v in tensors.items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (lay.group, lay.split, named))
    _raise_first_mismatch(every)


def _raise_first_mismatch(every: list) -> None:
    groups: dict = {}
    for rank, (g, split, named) in enumerate(every):
        groups.setdefault(g, []).append((rank, split, named))
    for g, members in sorted(groups.items()):
        where = f" of dp group {g}" if any(m[1] for m in members) else ""
        names = list(dict.fromkeys(k for m in members for k in m[2]))
        for name in names:
            held: dict = {}
            for rank, _, named in members:
                held.setdefault(named.get(name, ("value", "absent")), []).append(rank)
            if len(held) > 1:
                what = next(iter(held))[0]
                found = "; ".join(f"ranks {rs}: {_show(v[1])}" for v, rs in held.items())
                raise ValueError(f"{name}: expected the same {what} on every rank{where}, got {found}")


# ----------------------------------------------------------------------------- results


def concat(parts: list, output_type: str):
    """One result from per-chunk results (PIL lists, arrays or tensors)."""
    parts = [p for p in parts if p is not None and len(p)]
    if output_type == "pil":
        return [img for p in parts for img in p]
    if not parts:
        return None
    return np.concatenate(parts) if output_type == "np" else torch.cat(parts)


def collect(lay: Layout, mine, output_type: str, local: bool):
    """``mine`` (this group's share, in order) -> every image in order on every rank, or
    with ``local`` (the owned indices, their images)."""
    if local:
        return list(lay.owned), (mine if lay.owned else concat([], output_type))
    if not lay.split:
        return mine
    sent = mine.cpu() if isinstance(mine, torch.Tensor) else mine
    every: list = [None] * dist.get_world_size(lay.dp_group)
    dist.all_gather_object(every, (lay.share, sent), group=lay.dp_group)
    every.sort(key=lambda e: e[0][0] if e[0] else -1)
    out = concat([e[1] for e in every], output_type)
    return out.to(mine.device) if isinstance(mine, torch.Tensor) else out

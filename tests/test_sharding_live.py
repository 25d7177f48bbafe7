"""Live storage of sharded params, in one process: what a rank's shards keep alive
(`sharding.live_bytes`: the unique storages' ``untyped_storage().nbytes()``) is exactly
their elements' bytes and the plan's count on every mesh kind, cut at each rank's
coordinates by the code `shard_params` runs (`sharding.local_shards`); the memory table
measures it at released sizes on the meta device. The same through `shard_params` on real
gloo ranks, with ``full_tensor()`` of every leaf: tests/test_fsdp.py (its 4-rank spawn).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import functional_dit as fd
import sharding

MESHES = [
    dict(fsdp=4),
    dict(tp=4),
    dict(fsdp=2, tp=2),
    dict(tp=2, sp=2),
    dict(ring=4),
    dict(tp=2, ring=2),
    dict(fsdp=2, tp=4),
]
FAMILIES = ("flux1-tiny", "flux2-tiny", "qwen-image-tiny", "flux3-tiny", "qwen-image-2.1-tiny")
FUSED = (  # FLUX.2's leaves fused from equal blocks: on fsdp x tp they were views of the tp slice
    "transformer_blocks.0.ff.linear_in.weight",
    "transformer_blocks.0.ff_context.linear_in.weight",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight",
    "single_transformer_blocks.0.attn.to_out.weight",
)


def _coords(shape: dict) -> list[dict]:
    """Every rank's coordinates ``{axis: (index, size)}`` on a mesh of ``shape``."""
    axes = list(shape.items())
    return [{a: (i, n) for (a, n), i in zip(axes, idx)} for idx in itertools.product(*(range(n) for _, n in axes))]


def _fits(config, shape) -> bool:
    try:
        sharding.plan(config, shape)
    except ValueError:  # heads not divisible by tp (x sp)
        return False
    return True


@pytest.mark.parametrize("name", FAMILIES)
def test_every_rank_holds_exactly_its_elements_on_every_mesh_kind(name):
    config = fd.PRESETS[name]
    params = fd.init(config, seed=0)
    placed = 0
    for shape in (m for m in MESHES if _fits(config, m)):
        plan, want = sharding.plan(config, shape), sharding.bytes_per_rank(config, None, shape, torch.float32)
        for coords in _coords(shape):
            local = sharding.local_shards(params, coords, plan)
            got = (sharding.live_bytes(local), sharding.local_bytes(local))
            assert got == (want, want), (name, coords, got, want)
        placed += 1
    assert placed >= 4, name  # fsdp, ring, fsdp x tp and tp x ring always fit; tp=4 and tp x sp where the heads divide


def test_fused_leaves_on_fsdp_x_tp_own_their_bytes_and_hold_the_right_slices():
    """FLUX.2's fused leaves on fsdp=2 x tp=2: each shard owns exactly its bytes (it was a
    view of a storage twice its size) and holds what the ranges say (per block over tp, then
    fsdp's slice of the other dim)."""
    config = fd.PRESETS["flux2-tiny"]
    params = fd.init(config, seed=0)
    plan = sharding.tree.flatten(sharding.plan(config, {"fsdp": 2, "tp": 2}))
    full = params.flat()
    for coords in _coords({"fsdp": 2, "tp": 2}):
        local = sharding.local_shards(params, coords).flat()
        for path in FUSED:
            x, ranges = local[path], sharding.local_slices(full[path].shape, plan[path], coords)
            assert len({d for d, _, _ in ranges}) == 2 and plan[path].inner.blocks is not None, path
            held = x.untyped_storage().nbytes()
            assert held == x.numel() * x.element_size(), (path, coords, held)
            want = full[path]
            for dim in dict.fromkeys(d for d, _, _ in ranges):  # cut as the docstring of local_slices says
                want = torch.cat([want.narrow(d, a, b - a) for d, a, b in ranges if d == dim], dim)
            assert torch.equal(x, want), (path, coords)


def test_live_bytes_counts_each_storage_once_and_a_view_as_its_whole_buffer():
    buf = torch.zeros(10)
    tree = {"a": buf[:2], "b": {"c": buf[2:4]}, "d": torch.zeros(3, dtype=torch.float64)}
    assert sharding.live_bytes(tree) == 10 * 4 + 3 * 8
    assert sharding.local_bytes(tree) == 4 * 4 + 3 * 8
    q = fd.quantize(fd.init("flux1-tiny"), "fp8-row")  # wrapper leaves: their fp8 data and scales
    w = q.flat()["transformer_blocks.0.attn.to_q.weight"]
    assert sharding.live_bytes({"w": w}) == w.qdata.numel() + w.scale.numel() * w.scale.element_size()
    meta = fd.init("flux2-dev", dtype=torch.bfloat16, device="meta")  # released size, nothing allocated
    got = sharding.live_bytes(sharding.local_shards(meta, {"fsdp": (1, 4), "tp": (1, 2)}))
    assert got == sharding.bytes_per_rank(fd.PRESETS["flux2-dev"], None, {"fsdp": 4, "tp": 2}, torch.bfloat16)


def test_local_shards_names_bad_coordinates():
    params = fd.init("flux2-tiny")
    with pytest.raises(ValueError, match=r"coords: expected a mapping \{axis: \(index, size\)\}, got \{'tp': 2\}"):
        sharding.local_shards(params, {"tp": 2})
    with pytest.raises(ValueError, match=r"coordinate 2 is outside axis 'tp' of size 2"):
        sharding.local_shards(params, {"tp": (2, 2)})
    with pytest.raises(ValueError, match=r"heads do not divide by the degree tp=3"):
        sharding.local_shards(params, {"tp": (0, 3)})

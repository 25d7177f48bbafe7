"""sharding: plans, slices, byte counts, meshes, collectives, shard_map, shard/unshard and
failure bounds. Pure tests run in-process; the rest in two 2-rank gloo spawns."""

from __future__ import annotations

import dataclasses
import os
import re
import runpy
import subprocess
import sys
import time
import warnings

import pytest
import torch
from _dist import spawn

import functional_dit as fd
import sharding
from functional_dit import PACKED, Block, ParamSpec
from sharding import P, Replicate, Shard

FLUX1 = fd.PRESETS["flux1-tiny"]  # 2 heads x 16: inner 32, mlp 128
FLUX2 = fd.PRESETS["flux2-tiny"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _get(tree, path):
    for key in path.split("."):
        tree = tree[key]
    return tree


# ----------------------------------------------------------------------------- plan


def test_plan_flux1_placements():
    pl = sharding.plan(FLUX1, {"tp": 2})
    assert set(dict(sharding._plan.leaves(pl))) == set(fd.to_state_dict(fd.init(FLUX1)))
    n, m = FLUX1.inner_dim, FLUX1.mlp_hidden_dim
    want = {
        "transformer_blocks.0.attn.to_q.weight": Shard(0, "tp"),  # column-parallel
        "transformer_blocks.0.attn.to_q.bias": Shard(0, "tp"),
        "transformer_blocks.0.attn.to_out.0.weight": Shard(1, "tp"),  # row-parallel
        "transformer_blocks.0.attn.to_out.0.bias": Replicate(),  # added once, after the psum
        "transformer_blocks.0.attn.norm_q.weight": Replicate(),  # QK norm over head_dim
        "transformer_blocks.0.norm1.linear.weight": Shard(0, "tp"),  # AdaLN: contiguous, output gathered
        "transformer_blocks.0.norm1.linear.bias": Shard(0, "tp"),
        "single_transformer_blocks.1.norm.linear.weight": Shard(0, "tp"),
        "norm_out.linear.weight": Shard(0, "tp"),  # (scale, shift)
        "transformer_blocks.0.ff.net.0.proj.weight": Shard(0, "tp"),
        "transformer_blocks.0.ff.net.2.weight": Shard(1, "tp"),
        # fused [attn, mlp] in units of gcd(n, m) = n; proj_mlp's rows cut alike
        "single_transformer_blocks.1.proj_out.weight": Shard(1, "tp", (n,) * (1 + m // n)),
        "single_transformer_blocks.1.proj_mlp.weight": Shard(0, "tp", (n,) * (m // n)),
        "single_transformer_blocks.1.attn.to_q.weight": Shard(0, "tp"),  # one unit: contiguous heads
        "x_embedder.weight": Replicate(),
        "proj_out.weight": Replicate(),
    }
    for path, placement in want.items():
        assert _get(pl, path) == placement, path
    assert all(p == Replicate() for _, p in sharding._plan.leaves(sharding.plan(FLUX1, {"tp": 1, "sp": 2})))


def test_plan_accepts_params_config_specs_and_rules():
    p = fd.init(FLUX1)
    a = sharding.plan(p, {"tp": 2})
    assert a == sharding.plan(FLUX1, {"tp": 2}) == sharding.plan(fd.param_specs(FLUX1), {"tp": 2})
    # a rule for an axis the defaults do not split is fine
    assert sharding.plan(FLUX1, {"tp": 2}, {"heads": "tp", "mlp": "tp", "mod": "tp", "head_dim": None}) == a
    # the modulation rows split contiguously by default (the model all-gathers their output)
    assert a["norm_out"]["linear"]["weight"] == Shard(0, "tp")
    # other rules make storage layouts: here the modulation rows stay whole (fd.apply refuses
    # such params, see test_two_ranks_collectives_shard_map_and_shard_params)
    storage = sharding.plan(FLUX1, {"tp": 2}, {**sharding.DEFAULT_RULES, "mod": None})
    assert storage["norm_out"]["linear"]["weight"] == Replicate()


def _expect(match, fn, *args):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_plan_rejects_before_any_data_moves():
    odd = dataclasses.replace(FLUX1, num_attention_heads=3, axes_dims_rope=(4, 6, 6))
    _expect(r"num_attention_heads: 3 heads do not divide by the degree tp=2", sharding.plan, odd, {"tp": 2})
    _expect(r"num_attention_heads: 2 heads do not divide by the degree tp=4", sharding.plan, FLUX1, {"tp": 4})
    _expect(
        r"Ulysses .* the 1 heads per rank \(2 / tp=2\) to divide by the degree sp=2",
        sharding.plan,
        FLUX1,
        {"tp": 2, "sp": 2},
    )
    specs = {
        "a": {"weight": ParamSpec((6, 4), ("mlp", "embed"))},
        "fused": ParamSpec((8, 4), (PACKED, "embed"), (Block("attn", 2, "heads"), Block("mlp", 6, "mlp"))),
    }
    _expect(r"a\.weight: dim 0 \('mlp'\) of size 6 does not divide by tp=4", sharding.plan, specs, {"tp": 4})
    _expect(
        r"fused: dim 0 block 'attn' of size 2 does not divide by tp=4",
        sharding.plan,
        {"fused": specs["fused"]},
        {"tp": 4},
    )
    mixed = {"x": ParamSpec((8, 4), (PACKED, "embed"), (Block("a", 4, "heads"), Block("b", 4, None)))}
    _expect(r"x: the fused blocks .* map to different mesh axes", sharding.plan, mixed, {"tp": 2})
    _expect(
        r"rules: 'headz' is not a logical axis of these parameters; expected one of \[.*'heads'",
        sharding.plan,
        FLUX1,
        {"tp": 2},
        {**sharding.DEFAULT_RULES, "headz": "tp"},
    )
    _expect(
        r"rules: 'embed' -> 'model': expected a mesh axis in \('tp',\), got 'model'",
        sharding.plan,
        FLUX1,
        {"tp": 2},
        {"embed": "model"},
    )
    _expect(r"rules: expected a mapping", sharding.plan, FLUX1, {"tp": 2}, {"heads": 3})
    _expect(r"mesh: axis 'tp' must have a positive int size", sharding.plan, FLUX1, {"tp": 0})
    _expect(r"mesh: axis 'sp' must have a positive int size, got True", sharding.plan, FLUX1, {"sp": True})
    _expect(r"params_or_config: expected a specs tree", sharding.plan, object(), {"tp": 2})


def test_honest_layouts_and_their_errors_name_the_parameter():
    """Modulations split contiguously (their k·C rows must divide); fused dims of unequal
    blocks have no DTensor placement; a fused dim whose heads are cut into units cannot
    shard its heads (FLUX.2 with mlp_ratio 2.5: units of gcd(64, 160) = 32 rows, half the
    heads; sp alone is fine)."""
    from functional_dit.params import mod_spec

    _expect(
        r"norm\.weight: dim 0 \('mod'\) of size 9 does not divide by tp=2",
        sharding.plan,
        {"norm": mod_spec(3, ("shift", "scale", "gate"))},
        {"tp": 2},
    )
    _expect(
        r"plan: w: Shard\(dim=0, axis='tp', blocks=\(2, 6\)\): blocks of unequal sizes have no DTensor placement",
        sharding.dtensor_placements,
        Shard(0, "tp", (2, 6)),
        ("tp",),
        "plan: w",
    )
    odd = dataclasses.replace(FLUX2, mlp_ratio=2.5)
    fused = "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"
    assert _get(sharding.plan(odd, {"sp": 2}), fused) == Replicate()
    assert _get(fd.param_specs(odd), fused).blocks[0] == Block("q.0", 32, "heads")
    _expect(
        r"to_qkv_mlp_proj\.weight: fused block 'q\.0' is a unit of 32 of the 64 rows of the heads; sharding it "
        r"over tp=2 would reorder the heads a rank holds",
        sharding.plan,
        odd,
        {"tp": 2},
    )


# ----------------------------------------------------------------------------- slices


def test_local_slices_fused_blocks_flux1_proj_out():
    """FLUX.1's single-block proj_out input is cat([attn (32), mlp (128)]), cut into five
    units of 32: rank r holds columns 32u + [16r, 16r+16) of every unit u, and proj_mlp's
    rows are cut into the same four MLP units, so the hidden units agree."""
    spec = _get(fd.param_specs(FLUX1), "single_transformer_blocks.0.proj_out.weight")
    placement = _get(sharding.plan(FLUX1, {"tp": 2}), "single_transformer_blocks.0.proj_out.weight")
    assert sharding.local_slices(spec, placement, {"tp": (0, 2)}) == [(1, 32 * u, 32 * u + 16) for u in range(5)]
    assert sharding.local_slices(spec, placement, {"tp": (1, 2)}) == [(1, 32 * u + 16, 32 * u + 32) for u in range(5)]
    full = torch.arange(32 * 160).reshape(32, 160)
    local = sharding.take(full, sharding.local_slices(spec, placement, {"tp": (1, 2)}))
    assert torch.equal(local, torch.cat([full[:, 32 * u + 16 : 32 * u + 32] for u in range(5)], 1))
    mlp = "single_transformer_blocks.0.proj_mlp.weight"
    mlp_spec, mlp_placement = _get(fd.param_specs(FLUX1), mlp), _get(sharding.plan(FLUX1, {"tp": 2}), mlp)
    cols = [a - 32 for _, a, _ in sharding.local_slices(spec, placement, {"tp": (1, 2)})[1:]]
    assert [a for _, a, _ in sharding.local_slices(mlp_spec, mlp_placement, {"tp": (1, 2)})] == cols


@pytest.mark.parametrize("tp", [2, 4])
def test_local_slices_partition_flux2_qkv_mlp(tp):
    """FLUX.2's to_qkv_mlp_proj rows [q, k, v, gate, up]: over all ranks every row is held
    exactly once, and rank r's rows are the r-th slice of each block, in block order."""
    path = "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"
    spec, placement = _get(fd.param_specs(FLUX2), path), _get(sharding.plan(FLUX2, {"tp": tp}), path)
    k = len(spec.blocks)  # q, k, v and the gate and up blocks cut into units of gcd(n, m)
    assert placement.blocks == tuple(b.size for b in spec.blocks) and len(set(placement.blocks)) == 1 and k > 5
    rows = []
    for r in range(tp):
        ranges = sharding.local_slices(spec, placement, {"tp": (r, tp)})
        offsets = [sum(placement.blocks[:i]) for i in range(k)]
        assert ranges == [(0, o + r * b // tp, o + (r + 1) * b // tp) for o, b in zip(offsets, placement.blocks)]
        rows += [i for _, a, b in ranges for i in range(a, b)]
    assert sorted(rows) == list(range(spec.shape[0]))


def test_local_slices_replicate_and_errors():
    assert sharding.local_slices((3, 4), Replicate(), {"tp": (1, 2)}) == [(0, 0, 3)]
    assert sharding.local_slices((), Replicate(), {}) == []
    assert sharding.local_slices((8, 4), Shard(0, "tp"), {}) == [(0, 0, 8)]  # absent axis: size 1
    _expect(r"placement: dim 2 is outside", sharding.local_slices, (8, 4), Shard(2, "tp"), {"tp": (0, 2)})
    _expect(
        r"blocks \(3, 5\) of dim 0 \(size 8\) do not split by tp=2",
        sharding.local_slices,
        (8, 4),
        Shard(0, "tp", (3, 5)),
        {"tp": (0, 2)},
    )
    _expect(r"coordinate 2 is outside axis 'tp' of size 2", sharding.local_slices, (8,), Shard(0, "tp"), {"tp": (2, 2)})


def test_fused_bias_is_sliced_per_block_like_its_weight():
    """A fused projection with a bias (diffusers' TP shipped a contiguous bias slice under a
    per-block weight slice): both get the same per-block Shard, so each rank's local
    linear is exactly its rows of the full one."""
    blocks = (Block("q", 4, "heads"), Block("gate", 6, "mlp"), Block("up", 6, "mlp"))
    specs = {"w": ParamSpec((16, 3), (PACKED, "embed"), blocks), "b": ParamSpec((16,), (PACKED,), blocks)}
    pl = sharding.plan(specs, {"tp": 2})
    assert pl == {"w": Shard(0, "tp", (4, 6, 6)), "b": Shard(0, "tp", (4, 6, 6))}
    # small integers: every product and sum is exact, whatever kernel the shapes pick
    w, b, x = (torch.randint(-4, 5, shape).float() for shape in ((16, 3), (16,), (5, 3)))
    full = torch.nn.functional.linear(x, w, b)
    for r in range(2):
        ranges = sharding.local_slices(specs["b"], pl["b"], {"tp": (r, 2)})
        assert ranges == sharding.local_slices(specs["w"], pl["w"], {"tp": (r, 2)})
        local = torch.nn.functional.linear(x, sharding.take(w, ranges), sharding.take(b, ranges))
        rows = [i for _, a, z in ranges for i in range(a, z)]
        assert rows == [2 * r, 2 * r + 1] + [4 + 3 * r + i for i in range(3)] + [10 + 3 * r + i for i in range(3)]
        assert torch.equal(local, full[:, rows])


def test_sharding_imports_neither_functional_dit_nor_weights():
    code = (
        "import sys, sharding; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('functional_dit', 'weights')); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_shard_params_refuses_a_misshaped_leaf_before_anything_moves():
    class Mesh:  # what shard_params reads of a DeviceMesh before it cuts or moves a leaf
        mesh_dim_names, shape, device_type = ("dp", "sp", "tp"), (1, 1, 2), "cpu"

    p = fd.init(FLUX1)
    tree = p.flat()
    tree["proj_out.weight"] = torch.zeros(3, 3)
    bad = fd.Params(FLUX1, sharding.tree.nest(tree))
    with pytest.raises(ValueError, match=r"params: proj_out.weight: expected shape \(16, 32\), got \(3, 3\)"):
        sharding.shard_params(bad, Mesh())


# ----------------------------------------------------------------------------- bytes


def _flux1_sharded_numel(c) -> int:
    """Elements of the tp-sharded FLUX.1 params, counted from the architecture by hand."""
    n, m = c.inner_dim, c.mlp_hidden_dim
    double = 6 * (n * n + n) + 2 * n * n + 2 * (m * n + m + n * m)  # q,k,v x2 (+bias), 2 outs, 2 MLPs
    single = 3 * (n * n + n) + (m * n + m) + n * (n + m)  # q,k,v, proj_mlp, proj_out
    double += 2 * 6 * (n * n + n)  # AdaLN modulation of both streams (6 chunks each)
    single += 3 * (n * n + n)  # AdaLN modulation (3 chunks)
    final = 2 * (n * n + n)  # norm_out's (scale, shift)
    return c.num_layers * double + c.num_single_layers * single + final


@pytest.mark.parametrize("name,tp", [("flux1-tiny", 1), ("flux1-tiny", 2)] + [("flux1-dev", t) for t in (1, 2, 4, 8)])
def test_bytes_per_rank_is_replicated_plus_sharded_over_degree(name, tp):
    c = fd.PRESETS[name]
    total, sharded = fd.num_params(c), _flux1_sharded_numel(c)
    want = 2 * ((total - sharded) + sharded // tp)  # bf16
    assert sharding.bytes_per_rank(c, None, {"tp": tp}, torch.bfloat16) == want
    assert sharding.bytes_per_rank(c, sharding.plan(c, {"tp": tp}), {"tp": tp}, torch.bfloat16) == want


def test_memory_table_example(capsys):
    runpy.run_path(os.path.join(ROOT, "examples", "memory_table.py"), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()
    released = [k for k in fd.PRESETS if not k.endswith("-tiny")]
    assert [ln.split()[0] for ln in lines[1:]] == released
    for ln in lines[1:]:
        cells = [(float(a), float(b)) for a, b in re.findall(r"(\d+\.\d+) \(\s*(\d+\.\d+)\)", ln)]
        gb = [a for a, _ in cells]
        assert len(gb) == 4 and all(a > b for a, b in zip(gb, gb[1:])), ln
        assert cells[0][0] == cells[0][1], ln  # tp=1: all of it
        assert cells[-1][0] <= 1.15 * cells[-1][1], f"tp=8 per-rank memory above 1.15 x params / 8: {ln}"
    dev = lines[1 + released.index("flux1-dev")].split()
    assert float(dev[2]) == pytest.approx(2 * fd.num_params(fd.PRESETS["flux1-dev"]) / 1e9, abs=0.01)


# ----------------------------------------------------------------------------- meshes, shard_map (no processes)


def test_make_mesh_rejects_a_wrong_world_size():
    # No process group here (and WORLD_SIZE unset): tp*sp*dp*ring*fsdp must be 1.
    with pytest.raises(ValueError, match=r"tp\*sp\*dp\*ring\*fsdp: expected .*got 4"):
        sharding.make_mesh(tp=2, sp=2, device_type="cpu")
    with pytest.raises(ValueError, match=r"tp: expected a positive int, got 0"):
        sharding.make_mesh(tp=0)
    with pytest.raises(ValueError, match=r"timeout: expected positive seconds or a timedelta, got 0"):
        sharding.make_mesh(device_type="cpu", timeout=0)
    assert not torch.distributed.is_initialized()  # every refusal came before a process group


def test_shard_map_without_a_mesh_is_plain_call():
    f = sharding.shard_map(lambda a, b: a @ b, None, (P("tp"), P()), P("tp"))
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    assert torch.equal(f(a, b), a @ b)
    with pytest.raises(ValueError, match=r"P: expected mesh axis names or None"):
        P(1)


def test_collectives_are_the_identity_without_a_mesh():
    x = torch.randn(4, 6)

    def check():
        assert sharding.axis_size("tp") == 1 and sharding.axis_index("tp") == 0
        assert sharding.psum(x, "tp") is x and sharding.all_gather(x, "sp", 1) is x
        assert sharding.all_to_all(x, "sp", 1, 0) is x and sharding.shard(x, "dp", 0) is x
        assert sharding.ulysses(lambda *a: a, x, x, x, None) == (x, x, x, None)

    check()  # nothing bound
    with sharding.bind(None):  # a bound None, as shard_map(fn, None, ...) binds
        check()


def test_shard_map_refuses_axes_the_mesh_lacks_and_repeated_axes():
    """JAX raises for both; here a misspelt axis silently left the input unsplit (axis_size
    of an absent axis is 1) and the function saw the whole tensor."""

    class Mesh:  # what shard_map reads of a DeviceMesh before any collective
        mesh_dim_names = ("dp", "sp", "tp")

    with pytest.raises(
        ValueError, match=r"in_specs: axis 'model' is not a mesh dim; the mesh has \('dp', 'sp', 'tp'\)"
    ):
        sharding.shard_map(lambda a: a, Mesh(), (P("model"),), P())(torch.ones(4))
    with pytest.raises(ValueError, match=r"out_specs: axis 'mdl' is not a mesh dim"):
        sharding.shard_map(lambda a: a, Mesh(), (P(),), P(None, "mdl"))(torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"P: mesh axis 'tp' is used by more than one dim: P\('tp', 'tp'\)"):
        P("tp", "tp")


def test_default_device_type_and_backends(monkeypatch):
    acc = torch.accelerator
    monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sharding.default_device_type() == "cpu"
    monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(acc, "device_count", lambda: 0)  # a CUDA build without a GPU (torch 2.9 says cuda)
    assert sharding.default_device_type() == "cpu"
    monkeypatch.setattr(acc, "device_count", lambda: 1)
    assert sharding.default_device_type() == "cuda"
    monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: torch.device("mps"))
    assert sharding.default_device_type() == "cpu"  # mps has no collectives backend
    assert sharding.backend_for("cpu") == "gloo" and sharding.backend_for("cuda") == "nccl"
    with pytest.raises(ValueError, match=r"device_type: no process-group backend is registered for 'warp'"):
        sharding.backend_for("warp")


def test_make_mesh_selects_the_local_device_unless_one_is_chosen(monkeypatch):
    """What init_device_mesh did before make_mesh built its own sub-groups: with a process
    group the caller made, the accelerator is picked from LOCAL_RANK only if unset."""

    class Dev:
        count, initialized, chosen = 4, False, []

        @classmethod
        def device_count(cls):
            return cls.count

        @classmethod
        def is_initialized(cls):
            return cls.initialized

        @classmethod
        def set_device(cls, i):
            cls.chosen.append(i)

    monkeypatch.setattr(torch, "fakedev", Dev, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "6")
    sharding._mesh._set_device("fakedev", only_if_unset=True)
    assert Dev.chosen == [2]  # 6 % 4 devices
    Dev.initialized = True
    sharding._mesh._set_device("fakedev", only_if_unset=True)
    assert Dev.chosen == [2]  # the user's choice stands
    sharding._mesh._set_device("fakedev")  # a process group make_mesh creates: always
    assert Dev.chosen == [2, 2]


# ----------------------------------------------------------------------------- 2 ranks


def _core_work(rank, world):
    out = {}
    mesh = sharding.make_mesh(tp=2)  # initialises the gloo group from the torchrun-style env
    out["mesh"] = (mesh.mesh_dim_names, tuple(mesh.shape), mesh.device_type)
    try:
        sharding.make_mesh(tp=4)
    except ValueError as e:
        out["bad_mesh"] = str(e)
    x = torch.arange(12.0).reshape(2, 6) + 100 * rank
    with warnings.catch_warnings(record=True) as caught, sharding.bind(mesh):
        warnings.simplefilter("always")
        out["sizes"] = (sharding.axis_size("tp"), sharding.axis_size("dp"), sharding.axis_size("nope"))
        out["index"] = sharding.axis_index("tp")
        out["psum"] = sharding.psum(x, "tp")
        out["psum_absent"] = sharding.psum(x, "dp") is x
        out["gather"] = sharding.all_gather(x, "tp", dim=1)
        out["a2a"] = sharding.all_to_all(sharding.all_to_all(x, "tp", 1, 0), "tp", 0, 1)
        out["a2a_once"] = sharding.all_to_all(x, "tp", split_dim=1, concat_dim=0)
    out["warnings"] = [str(w.message) for w in caught]

    a, b = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), torch.randn(6, 2)
    b = torch.randn(6, 2, generator=torch.Generator().manual_seed(1))
    rows = sharding.shard_map(lambda a, b: a @ b, mesh, (P("tp"), P()), P("tp"))
    inner = sharding.shard_map(lambda a, b: sharding.psum(a @ b, "tp"), mesh, (P(None, "tp"), P("tp")), P())
    tree = sharding.shard_map(lambda d: {"y": d["a"] * 2}, mesh, ({"a": P("tp")},), {"y": P("tp")})
    out["shard_map"] = (rows(a, b), inner(a, b), tree({"a": a})["y"], a @ b, a * 2)

    odd = dataclasses.replace(FLUX1, num_attention_heads=3, axes_dims_rope=(4, 6, 6))
    try:
        sharding.shard_params(fd.init(odd), mesh)
    except ValueError as e:
        out["rejected"] = str(e)
    out["healthy"] = sharding.shard_map(lambda: sharding.psum(torch.ones(1), "tp"), mesh, (), P())()

    p = fd.init(FLUX2, seed=3)
    edited = sharding.plan(p, mesh)
    edited["x_embedder"]["weight"] = Shard(0, "tp")  # a user edit: plans are data
    s = sharding.shard_params(p, mesh, edited)
    out["edited_local"] = s["x_embedder"]["weight"].to_local().shape
    tree_only = sharding.shard_params(p.tree, mesh, edited)  # plain dicts, no config: the plan says it all
    exact = lambda u: all(torch.equal(v, u[k]) for k, v in p.flat().items())  # noqa: E731
    out["unshard"] = (
        exact(sharding.unshard(s, edited).flat()),
        exact(sharding.tree.flatten(sharding.unshard(tree_only, edited))),
    )
    try:
        sharding.shard_params(p, mesh, {"x_embedder": {}})
    except ValueError as e:
        out["bad_plan"] = str(e)
    out["user_plans"] = _user_plans(p, mesh)
    out["apply_layout"] = _apply_layout(mesh)
    out["compiled"] = _compiled_apply(mesh)
    # no config, no plan: the leaves' placements say it all (full_tensor())
    out["unshard_no_plan"] = exact(sharding.tree.flatten(sharding.unshard(sharding.shard_params(p.tree, mesh, edited))))
    return out


def _user_plans(p, mesh) -> dict:
    """Edited plans that shard_params must refuse, each before any leaf moves: a fused dim
    split contiguously, blocks on a dim that is not fused, an axis the mesh lacks."""
    fused = "single_transformer_blocks.1.attn.to_qkv_mlp_proj.weight"
    cases = {
        "contiguous": (fused, Shard(0, "tp")),
        "not_fused": ("proj_out.weight", Shard(1, "tp", (32, 32))),  # the last leaf: all others were fine
        "no_axis": ("proj_out.weight", Shard(0, "ep")),
    }
    real, moved, report = sharding._shard.dtensor_from_local, [], {}
    sharding._shard.dtensor_from_local = lambda *a, **k: moved.append(1) or real(*a, **k)
    try:
        for name, (path, placement) in cases.items():
            flat = dict(sharding._plan.leaves(sharding.plan(p, mesh)), **{path: placement})
            try:
                sharding.shard_params(p, mesh, sharding.tree.nest(flat))
                report[name] = "accepted"
            except ValueError as e:
                report[name] = str(e)
    finally:
        sharding._shard.dtensor_from_local = real
    report["moved"] = len(moved)
    return report


def _apply_layout(mesh) -> dict:
    """fd.apply on layouts the local-view model code cannot compute: the output channels
    split by a custom rule (it returned half the channels), an MLP edited to Replicate
    (its row-parallel psum would sum the full product tp times)."""
    import cases_flux1 as C

    p, kw = fd.init(FLUX1, seed=0), C.inputs(FLUX1, batch=1, txt_len=3, h=2, w=2)
    rules = {**sharding.DEFAULT_RULES, "out_channels": "tp"}
    replicated_mlp = sharding.plan(p, mesh)
    both = {"weight": Replicate(), "bias": Replicate()}
    replicated_mlp["transformer_blocks"]["0"]["ff"] = {"net": {"0": {"proj": both}, "2": both}}
    report = {}
    for name, pl in (("rules", sharding.plan(p, mesh, rules)), ("replicated_mlp", replicated_mlp)):
        try:
            report[name] = tuple(fd.apply(sharding.shard_params(p, mesh, pl), **kw).shape)
        except ValueError as e:
            report[name] = str(e)
    return report


def _compiled_apply(tp_mesh):
    """fd.apply on sharded params traces as one graph (functional collectives, the
    plain-list mesh stack) and computes what eager does: TP (psum) and Ulysses SP over an
    odd sequence (all_to_all, all_gather, padding). aot_eager: dynamo and AOTAutograd
    (functionalised collectives) without inductor's slow C++ compile; dynamic=False as
    on XLA (a second mesh's shapes would otherwise go symbolic, and tracing crawls).
    One block of each kind keeps the trace short."""
    import cases_flux1 as C

    config = dataclasses.replace(FLUX1, num_layers=1, num_single_layers=1)
    kw = C.inputs(config, batch=2, txt_len=5, h=2, w=3, seed=1)  # 5 + 6 tokens: sp pads
    results = []
    for mesh in (tp_mesh, sharding.make_mesh(sp=2)):
        s = sharding.shard_params(fd.init(config, seed=0), mesh)
        compiled = torch.compile(fd.apply, fullgraph=True, dynamic=False, backend="aot_eager")(s, **kw)
        results.append((torch.equal(compiled, fd.apply(s, **kw)), compiled))
    return results


def test_two_ranks_collectives_shard_map_and_shard_params():
    results = spawn(_core_work, 2, init=False, timeout=300)
    for rank, r in enumerate(results):
        assert r["mesh"] == (("dp", "sp", "tp"), (1, 1, 2), "cpu")  # fsdp, ring: only when > 1
        assert "expected the world size 2, got 4*1*1*1*1 = 4" in r["bad_mesh"]
        assert r["sizes"] == (2, 1, 1) and r["index"] == rank
        x0, x1 = torch.arange(12.0).reshape(2, 6), torch.arange(12.0).reshape(2, 6) + 100
        assert torch.equal(r["psum"], x0 + x1) and r["psum_absent"]
        assert torch.equal(r["gather"], torch.cat([x0, x1], 1))
        assert torch.equal(r["a2a"], x0 + 100 * rank)
        # rank r gets column chunk r of every rank's x, stacked in rank order along dim 0
        assert torch.equal(r["a2a_once"], torch.cat([x0[:, 3 * rank : 3 * rank + 3], x1[:, 3 * rank : 3 * rank + 3]]))
        assert r["warnings"] == [], "collectives must not warn (e.g. funcol's deprecated all_gather_tensor)"
        rows, inner, tree, full, twice = r["shard_map"]
        assert torch.equal(rows, full) and torch.equal(tree, twice)
        torch.testing.assert_close(inner, full, rtol=1e-6, atol=1e-6)  # a split contraction sums in another order
        assert "num_attention_heads: 3 heads do not divide by the degree tp=2" in r["rejected"]
        assert torch.equal(r["healthy"], torch.tensor([2.0])), "plan's ValueError left a collective behind"
        assert r["edited_local"] == (FLUX2.inner_dim // 2, FLUX2.in_channels)
        assert r["unshard"] == (True, True)
        assert "plan: expected the keys of the params" in r["bad_plan"]
        plans = r["user_plans"]
        assert plans["moved"] == 0, "shard_params moved leaves before refusing the plan"
        assert (
            "to_qkv_mlp_proj.weight: dim 0 is fused from blocks (64, 64, 64, 64, 64, 64, 64, 64, 64), so it splits "
            "per block; expected Shard(0, 'tp', (64, 64, 64, 64, 64, 64, 64, 64, 64))" in plans["contiguous"]
        ), plans["contiguous"]
        assert "plan: proj_out.weight: dim 1 is not fused" in plans["not_fused"], plans["not_fused"]
        assert "plan: proj_out.weight: axis 'ep' is not a mesh dim" in plans["no_axis"], plans["no_axis"]
        layout = r["apply_layout"]
        assert "params: proj_out.weight: fd.apply computes in the default layout, Replicate()" in layout["rules"], (
            layout
        )
        assert (
            "transformer_blocks.0.ff.net.0.proj.weight: fd.apply computes in the default layout, Shard("
            in layout["replicated_mlp"]
        )
        for axis, (same, _) in zip(("tp", "sp"), r["compiled"]):
            assert same, f"{axis}: torch.compile(fd.apply, fullgraph=True) differs from eager on sharded params"
        assert r["unshard_no_plan"]
    assert torch.equal(results[0]["shard_map"][1], results[1]["shard_map"][1])
    for (_, a), (_, b) in zip(results[0]["compiled"], results[1]["compiled"]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- failure bounds

PG_TIMEOUT = 10  # seconds per collective in the failure test (gloo set-up on a loaded 2-core CI machine needs some)
SLACK = 20  # scheduling slack on a busy 2-core machine


def _crash_work(rank, world, flag_dir):
    """A tp=2 x sp=2 mesh on 4 ranks: neither axis spans the world, so every collective
    runs on a mesh sub-group (whose timeout must be make_mesh's too, not torch's 30-minute
    default). Rank 1 raises inside its first single-stream block and then stays alive
    without closing its sockets (the worst case: a peer that neither answers nor hangs up)."""
    import cases_flux1 as C

    mesh = sharding.make_mesh(tp=2, sp=2, timeout=PG_TIMEOUT)
    config = C.TINY_SCHNELL  # 4 heads: 2 per tp rank, 1 per (tp, sp) rank
    kw = C.inputs(config, batch=2, txt_len=7, h=3, w=4, seed=0)
    s = sharding.shard_params(fd.init(config), mesh)
    real = fd.flux1.single_block

    def block(*args, **kwargs):
        if rank == 1:
            raise RuntimeError("injected failure on rank 1")
        return real(*args, **kwargs)

    fd.flux1.single_block = block
    start = time.monotonic()
    try:
        fd.apply(s, **kw)
        return {"finished": True}
    except Exception as e:  # noqa: BLE001
        elapsed = time.monotonic() - start
        open(os.path.join(flag_dir, f"rank{rank}_done"), "w").close()
        # Stay alive (sockets open) until every rank has failed on its own.
        while len(os.listdir(flag_dir)) < world and time.monotonic() - start < 3 * (PG_TIMEOUT + SLACK):
            time.sleep(0.1)
        return {"error": f"{type(e).__name__}: {e}"[:300], "elapsed": elapsed}


def test_a_rank_that_raises_mid_forward_fails_every_rank_in_bounded_time(tmp_path):
    start = time.monotonic()
    results = spawn(_crash_work, 4, str(tmp_path), init=False, timeout=4 * (PG_TIMEOUT + SLACK))
    assert "injected failure on rank 1" in results[1]["error"]
    for rank, r in enumerate(results):
        assert "error" in r, (rank, r)  # no rank finished a forward its peer never joined (or hung)
        # Failed by the process-group timeout (or a peer's failure), not hung: a rank may
        # first wait out one collective whose peer is itself waiting on the dead rank.
        assert r["elapsed"] < 2 * PG_TIMEOUT + SLACK, (rank, r)
    assert "Timed out" in results[0]["error"] or "timeout" in results[0]["error"].lower(), results[0]["error"]
    assert time.monotonic() - start < 3 * (PG_TIMEOUT + SLACK)

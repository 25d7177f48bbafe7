"""Streamed per-rank loading and gathered saving on a 2-rank gloo mesh.

`weights.load(..., mesh=)` must give exactly `sharding.shard_params(weights.load(...))`
(the same DTensor leaves, placements and local shards, bitwise) while each rank reads
only its own bytes; `weights.save` of the sharded params must write the unsharded
checkpoint. One spawn covers every family and layout; a second, on a FLUX.2 BFL file
of over 200 MB, measures each rank's peak RSS and bytes read.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import safetensors
import safetensors.torch
import torch
from _dist import spawn
from safetensors.torch import save_file
from test_weights_bfl import bfl_flux1_shapes, bfl_flux2_shapes, random_state

import functional_dit as fd
import sharding
import weights
from sharding.tree import flatten, nest

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md#numerics: sharded vs unsharded at the fp32 tolerance


def _cases():
    import cases_flux1
    import cases_flux2
    import cases_qwenimage

    return {  # name -> (cases module, config, layout)
        "flux1-diffusers": (cases_flux1, cases_flux1.TINY, "diffusers"),
        "flux1-bfl": (cases_flux1, cases_flux1.TINY_SCHNELL, "bfl"),
        "flux2-bfl": (cases_flux2, cases_flux2.TINY, "bfl"),
        # TINY_KLEIN's odd sizes, but an MLP width (72) that is a multiple of the inner width (24): tp can
        # shard its single blocks' heads only then (docs/architecture.md, honest DTensor leaves)
        "flux2-klein-diffusers": (cases_flux2, dataclasses.replace(cases_flux2.TINY_KLEIN, mlp_ratio=3.0), "diffusers"),
        "qwen-diffusers": (cases_qwenimage, cases_qwenimage.TINY, "diffusers"),
    }


def _write(tmp_path, name, config, layout) -> str:
    if layout == "bfl":
        shapes = bfl_flux1_shapes if isinstance(config, fd.Flux1Config) else bfl_flux2_shapes
        path = tmp_path / f"{name}.safetensors"
        save_file(random_state(shapes(config), seed=7), path)
        return str(path)
    weights.save(fd.init(config, seed=7), tmp_path / name, max_shard_size=40_000)
    return str(tmp_path / name)


def _same_dtensor(a, b) -> bool:
    return (
        type(a) is type(b)
        and a.placements == b.placements
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and torch.equal(a.to_local(), b.to_local())
    )


class _AuditedSafeOpen:
    """``safetensors.safe_open`` that adds up the bytes of every tensor and slice it hands
    out: what a rank really read, counted at the library boundary rather than by the
    loader's own `stats`."""

    bytes = 0

    def __init__(self, *args, **kwargs):
        self.inner = _REAL_SAFE_OPEN(*args, **kwargs)

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def _count(self, t):
        _AuditedSafeOpen.bytes += t.numel() * t.element_size()
        return t

    def get_tensor(self, name):
        return self._count(self.inner.get_tensor(name))

    def get_slice(self, name):
        return _Slice(self.inner.get_slice(name), self)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Slice:
    def __init__(self, sl, audit):
        self.sl, self.audit = sl, audit

    def __getitem__(self, idx):
        return self.audit._count(self.sl[idx])

    def __getattr__(self, name):
        return getattr(self.sl, name)


_REAL_SAFE_OPEN = safetensors.safe_open


def _audited_load(*args, **kwargs):
    safetensors.safe_open, _AuditedSafeOpen.bytes = _AuditedSafeOpen, 0
    try:
        return weights.load(*args, **kwargs), _AuditedSafeOpen.bytes
    finally:
        safetensors.safe_open = _REAL_SAFE_OPEN


def _mismatched(a, b) -> list[str]:
    a, b = a.flat(), b.flat()
    return [k for k in b if not _same_dtensor(a[k], b[k])] + ([] if list(a) == list(b) else ["key order"])


def _other_meshes(jobs, world):
    """Meshes over sp and dp, with the modulation rows (and over dp the text embedder's
    input columns) split over them: rules the defaults do not have."""
    report = {}
    extra = {"sp": {"mod": "sp"}, "dp": {"mod": "dp", "txt_embed": "dp"}}
    for axis, rules in ((a, {**sharding.DEFAULT_RULES, **r}) for a, r in extra.items()):
        mesh = sharding.make_mesh(**{axis: world}, device_type="cpu")
        for name in ("flux2-bfl", "qwen-diffusers"):
            path, config, _ = jobs[name]
            plan = sharding.plan(config, mesh, rules=rules)
            stats = {}
            streamed = weights.load(path, config=config, mesh=mesh, plan=plan, stats=stats)
            ref = sharding.shard_params(weights.load(path, config=config), mesh, plan)
            report[f"{axis}:{name}"] = dict(
                mismatched=_mismatched(streamed, ref),
                bytes_read=stats["bytes_read"],
                shard_bytes=sharding.local_bytes(streamed),
            )
    return report


def _bad_plans(jobs, mesh) -> list[str]:
    """Plans `sharding.plan` cannot make: a fused dim split contiguously, blocks on a dim
    that is not fused, a dim outside the tensor. Each must be refused before any read."""
    path, config, _ = jobs["flux2-bfl"]
    good = sharding.plan(config, mesh)
    fused = "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"
    plain = "transformer_blocks.0.attn.to_q.weight"
    messages = []
    for key, placement in (
        (fused, sharding.Shard(0, "tp")),
        (plain, sharding.Shard(0, "tp", (32, 32))),
        (plain, sharding.Shard(2, "tp")),
    ):
        flat = dict(flatten(good), **{key: placement})
        try:
            weights.load(path, config=config, mesh=mesh, plan=nest(flat))
            messages.append(f"{key} {placement}: accepted")
        except ValueError as e:
            messages.append(str(e))
    for kw in (dict(plan=["not", "a", "plan"]), dict(device="meta")):
        try:
            weights.load(path, config=config, mesh=mesh, **kw)
            messages.append(f"{kw}: accepted")
        except ValueError as e:
            messages.append(str(e))
    return messages


def _failed_save(streamed, target) -> str:
    """rank 0 cannot write (the target is a file): every rank must raise, promptly."""
    try:
        weights.save(streamed, target)
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _rank_load_save(rank, world, jobs, out_dir):
    """Per case: streamed sharded load vs shard_params(load), bytes read (by the loader and
    at safe_open), the sharded forward, and a save of the sharded params (rank 0 writes);
    then meshes over sp and dp, refused plans and a save that fails on rank 0."""
    mesh = sharding.make_mesh(tp=world, device_type="cpu")
    report = {}
    for name, (path, config, kw) in jobs.items():
        stats = {}
        streamed, audited = _audited_load(path, config=config, mesh=mesh, stats=stats)
        full = weights.load(path, config=config)
        ref = sharding.shard_params(full, mesh)
        a, b = streamed.flat(), ref.flat()
        mismatched = [k for k in b if not _same_dtensor(a[k], b[k])]
        shard_bytes = sharding.local_bytes(streamed)
        if name.endswith("-bfl"):
            # Also keep the AdaLN rows whole (a storage layout): the default splits them per
            # chunk, so the swapped (scale, shift) halves of norm_out straddle the ranks; the
            # loader must get both layouts right.
            plan = sharding.plan(config, mesh, rules={**sharding.DEFAULT_RULES, "mod": None})
            mod = weights.load(path, config=config, mesh=mesh, plan=plan).flat()
            ref_mod = sharding.shard_params(full, mesh, plan).flat()
            mismatched += [f"mod-sharded {k}" for k in ref_mod if not _same_dtensor(mod[k], ref_mod[k])]
        save_dir = f"{out_dir}/{name}-saved"
        weights.save(streamed, save_dir, max_shard_size=30_000)
        report[name] = dict(
            keys_equal=list(a) == list(b),
            mismatched=mismatched,
            bytes_read=stats["bytes_read"],
            audited=audited,
            shard_bytes=shard_bytes,
            out=fd.apply(streamed, **kw),
            save_dir=save_dir,
        )
    report["bad_plans"] = _bad_plans(jobs, mesh)
    start = time.monotonic()
    report["failed_save"] = _failed_save(streamed, f"{out_dir}/a-file")
    report["failed_save_s"] = time.monotonic() - start
    report["other_meshes"] = _other_meshes(jobs, world)
    return report


def test_streamed_sharded_load_equals_shard_params(tmp_path):
    jobs, refs = {}, {}
    for name, (cases, config, layout) in _cases().items():
        path = _write(tmp_path, name, config, layout)
        kw = cases.inputs(config)
        jobs[name] = (path, config, kw)
        refs[name] = (weights.load(path, config=config), kw)
    (tmp_path / "a-file").write_text("not a folder")
    reports = spawn(_rank_load_save, 2, jobs, str(tmp_path), timeout=240)
    for name, (full, kw) in refs.items():
        r0, r1 = (r[name] for r in reports)
        for rank, r in enumerate((r0, r1)):
            assert r["keys_equal"] and r["mismatched"] == [], (name, rank, r["mismatched"][:5])
            # each rank read exactly its own shard (the files are fp32 like the params), no
            # more: as the loader counts it and as safetensors handed it out
            assert r["bytes_read"] == r["audited"] == r["shard_bytes"], (name, rank)
            torch.testing.assert_close(r["out"], fd.apply(full, **kw), **FP32)
        total = sum(t.numel() * 4 for t in full.leaves())
        assert r0["shard_bytes"] + r1["shard_bytes"] < 1.9 * total  # every case has TP-sharded weights
        assert torch.equal(r0["out"], r1["out"]), name  # replicated output, bitwise across ranks
        saved = weights.load(r0["save_dir"])
        for k, t in full.flat().items():
            assert torch.equal(saved.flat()[k], t), (name, k)
    for r in reports:
        fused, plain, outside, not_a_plan, device = r["bad_plans"]
        # FLUX.2 single blocks: [q, k, v, mlp_gate, mlp_up] = (64, 64, 64, 192, 192) as 9 equal units of 64
        assert "to_qkv_mlp_proj.weight: dim 0 is fused from blocks (" + ", ".join(["64"] * 9) + ")" in fused, fused
        assert "to_q.weight: dim 0 is not fused" in plain, plain
        assert "dim 2 is outside the parameter's shape (64, 64)" in outside, outside
        assert not_a_plan.startswith("plan: expected None or a mapping shaped like the params"), not_a_plan
        assert device.startswith("device: the mesh's shards live on cpu, got device='meta'"), device
        for key, m in r["other_meshes"].items():
            assert m["mismatched"] == [] and m["bytes_read"] == m["shard_bytes"], (key, m)
            full_bytes = sum(t.numel() * 4 for t in refs[key.split(":")[1]][0].leaves())
            assert m["bytes_read"] < full_bytes, (key, m)  # the modulation rows (a small part) are split
        assert r["failed_save_s"] < 30  # not the 60 s collective timeout of a rank left gathering
    assert reports[0]["failed_save"].startswith("ValueError: path: ") and "is a file" in reports[0]["failed_save"]
    assert (
        reports[1]["failed_save"] == "RuntimeError: save: rank 0 failed to write the checkpoint; its exception says why"
    )


# ----------------------------------------------------------------------------- 200 MB, peak RSS

BIG = fd.Flux2Config(  # ~236 MB in fp32; modulation is shared by all blocks, so ~54% per rank
    in_channels=64,
    num_layers=4,
    num_single_layers=8,
    attention_head_dim=64,
    num_attention_heads=8,
    joint_attention_dim=64,
    timestep_guidance_channels=256,
    axes_dims_rope=(16, 16, 16, 16),
)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def _reset_peak_rss() -> None:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS.

    Not `resource.getrusage(...).ru_maxrss`: Linux carries ru_maxrss across execve, so a
    rank spawned from the pytest process starts with the parent's peak (the 240 MB
    state dict and diffusers) already on it. VmHWM belongs to this address space."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _warm_up_dtensor(mesh) -> None:
    """DTensor's first use imports and registers its op machinery: ~70 MB once per
    process, whatever the model size. It belongs to the interpreter baseline."""
    from torch.distributed.tensor import DTensor, Replicate

    DTensor.from_local(torch.zeros(2), mesh, [Replicate()] * mesh.ndim, run_check=False)


def _rank_peak_rss(rank, world, path):
    mesh = sharding.make_mesh(tp=world, device_type="cpu")
    _warm_up_dtensor(mesh)
    _reset_peak_rss()
    before = _status_bytes("VmRSS")  # interpreter, torch, gloo, the mesh, DTensor: the baseline
    stats = {}
    params = weights.load(path, config=BIG, mesh=mesh, stats=stats)
    peak = _status_bytes("VmHWM")
    shard = sharding.local_bytes(params)
    # The same measurement of a load that materialises the whole file, to show it can fail.
    _reset_peak_rss()
    whole_before = _status_bytes("VmRSS")
    whole = {k: t.clone() for k, t in safetensors.torch.load_file(path).items()}  # clone: may be lazy mmap views
    whole_growth = _status_bytes("VmHWM") - whole_before
    del whole
    return dict(before=before, peak=peak, shard=shard, whole_growth=whole_growth, **stats)


@pytest.mark.timeout(300)
def test_streamed_load_peak_rss_and_bytes_read(tmp_path):
    path = tmp_path / "flux2-big.safetensors"
    state = random_state(bfl_flux2_shapes(BIG), seed=0)
    save_file(state, path)
    file_bytes = sum(t.numel() * 4 for t in state.values())
    del state
    assert file_bytes >= 200e6
    reports = spawn(_rank_peak_rss, 2, str(path), timeout=240)
    for rank, r in enumerate(reports):
        growth = r["peak"] - r["before"]
        print(
            f"rank {rank}: file {file_bytes / 1e6:.1f} MB, shard {r['shard'] / 1e6:.1f} MB "
            f"({r['shard'] / file_bytes:.1%}), read {r['bytes_read'] / 1e6:.1f} MB, "
            f"peak RSS over baseline {growth / 1e6:.1f} MB = {growth / r['shard']:.3f} x shard "
            f"(a whole-file load: {r['whole_growth'] / r['shard']:.2f} x)"
        )
        assert r["bytes_read"] == r["shard"] == r["local_bytes"]
        # TP halves every block weight; the shared modulation, embedders and norms are replicated.
        assert 0.5 * file_bytes < r["bytes_read"] < 0.56 * file_bytes
        assert growth <= 1.25 * r["shard"], (rank, growth, r["shard"])
        assert r["whole_growth"] > 1.25 * r["shard"]  # the bound does catch a full materialisation

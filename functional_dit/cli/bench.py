"""``python -m functional_dit bench``: speed and memory side by side with diffusers.

Per family, at a mid-size config or a released preset's shape, with the same weights in
both: eager, compiled, cold compile, tp=2 against diffusers' own tensor parallelism,
achieved FLOP/s against the measured matmul peak, per-rank memory; contenders alternate
within every round, each figure the median of ``--runs``. diffusers refuses tensor
parallelism on CPU meshes, so only that device check is widened (it says so in its
output). What each figure is: docs/cli.md, "bench".
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch._inductor.config as inductor_config
import torch.multiprocessing as mp
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import sharding
from sharding.internal import is_dtensor

from .. import api as _api
from ..nn import kernels as _kernels
from ..nn import quant as _quant
from . import _bench_cache, bench_sample, bench_suite
from ._bench_models import (
    IMG_HW,
    TXT_LEN,
    diffusers_module,
    inputs,
    machine,
    machine_kind,
    mid_configs,
    one_block,
    random_params,
    released_depth,
)

# ----------------------------------------------------------------------------- timing


def _sync(device) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type not in ("cpu", "meta") and hasattr(getattr(torch, dev.type, None), "synchronize"):
        getattr(torch, dev.type).synchronize()


def _timed(fn, device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def alternate(contenders: dict, runs: int, device, warmup: int = 1) -> dict:
    """``{name: median seconds}``: every round runs each contender once, in turn."""
    with torch.no_grad():
        for fn in contenders.values():
            for _ in range(warmup):
                fn()
        times = {name: [] for name in contenders}
        for _ in range(runs):
            for name, fn in contenders.items():
                times[name].append(_timed(fn, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


PEAK_N = 2048  # the GEMM that measures the matmul peak on a CPU: n x n x n
PEAK_N_ACCELERATOR = 8192  # a GPU needs a bigger one to reach its peak


def peak_n(device) -> int:
    return PEAK_N if torch.device(device).type == "cpu" else PEAK_N_ACCELERATOR


def _cpu_flash_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def count_flops(fn) -> int:
    """FLOPs of one call (``torch.utils.flop_counter``). torch's table has no entry for the
    CPU flash-attention kernel (it would count attention as 0 FLOPs on a CPU): this adds
    the same formula torch uses for the GPU attention kernels."""
    extra = {}
    cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_flash is not None:
        extra[cpu_flash] = _cpu_flash_flops
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=extra) as counter:
        fn()
    return counter.get_total_flops()


# ----------------------------------------------------------------------------- sections


def _err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def _no_room_for_another_copy(params, device) -> str:
    """Why a third copy of the weights (diffusers after ``fuse_qkv_projections``) is left out
    on an accelerator without room for it, or "" (a released preset's shape on one GPU)."""
    if torch.device(device).type != "cuda":
        return ""
    need = 1.5 * sum(t.numel() * t.element_size() for t in params.leaves())  # weights + fused copies + work
    free = torch.cuda.mem_get_info(torch.device(device))[0]
    if free >= need:
        return ""
    return f"skipped: {free / 2**30:.1f} GiB free on {device}, a fused copy needs ~{need / 2**30:.1f} GiB"


def _stock_contenders(params, args, dkw) -> tuple[dict, str | None]:
    """diffusers' module, and the same after its own ``fuse_qkv_projections()`` where there
    is room for another copy and the class can fuse (else a note saying why not)."""
    module = diffusers_module(params, args.device, args.dtype)
    contenders = {"diffusers": lambda: module(**dkw)[0]}
    note = _no_room_for_another_copy(params, args.device)
    if not note:
        fused = diffusers_module(params, args.device, args.dtype)
        try:
            fused.fuse_qkv_projections()
            contenders["diffusers_fused"] = lambda: fused(**dkw)[0]
        except (ValueError, AttributeError, NotImplementedError) as e:  # e.g. added KV projections
            note = f"{type(e).__name__}: {e}"
    return contenders, note


def _eager_figures(config, med: dict, flops: int, peak: float, err: float, note) -> dict:
    out = dict(
        params=_api.num_params(config),
        eager_ours=med["ours"],
        eager_diffusers=med["diffusers"],
        eager_diffusers_fused=med.get("diffusers_fused"),
        fused_note=note,
        max_abs_err=err,
        flops=flops,
        flops_per_s=flops / med["ours"],
        peak_flops_per_s=peak,
        fraction_of_peak=flops / med["ours"] / peak,
        ratio_eager=med["ours"] / med["diffusers"],
    )
    if "diffusers_fused" in med:
        out["ratio_eager_fused"] = med["ours"] / med["diffusers_fused"]
    for pin in ("fast", "exact"):
        if f"ours_{pin}" in med:
            out[f"eager_ours_{pin}"] = med[f"ours_{pin}"]
            out[f"ratio_eager_{pin}"] = med[f"ours_{pin}"] / med["diffusers"]
    return out


def eager_section(name, config, args) -> dict:
    params = random_params(config, args.device, args.dtype)
    ours = _api.prepare(params) if not _fp8(args) else _ours(params, args)  # kernels="auto": measured here
    _kernels.clear()  # this family's picks only (`_chosen`)
    kw, dkw = inputs(config, args.device, args.dtype, **shape(args))
    stock, note = _stock_contenders(params, args, dkw)
    # The model's FLOPs, counted on the plain params: the flop counter knows aten's GEMMs,
    # not the oneDNN GEMM+GELU the fast kernels call (the same products).
    flops = count_flops(functools.partial(_api.apply, params, **kw))
    room = not _no_room_for_another_copy(params, args.device)
    del params  # `ours` holds what it needs (the fused groups in new buffers)
    contenders = {"ours": lambda: _api.apply(ours, **kw), **stock}
    if room:
        contenders.update(_pinned_contenders(ours, kw))
    n = peak_n(args.device)
    a, b = (torch.randn(n, n, device=args.device, dtype=args.dtype) for _ in range(2))
    contenders["matmul"] = lambda: a @ b  # the peak, measured in the same rounds (same load)
    with torch.no_grad():
        err = _err(contenders["ours"](), contenders["diffusers"]())
    med = alternate(contenders, args.runs, args.device)
    out = _eager_figures(config, med, flops, 2 * n**3 / med["matmul"], err, note)
    out["kernels"] = _chosen(ours)
    return out


def _pinned_contenders(ours, kw) -> dict:
    """`fd.prepare(..., kernels="fast")` and ``"exact"`` beside the default "auto" (on an
    accelerator only where there is room for their copies of the fused projections)."""
    pinned = {pin: _api.prepare(ours, kernels=pin) for pin in ("fast", "exact")}  # copies the fused groups only
    return {f"ours_{pin}": functools.partial(_api.apply, p, **kw) for pin, p in pinned.items()}


def _chosen(ours) -> dict:
    """``{op: {kernel: how many keys chose it}}`` from `fd.kernel_choices` (this process)."""
    out: dict = {}
    for c in _kernels.kernel_choices():
        per_op = out.setdefault(c["op"], {})
        per_op[c["choice"]] = per_op.get(c["choice"], 0) + 1
    return out


def _compile_first_call(fn, device) -> tuple[object, float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def _cold_worker(which, config, dtype, device, shape_kw, cache_dir, out_path):
    """In a fresh process: the first call of a compiled ``which`` ("ours" | "diffusers")."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    inductor_config.fx_graph_cache = False
    params = random_params(config, device, dtype)
    kw, dkw = inputs(config, device, dtype, **shape_kw)
    if which == "ours":
        f = torch.compile(_api.apply, fullgraph=True, dynamic=False)
        _, secs = _compile_first_call(lambda: f(params, **kw), device)
    else:
        g = torch.compile(diffusers_module(params, device, dtype), fullgraph=True, dynamic=False)
        _, secs = _compile_first_call(lambda: g(**dkw), device)
    torch.save(secs, out_path)


def _warm_worker(cache_dir):
    """Build inductor's per-machine artefacts (headers, toolchain probes) into ``cache_dir``."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch.compile(lambda x: (x.sin() + 1).sum())(torch.randn(8))


def _in_process(target, *args) -> None:
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"bench: {target.__name__}{args[:1]} failed in its process (exit code {proc.exitcode})")


def cold_compile(which, config, args, warm_dir) -> float:
    """Seconds of the first compiled call in a fresh process whose inductor cache is a copy
    of ``warm_dir``: the toolchain is warm, no kernel or graph of this model is cached."""
    with tempfile.TemporaryDirectory() as d:
        cache, path = os.path.join(d, "cache"), os.path.join(d, "secs.pt")
        shutil.copytree(warm_dir, cache)
        _in_process(_cold_worker, which, config, args.dtype, args.device, shape(args), cache, path)
        return torch.load(path)


def _fp8(args) -> str | None:
    return getattr(args, "quantize", None)


def _ours(params, args):
    """``params``, or with ``--quantize`` their fp8 compute form (`fd.quantize`, default skip list)."""
    return params if not _fp8(args) else _quant.quantize(params, _fp8(args))


def compile_section(name, config, args, warm_dir) -> dict:
    """Cold compile time (each in a fresh process, see `cold_compile`) at full depth and one
    block, ours and diffusers; then compiled vs compiled, alternating."""
    out = {}
    for depth, cfg in (("full", config), ("one_block", one_block(config))):
        for which in ("ours", "diffusers"):
            out[f"compile_{which}_{depth}"] = cold_compile(which, cfg, args, warm_dir)
    params = random_params(config, args.device, args.dtype)
    kw, dkw = inputs(config, args.device, args.dtype, **shape(args))
    module = diffusers_module(params, args.device, args.dtype)
    torch._dynamo.reset()
    f = torch.compile(_api.apply, fullgraph=True, dynamic=False)
    g = torch.compile(module, fullgraph=True, dynamic=False)
    ours = _ours(params, args)
    med = alternate({"ours": lambda: f(ours, **kw), "diffusers": lambda: g(**dkw)[0]}, args.runs, args.device)
    out.update(compiled_ours=med["ours"], compiled_diffusers=med["diffusers"])
    out["ratio_compiled"] = out["compiled_ours"] / out["compiled_diffusers"]
    out["ratio_compile_time"] = out["compile_ours_full"] / out["compile_diffusers_full"]
    out["ours_full_over_one_block"] = out["compile_ours_full"] / out["compile_ours_one_block"]
    out["diffusers_full_over_one_block"] = out["compile_diffusers_full"] / out["compile_diffusers_one_block"]
    return out


# ----------------------------------------------------------------------------- tp=2


def _widen_diffusers_tp_devices() -> None:
    """diffusers' TP refuses CPU meshes; allow "cpu" (this check only, nothing else)."""
    # diffusers: seconds to import, loaded when first used
    import diffusers.hooks.tensor_parallel as tp

    if "cpu" not in tp._SUPPORTED_TP_DEVICES:
        tp._SUPPORTED_TP_DEVICES = (*tp._SUPPORTED_TP_DEVICES, "cpu")


def _diffusers_tp(module, tp_config, rank, world) -> None:
    """``module.enable_parallelism(config=tp_config)``'s tensor-parallel steps, in its order:
    diffusers' own checks, shard specs, config setup and ``apply_tensor_parallel`` with the
    model's ``_tp_plan``. Only the device lookup differs: enable_parallelism takes the device
    from ``torch.accelerator`` (none on a CPU machine: it divides by a device count of 0),
    here it is the CPU mesh's."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.hooks.tensor_parallel import (
        _check_tp_supported,
        _tp_degree,
        apply_tensor_parallel,
        resolve_tp_shard_specs,
    )

    # diffusers: seconds to import, loaded when first used
    from diffusers.models._modeling_parallel import ParallelConfig

    heads = getattr(module.config, "num_attention_heads", None)
    _check_tp_supported(type(module).__name__, module._tp_plan, heads, tp_config, model=module)
    resolve_tp_shard_specs(module, module._tp_plan, _tp_degree(tp_config))
    config = ParallelConfig(tensor_parallel_config=tp_config)
    config.setup(rank, world, torch.device("cpu"), mesh=tp_config.mesh)
    module._parallel_config = config
    apply_tensor_parallel(module, config.tensor_parallel_config, module._tp_plan)


def _tp_rank(rank, world, port, name, config, runs, dtype, shape_kw, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # diffusers: seconds to import, loaded when first used
        from diffusers.models._modeling_parallel import TensorParallelConfig

        mesh = sharding.make_mesh(tp=world, device_type="cpu")
        params = _api.init(config, seed=0, dtype=dtype)
        ours = _api.prepare(sharding.shard_params(params, mesh))
        kw, dkw = inputs(config, "cpu", dtype, **shape_kw)
        _widen_diffusers_tp_devices()
        module = diffusers_module(params, "cpu", dtype)
        tp_mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        _diffusers_tp(module, TensorParallelConfig(mesh=tp_mesh), rank, world)
        contenders = {"ours": lambda: _api.apply(ours, **kw), "diffusers": lambda: module(**dkw)[0]}
        with torch.no_grad():
            err = _err(contenders["ours"](), contenders["diffusers"]())
        med = alternate(contenders, runs, "cpu")
        mine = sharding.local_bytes(ours)
        theirs = sum((p.to_local() if is_dtensor(p) else p).numel() * p.element_size() for p in module.parameters())
        if rank == 0:
            torch.save(dict(tp_ours=med["ours"], tp_diffusers=med["diffusers"], tp_err=err, bytes_ours=mine,
                            bytes_diffusers=theirs), out_path)  # fmt: skip
    finally:
        torch.distributed.destroy_process_group()


def tp_section(name, config, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tp.pt")
        mp.spawn(_tp_rank, args=(2, port, name, config, args.runs, args.dtype, shape(args), path), nprocs=2, join=True)
        out = torch.load(path)
    out["ratio_tp"] = out["tp_ours"] / out["tp_diffusers"]
    return out


def memory_section() -> list[tuple[str, float, float]]:
    """(preset, GB per rank at tp=8, ideal GB) for every released preset, bf16."""
    rows = []
    for preset, config in _api.PRESETS.items():
        if preset.endswith("-tiny"):
            continue
        try:
            got = sharding.bytes_per_rank(config, None, {"tp": 8}, torch.bfloat16) / 1e9
        except ValueError:
            continue
        rows.append((preset, got, _api.num_params(config) * 2 / 1e9 / 8))
    return rows


# ----------------------------------------------------------------------------- report


def _picks(counts: dict) -> str:
    return "/".join(f"{k} x{n}" for k, n in counts.items())


def _f(v, spec="{:.3f}") -> str:
    return "n/a" if v is None else spec.format(v)


TABLE_HEAD = [
    "family",
    "params",
    "eager ours s",
    "diffusers s",
    "ours/diffusers",
    "fast; exact /diffusers",
    "ours/diffusers fused",
    "FLOP/s vs peak",
    "compiled ours/diffusers",
    "cold compile ours/diffusers s",
    "full/one block ours (diffusers)",
    "tp=2 ours/diffusers s",
    "tp=2 MB/rank ours (diffusers)",
]


def _eager_cells(r: dict) -> list[str]:
    return [
        f"{r['params'] / 1e6:.1f}M",
        _f(r["eager_ours"]),
        _f(r["eager_diffusers"]),
        _f(r["ratio_eager"], "{:.2f}"),
        f"{_f(r.get('ratio_eager_fast'), '{:.2f}')}; {_f(r.get('ratio_eager_exact'), '{:.2f}')}",
        _f(r.get("ratio_eager_fused"), "{:.2f}"),
        f"{r['flops_per_s'] / 1e9:.1f} / {r['peak_flops_per_s'] / 1e9:.1f} GFLOP/s = {r['fraction_of_peak']:.2f}",
    ]


def _compile_tp_cells(c: dict, tp: dict) -> list[str]:
    if not c:
        compile_cells = ["n/a", "n/a", "n/a"]
    else:
        compile_cells = [
            f"{_f(c.get('ratio_compiled'), '{:.2f}')} ({c['compiled_ours']:.3f} / {c['compiled_diffusers']:.3f} s)",
            f"{c['compile_ours_full']:.1f} / {c['compile_diffusers_full']:.1f} = {c['ratio_compile_time']:.2f}",
            f"{c['ours_full_over_one_block']:.2f} ({c['diffusers_full_over_one_block']:.2f})",
        ]
    if not tp:
        return compile_cells + ["n/a", "n/a"]
    return compile_cells + [
        f"{tp['tp_ours']:.3f} / {tp['tp_diffusers']:.3f} = {tp['ratio_tp']:.2f}",
        f"{tp['bytes_ours'] / 1e6:.1f} ({tp['bytes_diffusers'] / 1e6:.1f})",
    ]


def peak_note(device) -> str:
    """What the table's "FLOP/s vs peak" column divides by: one peak, measured per family."""
    n = peak_n(device)
    return (
        f"FLOP/s vs peak: ours' model FLOP/s / the matmul peak (a {n}x{n}x{n} GEMM timed in the same "
        "alternating rounds as the family, so under the same load) = the fraction of it reached"
    )


def table(results: dict) -> list[str]:
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
    for name, r in results.items():
        row = [name, *_eager_cells(r), *_compile_tp_cells(r.get("compile") or {}, r.get("tp") or {})]
        lines.append("| " + " | ".join(row) + " |")
    return lines


COMPILED_NOTE = (
    "- compiled: `torch.compile(fd.apply, fullgraph=True, dynamic=False)` on the plain params vs "
    "`torch.compile(module, fullgraph=True, dynamic=False)`; cold compile = the first compiled call in a fresh "
    "process whose inductor cache holds only a trivial warm-up (toolchain ready, no kernel or graph of the "
    "model cached), FX graph cache off"
)
TP_NOTE = (
    "- tp=2: 2 gloo processes on this machine, 1 thread each, ours on `fd.prepare`d sharded params; "
    "diffusers' own tensor parallelism (`enable_parallelism(TensorParallelConfig)`'s steps: its checks, "
    "shard specs, `apply_tensor_parallel` with the model's `_tp_plan`), with its device-type check widened to "
    "allow CPU (`diffusers.hooks.tensor_parallel._SUPPORTED_TP_DEVICES` += 'cpu') and the device taken from "
    "the CPU mesh instead of `torch.accelerator` (none on a CPU machine); nothing else changed"
)


def _method_notes(results: dict) -> list[str]:
    """How the compiled and tp figures were taken, where the report has them."""
    notes = []
    if any(r.get("compile") for r in results.values()):
        notes.append(COMPILED_NOTE)
    if any(r.get("tp") for r in results.values()):
        notes.append(TP_NOTE)
    return notes


def markdown(results, args, command, started, elapsed) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"## {machine_kind()}",
        "",
        f"- date: {started:%Y-%m-%d %H:%M} UTC; wall time {elapsed / 60:.1f} min",
        f"- machine: {machine()}",
        f"- command: `{command}`",
        f"- device {args.device}, dtype {str(args.dtype).removeprefix('torch.')}, batch 1, "
        f"{args.image_tokens} image + {args.text_tokens} text tokens, random weights (the same in both), "
        f"median of {args.runs} alternating rounds",
        "- blocks (double + single): "
        + ", ".join(f"{n} {b}" for n, b in getattr(args, "blocks", {}).items())
        + ("" if getattr(args, "depth", "mid") == "mid" else " (the released models' depth, mid width)"),
        f"- matmul peak: a {peak_n(args.device)}³ GEMM, timed in the same alternating rounds as each family "
        "(so under the same load): the peak of the table's FLOP/s column",
        '- ours: `fd.apply` on `fd.prepare`d params (fused q/k/v and the eager kernels `kernels="auto"` measured '
        'faster on this machine, `functional_dit.nn.kernels`); beside it the pins `kernels="fast"` (every fast '
        'kernel) and `"exact"` (the plain params\' kernels); FLOPs counted by `torch.utils.flop_counter` on the '
        "plain params (the same products), attention included",
        "- auto's picks (op: kernel x shapes): "
        + "; ".join(
            f"{n}: " + ", ".join(f"{op} {_picks(c)}" for op, c in r.get("kernels", {}).items())
            for n, r in results.items()
        ),  # fmt: skip
    ]
    lines += _method_notes(results)
    lines.append("")
    lines += table(results)
    lines += ["", "Every figure:", "", "```"]
    for name, r in results.items():
        lines.append(f"{name}: {r}")
    lines += ["```", "", "Per-rank parameter memory at tp=8 (bf16, GB; ideal = params / 8):", ""]
    lines += ["| preset | GB per rank | ideal | ratio |", "|---|---|---|---|"]
    lines += [f"| {p} | {g:.2f} | {i:.2f} | {g / i:.3f} |" for p, g, i in memory_section()]
    return "\n".join(lines) + "\n"


def sections(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """(the lines before the first ``## `` heading, {heading: its section's lines})."""
    head, parts, current = [], {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            parts[current] = []
        (head if current is None else parts[current]).append(line)
    return head, parts


def write_report(path: str, text: str) -> None:
    """Write ``text`` (one machine kind's section) to ``path``, keeping the sections of
    other machine kinds already there and replacing this kind's own."""
    new_head, new_parts = sections(text)
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    old_head, parts = sections(old)
    parts.update(new_parts)
    lines = (old_head if any(ln.strip() for ln in old_head) else new_head) + [ln for p in parts.values() for ln in p]
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n")


# ----------------------------------------------------------------------------- CLI


def add_arguments(p) -> None:
    """The forward figures' shapes and runs, then the report and the extra sections."""
    _shape_arguments(p)
    _section_arguments(p)


def _shape_arguments(p) -> None:
    """Device, dtype, the configs and shapes timed, rounds and threads."""
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument(
        "--preset", default=None, help="a released preset's shape (random weights) instead of the mid configs"
    )
    p.add_argument(
        "--image-tokens", type=int, default=IMG_HW[0] * IMG_HW[1], help="latent tokens, a square (default 1024)"
    )
    p.add_argument("--text-tokens", type=int, default=TXT_LEN, help="text tokens (default 128)")
    p.add_argument(
        "--depth",
        choices=("mid", "released"),
        default="mid",
        help="the mid configs' block counts (default) or their released models' (flux1-dev 19 + 38, ...)",
    )
    p.add_argument(
        "--families",
        default="flux1,flux2,qwenimage,flux3,qwenimage21",
        help="comma-separated subset of the mid configs",
    )
    p.add_argument("--runs", type=int, default=7, help="rounds per figure (median); >= 7 for a full run")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def _section_arguments(p) -> None:
    """What to skip or add (compile, tp, fp8, sampling, caches, the GPU suite) and the report file."""
    p.add_argument("--no-compile", action="store_true", help="skip the compile figures")
    p.add_argument("--no-tp", action="store_true", help="skip tp=2 (CPU only)")
    p.add_argument(
        "--quantize",
        choices=_quant.SCHEMES,
        default=None,
        help="ours with fp8 compute (fd.quantize, default skip list) in the eager and compiled figures, "
        "diffusers unquantized; implies --no-tp",
    )
    p.add_argument(
        "--out",
        default=None,
        help="a Markdown file to write the report to (default: none; the committed "
        "BENCHMARKS.md is rewritten only when named)",
    )
    p.add_argument("--sampling", action="store_true", help="only the sampling section, appended to --out")
    p.add_argument("--cache", nargs="+", default=None, help="sampling rows with these step caches (fbcache:0.1 ...)")
    p.add_argument("--cache-steps", type=int, default=8, help="sampling steps of the --cache rows (default 8)")
    p.add_argument("--cache-size", type=int, default=256, help="image side in pixels of the --cache rows")
    p.add_argument(
        "--suite",
        choices=("gpu",),
        default=None,
        help="gpu: every section side by side with diffusers within --budget (functional_dit.cli.bench_suite)",
    )
    p.add_argument("--budget", type=float, default=None, help="--suite's seconds (default 450 on CUDA, 55 on a CPU)")
    p.add_argument("--compile-backend", default=None, help="--suite's torch.compile backend (inductor on CUDA, none)")


def shape(args) -> dict:
    """`inputs`' keywords for ``--image-tokens`` (a square of latent tokens) and ``--text-tokens``."""
    side = math.isqrt(args.image_tokens)
    if side * side != args.image_tokens or side < 1:
        raise ValueError(f"--image-tokens: expected a square number of latent tokens, got {args.image_tokens}")
    if args.text_tokens < 1:
        raise ValueError(f"--text-tokens: expected a positive number of text tokens, got {args.text_tokens}")
    return dict(hw=(side, side), txt_len=args.text_tokens)


def _configs(args) -> dict:
    if args.preset is not None:
        presets = _api.PRESETS
        if args.preset not in presets:
            raise ValueError(f"--preset: expected one of {sorted(presets)}, got {args.preset!r}")
        return {args.preset: presets[args.preset]}
    mids = mid_configs()
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in mids]
    if unknown:
        raise ValueError(f"--families: expected a subset of {sorted(mids)}, got {unknown}")
    if args.depth == "released":
        return {n: released_depth(n, mids[n]) for n in names}
    return {n: mids[n] for n in names}


def _setup(args) -> dict:
    """Checks the flags and sets the process up; returns the configs to measure."""
    args.dtype = getattr(torch, args.dtype) if isinstance(args.dtype, str) else args.dtype
    if not isinstance(args.dtype, torch.dtype):
        raise ValueError(f"--dtype: expected a torch dtype name, got {args.dtype!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if _fp8(args):
        args.no_tp = True  # the tp=2 rows build their own unquantized params
    inductor_config.fx_graph_cache = False  # cold compile times
    configs = _configs(args)
    args.blocks = {n: "+".join(str(getattr(c, k)) for k in ("num_layers", "num_single_layers") if hasattr(c, k))
                   for n, c in configs.items()}  # fmt: skip
    shape(args)  # bad token counts fail before any work
    return configs


def _measure(configs: dict, args) -> dict:
    """Every section per family, each printed as soon as the family is done."""
    results = {}
    warm = tempfile.TemporaryDirectory()
    if not args.no_compile:
        _in_process(_warm_worker, warm.name)
    for name, config in configs.items():
        print(f"{name}: eager ...", flush=True)
        r = eager_section(name, config, args)
        if not args.no_compile:
            print(f"{name}: compile ...", flush=True)
            r["compile"] = compile_section(name, config, args, warm.name)
        if not args.no_tp and torch.device(args.device).type == "cpu":
            print(f"{name}: tp=2 ...", flush=True)
            r["tp"] = tp_section(name, config, args)
        results[name] = r
        print(f"{name}: done", flush=True)
    return results


def run(args) -> int:
    if getattr(args, "suite", None):  # one command for a GPU's whole picture: functional_dit.cli.bench_suite
        return bench_suite.run(args)
    if getattr(args, "sampling", False):  # fd.sample vs stock, dp scaling: functional_dit.cli.bench_sample
        return bench_sample.run(args)
    configs = _setup(args)
    command = "python -m functional_dit " + " ".join(getattr(args, "argv", sys.argv[1:]))
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    results = _measure(configs, args)
    cache_rows = _bench_cache.section(configs, args.cache, args.cache_steps, args.cache_size) if args.cache else []
    elapsed = time.perf_counter() - t0
    text = markdown(results, args, command, started, elapsed)
    if cache_rows:  # sampling rows of step caching (functional_dit.cli._bench_cache)
        text += "\nStep caching, per image (fd.sample vs the stock pipeline + diffusers' cache):\n\n"
        text += "\n".join(_bench_cache.table(cache_rows)) + "\n"
    print("\n".join(table(results) + _bench_cache.table(cache_rows) * bool(cache_rows)))
    print(peak_note(args.device))
    print(f"wall time {elapsed / 60:.1f} min")
    if args.out:
        write_report(args.out, text)
        print(f"wrote {args.out} (section {machine_kind()!r})")
    else:
        print("no report written: pass --out FILE.md to keep one")
    return 0

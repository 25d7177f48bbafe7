"""fp8 compute (`fd.quantize`): the error table and the memory table of docs/quantization.md.

``--memory``: parameter bytes per rank of every released preset, quantized ("fp8-row", the
default skip list; "fp8-tensor" differs only in a few scale bytes) vs bf16, at tp = 1, 2, 8,
from the meta device (no weights): the fp8 leaves hold 1 byte a value plus their float32
scales; the rest stays bf16. Sharded leaves divide by tp as `sharding.plan` places them
(a row-wise scale shards with its rows; a column-parallel weight's scales are whole).

``--error``: per family (the tiny configs of `functional_dit.tiny`, random weights: a
check of the numerics, not of image quality on released weights), scheme and skip list,
the relative error (Frobenius) vs the fp32 unquantized model of
- one ``fd.apply`` at each of 8 timesteps (the mean, and the share of steps within 5 %),
- the latents of ``fd.sample`` at 4 steps (the tiny pipeline, one prompt, seed 0);
with the default skip list (`functional_dit.nn.quant.DEFAULT_SKIP`) and with every linear
quantized, and the bf16 unquantized model beside them for scale.

``--time``: the CPU time of one ``fd.apply`` (bf16 compute, median of 5, this machine, both
in one run) quantized vs not: on a CPU ``torch._scaled_mm`` is not a faster kernel, so this
is an honest cost, not a speed-up.

    python examples/quantization_table.py [--memory] [--error] [--time]   (all by default)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import functional_dit as fd
import sharding
from functional_dit.nn import quant
from sharding.tree import leaves

DEGREES = (1, 2, 8)
PRESETS = ("flux1-dev", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b", "qwen-image", "flux3-klein", "qwen-image-2.1")
BOUND = 0.05  # a step's output counts as within bound at a relative error <= 5 %


def _leaf_bytes(t: torch.Tensor, placement, tp: int) -> tuple[int, int]:
    """(bytes on one rank, bytes of the same leaf in bf16 on one rank)."""
    split = tp if isinstance(placement, sharding.Shard) else 1
    bf16 = t.numel() * 2 // split
    if not quant.is_quant(t):
        return bf16, bf16
    scale = t.scale.numel() * 4 // (split if placement_dim(placement) == 0 and t.scheme == "fp8-row" else 1)
    return t.numel() // split + scale, bf16


def placement_dim(placement) -> int | None:
    return placement.dim if isinstance(placement, sharding.Shard) else None


def memory_row(name: str) -> str:
    q = fd.quantize(fd.init(name, dtype=torch.bfloat16, device="meta"), "fp8-row")
    cells = []
    for tp in DEGREES:
        try:
            plan = dict(leaves(sharding.plan(q.config, {"tp": tp})))
        except ValueError:  # heads or blocks that do not split tp ways
            cells.append(f"{'n/a':>22}")
            continue
        total = bf16 = qleaf = qleaf_bf16 = 0
        for key, t in q.flat().items():
            got, base = _leaf_bytes(t, plan[key], tp)
            total, bf16 = total + got, bf16 + base
            if quant.is_quant(t):
                qleaf, qleaf_bf16 = qleaf + got, qleaf_bf16 + base
        cells.append(f"{total / 1e9:6.2f} / {bf16 / 1e9:6.2f} ({qleaf / qleaf_bf16:.3f}×)")
    share = sum(t.numel() for t in q.leaves() if quant.is_quant(t)) / sum(t.numel() for t in q.leaves())
    return f"| {name} | {share:.1%} | " + " | ".join(cells) + " |"


def memory_table() -> str:
    head = " | ".join(f"tp={tp}: fp8-row / bf16 GB (fp8 leaves ÷ bf16)" for tp in DEGREES)
    lines = [f"| preset | params quantized | {head} |", "|---" * (2 + len(DEGREES)) + "|"]
    return "\n".join(lines + [memory_row(name) for name in PRESETS])


# ----------------------------------------------------------------------------- error


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(kind: str, pipe):
    """One call's inputs for ``kind``'s tiny transformer: from the test case modules' recipe."""
    config = fd.from_diffusers(pipe.transformer).config
    g = torch.Generator().manual_seed(0)
    S, T = 16, 8
    kw = dict(
        x=torch.randn(1, S, config.in_channels, generator=g),
        txt=torch.randn(1, T, config.joint_attention_dim, generator=g),
    )
    if kind == "flux":
        kw.update(
            pooled=torch.randn(1, config.pooled_projection_dim, generator=g), img_ids=torch.randn(S, 3, generator=g)
        )
        kw.update(txt_ids=torch.zeros(T, 3), guidance=torch.full((1,), 3.5))
    elif kind == "flux2":
        kw.update(img_ids=torch.randn(S, 4, generator=g), txt_ids=torch.zeros(T, 4), guidance=torch.full((1,), 4.0))
    else:
        kw.update(txt_mask=torch.ones(1, T, dtype=torch.bool), img_shapes=[[(1, 4, 4)]])
    return kw


def _steps(params, kw) -> list[torch.Tensor]:
    return [fd.apply(params, t=torch.full((1,), t), **kw) for t in torch.linspace(1.0, 0.05, 8).tolist()]


def error_rows(kind: str) -> list[str]:
    from functional_dit import tiny

    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    kw = _inputs(kind, pipe)
    size = dict(height=32, width=32, steps=4, seed=0, output_type="latent")
    with torch.no_grad():
        ref_steps = _steps(params, kw)
        ref_latents = fd.sample(params, pipe, "a red cube on a table", **size)
        variants = [("bf16 (no fp8)", None, None)] + [(s, s, k) for s in quant.SCHEMES for k in ("default", "none")]
        rows = []
        for label, scheme, skip in variants:
            if scheme is None:  # the whole pipeline in bf16 (its own copy: a cast back would not restore fp32)
                bf16 = tiny.pipeline(kind, dtype=torch.bfloat16)
                p = fd.from_diffusers(bf16.transformer)
                steps = [o.float() for o in _steps(p, {k: _bf16(k, v) for k, v in kw.items()})]
                lat = fd.sample(p, bf16, "a red cube on a table", **size).float()
            else:
                p = fd.quantize(params, scheme, skip=None if skip == "default" else ())
                steps, lat = _steps(p, kw), fd.sample(p, pipe, "a red cube on a table", **size)
            errs = [_rel(o, r) for o, r in zip(steps, ref_steps)]
            within = sum(e <= BOUND for e in errs) / len(errs)
            n = sum(quant.is_quant(t) for t in p.leaves())
            rows.append(
                f"| {kind} | {label} | {skip or '–'} | {n} | {statistics.mean(errs):.2%} | {within:.0%} | "
                f"{_rel(lat, ref_latents):.2%} |"
            )
    return rows


def _bf16(key: str, v):
    return v.to(torch.bfloat16) if key in ("x", "txt", "pooled") else v


def error_table() -> str:
    head = (
        "| family | scheme | skip list | fp8 linears | mean rel. error per step (8 t) | steps within 5 % | "
        "latents after fd.sample (4 steps) |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for kind in ("flux", "flux2", "qwen-image"):
        lines += error_rows(kind)
    return "\n".join(lines)


def cpu_time() -> str:
    """Median seconds of one bf16 fd.apply on flux2-tiny-sized wider model, quantized vs not."""
    import dataclasses

    config = dataclasses.replace(
        fd.PRESETS["flux2-tiny"], num_attention_heads=8, attention_head_dim=64, axes_dims_rope=(16, 16, 16, 16)
    )
    params = fd.init(config, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    S, T = 256, 64
    kw = dict(
        x=torch.randn(1, S, config.in_channels, generator=g).bfloat16(),
        t=torch.full((1,), 0.5),
        txt=torch.randn(1, T, config.joint_attention_dim, generator=g).bfloat16(),
        img_ids=torch.randn(S, 4, generator=g),
        txt_ids=torch.zeros(T, 4),
        guidance=torch.full((1,), 4.0),
    )
    out = []
    with torch.no_grad():
        for label, p in (("bf16", params), ("fp8-row", fd.quantize(params, "fp8-row"))):
            fd.apply(p, **kw)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                fd.apply(p, **kw)
                times.append(time.perf_counter() - t0)
            out.append((label, statistics.median(times)))
    (a, ta), (b, tb) = out
    return (
        f"CPU, one fd.apply (inner dim 512, 320 tokens, bf16 compute, {torch.get_num_threads()} threads): "
        f"{a} {ta * 1e3:.1f} ms, {b} {tb * 1e3:.1f} ms ({tb / ta:.2f}× the bf16 time)"
    )


def main(argv: list[str]) -> None:
    which = set(argv) or {"--memory", "--error", "--time"}
    if "--memory" in which:
        print(memory_table())
        print()
    if "--error" in which:
        print(error_table())
        print()
    if "--time" in which:
        print(cpu_time())


if __name__ == "__main__":
    main(sys.argv[1:])

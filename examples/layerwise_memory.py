"""Layerwise casting (`fd.layerwise_cast`): the memory the parameters hold, the peak of one
forward and the forward time, for fp32 / bf16 params against float8 storage read as fp32 /
bf16, on a moderate FLUX.1 (4 double + 8 single blocks, 8 heads x 128, 270 M parameters;
256 image + 64 text tokens by default, batch 1), on the CPU.

Each mode runs in a fresh process with glibc's mmap threshold fixed low
(``MALLOC_MMAP_THRESHOLD_``), so every large tensor is its own mapping and freeing it
gives the memory back: the resident set then follows the live tensors. The parameters are
built (fp32 init, then converted), the peak resident set is reset (Linux
``/proc/self/clear_refs``), and the figures are the parameters' bytes, the resident memory
they hold (above the process before them), the peak resident memory of one
``torch.no_grad`` forward above the process before the parameters (parameters +
activations + the one weight cast at a time). The forward times are measured apart, in
this process with the default allocator: the four param sets side by side, their forwards
interleaved (``--repeats`` rounds, the best of each), so a shared machine's load drifts
over all modes alike.
The skip patterns are diffusers' for FLUX.1 (norms and position embeddings stay as they are).

    python examples/layerwise_memory.py [--repeats 5] [--threads N] [--tokens 256 64]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

import functional_dit as fd

CONFIG = fd.Flux1Config(
    num_layers=4,
    num_single_layers=8,
    attention_head_dim=128,
    num_attention_heads=8,
    joint_attention_dim=1024,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
SKIP = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")  # diffusers' defaults + FLUX.1's
MODES = {  # name: (params dtype, storage dtype or None)
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "fp8 -> fp32": (torch.float32, torch.float8_e4m3fn),
    "fp8 -> bf16": (torch.bfloat16, torch.float8_e4m3fn),
}
TOKENS = [256, 64]  # image, text (--tokens)


def _rss(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _inputs(dtype):
    g, (S_IMG, S_TXT) = torch.Generator().manual_seed(0), TOKENS
    return dict(
        x=torch.randn(1, S_IMG, CONFIG.in_channels, generator=g).to(dtype),
        t=torch.rand(1, generator=g),
        txt=torch.randn(1, S_TXT, CONFIG.joint_attention_dim, generator=g).to(dtype),
        pooled=torch.randn(1, CONFIG.pooled_projection_dim, generator=g).to(dtype),
        guidance=torch.full((1,), 3.5),
        img_ids=torch.randn(S_IMG, 3, generator=g),
        txt_ids=torch.zeros(S_TXT, 3),
    )


def _params(mode: str) -> fd.Params:
    dtype, storage = MODES[mode]
    params = torch.utils._pytree.tree_map(lambda t: t.to(dtype), fd.init(CONFIG, seed=0))
    return params if storage is None else fd.layerwise_cast(params, storage, dtype, skip=SKIP)


def measure(mode: str) -> dict:
    """One mode's memory figures, in this process (see the module docstring)."""
    kw = _inputs(MODES[mode][0])
    before = _rss("VmRSS")
    params = _params(mode)
    gc.collect()
    held = _rss("VmRSS") - before
    stored = sum(getattr(t, "stored", t).nbytes for t in params.leaves())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    with torch.no_grad():
        fd.apply(params, **kw)
    return dict(mode=mode, stored=stored, held=held, peak=_rss("VmHWM") - before)


def times(repeats: int) -> dict[str, float]:
    """The best forward time of each mode, the modes interleaved (see the module docstring)."""
    runs = {mode: (_params(mode), _inputs(MODES[mode][0])) for mode in MODES}
    best = dict.fromkeys(MODES, float("inf"))
    with torch.no_grad():
        for round_ in range(repeats + 1):
            for mode, (params, kw) in runs.items():
                start = time.perf_counter()
                fd.apply(params, **kw)
                if round_:  # round 0 warms up
                    best[mode] = min(best[mode], time.perf_counter() - start)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, nargs=2, default=TOKENS, metavar=("IMAGE", "TEXT"))
    ap.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)  # one mode, in a child process
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    TOKENS[:] = args.tokens
    if args.mode:
        print(json.dumps(measure(args.mode)))
        return
    rows = []
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode, "--tokens", *map(str, TOKENS)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    for row, t in zip(rows, times(args.repeats).values()):
        row["time"] = t
    print(
        f"FLUX.1, {fd.num_params(CONFIG) / 1e6:.0f} M params, {TOKENS[0]} + {TOKENS[1]} tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'mode':<12} {'params bytes':>12} {'params RSS':>11} {'forward peak RSS':>17} {'forward':>9}")
    mib = 2**20
    ref = {"fp32": rows[0], "bf16": rows[1]}
    for r in rows:
        same = ref[r["mode"].split()[-1]]
        ratio = f" ({r['time'] / same['time']:.2f}x)" if r is not same else ""
        print(
            f"{r['mode']:<12} {r['stored'] / mib:>8.0f} MiB {r['held'] / mib:>7.0f} MiB {r['peak'] / mib:>13.0f} MiB "
            f"{r['time']:>7.2f} s{ratio}"
        )


if __name__ == "__main__":
    main()

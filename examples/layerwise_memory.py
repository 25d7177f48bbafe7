"""Layerwise casting (`fd.layerwise_cast`): the memory the parameters hold, the peak of one
forward and the forward time, for fp32 / bf16 params against float8 storage read as fp32 /
bf16, on a moderate FLUX.1 (4 double + 8 single blocks, 8 heads x 128, 270 M parameters;
256 image + 64 text tokens, batch 1), on the CPU.

Each mode runs in a fresh process: the parameters are built (fp32 init, then converted),
the peak resident set is reset (Linux ``/proc/self/clear_refs``), and the figures are the
resident memory held by the parameters (above the process before them), the peak during
one ``torch.no_grad`` forward above that, and the best of ``--repeats`` forward times.
The skip patterns are diffusers' for FLUX.1 (norms and position embeddings stay as they are).

    python examples/layerwise_memory.py [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
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
S_IMG, S_TXT = 256, 64


def _rss(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    return dict(
        x=torch.randn(1, S_IMG, CONFIG.in_channels, generator=g).to(dtype),
        t=torch.rand(1, generator=g),
        txt=torch.randn(1, S_TXT, CONFIG.joint_attention_dim, generator=g).to(dtype),
        pooled=torch.randn(1, CONFIG.pooled_projection_dim, generator=g).to(dtype),
        guidance=torch.full((1,), 3.5),
        img_ids=torch.randn(S_IMG, 3, generator=g),
        txt_ids=torch.zeros(S_TXT, 3),
    )


def measure(mode: str, repeats: int) -> dict:
    """One mode's figures, in this process (see the module docstring)."""
    dtype, storage = MODES[mode]
    kw = _inputs(dtype)
    before = _rss("VmRSS")
    params = fd.init(CONFIG, seed=0)
    params = torch.utils._pytree.tree_map(lambda t: t.to(dtype), params)
    if storage is not None:
        params = fd.layerwise_cast(params, storage, dtype, skip=SKIP)
    import gc

    gc.collect()
    held = _rss("VmRSS") - before
    stored = sum(getattr(t, "stored", t).nbytes for t in params.leaves())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    base = _rss("VmRSS")
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            fd.apply(params, **kw)
            times.append(time.perf_counter() - start)
            if not times[1:]:
                peak = _rss("VmHWM") - base  # the first forward's peak
    return dict(mode=mode, stored=stored, held=held, peak=peak, time=min(times))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)  # one mode, in a child process
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode:
        print(json.dumps(measure(args.mode, args.repeats)))
        return
    rows = []
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode, "--repeats", str(args.repeats)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"FLUX.1, {fd.num_params(CONFIG) / 1e6:.0f} M params, {S_IMG} + {S_TXT} tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'mode':<12} {'params bytes':>12} {'params RSS':>11} {'forward peak':>13} {'forward':>9}")
    mib = 2**20
    ref = {"fp32": rows[0], "bf16": rows[1]}
    for r in rows:
        same = ref[r["mode"].split()[-1]]
        ratio = f" ({r['time'] / same['time']:.2f}x)" if r is not same else ""
        print(
            f"{r['mode']:<12} {r['stored'] / mib:>8.0f} MiB {r['held'] / mib:>7.0f} MiB {r['peak'] / mib:>9.0f} MiB "
            f"{r['time']:>7.2f} s{ratio}"
        )


if __name__ == "__main__":
    main()

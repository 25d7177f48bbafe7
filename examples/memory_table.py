"""Per-rank parameter memory (bf16, GB = 1e9 bytes) of every released preset at tensor
parallelism 1, 2, 4 and 8: replicated bytes + sharded bytes / tp, from `param_specs` and
the default sharding plan (attention heads, MLPs and the AdaLN modulation split over tp),
with the ideal (all parameters / tp) beside each figure. No weights, no processes.

    python examples/memory_table.py
"""

from __future__ import annotations

import torch

import functional_dit as fd
import sharding

DEGREES = (1, 2, 4, 8)


def cells(config) -> list[tuple[float | None, float]]:
    """(GB per rank or None when tp does not divide the heads, ideal GB) per degree."""
    total = fd.num_params(config) * torch.bfloat16.itemsize / 1e9
    out = []
    for tp in DEGREES:
        try:
            out.append((sharding.bytes_per_rank(config, None, {"tp": tp}, torch.bfloat16) / 1e9, total / tp))
        except ValueError:  # e.g. heads not divisible by tp
            out.append((None, total / tp))
    return out


def row(name: str, config) -> str:
    text = [f"{'n/a':>15}" if got is None else f"{got:7.2f} ({ideal:5.2f})" for got, ideal in cells(config)]
    return f"{name:<22}{fd.num_params(config) / 1e9:>8.2f}B " + " ".join(text)


def main() -> None:
    released = {k: v for k, v in fd.PRESETS.items() if not k.endswith("-tiny")}
    head = " ".join(f"{f'tp={tp} (ideal)':>15}" for tp in DEGREES)
    print(f"{'preset':<22}{'params':>9} {head}   (GB per rank, bf16)")
    for name, config in released.items():
        print(row(name, config))


if __name__ == "__main__":
    main()

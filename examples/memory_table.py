"""Per-rank parameter memory (bf16, GB = 1e9 bytes) of every released preset at tensor
parallelism 1, 2, 4 and 8: replicated bytes + sharded bytes / tp, from `param_specs` and
the default sharding plan. No weights, no processes.

    python examples/memory_table.py
"""

from __future__ import annotations

import torch

import functional_dit as fd
import sharding

DEGREES = (1, 2, 4, 8)


def row(name: str, config) -> str:
    cells = []
    for tp in DEGREES:
        try:
            cells.append(f"{sharding.bytes_per_rank(config, None, {'tp': tp}, torch.bfloat16) / 1e9:8.2f}")
        except ValueError:  # e.g. heads not divisible by tp
            cells.append(f"{'n/a':>8}")
    return f"{name:<22}{fd.num_params(config) / 1e9:>8.2f}B" + "".join(cells)


def main() -> None:
    released = {k: v for k, v in fd.PRESETS.items() if not k.endswith("-tiny")}
    print(f"{'preset':<22}{'params':>9}" + "".join(f"{f'tp={tp}':>8}" for tp in DEGREES) + "   (GB per rank, bf16)")
    for name, config in released.items():
        print(row(name, config))


if __name__ == "__main__":
    main()

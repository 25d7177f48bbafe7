"""Per-rank attention activation memory and communication per denoising step for Ulysses
(``sp=N``), ring attention (``ring=N``) and USP (``sp=N/2 x ring=2``) at 8 and 16 ranks,
for FLUX.1-dev, FLUX.2-dev and Qwen-Image at 1024², 2048² and 4096². No hardware, no
weights: the heads, head size and attention layers come from the presets, and
`sharding.plan` decides whether a mesh is possible (Ulysses needs the heads to divide by
sp; the table says "—" where the plan refuses it).

What is counted (bf16, batch 1, 512 text tokens, 16 pixels per image token), per rank:

- activation: the attention working set of one layer (it is freed before the next):
  Ulysses' q, k, v after the all-to-all (the whole sequence, H/sp heads) and the output,
  ``4 S H D / sp``; the ring's query block, its output accumulator (fp32) and the key/
  value block in use plus the one arriving, ``(1 + 2 + 4) S H D / ring``; USP the ring
  terms over the sp x ring ranks. Kernel scratch (a flash kernel's tiles; the exact CPU
  kernel's score block) is not counted. An all-gather of K/V instead of a ring would
  hold ``2 S H D / sp`` per rank: it does not shrink with the ring degree.
- communication: bytes each rank sends per step over all attention layers: Ulysses' four
  all-to-alls (q, k, v in; out back) send ``(sp - 1)/sp`` of its ``4 S H D / N`` elements;
  the ring's ``ring - 1`` passes send its k, v block, ``2 S H D / N`` each.

    python examples/sequence_parallel_table.py
"""

from __future__ import annotations

import functional_dit as fd
import sharding

MODELS = ("flux1-dev", "flux2-dev", "qwen-image")
SIDES = (1024, 2048, 4096)
RANKS = (8, 16)
TXT = 512
BYTES = 2  # bf16


def layouts(n: int) -> dict[str, dict]:
    return {"Ulysses": {"sp": n}, "ring": {"ring": n}, "USP": {"sp": n // 2, "ring": 2}}


def cost(config, sizes: dict, side: int) -> tuple[float, float] | None:
    """(activation GB per layer, communication GB per step) per rank, or None when the
    plan refuses the mesh (the heads do not divide by sp)."""
    try:
        sharding.plan(config, sizes)
    except ValueError:
        return None
    sp, ring = sizes.get("sp", 1), sizes.get("ring", 1)
    n = sp * ring
    S = TXT + (side // 16) ** 2
    HD = config.num_attention_heads * config.attention_head_dim
    layers = config.num_layers + getattr(config, "num_single_layers", 0)
    act = (4 if ring == 1 else 7) * S * HD / n
    comm = 4 * S * HD / n * (sp - 1) / sp + 2 * S * HD / n * (ring - 1)
    return act * BYTES / 1e9, comm * BYTES * layers / 1e9


def table() -> list[str]:
    head = "| model | image | ranks | " + " | ".join(f"{k} act / comm" for k in layouts(8)) + " |"
    lines = [head, "|" + "---|" * (3 + len(layouts(8)))]
    for name in MODELS:
        config = fd.PRESETS[name]
        for side in SIDES:
            for n in RANKS:
                cells = []
                for sizes in layouts(n).values():
                    c = cost(config, sizes, side)
                    cells.append("—" if c is None else f"{c[0]:.3f} / {c[1]:.2f}")
                lines.append(f"| {name} | {side}² | {n} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    print("Per rank: attention activation GB per layer / communication GB per step (bf16, batch 1, 512 text tokens)")
    print("\n".join(table()))


if __name__ == "__main__":
    main()

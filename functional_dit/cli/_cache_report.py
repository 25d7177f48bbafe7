"""What a step cache did, in one line: ``N of M steps computed (K block calls skipped)``,
from `functional_dit.pipelines.cache.CacheRun.decisions` (per step, per CFG branch: True
where the whole network ran). The demo's cache row and ``generate --cache`` print it;
``generate`` warns on stderr when a cache skipped nothing.

A skipped branch-step of First-Block Cache still runs block 0 (its residual decides), so
it skips ``blocks - 1`` block calls; TaylorSeer and MagCache on the output skip every
block. The attention-level caches (TaylorSeer with ``attention=1``, FasterCache) run
every block and reuse one attention output per block instead: their count is of
attention calls.
"""

from __future__ import annotations

import sys

from ..pipelines import cache as _cache


def blocks(config) -> int:
    """Transformer blocks one model call runs (double + single stream)."""
    return config.num_layers + getattr(config, "num_single_layers", 0)


def counts(runs, config) -> dict:
    """Totals over one or more `CacheRun` s of the same cache: steps, steps computed in full
    (every branch), calls skipped and what a call is (``"block"`` or ``"attention"``)."""
    runs = [r for r in runs if r is not None]
    decisions = [d for r in runs for d in r.decisions]
    skipped = sum(not c for d in decisions for c in d)
    cache = runs[0].config if runs else None
    attention = cache is not None and _cache.attention_level(cache)
    per = blocks(config) - (1 if isinstance(cache, _cache.FirstBlockCache) else 0)
    return dict(
        steps=len(decisions),
        computed=sum(all(d) for d in decisions),
        skipped=skipped * per,
        unit="attention" if attention else "block",
    )


def line(runs, config) -> str:
    """``N of M steps computed (K block calls skipped)``."""
    c = counts(runs, config)
    verb = "reused" if c["unit"] == "attention" else "skipped"
    return f"{c['computed']} of {c['steps']} steps computed ({c['skipped']} {c['unit']} calls {verb})"


def warning(runs, config, spec: str) -> str | None:
    """One line for stderr when the cache skipped nothing (else None)."""
    c = counts(runs, config)
    if c["skipped"] or not c["steps"]:
        return None
    return (
        f"warning: --cache {spec} skipped nothing: all {c['steps']} steps ran the whole network "
        "(a larger threshold or interval skips more)"
    )


def report(runs, config) -> None:
    """``generate``'s lines (rank 0): the summary on stdout, `warning` on stderr."""
    runs = [r for r in runs if r is not None]
    if not runs:
        return
    spec = _cache.label(runs[0].config)
    print(f"step cache {spec}: {line(runs, config)}")
    said = warning(runs, config, spec)
    if said:
        print(said, file=sys.stderr)

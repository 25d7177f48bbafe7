"""torch_xla's counters as `check` reads them: the metrics module (None without torch_xla),
the compile count and the ``aten::`` ops that fell back to the CPU."""

from __future__ import annotations


def xla():
    try:
        # optional: torch_xla, XLA devices only
        import torch_xla.debug.metrics as met
    except ImportError:
        return None
    return met


def compiles(met) -> int:
    data = met.metric_data("CompileTime")
    return 0 if data is None else data[0]


def aten_fallbacks(met) -> list[str]:
    return [name for name in met.counter_names() if name.startswith("aten::")]

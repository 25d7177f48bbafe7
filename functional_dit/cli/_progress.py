"""The commands' tqdm bars: a step forward that draws the final line once."""

from __future__ import annotations


def advance(bar, n: int = 1) -> None:
    """``n`` more done on ``bar`` (a tqdm bar). The last advance is only counted, not drawn:
    ``bar.close()`` draws the final line, and drawing it here too printed it twice wherever
    the output is no terminal (a log, a pipe: no carriage return folds the two)."""
    if bar.total is None or bar.n + n < bar.total:
        bar.update(n)
    else:
        bar.n = bar.total

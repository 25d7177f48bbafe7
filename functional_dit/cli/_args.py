"""What every command shares: the expected-failure type and the argument types."""

from __future__ import annotations

import argparse
import math

from ..pipelines.cache import parse  # imported on use: `--help` stays fast
from ..pipelines.sampling import bad_seed


class CLIError(Exception):
    """An expected failure: printed as one line (``error: ...``), exit status 2."""


def positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return v


def seed(text: str) -> int:
    """argparse type of ``--seed``: an int in [0, 2**64) (`bad_seed`)."""
    try:
        v = int(text)
    except ValueError:
        v = text
    want = bad_seed(v)
    if want is not None:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    return v


def cache_spec(text: str):
    """``--cache`` text -> a step-cache config (`functional_dit.pipelines.cache.parse`)."""
    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("cache: ")) from None


def finite(text: str) -> float:
    """A finite float (argparse's ``float`` takes ``nan`` and ``inf``)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def scale(text: str) -> float:
    """A guidance scale: finite and >= 0 (`fd.sample` refuses a negative one too)."""
    v = finite(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a scale >= 0, got {text!r}")
    return v

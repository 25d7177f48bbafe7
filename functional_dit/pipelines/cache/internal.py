"""The step caches' parts for the rest of `functional_dit.pipelines` (not a public API):
``items``, a step cache per item inside one batched call (`_items`: each item decides
alone; `functional_dit.sampling` and the server use it), and ``CacheHooks``, diffusers'
cache hooks on the adapter (`_hooks`, which imports diffusers: loaded on first use)."""

from __future__ import annotations

from . import _items as items  # noqa: F401
from ._hooks import CacheHooks


def __getattr__(name):
    if name == "CacheHooks":
        return CacheHooks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

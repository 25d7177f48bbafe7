"""The sampler's parts for the rest of `functional_dit.pipelines` (not a public API):
``state``, the sampling state and its one pure step (`_state`), which
`functional_dit.sampling` re-exports and ``fd.sample`` loops over."""

from __future__ import annotations

from . import _state as state  # noqa: F401

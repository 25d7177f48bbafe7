"""The sampler's parts for the rest of `functional_dit.pipelines` (not a public API):
``state``, the sampling state and its one pure step (`_state`), which
`functional_dit.sampling` re-exports and ``fd.sample`` loops over; ``ranks``, the
agreement check across ranks (`_ranks`), which `functional_dit.sampling` runs on its
text-to-image requests; ``packing``, items of several sizes in one model call
(`_packing`); ``requests``, the per-image requests and the true-CFG rule (`_requests`)."""

from __future__ import annotations

from . import _packing as packing  # noqa: F401
from . import _ranks as ranks  # noqa: F401
from . import _requests as requests  # noqa: F401
from . import _state as state  # noqa: F401

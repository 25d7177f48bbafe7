"""The toy family's product module (`functional_dit.pipelines.families.HOOKS`): FLUX.1's
sampling steps, adapter argument map, tiny recipes and bench inputs, taken as they are,
and the toy's stock class, the oracle a new family gets from diffusers (here diffusers'
FLUX.1 transformer under the toy's name; the test sets it on ``diffusers``)."""

from __future__ import annotations

import diffusers

from functional_dit.pipelines.families.flux1 import *  # noqa: F403  (every hook of FLUX.1's product)

BENCH_CACHE = None  # no step-cache bench row of its own


class ToyTransformer2DModel(diffusers.FluxTransformer2DModel):
    """The toy's stock diffusers class: FLUX.1's transformer under the toy's name."""

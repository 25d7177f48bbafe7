"""The families package's shared parts for its family subpackages (``flux1/``, ``flux2/``,
``qwenimage/``) and the sampler (not a public API, the ``equinox.internal`` idea): the steps
protocol and its tables (`_steps`), the latent helpers (`_latents`), the image jobs' checks
(`_jobs`), the product modules' common hooks (``common``, `_common`) and FLUX.2's adapter KV
cache (``flux2_kv``, `_flux2_kv`, imported on first use: it imports diffusers)."""

from __future__ import annotations

import importlib

from . import _common as common  # noqa: F401
from ._common import flux_ids_inputs, refuse_kv_cache, stock_module  # noqa: F401
from ._jobs import (  # noqa: F401
    ImageInputs,
    check_crop,
    check_strength,
    cut,
    one_image,
    refuse,
    refuse_layers,
    refuse_max_area,
    refuse_reference,
)
from ._latents import _batch, copy_generator, flux2_vae_input, grid_ids, pack_2x2, unpack_2x2  # noqa: F401
from ._steps import NO_TABLES, Prompt, Steps, tables  # noqa: F401


def __getattr__(name: str):
    if name == "flux2_kv":
        return importlib.import_module("._flux2_kv", __package__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

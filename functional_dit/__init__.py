"""functional_dit: FLUX.1, FLUX.2 and Qwen-Image transformers as pure functions over
parameter pytrees. See docs/architecture.md for the design."""

from . import flux1, flux2, flux3, qwenimage, qwenimage21
from ._api import (
    PRESETS,
    apply,
    as_config,
    config_from_diffusers,
    config_to_diffusers,
    from_diffusers,
    from_state_dict,
    init,
    num_params,
    param_specs,
    prepare,
    to_state_dict,
)
from ._cache import CacheRun, FirstBlockCache, MagCache, TaylorSeer
from ._kernels import kernel_choices
from ._pytree import PACKED, Block, Params, ParamSpec
from ._sample import sample
from ._stack import stack_params, unstack_params
from .adapter import DiffusersTransformer
from .flux1 import Flux1Config
from .flux2 import Flux2Config
from .flux2_kv import Flux2KVCache
from .flux3 import Flux3Config
from .qwenimage import QwenImageConfig
from .qwenimage21 import QwenImage21Config, QwenImage21KVCache

__all__ = [
    "DiffusersTransformer",
    "PACKED",
    "PRESETS",
    "Block",
    "CacheRun",
    "FirstBlockCache",
    "MagCache",
    "TaylorSeer",
    "Flux1Config",
    "Flux2Config",
    "Flux2KVCache",
    "Flux3Config",
    "ParamSpec",
    "Params",
    "QwenImageConfig",
    "QwenImage21Config",
    "QwenImage21KVCache",
    "apply",
    "as_config",
    "flux1",
    "flux2",
    "flux3",
    "qwenimage",
    "qwenimage21",
    "config_from_diffusers",
    "config_to_diffusers",
    "from_diffusers",
    "from_state_dict",
    "init",
    "kernel_choices",
    "num_params",
    "param_specs",
    "prepare",
    "sample",
    "stack_params",
    "to_state_dict",
    "unstack_params",
]

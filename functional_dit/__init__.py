"""functional_dit: FLUX.1, FLUX.2, FLUX.3, Qwen-Image and Qwen-Image 2.1 transformers as
pure functions over parameter pytrees. See docs/architecture.md for the design.

The core (configs, params, the families, `apply`) imports only torch and `sharding`.
The product names re-exported here (`DiffusersTransformer`, `sample`, the step caches,
`tiny`) live in `functional_dit.pipelines` and resolve on first use (PEP 562), so
``import functional_dit`` loads neither diffusers nor transformers nor `weights`.
"""

import importlib

from . import flux1, flux2, flux3, qwenimage, qwenimage21
from .api import (
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
from .flux1 import Flux1Config
from .flux2 import Flux2Config
from .flux2_kv import Flux2KVCache
from .flux3 import Flux3Config
from .nn.kernels import kernel_choices
from .nn.layerwise import CastTensor, layerwise_cast
from .nn.quant import QuantTensor, dequantize, quantize
from .params import PACKED, Block, Params, ParamSpec, Segment
from .qwenimage import QwenImageConfig
from .qwenimage21 import QwenImage21Config, QwenImage21KVCache
from .stack import stack_params, unstack_params

_LAZY = {  # name -> (module, attribute or None for the module itself)
    "DiffusersTransformer": (".pipelines.adapter", "DiffusersTransformer"),
    "sample": (".pipelines.sampler", "sample"),
    "CacheRun": (".pipelines.cache", "CacheRun"),
    "FirstBlockCache": (".pipelines.cache", "FirstBlockCache"),
    "MagCache": (".pipelines.cache", "MagCache"),
    "TaylorSeer": (".pipelines.cache", "TaylorSeer"),
    "FasterCache": (".pipelines.cache", "FasterCache"),
    "tiny": (".tiny", None),
    "sampling": (".sampling", None),
    "lora": (".lora", None),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module, __name__)
    value = value if attr is None else getattr(value, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DiffusersTransformer",
    "PACKED",
    "PRESETS",
    "Block",
    "CacheRun",
    "CastTensor",
    "FirstBlockCache",
    "MagCache",
    "TaylorSeer",
    "FasterCache",
    "Flux1Config",
    "Flux2Config",
    "Flux2KVCache",
    "Flux3Config",
    "ParamSpec",
    "Params",
    "Segment",
    "QuantTensor",
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
    "dequantize",
    "from_diffusers",
    "from_state_dict",
    "init",
    "kernel_choices",
    "layerwise_cast",
    "num_params",
    "param_specs",
    "prepare",
    "quantize",
    "sample",
    "stack_params",
    "to_state_dict",
    "unstack_params",
]

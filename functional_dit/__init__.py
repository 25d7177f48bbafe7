"""functional_dit: FLUX.1, FLUX.2 and Qwen-Image transformers as pure functions over
parameter pytrees. See DESIGN.md for the public contract."""

from . import _api, flux1, flux2, qwenimage
from ._api import (
    apply,
    config_from_diffusers,
    config_to_diffusers,
    from_diffusers,
    from_state_dict,
    init,
    num_params,
    param_specs,
    to_state_dict,
)
from ._pytree import PACKED, Block, Params, ParamSpec
from ._stack import stack_params, unstack_params
from .flux1 import Flux1Config
from .flux2 import Flux2Config, Flux2KVCache
from .qwenimage import QwenImageConfig

flux1.CONFIG = Flux1Config
_api.register_family(flux1)
flux2.CONFIG = Flux2Config
_api.register_family(flux2)
qwenimage.CONFIG = QwenImageConfig
_api.register_family(qwenimage)

PRESETS = _api.presets()

from .adapter import DiffusersTransformer  # noqa: E402  (wraps the public functions above)

__all__ = [
    "DiffusersTransformer",
    "PACKED",
    "PRESETS",
    "Block",
    "Flux1Config",
    "Flux2Config",
    "Flux2KVCache",
    "ParamSpec",
    "Params",
    "QwenImageConfig",
    "apply",
    "config_from_diffusers",
    "config_to_diffusers",
    "from_diffusers",
    "from_state_dict",
    "init",
    "num_params",
    "param_specs",
    "stack_params",
    "to_state_dict",
    "unstack_params",
]

"""LoRA adapters as pytrees: load (diffusers/PEFT, Kohya and BFL layouts), merge, or
apply on the fly with ``fd.apply(..., lora=[(adapter, scale), ...])``; sharded by the
same plan as the base weights.

    import functional_dit.lora as lora
    ad = lora.load("my_lora.safetensors", params)     # factors as a pytree
    merged = lora.merge(params, ad, scale=0.8)        # new Params
    out = fd.apply(params, x, t, txt, ..., lora=[(ad, 0.8)])   # the same, unmerged
"""

from ._adapter import DEFAULT_TARGETS, RANK, Adapter, LoraConfig, factor_specs, init, linear_modules
from ._apply import merge
from ._io import METADATA_KEY, from_state_dict, load, save, to_state_dict

__all__ = [
    "DEFAULT_TARGETS",
    "RANK",
    "Adapter",
    "LoraConfig",
    "METADATA_KEY",
    "factor_specs",
    "from_state_dict",
    "init",
    "linear_modules",
    "load",
    "merge",
    "save",
    "to_state_dict",
]

"""LoRA adapters as pytrees: load (diffusers/PEFT, Kohya and BFL layouts), merge, or
apply on the fly with ``fd.apply(..., lora=[(adapter, scale), ...])``; sharded by the
same plan as the base weights.

    import functional_dit.lora as lora
    ad = lora.load("my_lora.safetensors", params)     # factors as a pytree
    merged = lora.merge(params, ad, scale=0.8)        # new Params
    out = fd.apply(params, x, t, txt, ..., lora=[(ad, 0.8)])   # the same, unmerged

The adapter pytree and its application (`_adapter`, `_apply`) sit below ``fd.apply``,
which imports them; the file IO (`_io`: ``load``, ``save``, ``from_state_dict``,
``to_state_dict``, ``METADATA_KEY``) reads through `weights` and the model table, so it
resolves on first use (PEP 562) and ``import functional_dit`` loads no `weights`.
"""

import importlib

from ._adapter import DEFAULT_TARGETS, RANK, Adapter, LoraConfig, factor_specs, init, linear_modules
from ._apply import merge

_IO = ("METADATA_KEY", "from_state_dict", "load", "save", "to_state_dict")


def __getattr__(name):
    if name not in _IO:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("._io", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_IO))


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

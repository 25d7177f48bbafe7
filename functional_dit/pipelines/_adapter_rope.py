"""The stock ``pos_embed`` of `fd.DiffusersTransformer`: the parameter-free RoPE module each
stock class holds (``FluxPosEmbed``, ``Flux2PosEmbed``, ``Flux3PosEmbed``, ``QwenEmbedRope``
/ ``QwenEmbedLayer3DRope``, ``QwenImage21Rope``), built from the adapter's stock config as
the stock ``__init__`` builds it. The adapter's forward does not call it (`fd.apply` builds
the same tables itself); it is there for code that reads or calls ``model.pos_embed``.
None of these modules has parameters or persistent buffers, so ``state_dict()`` and
``parameters()`` stay the stock class's.
"""

from __future__ import annotations

import importlib

import torch

_MODULE = "diffusers.models.transformers.transformer_{}"


def _qwen(c) -> tuple[str, str, dict]:
    name = "QwenEmbedLayer3DRope" if c.get("use_layer3d_rope", False) else "QwenEmbedRope"
    return "qwenimage", name, dict(theta=10000, axes_dim=list(c["axes_dims_rope"]), scale_rope=True)


# Family key -> the stock module file, class and constructor arguments from the stock config
# (the stock __init__'s own call).
_STOCK = {
    "flux1": lambda c: ("flux", "FluxPosEmbed", dict(theta=10000, axes_dim=c["axes_dims_rope"])),
    "flux2": lambda c: ("flux2", "Flux2PosEmbed", dict(theta=c["rope_theta"], axes_dim=c["axes_dims_rope"])),
    "flux3": lambda c: ("flux3", "Flux3PosEmbed", dict(theta=c["rope_theta"], axes_dim=list(c["axes_dims_rope"]))),
    "qwenimage": _qwen,
    "qwenimage21": lambda c: ("qwenimage21", "QwenImage21Rope", dict(theta=10000, axes_dim=list(c["axes_dims_rope"]))),
}


def stock_pos_embed(family_key: str, config) -> torch.nn.Module | None:
    """The stock class's ``pos_embed`` for this family and stock config (None if it has none)."""
    if family_key not in _STOCK:
        return None
    file, name, kwargs = _STOCK[family_key](config)
    return getattr(importlib.import_module(_MODULE.format(file)), name)(**kwargs)

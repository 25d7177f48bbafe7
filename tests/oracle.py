"""The diffusers oracle: the diffusers class for a config, at the same weights as our params."""

from __future__ import annotations

import diffusers
import torch

import functional_dit as fd


def diffusers_model(config, seed: int = 0, dtype=torch.float32):
    """(diffusers module, Params sharing its storage) with `fd.init(config, seed)` weights."""
    cfg = fd.config_to_diffusers(config)
    cls = getattr(diffusers, cfg["_class_name"])
    module = cls(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    module.load_state_dict(fd.to_state_dict(fd.init(config, seed=seed)))
    module = module.to(dtype).eval().requires_grad_(False)
    return module, fd.from_diffusers(module)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()

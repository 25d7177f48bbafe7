"""The public functions: configs, parameter trees and ``apply``, dispatched to the
family module (`flux1`, `flux2`, `qwenimage`) that owns a config class."""

from __future__ import annotations

import inspect
import json
import os
import warnings
from collections.abc import Mapping

import torch
import torch.utils._pytree as pytree

import sharding

from . import _config
from ._pytree import Params, ParamSpec, flatten, nest

_FAMILIES: list = []  # family modules, registered by __init__


def register_family(module) -> None:
    _FAMILIES.append(module)


def family(config):
    """The family module that owns ``config`` (a config instance or `Params`)."""
    config = config.config if isinstance(config, Params) else config
    for fam in _FAMILIES:
        if type(config) is fam.CONFIG:
            return fam
    known = [f.CONFIG.__name__ for f in _FAMILIES]
    raise ValueError(f"config: expected one of {known}, got {type(config).__name__}")


def presets() -> dict:
    return {name: cfg for fam in _FAMILIES for name, cfg in fam.PRESETS.items()}


def config_from_diffusers(cfg):
    """A config from a diffusers config mapping, a ``config.json`` path or a model folder."""
    if isinstance(cfg, (str, os.PathLike)):
        path = os.fspath(cfg)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            cfg = json.load(f)
    if not isinstance(cfg, Mapping):
        raise ValueError(f"cfg: expected a mapping or a config.json path, got {type(cfg).__name__}")
    name = cfg.get("_class_name")
    if name is None:
        raise ValueError(
            f"cfg: no '_class_name' in the config; expected one of {[f.DIFFUSERS_CLASS for f in _FAMILIES]}"
        )
    for fam in _FAMILIES:
        if name == fam.DIFFUSERS_CLASS:
            return _config.from_mapping(fam.CONFIG, _drop_keys_diffusers_ignores(name, cfg))
    raise ValueError(f"cfg: _class_name {name!r} is not one of {[f.DIFFUSERS_CLASS for f in _FAMILIES]}")


def _drop_keys_diffusers_ignores(class_name: str, cfg: Mapping) -> dict:
    """Released configs carry keys the diffusers class does not take (Qwen-Image's
    ``pooled_projection_dim``); diffusers ignores them with a warning, and so do we.
    Every key the class does take must be a config field (checked by from_mapping)."""
    import diffusers

    accepted = set(inspect.signature(getattr(diffusers, class_name).__init__).parameters)
    ignored = sorted(k for k in cfg if not k.startswith("_") and k not in accepted)
    if ignored:
        warnings.warn(f"config keys {ignored} are not arguments of diffusers.{class_name}; ignored", stacklevel=3)
    return {k: v for k, v in cfg.items() if k not in ignored}


def config_to_diffusers(config) -> dict:
    return _config.to_mapping(config, family(config).DIFFUSERS_CLASS)


def param_specs(config) -> dict:
    """Nested dict of `ParamSpec` shaped like the params; allocates nothing."""
    return family(config).param_specs(config)


def num_params(config) -> int:
    return sum(s.numel for s in flatten(param_specs(config)).values())


def _init_leaf(key: str, spec: ParamSpec, gen: torch.Generator) -> torch.Tensor:
    if key.endswith("bias"):
        return torch.randn(spec.shape, generator=gen) * 0.02
    if len(spec.shape) == 1:  # norm scales
        return 1.0 + torch.randn(spec.shape, generator=gen) * 0.02
    return torch.randn(spec.shape, generator=gen) / spec.shape[-1] ** 0.5


def init(config, seed: int = 0, dtype=torch.float32, device="cpu") -> Params:
    """Random params, deterministic per ``seed``: fan-in scaled normal weights, small
    random biases, norm scales near 1 (no zero-init, so every path is exercised).
    ``device="meta"`` allocates and draws nothing (shapes and dtypes only)."""
    specs = flatten(param_specs(config))
    if torch.device(device).type == "meta":
        return Params(config, nest({k: torch.empty(s.shape, dtype=dtype, device="meta") for k, s in specs.items()}))
    gen = torch.Generator().manual_seed(seed)
    return Params(config, nest({k: _init_leaf(k, s, gen).to(device=device, dtype=dtype) for k, s in specs.items()}))


def from_state_dict(config, state: Mapping[str, torch.Tensor]) -> Params:
    """Params from a diffusers-keyed state dict; strict: one ValueError lists every
    missing, unexpected and mis-shaped key. Tensors are used as given (no copy)."""
    specs = flatten(param_specs(config))
    missing = [k for k in specs if k not in state]
    unexpected = [k for k in state if k not in specs]
    shapes = [
        f"{k}: expected {s.shape}, got {tuple(state[k].shape)}"
        for k, s in specs.items()
        if k in state and tuple(state[k].shape) != s.shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(_mismatch_report(type(config).__name__, missing, unexpected, shapes))
    return Params(config, nest({k: state[k] for k in specs}))


def _mismatch_report(name, missing, unexpected, shapes, limit=20) -> str:
    parts = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes)):
        if items:
            more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
            parts.append(f"{len(items)} {title}: {items[:limit]}{more}")
    return f"state dict does not match {name}: " + "; ".join(parts)


def to_state_dict(params: Params) -> dict:
    """``{diffusers key: tensor}``, sharing storage with ``params``."""
    return params.flat()


def from_diffusers(module) -> Params:
    """Params sharing storage with a diffusers transformer module."""
    config = config_from_diffusers(dict(module.config, _class_name=type(module).__name__))
    return from_state_dict(config, {k: v.detach() for k, v in module.state_dict().items()})


def apply(params: Params, x, t, txt, *, lora=None, **kwargs):
    """The model as a pure function; see the family's ``apply`` for the arguments.
    Sharded params (DTensor leaves) run in the local view on their mesh.

    ``lora``: a list of ``(adapter, scale)`` pairs (``functional_dit.lora``) applied on the
    fly, unmerged; sharded params need the adapters placed on the same mesh."""
    fam = family(params)
    local, mesh = sharding.local_view(params) if hasattr(sharding, "local_view") else (params, None)
    if lora:
        from .lora import _apply as lora_apply  # late: the lora package imports this module

        adapters = lora_apply.local_adapters(lora_apply.check(params, lora), mesh)
    if mesh is None:  # plain tensors: run under whatever mesh the caller bound (shard_map), if any
        return _call(fam, lora_apply.attach(local, adapters) if lora else local, x, t, txt, kwargs)
    with sharding.bind(mesh):
        return _call(fam, lora_apply.attach(local, adapters) if lora else local, x, t, txt, kwargs)


_SHARE_AXES = ("sp", "dp")


def _call(fam, params, x, t, txt, kwargs):
    """``fam.apply`` with the params and inputs marked by ``sharding.pvary`` over sp and
    dp: each rank computes with its own tokens and batch items, so the gradient of any
    of them (each is whole on every rank) comes as per-rank shares, summed over those
    axes here, once. (Over tp the model pairs its collectives Megatron-style instead.)"""
    if torch.is_grad_enabled() and any(sharding.axis_size(a) > 1 for a in _SHARE_AXES):  # only backward sums
        params, x, t, txt, kwargs = pytree.tree_map(_share, (params, x, t, txt, kwargs))
    return fam.apply(params, x, t, txt, **kwargs)


def _share(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return sharding.pvary(x, _SHARE_AXES)
    return x

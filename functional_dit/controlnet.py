"""ControlNets as pure functions: FLUX.1's (``FluxControlNetModel``, Union and XLabs
included) and Qwen-Image's (``QwenImageControlNetModel``), each over its own `Params`
whose dotted keys are the stock module's ``state_dict`` keys.

    from functional_dit import controlnet

    cn = controlnet.from_diffusers(pipe.controlnet)          # or controlnet.init / weights.load
    res = controlnet.apply(cn, x, t, txt, cond, scale=0.7, pooled=pooled, guidance=g, img_ids=ids)
    out = fd.apply(params, x, t, txt, pooled=pooled, guidance=g, img_ids=ids, **res)

`apply` returns the residuals as the keywords of `fd.apply` (and of the stock
transformer's forward): ``controlnet_block_samples`` (and for FLUX.1
``controlnet_single_block_samples``, ``controlnet_blocks_repeat``). Several ControlNets
(diffusers' ``FluxMultiControlNetModel`` / ``QwenImageMultiControlNetModel``): `combine`
sums their residuals. Sharded params (``sharding.shard_params(cn, mesh)``) run in the
local view on their mesh, as `fd.apply` does, and return the full residuals on every rank.
See docs/controlnet.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping

import torch

import sharding
from sharding.internal import mesh_fsdp, wrap_tree
from sharding.tree import flatten, nest

from . import configs as _configs
from . import flux1_controlnet, qwenimage_controlnet
from .params import Params, check_leaves, init_leaf

KINDS = (flux1_controlnet, qwenimage_controlnet)  # one line per ControlNet kind
BY_CONFIG = {k.CONFIG: k for k in KINDS}
BY_DIFFUSERS_CLASS = {k.DIFFUSERS_CLASS: k for k in KINDS}
PRESETS = {name: cfg for k in KINDS for name, cfg in k.PRESETS.items()}
Flux1ControlNetConfig = flux1_controlnet.Flux1ControlNetConfig
QwenImageControlNetConfig = qwenimage_controlnet.QwenImageControlNetConfig


def kind(config):
    """The ControlNet module (`flux1_controlnet`, `qwenimage_controlnet`) owning ``config``
    (a config or `Params`)."""
    config = config.config if isinstance(config, Params) else config
    if type(config) not in BY_CONFIG:
        raise ValueError(
            f"controlnet: expected ControlNet params or a config of {[c.__name__ for c in BY_CONFIG]}, "
            f"got {type(config).__name__}"
        )
    return BY_CONFIG[type(config)]


def is_controlnet(params) -> bool:
    return isinstance(params, Params) and type(params.config) in BY_CONFIG


def as_config(config):
    """A preset name in `PRESETS`, a config, `Params`, or a diffusers config mapping / module / path."""
    if isinstance(config, Params):
        config = config.config
    if isinstance(config, str) and config in PRESETS:
        return PRESETS[config]
    if isinstance(config, (str, os.PathLike, Mapping, torch.nn.Module)):
        return config_from_diffusers(config)
    kind(config)
    return config


def config_from_diffusers(cfg):
    """A ControlNet config from a diffusers ``FluxControlNetModel`` / ``QwenImageControlNetModel``
    module, its config mapping (with ``_class_name``), a ``config.json`` path or a model folder."""
    module = getattr(cfg, "_orig_mod", cfg)
    if isinstance(module, torch.nn.Module):
        name = type(module).__name__
        if name not in BY_DIFFUSERS_CLASS:
            raise ValueError(f"module: expected one of {list(BY_DIFFUSERS_CLASS)}, got {name}")
        return config_from_diffusers({**module.config, "_class_name": name})
    if isinstance(cfg, (str, os.PathLike)):
        path = os.fspath(cfg)
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(path):
            raise ValueError(f"cfg: expected a ControlNet config.json or a folder holding one, got {cfg!r:.200}")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    if not isinstance(cfg, Mapping) or cfg.get("_class_name") not in BY_DIFFUSERS_CLASS:
        got = cfg.get("_class_name") if isinstance(cfg, Mapping) else type(cfg).__name__
        raise ValueError(f"cfg: expected a config with _class_name in {list(BY_DIFFUSERS_CLASS)}, got {got!r}")

    name = cfg["_class_name"]
    kept = _configs.drop_keys_diffusers_ignores(name, cfg)  # keys the stock class ignores, warned as diffusers
    return _configs.from_mapping(BY_DIFFUSERS_CLASS[name].CONFIG, kept)


def config_to_diffusers(config) -> dict:
    config = as_config(config)
    return _configs.to_mapping(config, kind(config).DIFFUSERS_CLASS)


def param_specs(config) -> dict:
    return as_config(config).param_specs()


def init(config, seed: int = 0, dtype=torch.float32, device="cpu") -> Params:
    """Random ControlNet params, as `fd.init` draws them (no zero-init, so every residual
    is non-zero and every path is exercised)."""
    config = as_config(config)
    gen = torch.Generator().manual_seed(seed)
    specs = flatten(param_specs(config))

    def leaf(key, spec):  # convolutions (the XLabs hint block): fan-in over the kernel too
        w = init_leaf(key, spec, gen)
        return w / (math.prod(spec.shape[2:]) ** 0.5) if len(spec.shape) == 4 else w

    return Params(config, nest({k: leaf(k, s).to(device=device, dtype=dtype) for k, s in specs.items()}))


def from_state_dict(config, state: Mapping[str, torch.Tensor]) -> Params:
    """ControlNet params from a diffusers-keyed state dict; strict (`check_leaves`), no copy."""
    config = as_config(config)
    check_leaves(config, state)
    return Params(config, nest({k: state[k] for k in flatten(param_specs(config))}))


def to_state_dict(params: Params) -> dict:
    return params.flat()


def from_diffusers(module) -> Params:
    """Params sharing storage with a diffusers ControlNet module. A multi-ControlNet wrapper
    (``FluxMultiControlNetModel``, ``QwenImageMultiControlNetModel``) gives a list, one per net."""
    module = getattr(module, "_orig_mod", module)
    if type(module).__name__ in ("FluxMultiControlNetModel", "QwenImageMultiControlNetModel"):
        return [from_diffusers(net) for net in module.nets]
    config = config_from_diffusers(module)
    return from_state_dict(config, {k: v.detach() for k, v in module.state_dict().items()})


def apply(params: Params, x, t, txt, cond, *, scale: float = 1.0, **kwargs) -> dict:
    """The ControlNet as a function: the residuals for the transformer at this step, as the
    keywords of `fd.apply` (the stock transformer's ``controlnet_*`` arguments), each
    residual (B, S_img, inner_dim) scaled by ``scale`` (the stock ``conditioning_scale``).

    x, t, txt and the family keywords are what the transformer gets (FLUX.1: ``pooled``,
    ``guidance`` when the ControlNet embeds it, ``img_ids``, ``txt_ids``, ``rope``; Qwen-Image:
    ``txt_mask``, ``img_shapes``, ``rope``); ``cond``: the control latents packed as x (an
    XLabs ControlNet: the (B, 3, H, W) control image); ``mode``: a FLUX.1 Union ControlNet's
    control mode per item. Equals the stock module's ``forward(...)``."""
    k = kind(params)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"scale: expected a real number (the conditioning scale), got {scale!r}")
    unknown = sorted(set(kwargs) - set(k.ARGS))
    if unknown:
        raise ValueError(f"{unknown[0]}: not an argument of the {k.NAME}; expected one of {list(k.ARGS)}")
    local, mesh = sharding.local_view(params)
    with sharding.bind(mesh) if mesh is not None else contextlib.nullcontext():
        samples = _apply_local(k, _gathering(local, mesh), x, t, txt, cond, float(scale), kwargs)
    return k.fd_apply_args(samples, params)


def _gathering(params: Params, mesh) -> Params:
    """Fully sharded params (an "fsdp" mesh axis) as `fd.apply` reads them: the non-block
    leaves gathered now, each block gathered leaf by leaf as the forward reads it (the batch
    is split over dp x fsdp, `_apply_local`); as they are otherwise. Inference: the gathers'
    backward reduce-scatters, but the residuals' other gradients are not summed over fsdp."""
    if mesh is None or mesh_fsdp(mesh) == 1:
        return params
    return Params(params.config, wrap_tree(params.tree, params.config, mesh))


def _apply_local(k, params, x, t, txt, cond, scale, kwargs) -> tuple:
    """Checks in the full view, the dp split, the forward, the sp / dp gathers (`_api.apply`'s steps)."""
    inputs = k.check_inputs(params, x, t, txt, cond, **kwargs)
    B = x.shape[0]
    x, t, txt = (sharding.shard(a, "dp", 0) for a in (x, t, txt))
    inputs = {n: sharding.shard(v, "dp", 0) if n in k.BATCHED and v is not None else v for n, v in inputs.items()}
    samples, S = k.forward(params, x, t, txt, scale=scale, **inputs)
    full = lambda r: sharding.gather(sharding.gather(r, "sp", 1, S), "dp", 0, B)  # noqa: E731
    return tuple(None if s is None else [full(r) for r in s] for s in samples)


def combine(results) -> dict:
    """Several ControlNets' residuals (`apply` results) summed per block, as diffusers' multi-
    ControlNet wrappers merge them (in order: ``((r0 + r1) + r2) ...``). ``controlnet_blocks_repeat``
    is the first's (FluxControlNetPipeline reads it off ``nets[0]``)."""
    results = list(results)
    if not results or not all(isinstance(r, dict) for r in results):
        raise ValueError(f"results: expected a non-empty list of controlnet.apply results, got {results!r:.80}")
    out = dict(results[0])
    for r in results[1:]:
        for name, v in r.items():
            if isinstance(v, list) and out.get(name) is not None:
                out[name] = [a + b for a, b in zip(out[name], v)]
    return out

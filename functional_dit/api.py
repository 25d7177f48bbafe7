"""The public functions: configs, parameter trees and ``apply``, dispatched to the
family module (`flux1`, `flux2`, `qwenimage`) that owns a config class."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

import sharding
from sharding import internal as _fsdp
from sharding.tree import flatten, nest

from . import configs as _config
from . import controlnet as _controlnet
from . import families as _families
from .lora import internal as _lora
from .nn import compile as _compile
from .nn import fused as _fuse
from .nn import kernels as _kernels
from .nn import quant as _quant
from .nn import values as _values
from .params import Params, check_leaves, init_leaf, register_pytree

# The families: config class -> the module that owns it (specs, check_inputs, forward, presets,
# DIFFUSERS_CLASS), read off the one family registry (`functional_dit.families`).
FAMILIES: dict = {}
PRESETS: dict = {}
DIFFUSERS_CLASSES: dict = {}
REGIONS: dict = {}  # each family's blocks as compile regions


def _add_family(fam) -> None:
    FAMILIES[fam.CONFIG] = fam
    PRESETS.update(fam.PRESETS)
    DIFFUSERS_CLASSES[fam.DIFFUSERS_CLASS] = fam.CONFIG
    REGIONS[fam.CONFIG] = _compile.regions(fam)


def _remove_family(fam) -> None:
    for table, key in ((FAMILIES, fam.CONFIG), (DIFFUSERS_CLASSES, fam.DIFFUSERS_CLASS), (REGIONS, fam.CONFIG)):
        table.pop(key, None)
    for name in fam.PRESETS:
        PRESETS.pop(name, None)


_families.watch(_add_family, _remove_family)  # kept current when a family is registered at run time
register_pytree(FAMILIES)
family = _families.of  # the family module that owns a config or `Params`


def as_config(config):
    """The config meant by ``config``: a preset name in `PRESETS`, a config, `Params`
    (its config) or a diffusers config mapping (see `config_from_diffusers`). Every
    function that takes a config takes any of these."""
    if isinstance(config, Params):
        return config.config
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"config: expected a preset name in {sorted(PRESETS)} or a config, got {config!r}")
        return PRESETS[config]
    if isinstance(config, Mapping):
        return config_from_diffusers(config)
    if type(config) in _controlnet.BY_CONFIG:  # a ControlNet's (its params, specs, checkpoints)
        return config
    family(config)  # a ValueError naming the config classes
    return config


def config_from_diffusers(cfg):
    """A config from what users of diffusers hold: a config mapping (``pipe.transformer.config``,
    a FrozenDict without ``_class_name``: the family is read off its keys), the transformer
    module (also under ``torch.compile``), a ``config.json`` path, a model folder or a
    pipeline folder (its ``transformer/config.json``)."""
    module = getattr(cfg, "_orig_mod", cfg)  # torch.compile's OptimizedModule wraps the module
    if isinstance(module, torch.nn.Module):
        if not isinstance(getattr(module, "config", None), Mapping):
            raise ValueError(
                f"cfg: expected a diffusers transformer module with a .config, got {type(module).__name__}"
            )
        return config_from_diffusers({**module.config, "_class_name": type(module).__name__})
    if isinstance(cfg, (str, os.PathLike)):
        cfg = _read_config_json(os.fspath(cfg))
    if not isinstance(cfg, Mapping):
        raise ValueError(
            f"cfg: expected a mapping, a diffusers module, a config.json path or a folder, got {type(cfg).__name__}"
        )
    name = cfg.get("_class_name")
    if name in _controlnet.BY_DIFFUSERS_CLASS:
        return _controlnet.config_from_diffusers(cfg)
    if name is None:
        name = _class_from_keys(cfg)
    if name not in DIFFUSERS_CLASSES:
        raise ValueError(f"cfg: _class_name {name!r} is not one of {list(DIFFUSERS_CLASSES)}")
    return _config.from_mapping(DIFFUSERS_CLASSES[name], _config.drop_keys_diffusers_ignores(name, cfg))


def _read_config_json(path: str) -> dict:
    if isinstance(path, str) and path.lstrip().startswith("{"):
        raise ValueError(
            "cfg: got a JSON string; expected a mapping (json.loads(text)), a config.json path or a folder"
        )
    candidates = [path, os.path.join(path, "config.json"), os.path.join(path, "transformer", "config.json")]
    for file in candidates if os.path.isdir(path) else candidates[:1]:
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                return json.load(f)
    raise ValueError(
        f"cfg: expected a config.json file, a model folder or a pipeline folder; found none at {path!r:.200}"
    )


def _class_from_keys(cfg: Mapping) -> str:
    """The one family whose config has every (non-``_``) key of ``cfg``; ambiguous or none: an error."""
    keys = {k for k in cfg if not k.startswith("_")}
    fits = [fam.DIFFUSERS_CLASS for cls, fam in FAMILIES.items() if keys <= {f.name for f in dataclasses.fields(cls)}]
    if len(fits) != 1:
        what = f"fit {fits}" if fits else "fit none of the families"
        raise ValueError(
            f"cfg: no '_class_name', and its keys {sorted(keys)} {what}; expected exactly one of "
            f"{list(DIFFUSERS_CLASSES)}: add '_class_name'"
        )
    return fits[0]


def config_to_diffusers(config) -> dict:
    config = as_config(config)
    if type(config) in _controlnet.BY_CONFIG:
        return _controlnet.config_to_diffusers(config)
    return _config.to_mapping(config, family(config).DIFFUSERS_CLASS)


def param_specs(config) -> dict:
    """Nested dict of `ParamSpec` shaped like the params; allocates nothing."""
    return as_config(config).param_specs()


def num_params(config) -> int:
    """The parameter count of a config (or preset name, or `Params`)."""
    return sum(s.numel for s in flatten(param_specs(config)).values())


def init(config, seed: int = 0, dtype=torch.float32, device="cpu") -> Params:
    """Random params, deterministic per ``seed``: fan-in scaled normal weights, small
    random biases, norm scales near 1 (no zero-init, so every path is exercised).
    ``device="meta"`` allocates and draws nothing (shapes and dtypes only)."""
    config = as_config(config)
    if not _config.is_int(seed):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype: expected a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
    specs = flatten(param_specs(config))
    if torch.device(device).type == "meta":
        return Params(config, nest({k: torch.empty(s.shape, dtype=dtype, device="meta") for k, s in specs.items()}))
    gen = torch.Generator().manual_seed(seed)
    return Params(config, nest({k: init_leaf(k, s, gen).to(device=device, dtype=dtype) for k, s in specs.items()}))


def from_state_dict(config, state: Mapping[str, torch.Tensor]) -> Params:
    """Params from a diffusers-keyed state dict; strict: one ValueError lists every
    missing, unexpected, mis-shaped and non-floating key (`check_leaves`), and refuses a
    mix of dtypes or devices. Tensors are used as given (no copy)."""
    config = as_config(config)
    if not isinstance(state, Mapping):
        raise ValueError(f"state: expected a mapping of diffusers keys to tensors, got {type(state).__name__}")
    _refuse_bfl_layout(config, state)
    check_leaves(config, state)
    return Params(config, nest({k: state[k] for k in flatten(param_specs(config))}))


# The top-level names of Black Forest Labs' FLUX checkpoints (diffusers' are others).
_BFL_NAMES = ("double_blocks", "single_blocks", "final_layer", "time_in", "vector_in", "guidance_in")


def _refuse_bfl_layout(config, state: Mapping) -> None:
    names = {k.removeprefix("model.diffusion_model.").split(".")[0] for k in state}
    if names & set(_BFL_NAMES) and not names & set(param_specs(config)):
        raise ValueError(
            f"state: the keys are in Black Forest Labs' layout ({sorted(names & set(_BFL_NAMES))}), not diffusers'; "
            "save it as .safetensors and read it with weights.load(file, config=...), which converts the layout"
        )


def to_state_dict(params: Params) -> dict:
    """``{diffusers key: tensor}``, sharing storage with ``params``."""
    return params.flat()


def from_diffusers(module) -> Params:
    """Params sharing storage with a diffusers transformer module (or its ``torch.compile``)."""
    module = getattr(module, "_orig_mod", module)
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"module: expected a diffusers transformer module, got {type(module).__name__}")
    return from_state_dict(config_from_diffusers(module), {k: v.detach() for k, v in module.state_dict().items()})


# The keywords of fd.apply's common signature; a family takes some (its ``ARGS``) and
# accepts the others as None, so a generic caller may pass them all.
COMMON_ARGS = ("img_ids", "txt_ids", "guidance", "pooled", "txt_mask", "img_shapes", "rope")


def prepare(params: Params, kernels: str = "auto") -> Params:
    """``params`` laid out for the fast eager path: each group of projections that read
    the same input (q/k/v; FLUX.1's single-block q/k/v + MLP input) becomes row views of
    one buffer, so `apply` runs it as one matmul. The same keys, shapes and values (a
    derived layout, not a new format); plain or sharded params (each rank's local rows,
    so the fused weight shards per block). For eager inference: params that require grad
    are refused, and ``torch.compile`` wants the params as they are (its per-block
    regions refuse inputs that share storage; compiled code gains nothing from the
    layout). See `functional_dit.nn.fused`.

    ``kernels``: which eager kernels the prepared params run. "auto" (default): per op,
    whichever of its fast and exact kernels measured faster on this machine at the shapes
    in use (a short micro-benchmark at an op's first call with new shapes, cached for the
    process; `kernel_choices` lists them); "fast": every fast kernel; "exact": the exact
    kernels and unfused projections, bitwise what plain params compute. See
    `functional_dit.nn.kernels`."""
    _kernels.check_mode(kernels)
    return _fuse.prepare(params, family(params).FUSED, kernels)


def apply(params: Params, x, t, txt, *, lora=None, checkpoint: bool = False, **kwargs):
    """The model as a pure function: ``fd.apply(params, x, t, txt, *, img_ids=None,
    txt_ids=None, guidance=None, pooled=None, txt_mask=None, img_shapes=None, rope=None,
    lora=None, ...)``; the family's ``check_inputs`` documents the arguments it takes
    (``flux1.check_inputs``, ...). ``rope=(cos, sin)``: a precomputed RoPE table in place of the
    position ids (``flux1.rope_table``, ``flux2.rope_table``, ``qwenimage.pos_embed``).
    ``lora=[(adapter, scale), ...]``: LoRA adapters applied on the fly (`functional_dit.lora`).
    Returns the diffusers class's ``forward(...)[0]``, replicated on every rank.

    Sharded params (DTensor leaves) run in the local view on their mesh: inputs are
    checked in the full view, x, t, txt and the family's batched inputs split over "dp",
    and the output gathered over "sp" and "dp", here and only here.

    ``lora`` (every family): a list of ``(adapter, scale)`` pairs (``functional_dit.lora``)
    applied on the fly, unmerged; sharded params need the adapters placed on the same mesh.
    Per item: ``(adapter, scale, rows)`` applies the adapter to those rows of the batch only
    (Python ints in ``[0, B)``; each row computes only its own adapters' low-rank updates,
    gathered by row), e.g. ``lora=[(a, 1.0, [0, 2]), (b, 0.5, [1])]``; pairs and triples mix.

    ``checkpoint=True``: gradient (activation) checkpointing, per block: under autograd
    each transformer block keeps only its inputs and recomputes its activations in
    backward (the same gradients, less memory; `nn.compile.recompute_blocks`)."""
    if not isinstance(checkpoint, bool):
        raise ValueError(f"checkpoint: expected True or False, got {checkpoint!r}")
    call = prepare_call(params, **kwargs)
    kwargs = call.kwargs
    _values.check_values(t, x=x, txt=txt, pooled=kwargs.get("pooled"), guidance=kwargs.get("guidance"))
    adapters = call.adapters(lora, x.shape[0] if isinstance(x, torch.Tensor) and x.ndim else None)
    if not checkpoint:  # no context manager on the default path: nothing extra for torch.compile to trace
        return _apply_bound(call.fam, call.local, call.mesh, x, t, txt, kwargs, adapters)
    with _compile.recompute_blocks():
        return _apply_bound(call.fam, call.local, call.mesh, x, t, txt, kwargs, adapters)


class Call(NamedTuple):
    """`apply`'s set-up of one model call (`prepare_call`), for the callers that run a
    family's stages themselves (the step caches of `functional_dit.pipelines.cache`): the
    family module, its keywords checked, the params' local view and their mesh (None for
    plain tensors). What a forward then needs is asked of it, so every model call is set up
    the one way `apply` sets up its own."""

    fam: Any
    params: Params  # as given (DTensor leaves on a mesh)
    local: Params  # their local view
    mesh: Any
    kwargs: dict  # the family's keywords (`apply`'s, checked)

    def adapters(self, lora, batch: int | None) -> list:
        """``lora`` (`apply`'s: ``(adapter, scale[, rows])`` for a batch of ``batch`` rows)
        checked against the params and taken in their local view; [] for None."""
        return _lora_adapters(self.params, lora, self.mesh, batch)

    def model_params(self, adapters, batch: int, *, split: bool = True) -> Params:
        """Under the call's bound mesh: the local params a forward or its stages run, the
        ``adapters`` (`adapters`) attached for a batch of ``batch`` rows (``split=False``:
        every row on every rank, not split over dp) and on an fsdp axis gathered block by
        block as the stages reach them (`apply`'s step 3)."""
        lora_dims: dict = {}  # fully sharded LoRA factors: {path through the attached tuples: fsdp dim}
        local = _lora.attach(self.local, adapters, batch, lora_dims, split=split) if adapters else self.local
        return _gathering(local, lora_dims)


def prepare_call(params: Params, **kwargs) -> Call:
    """`apply`'s set-up of a call with ``kwargs`` (its keywords, less ``lora`` and
    ``checkpoint``): the family that owns ``params`` (`functional_dit.families.of`), the
    keywords it takes (a common one it does not take must be None: ValueError naming it),
    the local view and mesh of the params (`sharding.local_view`). The one entry into the
    core for a model call that `apply` does not make itself (docs/architecture.md, "The
    call path of `fd.apply`")."""
    fam = family(params)
    kwargs = _family_args(fam, kwargs)
    local, mesh = sharding.local_view(params)
    return Call(fam, params, local, mesh, kwargs)


def _apply_bound(fam, local: Params, mesh, x, t, txt, kwargs: dict, adapters) -> torch.Tensor:
    if mesh is None:  # plain tensors: run under whatever mesh the caller bound (shard_map), if any
        return _apply_local(fam, local, x, t, txt, kwargs, adapters)
    with sharding.bind(mesh):
        return _apply_local(fam, local, x, t, txt, kwargs, adapters)


def _lora_adapters(params: Params, lora, mesh, batch: int | None = None) -> list:
    """``lora`` checked against ``params`` (a list of ``(adapter, scale[, rows])``, rows of a
    batch of ``batch``; None: none), as the adapters' local views on the params' mesh."""
    if lora is None:
        return []
    return _lora.local_adapters(_lora.check(params, lora, batch=batch), mesh)


def _family_args(fam, kwargs: dict) -> dict:
    """The keywords ``fam`` takes; a common one it does not take must be None."""
    for name, value in kwargs.items():
        if name in fam.ARGS:
            continue
        if name not in COMMON_ARGS:
            raise ValueError(f"{name}: not an argument of {fam.NAME}'s apply; expected one of {list(fam.ARGS)}")
        if value is not None:
            raise ValueError(f"{name}: {fam.NAME} takes no {name}; expected None, got {type(value).__name__}")
    return {k: v for k, v in kwargs.items() if k in fam.ARGS}


_SHARE_AXES = ("ring", "sp", "dp", "fsdp")  # the sequence (sp x ring) and batch (dp x fsdp) splits


def _apply_local(fam, params: Params, x, t, txt, kwargs: dict, adapters=()):
    """Checks in the full view, the dp split, the family's forward, the sp/dp gathers;
    LoRA ``adapters`` (local views) attached to their layers first, under the bound mesh.

    Params and inputs are first marked by ``sharding.pvary`` over ring, sp and dp: each rank
    computes with its own tokens and batch items, so the gradient of any of them (each is
    whole on every rank) comes as per-rank shares, summed over those axes here, once.
    (Over tp the model pairs its collectives Megatron-style instead.)"""
    fsdp = sharding.axis_size("fsdp") > 1
    lora_dims: dict = {}  # fully sharded LoRA factors: {path through the attached tuples: fsdp dim}
    if adapters:
        params = _lora.attach(params, adapters, x.shape[0], lora_dims)
    if torch.is_grad_enabled() and any(sharding.axis_size(a) > 1 for a in (*_SHARE_AXES, "fsdp")):  # backward sums
        params = _share_params(params, lora_dims) if fsdp else pytree.tree_map(_share, params)  # (LoRA leaves too)
        x, t, txt, kwargs = pytree.tree_map(_share, (x, t, txt, kwargs))
    params = _gathering(params, lora_dims)
    inputs = fam.check_inputs(params, x, t, txt, **kwargs)
    B = x.shape[0]
    x, t, txt = (sharding.shard(a, "dp", 0) for a in (x, t, txt))
    inputs = {k: sharding.shard(v, "dp", 0) if k in fam.BATCHED and v is not None else v for k, v in inputs.items()}
    fast = _fuse.active(params, fam.FUSED, (x, t, txt, inputs))  # fd.prepare'd params, inference
    regions = REGIONS[type(params.config)]  # None for a family without regions
    if regions is not None:
        inputs = {**inputs, "blocks": regions}
    if fast:
        with _kernels.fast_kernels(_fuse.kernels(params, fam.FUSED)):
            out, seq, extra = fam.forward(params, x, t, txt, **inputs)
    else:
        out, seq, extra = fam.forward(params, x, t, txt, **inputs)
    out = sharding.gather(sharding.gather(out, "sp", 1, seq), "dp", 0, B)
    return out if extra is None else (out, extra)


def _gathering(params: Params, lora_dims: dict | None = None) -> Params:
    """``params`` (the local view, under the bound mesh) for a forward: on an "fsdp" axis
    the non-block leaves gathered now and every block (with the attached LoRA factors of
    ``lora_dims``, ``{path: fsdp dim}``) gathered when its loop reaches it (sharding._fsdp);
    as they are otherwise."""
    if sharding.axis_size("fsdp") == 1:
        return params
    quantized = next((k for k, v in flatten(params.tree).items() if _quant.is_quant(v)), None)
    if quantized is not None:
        raise ValueError(
            f"params: fd.quantize'd (fp8 compute) params do not run on an fsdp axis yet (their scales are not "
            f"gathered with the values), got the quantized leaf {quantized!r} at fsdp={sharding.axis_size('fsdp')}; "
            "use tp, or layerwise fp8 storage (fd.layerwise_cast), on fsdp"
        )
    mesh = sharding.current_mesh()
    return Params(params.config, _fsdp.wrap_tree(params.tree, params.config, mesh, lora_dims or {}))


def _share(x, axes=_SHARE_AXES):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return sharding.pvary(x, axes)
    return x


def _share_params(params: Params, lora_dims: dict) -> Params:
    """`_share` of every leaf, the attached LoRA tuples' too; a fully sharded leaf (of the
    params, or in ``lora_dims``) not over "fsdp": its gather's backward reduce-scatters (sums)
    over fsdp already."""
    mesh = sharding.current_mesh()
    dims = {**_fsdp.gather_dims(params.config, mesh), **lora_dims} if sharding.axis_size("fsdp") > 1 else {}
    inner = tuple(a for a in _SHARE_AXES if a != "fsdp")

    def share(path, x):
        if isinstance(x, tuple):
            return tuple(share(f"{path}.{i}", v) for i, v in enumerate(x))
        return _share(x, inner if path in dims else _SHARE_AXES)

    return Params(params.config, nest({k: share(k, x) for k, x in flatten(params.tree).items()}))

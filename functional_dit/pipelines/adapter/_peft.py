"""diffusers' PEFT entry points on `DiffusersTransformer`, over `functional_dit.lora`.

The stock classes inject PEFT ``LoraLayer`` s into their ``nn.Linear`` modules. Here a
named adapter is a `functional_dit.lora.Adapter` whose tensors are registered on the
adapted modules, each of which becomes a PEFT ``BaseTunerLayer`` holding them as PEFT
does (`adapter._peft_layers`: ``<module>.lora_A.<adapter name>.weight``, the base weight
at ``<module>.base_layer.weight``, so ``state_dict()`` and ``get_peft_model_state_dict``
give the stock keys; ``parameters()`` lists them, ``to()`` moves them, an optimizer
trains them). Every forward applies the active ones on the fly at the layers' scalings
(`fd.apply(..., lora=...)`); ``fuse_lora`` folds them into the base weights in place.

``add_adapter(peft.LoraConfig)``, ``load_lora_adapter`` (the stock ``peft_config`` from
the file's metadata or inferred, ``low_cpu_mem_usage`` accepted, missing / unexpected
LoRA keys warned about as the stock loader warns), ``save_lora_adapter`` (the stock file
and metadata), ``set_adapters(names, weights)``, ``set_adapter``, ``active_adapters``,
``disable_adapters`` / ``enable_adapters`` (``disable_lora`` / ``enable_lora``),
``fuse_lora`` / ``unfuse_lora``, ``delete_adapters`` and ``unload_lora`` behave as the
stock ones. What PEFT offers and `functional_dit.lora` does not compute (dropout, per-block
weight dicts, hotswapping) raises a ValueError naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os

import torch
from diffusers.loaders.peft import PeftAdapterMixin

import functional_dit.lora as lora
import sharding
from functional_dit.lora import internal as lora_internal
from sharding import unshard
from sharding.internal import is_dtensor
from sharding.tree import flatten, get, nest
from weights.internal import read_tensors, write_file

from . import _peft_layers as layers_mod

PEFT_FILE = "pytorch_lora_weights.safetensors"  # what the stock save_lora_adapter writes
# PEFT LoraConfig fields and the only values functional_dit.lora computes.
_PEFT_DEFAULTS = {
    "bias": "none",
    "lora_dropout": 0.0,
    "modules_to_save": None,
    "layers_to_transform": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
}


def _matches(module: str, target: str) -> bool:
    """PEFT's name matching for a list entry: the whole name or a dotted suffix."""
    return module == target or module.endswith("." + target)


def _pattern(patterns: dict, module: str, default):
    return next((v for k, v in (patterns or {}).items() if _matches(module, k)), default)


def _check_peft_config(cfg) -> None:
    """ValueError for a PEFT config field this adapter cannot honour."""
    for field, default in _PEFT_DEFAULTS.items():
        value = getattr(cfg, field, default)
        if value != default and not (field == "lora_dropout" and value == 0):
            raise ValueError(f"adapter_config.{field}: not supported by functional_dit.lora, got {value!r}")
    if isinstance(cfg.target_modules, str) or not cfg.target_modules:
        raise ValueError(
            f"adapter_config.target_modules: expected a list of module names (regular expressions are not "
            f"supported), got {cfg.target_modules!r}"
        )
    if cfg.init_lora_weights not in (True, False):
        raise ValueError(f"adapter_config.init_lora_weights: expected True or False, got {cfg.init_lora_weights!r}")
    if cfg.use_dora and cfg.lora_bias:
        raise ValueError("adapter_config.lora_bias: not supported together with use_dora=True (nor by PEFT), got True")


def new_adapter(params, cfg):
    """A fresh `lora.Adapter` for ``params`` from a PEFT ``LoraConfig``, initialised as PEFT
    does from torch's global RNG: ``A`` Kaiming-uniform, ``B`` zero (``init_lora_weights=
    False``: Kaiming-uniform too, so the update is not zero); a ``lora_bias`` zero (else
    nn.Linear's uniform); DoRA's magnitude ``||W + (alpha / r) B A||`` per row."""

    _check_peft_config(cfg)
    known = lora.linear_modules(params.config)
    targets = list(cfg.target_modules)
    modules = [m for m in known if any(_matches(m, t) for t in targets)]
    if not modules:
        raise ValueError(f"adapter_config.target_modules: {targets} match no linear layer of the model")
    spec = tuple(
        (m, int(_pattern(cfg.rank_pattern, m, cfg.r)), float(_pattern(cfg.alpha_pattern, m, cfg.lora_alpha)))
        for m in modules
    )
    lcfg = lora.LoraConfig(params.config, spec, bool(cfg.use_rslora), bool(cfg.lora_bias), bool(cfg.use_dora))
    flat, leaves = {}, params.flat()
    for m, r, _ in spec:
        w = leaves[f"{m}.weight"]
        out_dim, in_dim = w.shape
        a = (torch.rand(r, in_dim) * 2 - 1) / math.sqrt(in_dim)  # kaiming_uniform_(a=sqrt(5))
        b = torch.zeros(out_dim, r) if cfg.init_lora_weights else (torch.rand(out_dim, r) * 2 - 1) / math.sqrt(r)
        flat[f"{m}.lora_A.weight"], flat[f"{m}.lora_B.weight"] = (t.to(w.device, w.dtype) for t in (a, b))
        if cfg.lora_bias:
            bias = torch.zeros(out_dim) if cfg.init_lora_weights else (torch.rand(out_dim) * 2 - 1) / math.sqrt(r)
            flat[f"{m}.lora_B.bias"] = bias.to(w.device, w.dtype)
    if cfg.use_dora:
        flat.update(lora_internal.magnitudes(params, lcfg, flat))
    return lora.Adapter(lcfg, nest(flat))


def peft_metadata(cfg) -> dict:
    """The safetensors metadata the stock ``save_lora_adapter`` writes for ``cfg``."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

    meta = {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.to_dict().items()}
    return {"format": "pt", LORA_ADAPTER_METADATA_KEY: json.dumps(meta, indent=2, sort_keys=True)}


def check_name(name, taken=()) -> str:
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(f"adapter_name: expected a non-empty name without '.', got {name!r}")
    if name in taken:
        raise ValueError(f"adapter_name: an adapter named {name!r} already exists; use a different name")
    return name


def weights_for(names: list[str], weights) -> list[float]:
    """``set_adapters``' weights as one float per name (None -> 1.0), as the stock one
    expands them; per-block weight dicts are refused."""
    weights = [weights] * len(names) if not isinstance(weights, list) else weights
    if len(weights) != len(names):
        raise ValueError(f"weights: expected {len(names)} weights for {names}, got {len(weights)}")
    out = []
    for w in weights:
        if isinstance(w, dict):
            raise ValueError(f"weights: per-block weight dicts are not supported by functional_dit.lora, got {w!r}")
        if w is None:
            w = 1.0
        if not isinstance(w, (int, float)) or isinstance(w, bool):
            raise ValueError(f"weights: expected floats (or None), got {w!r}")
        out.append(float(w))
    return out


def lora_file(path, weight_name) -> str:
    """The file ``save_lora_adapter`` writes: ``weight_name`` (default the stock name) in
    the folder ``path``."""
    name = PEFT_FILE if weight_name is None else weight_name
    if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(".safetensors"):
        raise ValueError(f"weight_name: expected a .safetensors file name, got {weight_name!r}")
    os.makedirs(os.fspath(path), exist_ok=True)
    return os.path.join(os.fspath(path), name)


def read_lora(source, prefix, metadata, weight_name) -> tuple[dict, dict | None]:
    """(state dict, LoraConfig fields or None) of what ``load_lora_adapter`` reads — a
    state dict or a safetensors file / folder (`weights`' reader: pickles refused) —
    the keys under ``prefix`` with it stripped, as the stock loader reads them."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

    if isinstance(source, dict):
        state = dict(source)
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, PEFT_FILE if weight_name is None else weight_name)
        state, file_meta = read_tensors(path)
        raw = (file_meta or {}).get(LORA_ADAPTER_METADATA_KEY)
        metadata = json.loads(raw) if metadata is None and raw else metadata
    if prefix is not None:
        state = {k.removeprefix(f"{prefix}."): v for k, v in state.items() if k.startswith(f"{prefix}.")}
        if metadata is not None:
            metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
    return state, metadata


def loaded_config(state: dict, alphas, metadata, model_state: dict, name: str):
    """The ``peft.LoraConfig`` the stock loader builds for a loaded LoRA: from its metadata,
    else from its ranks and alphas (diffusers' own function, with its TypeError for bad
    metadata)."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.utils.peft_utils import _create_lora_config

    ranks = {f"^{k}": v.shape[1] for k, v in state.items() if "lora_B" in k and v.ndim > 1}
    return _create_lora_config(state, alphas or None, metadata, ranks, model_state_dict=model_state, adapter_name=name)


_FACTORS = ("lora_A.weight", "lora_B.weight")
# what PEFT's LoraLayer on an nn.Linear holds per adapter (the magnitude: its DoRA layer's)
_LEAVES = (*_FACTORS, "lora_B.bias", "lora_magnitude_vector")


def _init_factor(leaf: str, r: int, shape: tuple, like: torch.Tensor, init_weights) -> torch.Tensor:
    """A missing factor as PEFT initialises it (global RNG): ``A`` Kaiming-uniform, ``B``
    zero (``init_lora_weights=False``: small uniform)."""
    out_dim, in_dim = shape
    if leaf == "lora_A.weight":
        t = (torch.rand(r, in_dim) * 2 - 1) / math.sqrt(in_dim)  # kaiming_uniform_(a=sqrt(5))
    else:
        t = torch.zeros(out_dim, r) if init_weights is not False else (torch.rand(out_dim, r) * 2 - 1) / math.sqrt(r)
    return t.to(like.device, like.dtype)


def _named(leaf: str, name: str) -> str:
    """A leaf as PEFT names it in the model: ``lora_A.weight`` -> ``lora_A.<name>.weight``."""
    first, _, rest = leaf.partition(".")
    return f"{first}.{name}.{rest}" if rest else f"{first}.{name}"


def reconcile(state: dict, config, peft_config, name: str) -> dict:
    """``state`` (PEFT keys, prefix stripped) as the stock loader takes it: a linear
    module given one factor gets the other as PEFT initialises it, and keys of adapted
    modules that are no LoRA tensor are dropped, each reported with the stock warning
    (diffusers' ``_maybe_warn_for_unhandled_keys``: same logger, same message; a missing
    key named as PEFT names it in the model, an unexpected one as given)."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.utils.peft_utils import _maybe_warn_for_unhandled_keys

    known = lora.linear_modules(config)
    split = {k: k.split(".lora_", 1) for k in state if ".lora_" in k}
    split = {k: (m, "lora_" + rest) for k, (m, rest) in split.items() if m in known}
    unexpected = [k for k, (_, leaf) in split.items() if leaf not in _LEAVES]
    out = {k: v for k, v in state.items() if k not in unexpected}
    missing = []
    for m in dict.fromkeys(m for m, leaf in split.values() if leaf in _FACTORS):
        have = {leaf: out[f"{m}.{leaf}"] for leaf in _FACTORS if f"{m}.{leaf}" in out}
        for leaf in (f for f in _FACTORS if f not in have):
            (given,) = have.values()
            r = given.shape[0] if leaf == "lora_B.weight" else given.shape[1]
            out[f"{m}.{leaf}"] = _init_factor(leaf, r, known[m].shape, given, peft_config.init_lora_weights)
            missing.append(f"{m}.{_named(leaf, name)}")
    keys = collections.namedtuple("IncompatibleKeys", "missing_keys unexpected_keys")(missing, unexpected)
    _maybe_warn_for_unhandled_keys(keys, name)
    return out


def _module_leaves(adapter, module: str) -> dict:
    """``module``'s own subtree of ``adapter`` ({"lora_A": {...}, "lora_B": {...}, ...}),
    every leaf the adapter holds for it; the subtrees of adapted child modules left out."""

    others = {m for m, _, _ in adapter.config.modules if m.startswith(module + ".")}
    sub = get(adapter.tree, module)
    inner = {k for k in sub for o in others if o == f"{module}.{k}" or o.startswith(f"{module}.{k}.")}
    return {k: v for k, v in sub.items() if k not in inner}


class PeftMixin(PeftAdapterMixin):
    """The PEFT methods of `DiffusersTransformer` (see the module docstring), each of
    diffusers' ``PeftAdapterMixin`` overridden or reached through PEFT tuner layers
    (`adapter._peft_layers`; code that checks for that mixin, as the pipelines' LoRA
    loaders do, finds it). State: ``_peft`` {name: [lora.LoraConfig, peft.LoraConfig]}
    in load order, ``_peft_layers`` {module path: its `LoraLayer`}; the active adapters,
    their scalings, disabled and merged state live in the layers, as in PEFT."""

    @property
    def _hf_peft_config_loaded(self) -> bool:
        return bool(self._peft_state())

    def _peft_state(self) -> dict:
        return self.__dict__.setdefault("_peft", {})

    def _peft_layers(self) -> dict:
        return self.__dict__.setdefault("_peft_layer_map", {})

    def _peft_register(self, name: str, adapter, peft_config, trainable: bool) -> None:
        layers = self._peft_layers()
        for m, _, _ in adapter.config.modules:
            node = layers.get(m) or layers.setdefault(m, layers_mod.adapt(self.get_submodule(m), m))
            layers_mod.add(node, name, adapter.config, _module_leaves(adapter, m), trainable)
        self._peft_state()[name] = [adapter.config, peft_config]
        self.__dict__.pop("_peft_cfg_cache", None)

    def _peft_set_active(self, names: list[str]) -> None:
        for node in self._peft_layers().values():
            node._active_adapter = list(names)

    def _peft_adapter(self, name: str, modules=None):
        """The named adapter as a `lora.Adapter` over the registered tensors (not detached:
        gradients reach them); ``modules``: only those."""

        lcfg = self._peft_state()[name][0]
        layers = self._peft_layers()
        flat = {}
        for m, _, _ in lcfg.modules:
            if modules is None or m in modules:
                flat.update({f"{m}.{k}": v for k, v in flatten(layers[m].factor_tree(name)).items()})
        return lora.Adapter(lcfg, nest(flat))

    def _forward_config(self, name: str, scalings: dict):
        """(lora.LoraConfig, scale) applying adapter ``name`` at the layers' ``scalings``:
        its own config at one scale when every module has the same ratio to alpha / r,
        else a config over those modules whose alphas carry each ratio (cached)."""
        lcfg = self._peft_state()[name][0]
        ratios = {m: (s / lcfg.scale(m) if lcfg.scale(m) else 0.0) for m, s in scalings.items()}
        if len(set(ratios.values())) == 1 and len(ratios) == len(lcfg.modules):
            return lcfg, next(iter(ratios.values()))
        cache = self.__dict__.setdefault("_peft_cfg_cache", {})
        key = (name, tuple(sorted(ratios.items())))
        if key not in cache:
            modules = tuple((m, r, a * ratios[m]) for m, r, a in lcfg.modules if m in ratios)
            cache[key] = dataclasses.replace(lcfg, modules=modules)
        return cache[key], 1.0

    def _peft_pairs(self) -> list:
        """What the forward applies: per adapter name, where it is active (not disabled,
        not merged), at the layers' scalings."""
        active = layers_mod.active_pairs(self._peft_layers().values())

        pairs = []
        for name in (n for n in self._peft_state() if n in active):
            cfg, scale = self._forward_config(name, active[name])
            pairs.append((lora.Adapter(cfg, self._peft_adapter(name, active[name]).tree), scale))
        return pairs

    @property
    def peft_config(self) -> dict:
        """{adapter name: its ``peft.LoraConfig``} (a loaded file's: built as the stock loader does)."""
        return {n: s[1] for n, s in self._peft_state().items()}

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """A new trainable LoRA from a ``peft.LoraConfig`` (its factors require grad); it
        becomes the one active adapter, as the stock ``add_adapter`` makes it."""
        # optional: peft, the PEFT entry points only
        import peft

        if not isinstance(adapter_config, peft.LoraConfig):
            raise ValueError(f"adapter_config: expected a peft.LoraConfig, got {type(adapter_config).__name__}")
        name = check_name(adapter_name, self._peft_state())
        self._peft_register(name, new_adapter(self.params, adapter_config), adapter_config, trainable=True)
        self._peft_set_active([name])

    def _peft_load(self, state: dict, metadata, alphas: dict, name) -> None:
        """Add the LoRA ``state`` (PEFT keys, prefix stripped) as the stock loader does:
        its ``peft_config`` built first (a TypeError for bad metadata), the keys reconciled
        (`reconcile`), the factors read by `functional_dit.lora` (placed as the params are)."""

        name = f"default_{len(self._peft_state())}" if name is None else check_name(name, self._peft_state())
        cfg = loaded_config(state, {k: float(v) for k, v in alphas.items()}, metadata, self.state_dict(), name)
        params = self._base_params(detached=True)
        state = dict(reconcile(state, params.config, cfg, name), **{k: torch.as_tensor(v) for k, v in alphas.items()})
        if metadata is None and alphas:  # the stock config's alphas: a module without one gets its lora_alpha,
            metadata = {"lora_alpha": cfg.lora_alpha, "alpha_pattern": dict(cfg.alpha_pattern)}  # the most common
        ad = lora.from_state_dict(state, params, None if metadata is None else {lora.METADATA_KEY: metadata})
        _, mesh = sharding.local_view(params)
        self._peft_add_loaded(ad if mesh is None else sharding.shard_params(ad, mesh), name, cfg)

    def _peft_add_loaded(self, adapter, name, peft_config) -> None:
        """A loaded adapter at weight 1; it becomes the one active adapter, as the stock
        loader makes it (``set_adapters`` combines several)."""
        self._peft_register(name, adapter, peft_config, trainable=False)
        self._peft_set_active([name])

    def _peft_names(self, adapter_names) -> list[str]:
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        missing = [n for n in names if n not in self._peft_state()]
        if missing:
            raise ValueError(
                f"adapter_names: {missing} not in the list of present adapters {sorted(self._peft_state())}"
            )
        return names

    def set_adapters(self, adapter_names, weights=None) -> None:
        """Use exactly ``adapter_names``, at ``weights`` (a float, or one per name; None: 1),
        set on every layer as the stock one sets them (``set_weights_and_activate_adapters``)."""
        # diffusers: seconds to import, loaded when first used
        from diffusers.utils.peft_utils import set_weights_and_activate_adapters

        names = self._peft_names(adapter_names)
        set_weights_and_activate_adapters(self, names, weights_for(names, weights))

    def set_adapter(self, adapter_name) -> None:
        """Use exactly ``adapter_name`` (a name or a list), at the weights they have."""
        names = self._peft_names(adapter_name)
        for node in self._peft_layers().values():
            node.set_adapter(names)

    def active_adapters(self) -> list[str]:
        """The active adapters (those of the first LoRA layer, as the stock method reads them)."""
        return next((list(n.active_adapters) for n in self._peft_layers().values()), [])

    def disable_adapters(self) -> None:
        for node in self._peft_layers().values():
            node.enable_adapters(False)

    def enable_adapters(self) -> None:
        for node in self._peft_layers().values():
            node.enable_adapters(True)

    disable_lora, enable_lora = disable_adapters, enable_adapters

    def delete_adapters(self, adapter_names) -> None:
        """Remove the named adapters and their tensors (a layer left without any is a
        plain module again)."""
        layers = self._peft_layers()
        for name in self._peft_names(adapter_names):
            for m, _, _ in self._peft_state().pop(name)[0].modules:
                layers_mod.remove(layers[m], name)
                if not isinstance(layers[m], layers_mod.LoraLayer):
                    del layers[m]
        self.__dict__.pop("_peft_cfg_cache", None)

    def unload_lora(self) -> None:
        """Remove every adapter: named ones and those ``set_lora`` set (merged weights stay
        merged, as the stock method leaves them)."""
        self.delete_adapters(list(self._peft_state()))
        self.__dict__["_lora"] = []

    def fuse_lora(self, lora_scale=1.0, safe_fusing=False, adapter_names=None):
        """Fold the active adapters (or ``adapter_names``), at their weights x ``lora_scale``,
        into the base weights in place (the stock method over PEFT's ``merge`` of each
        layer, which computes with `functional_dit.lora.merge`). ``safe_fusing``: the stock
        ValueError if a fused weight would not be finite, raised before any change."""
        if adapter_names is not None:
            adapter_names = self._peft_names(adapter_names)
        if safe_fusing:
            for node in self._peft_layers().values():
                names = adapter_names if adapter_names is not None else node.active_adapters
                node.check_finite([n for n in names if n not in node.merged_adapters], lora_scale)
        super().fuse_lora(lora_scale, safe_fusing=safe_fusing, adapter_names=adapter_names)

    def save_lora_adapter(
        self,
        save_directory,
        adapter_name: str = "default",
        upcast_before_saving: bool = False,
        safe_serialization: bool = True,
        weight_name: str | None = None,
    ) -> None:
        """Write the named adapter as the stock method does (its PEFT tensors, its
        ``LoraConfig`` in the metadata); ``load_lora_adapter`` and ``pipe.load_lora_weights``
        read it back."""

        if adapter_name not in self._peft_state():
            raise ValueError(f"adapter_name: Adapter name {adapter_name} not found in the model.")
        if not safe_serialization:
            raise ValueError("safe_serialization: only safetensors are written (pickle is refused), got False")
        ad = self._peft_adapter(adapter_name)
        ad = unshard(ad) if any(is_dtensor(t) for t in ad.leaves()) else ad
        state = {k: (v.float() if upcast_before_saving else v).detach().contiguous() for k, v in ad.flat().items()}
        write_file(lora_file(save_directory, weight_name), state, peft_metadata(self.peft_config[adapter_name]))

    def enable_lora_hotswap(self, *args, **kwargs):
        raise ValueError("enable_lora_hotswap: hotswapping is not supported; use set_adapters / set_lora to swap")

"""diffusers' PEFT entry points on `DiffusersTransformer`, over `functional_dit.lora`.

The stock classes inject PEFT ``LoraLayer`` s into their ``nn.Linear`` modules; the
adapter has no such modules, so here a named adapter is a `functional_dit.lora.Adapter`
whose factors are registered as parameters of the adapter module under the PEFT names
(``<module>.lora_A.<adapter name>.weight``: ``parameters()`` lists them, ``to()`` moves
them, an optimizer trains them) and every forward applies the active ones on the fly
with their weights (`fd.apply(..., lora=...)`), nothing merged.

``add_adapter(peft.LoraConfig)``, ``load_lora_adapter``, ``save_lora_adapter``,
``set_adapters(names, weights)``, ``set_adapter``, ``active_adapters``,
``disable_adapters`` / ``enable_adapters`` (``disable_lora`` / ``enable_lora``),
``delete_adapters`` and ``unload_lora`` behave as the stock ones. What PEFT offers and
`functional_dit.lora` does not compute (dropout, per-block weight
dicts, hotswapping, fusing into the base weights in place) raises a ValueError naming it.
"""

from __future__ import annotations

import math
import os

import torch
from diffusers.loaders.peft import PeftAdapterMixin

from sharding.tree import nest

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
    import functional_dit.lora as lora
    from functional_dit.lora import internal as lora_internal

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


def _holder(t: torch.Tensor, trainable: bool) -> torch.nn.Module:
    m = torch.nn.Module()
    m.register_parameter("weight", torch.nn.Parameter(t, requires_grad=trainable))
    return m


class PeftMixin(PeftAdapterMixin):
    """The PEFT methods of `DiffusersTransformer` (see the module docstring), each of
    diffusers' ``PeftAdapterMixin`` overridden (code that checks for that mixin, as the
    pipelines' LoRA loaders do, finds it). State: ``_peft`` {name: [lora.LoraConfig,
    weight, peft config or None]} in load order, ``_peft_active`` the names in use,
    ``_peft_disabled``."""

    @property
    def _hf_peft_config_loaded(self) -> bool:
        return bool(self._peft_state())

    def _peft_state(self) -> dict:
        return self.__dict__.setdefault("_peft", {})

    def _peft_register(self, name: str, adapter, weight: float, peft_config, trainable: bool) -> None:
        for m, _, _ in adapter.config.modules:
            node = self.get_submodule(m)
            for factor in ("lora_A", "lora_B"):
                if factor not in node._modules:
                    node.add_module(factor, torch.nn.ModuleDict())
                node._modules[factor][name] = _holder(adapter.factors(m)[factor == "lora_B"], trainable)
        self._peft_state()[name] = [adapter.config, weight, peft_config]

    def _peft_adapter(self, name: str):
        """The named adapter as a `lora.Adapter` over the registered factors (not detached:
        gradients reach them)."""
        import functional_dit.lora as lora

        lcfg = self._peft_state()[name][0]
        flat = {}
        for m, _, _ in lcfg.modules:
            node = self.get_submodule(m)
            for factor in ("lora_A", "lora_B"):
                flat[f"{m}.{factor}.weight"] = node._modules[factor][name].weight
        return lora.Adapter(lcfg, nest(flat))

    def _peft_pairs(self) -> list:
        if self.__dict__.get("_peft_disabled", False):
            return []
        state = self._peft_state()
        return [(self._peft_adapter(n), state[n][1]) for n in self.__dict__.get("_peft_active", [])]

    @property
    def peft_config(self) -> dict:
        """{adapter name: the PEFT config given to ``add_adapter`` (None for a loaded file)}."""
        return {n: s[2] for n, s in self._peft_state().items()}

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """A new trainable LoRA from a ``peft.LoraConfig`` (its factors require grad); it
        becomes the one active adapter, as the stock ``add_adapter`` makes it."""
        import peft

        if not isinstance(adapter_config, peft.LoraConfig):
            raise ValueError(f"adapter_config: expected a peft.LoraConfig, got {type(adapter_config).__name__}")
        name = check_name(adapter_name, self._peft_state())
        self._peft_register(name, new_adapter(self.params, adapter_config), 1.0, adapter_config, trainable=True)
        self.__dict__["_peft_active"] = [name]

    def _peft_add_loaded(self, adapter, name) -> None:
        """A loaded adapter at weight 1, used together with those already active."""
        state = self._peft_state()
        name = f"default_{len(state)}" if name is None else check_name(name, state)
        self._peft_register(name, adapter, 1.0, None, trainable=False)
        self.__dict__["_peft_active"] = [*self.__dict__.get("_peft_active", []), name]

    def _peft_names(self, adapter_names) -> list[str]:
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        missing = [n for n in names if n not in self._peft_state()]
        if missing:
            raise ValueError(
                f"adapter_names: {missing} not in the list of present adapters {sorted(self._peft_state())}"
            )
        return names

    def set_adapters(self, adapter_names, weights=None) -> None:
        """Use exactly ``adapter_names``, at ``weights`` (a float, or one per name; None: 1)."""
        names = self._peft_names(adapter_names)
        for n, w in zip(names, weights_for(names, weights)):
            self._peft_state()[n][1] = w
        self.__dict__["_peft_active"] = names

    def set_adapter(self, adapter_name) -> None:
        """Use exactly ``adapter_name`` (a name or a list), at the weights they have."""
        self.__dict__["_peft_active"] = self._peft_names(adapter_name)

    def active_adapters(self) -> list[str]:
        return list(self.__dict__.get("_peft_active", []))

    def disable_adapters(self) -> None:
        self.__dict__["_peft_disabled"] = True

    def enable_adapters(self) -> None:
        self.__dict__["_peft_disabled"] = False

    disable_lora, enable_lora = disable_adapters, enable_adapters

    def delete_adapters(self, adapter_names) -> None:
        """Remove the named adapters and their factors."""
        for name in self._peft_names(adapter_names):
            for m, _, _ in self._peft_state().pop(name)[0].modules:
                node = self.get_submodule(m)
                for factor in ("lora_A", "lora_B"):
                    del node._modules[factor][name]
                    if not node._modules[factor]:
                        del node._modules[factor]
            self.__dict__["_peft_active"] = [n for n in self.active_adapters() if n != name]

    def unload_lora(self) -> None:
        """Remove every adapter: named ones and those ``set_lora`` set."""
        self.delete_adapters(list(self._peft_state()))
        self.__dict__["_lora"] = []

    def save_lora_adapter(
        self,
        save_directory,
        adapter_name: str = "default",
        upcast_before_saving: bool = False,
        safe_serialization: bool = True,
        weight_name: str | None = None,
    ) -> None:
        """Write the named adapter as a diffusers LoRA file (`lora.save`), which
        ``load_lora_adapter`` and ``pipe.load_lora_weights`` read back."""
        import functional_dit.lora as lora

        if adapter_name not in self._peft_state():
            raise ValueError(f"adapter_name: Adapter name {adapter_name} not found in the model")
        if not safe_serialization:
            raise ValueError("safe_serialization: only safetensors are written (pickle is refused), got False")
        ad = self._peft_adapter(adapter_name)
        if upcast_before_saving:
            ad = ad.replace(nest({k: v.float() for k, v in ad.flat().items()}))
        lora.save(ad, lora_file(save_directory, weight_name), prefix="")

    def fuse_lora(self, *args, **kwargs):
        raise ValueError(
            "fuse_lora: the adapter applies LoRA on the fly and does not fuse it into its weights in place; "
            "merge with functional_dit.lora.merge(params, adapter, scale) and wrap the result instead"
        )

    def unfuse_lora(self, *args, **kwargs):
        raise ValueError("unfuse_lora: the adapter never fuses LoRA (see fuse_lora)")

    def _fuse_lora_apply(self, *args, **kwargs):
        self.fuse_lora()

    def _unfuse_lora_apply(self, *args, **kwargs):
        self.unfuse_lora()

    def enable_lora_hotswap(self, *args, **kwargs):
        raise ValueError("enable_lora_hotswap: hotswapping is not supported; use set_adapters / set_lora to swap")

"""PEFT tuner layers on `DiffusersTransformer`'s linear modules, over `functional_dit.lora`.

When a named adapter reaches a linear module (``transformer_blocks.0.attn.to_q``), that
module becomes a `LoraLayer`: a ``peft.tuners.tuners_utils.BaseTunerLayer`` holding the
adapter's tensors the way PEFT's ``LoraLayer`` does — ``lora_A`` / ``lora_B`` (and any
other leaf of the module's `lora.Adapter` subtree) as ``ModuleDict`` s per adapter name,
``r`` / ``lora_alpha`` / ``scaling`` per name, ``active_adapters``, ``disable_adapters``
and ``merged_adapters`` — so PEFT's and diffusers' utilities (``get_peft_model_state_dict``,
``set_weights_and_activate_adapters``, ``fuse_lora``) read and set it as on the stock
module. Nothing is computed by the modules: each forward of the adapter gathers, per
adapter name, the factors and scalings of the layers where it is active (`active_pairs`)
and hands them to ``fd.apply(..., lora=...)``; ``merge`` / ``unmerge`` fold an adapter
into the base weights in place with `functional_dit.lora.merge`.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge

import functional_dit.lora as lora
from sharding.tree import flatten, nest

from ...params import Params

_OTHER = ("r", "lora_alpha", "scaling", "use_rslora")  # PEFT's per-adapter dicts of a LoraLayer
# Leaves of a module's `lora.Adapter` subtree that are one tensor, held by PEFT as a module
# with a ``weight`` (its DoRA layer: ``<module>.lora_magnitude_vector.<name>.weight``).
_VECTORS = ("lora_magnitude_vector",)


class Factor(torch.nn.Module):
    """One adapter's tensors of one factor (``lora_A[name]``): parameters, not callable."""

    def forward(self, *args, **kwargs):
        raise ValueError("Factor: a LoRA factor of DiffusersTransformer, applied by fd.apply, not callable")


def _holder(subtree: dict, trainable: bool) -> Factor:
    """A `Factor` with ``subtree``'s tensors as parameters (nested dicts: child modules)."""
    m = Factor()
    for k, v in subtree.items():
        if isinstance(v, torch.Tensor):
            m.register_parameter(k, torch.nn.Parameter(v, requires_grad=trainable))
        else:
            m.add_module(k, _holder(v, trainable))
    return m


class LoraLayer(BaseTunerLayer):
    """The PEFT side of an adapted linear module (mixed into its `_Node` class by
    `adapt`); the module's own ``weight`` / ``bias`` move to its ``base_layer`` child, as
    PEFT's ``LoraLayer`` holds them (``state_dict`` keys ``<module>.base_layer.weight``)."""

    def forward(self, *args, **kwargs):
        raise ValueError(f"{self._fd_path}: a LoRA layer of DiffusersTransformer, applied by fd.apply, not callable")

    def _base_scale(self, name: str) -> float:
        r, alpha = self.r[name], self.lora_alpha[name]
        return alpha / r**0.5 if self.use_rslora[name] else alpha / r

    def set_scale(self, adapter: str, scale: float) -> None:
        """PEFT's: the adapter's scaling = ``scale`` x its ``alpha / r``."""
        if adapter in self.scaling:
            self.scaling[adapter] = scale * self._base_scale(adapter)

    def scale_layer(self, scale: float) -> None:
        """PEFT's: multiply the active adapters' scalings by ``scale``."""
        for name in self.active_adapters:
            if name in self.scaling and scale != 1:
                self.scaling[name] *= scale

    def unscale_layer(self, scale=None) -> None:
        """PEFT's: divide the active adapters' scalings by ``scale`` (None: reset to alpha / r)."""
        for name in self.active_adapters:
            if name in self.scaling:
                self.scaling[name] = self._base_scale(name) if scale is None else self.scaling[name] / scale

    def factor_tree(self, name: str) -> dict:
        """``{"lora_A": {"weight": A}, "lora_B": {...}, ...}``: adapter ``name``'s leaves here."""
        flat = {}
        for key in self.adapter_layer_names:
            holder = getattr(self, key)
            if name in holder:
                params = dict(holder[name].named_parameters())
                own = {key: params["weight"]} if key in _VECTORS else {f"{key}.{k}": p for k, p in params.items()}
                flat.update(own)
        return nest(flat)

    def folded(self, name: str, factor: float) -> dict:
        """``{leaf name: new tensor}``: this layer's base leaves with adapter ``name`` merged
        at ``factor`` x its scaling (`functional_dit.lora.merge`, which computes in fp32)."""
        lcfg = self._fd_lcfg[name]
        entry = tuple(e for e in lcfg.modules if e[0] == self._fd_path)
        sub = lora.Adapter(dataclasses.replace(lcfg, modules=entry), nest({self._fd_path: self.factor_tree(name)}))
        own = {f"{self._fd_path}.{k}": p for k, p in self.base_layer._parameters.items() if p is not None}
        base = Params(lcfg.base, nest(own))
        base_scale = self._base_scale(name)
        scale = factor * self.scaling[name] / base_scale if base_scale else 0.0
        with torch.no_grad():
            new = flatten(lora.merge(base, sub, scale).tree)
        old = base.flat()
        return {k[len(self._fd_path) + 1 :]: v for k, v in new.items() if v is not old[k]}

    def check_finite(self, names, factor: float = 1.0) -> None:
        """The stock ValueError if merging any of ``names`` would give a non-finite weight."""
        for name in names:
            if name in self.scaling:
                _refuse_nan(name, self.folded(name, factor))

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        """PEFT's merge: fold the (active, or ``adapter_names``) adapters into the base
        weights in place; the forward then applies none of this layer's adapters."""
        names = [n for n in check_adapters_to_merge(self, adapter_names) if n in self.scaling]
        for name in names:
            new = self.folded(name, 1.0)
            if safe_merge:
                _refuse_nan(name, new)
            if self._fd_lcfg[name].use_dora:  # DoRA's merge is not additive: keep what it replaces
                self._fd_saved[name] = {k: self.base_layer._parameters[k].detach().clone() for k in new}
            with torch.no_grad():
                for k, v in new.items():
                    self.base_layer._parameters[k].copy_(v)
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """PEFT's unmerge: subtract every merged adapter at its current scaling, as PEFT
        does (exact up to the rounding of the weights' dtype); a DoRA adapter, whose merge
        rescales the rows, gets back the weights it replaced."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name in self.scaling:
                old = self._fd_saved.pop(name, None)
                with torch.no_grad():
                    for k, v in (old if old is not None else self.folded(name, -1.0)).items():
                        self.base_layer._parameters[k].copy_(v)


def _refuse_nan(name: str, new: dict) -> None:
    """The stock ValueError when adapter ``name``'s merged weights ``new`` are not finite."""
    if not all(torch.isfinite(v).all() for v in new.values()):
        raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems to be broken")


_CLASSES: dict[type, type] = {}
_STATE = ("_fd_path", "_fd_lcfg", "adapter_layer_names", "other_param_names", "_active_adapter", "_disable_adapters")
_STATE += ("merged_adapters", "_fd_saved")


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__.lstrip('_')}", (cls, LoraLayer), {"__module__": __name__})
    return _CLASSES[cls]


def adapt(node: torch.nn.Module, path: str) -> LoraLayer:
    """``node`` (a `_Node` at ``path``) as a `LoraLayer` with no adapters yet."""
    if not isinstance(node, LoraLayer):
        plain = type(node)
        base = plain()
        for k in list(node._parameters):
            base.register_parameter(k, node._parameters.pop(k))
        node.add_module("base_layer", base)
        node.__class__ = _lora_class(plain)
        node.__dict__.update({k: {} for k in _OTHER})
        node.__dict__.update(
            _fd_plain=plain,
            _fd_path=path,
            _fd_lcfg={},
            _fd_saved={},
            adapter_layer_names=(),
            other_param_names=_OTHER,
            _active_adapter=[],
            _disable_adapters=False,
            merged_adapters=[],
        )
    return node


def add(node: LoraLayer, name: str, lcfg, subtree: dict, trainable: bool) -> None:
    """Register adapter ``name``'s leaves of ``node`` (``subtree``: {"lora_A": {...}, ...},
    every key a ModuleDict as PEFT holds it) with its rank and alpha from ``lcfg``."""
    for key, value in subtree.items():
        if key not in node._modules:
            node.add_module(key, torch.nn.ModuleDict())
            node.__dict__["adapter_layer_names"] = (*node.adapter_layer_names, key)
        node._modules[key][name] = _holder({"weight": value} if key in _VECTORS else value, trainable)
    (_, r, alpha), *_ = (e for e in lcfg.modules if e[0] == node._fd_path)
    node.r[name], node.lora_alpha[name], node.use_rslora[name] = r, alpha, bool(lcfg.use_rslora)
    node._fd_lcfg[name] = lcfg
    node.scaling[name] = node._base_scale(name)


def remove(node: LoraLayer, name: str) -> None:
    """Delete adapter ``name`` from ``node`` (PEFT's ``delete_adapter``); with none left,
    ``node`` is a plain `_Node` again (as ``unload_lora`` leaves the stock module)."""
    node.delete_adapter(name)
    node._fd_lcfg.pop(name, None)
    if node._fd_lcfg:
        return
    for key in node.adapter_layer_names:
        del node._modules[key]
    base = node._modules.pop("base_layer")
    node.__class__ = node.__dict__.pop("_fd_plain")
    for k, p in base._parameters.items():
        node.register_parameter(k, p)
    for k in (*_OTHER, *_STATE):
        node.__dict__.pop(k, None)


def base_key(key: str, layers) -> str | None:
    """The base model's name of parameter ``key`` (``<m>.base_layer.weight`` -> ``<m>.weight``),
    or None for a LoRA tensor of a layer in ``layers`` (module paths)."""
    head = key
    while "." in head:
        head, _, _ = head.rpartition(".")
        if head in layers:
            rest = key[len(head) + 1 :]
            return f"{head}.{rest[len('base_layer.') :]}" if rest.startswith("base_layer.") else None
    return key


def active_pairs(layers) -> dict[str, dict[str, float]]:
    """``{adapter name: {module path: scaling}}`` of what the forward applies: per layer
    (not disabled, nothing merged into it), its active adapters at their scalings."""
    out: dict[str, dict[str, float]] = {}
    for node in layers:
        if node.disable_adapters or node.merged:
            continue
        for name in node.active_adapters:
            if name in node.scaling:
                out.setdefault(name, {})[node._fd_path] = node.scaling[name]
    return out

"""``enable_layerwise_casting`` on `DiffusersTransformer`, backed by `fd.layerwise_cast`.

The stock method (diffusers' ``ModelMixin.enable_layerwise_casting``) walks the module
tree and hooks every ``nn.Linear`` / conv / ``nn.Embedding`` leaf whose name, or an
ancestor's, matches no skip pattern (and whose class, or an ancestor's, is not in
``skip_modules_classes``): its weight and bias are stored in ``storage_dtype`` and cast
to ``compute_dtype`` while it runs. The adapter has no such modules to hook; it makes the
same choice leaf by leaf and stores the chosen leaves as `fd.layerwise_cast` does
(`functional_dit.nn.layerwise.CastTensor`: read in the compute dtype at each op).

The choice: the adapter's module names are the stock ones (a PEFT-adapted module's weight
at ``<module>.base_layer.weight``, its factors at ``<module>.lora_A.<name>.weight``), and
the class the stock module at each name has is read off the stock class built on the
meta device (no memory; PEFT's classes for the adapted modules: ``lora.Linear`` around an
``nn.Linear`` base layer and ``nn.Linear`` factors). The patterns are the stock ones:
the given ones or diffusers' defaults, the model's ``_keep_in_fp32_modules`` and the stock
class's ``_skip_layerwise_casting_patterns``, and, with no patterns given, PEFT's adapter
layer names (the factors stay as they are).

After it: ``adapter.dtype`` is ``compute_dtype``, as stock (a diffusers hook named
``layerwise_casting`` with that ``compute_dtype`` sits on the adapter, where
``get_parameter_dtype`` looks; its forward passes through); moving to another device
keeps the storage; a dtype change (``to(dtype)``, ``half()``) is a ValueError (the stock
modules would cast back to their storage and compute dtypes at their next forward:
re-create the model in the dtype you want instead); ``save_pretrained`` writes the stored
dtype, as stock; LoRA added, fused or unfused afterwards works (a fused weight is rounded
to the storage dtype once); removing the hook is a ValueError (stock: NotImplementedError).
Sharded params (``fd.DiffusersTransformer(sharding.shard_params(...))``) are stored shard by
shard, placed as they were (`fd.layerwise_cast` of DTensor leaves); the footprint counts the
whole model in its stored dtype, as unsharded.
"""

from __future__ import annotations

import re

import diffusers
import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS
from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

from sharding.internal import is_dtensor

from ...nn import layerwise
from ...params import COMPUTE_DTYPES
from ._peft_layers import base_key

HOOK_NAME = "layerwise_casting"  # where diffusers' get_parameter_dtype looks


class LayerwiseCastingHook(ModelHook):
    """Marks the adapter as layerwise-cast (its ``compute_dtype`` is the model's dtype);
    the casting itself is in the leaves (`CastTensor`), so the forward passes through."""

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool):
        super().__init__()
        self.storage_dtype, self.compute_dtype, self.non_blocking = storage_dtype, compute_dtype, non_blocking

    def deinitalize_hook(self, module):  # diffusers' spelling
        raise ValueError(
            f"{HOOK_NAME}: layerwise casting cannot be removed: the weights are stored as {self.storage_dtype} "
            "(rounded once); re-create the model in its original dtype instead"
        )


def _peft_stock_class(path: str, layers: dict):
    """The class PEFT gives the stock module at ``path`` when it is part of an adapted
    layer (``layers``: {module path: our LoraLayer}), else None."""
    # optional: peft, the PEFT entry points only
    from peft.tuners.lora import Linear as PeftLinear
    from peft.tuners.lora.dora import DoraLinearLayer

    if path in layers:
        return PeftLinear
    head, _, last = path.rpartition(".")
    if head in layers:  # <m>.base_layer is the stock nn.Linear (handled by the caller); containers
        return None if last == "base_layer" else torch.nn.ModuleDict
    owner, _, kind = head.rpartition(".")
    if owner in layers:  # <m>.lora_A.<name>
        return DoraLinearLayer if kind == "lora_magnitude_vector" else torch.nn.Linear
    return None


def stock_classes(adapter) -> dict[str, type]:
    """{module path of the adapter: the class the stock module at that path has}."""
    stock_cls = getattr(diffusers, type(adapter).__name__)
    with torch.device("meta"):
        meta = stock_cls.from_config(dict(adapter.config))
    stock = {name: type(m) for name, m in meta.named_modules()}
    layers = adapter._peft_layers()
    out = {}
    for name, module in adapter.named_modules():
        peft_cls = _peft_stock_class(name, layers)
        plain = ".".join(p for p in name.split(".") if p != "base_layer")
        out[name] = peft_cls or stock.get(plain, type(module))
    return out


def skip_patterns(adapter, skip_modules_pattern) -> tuple[str, ...]:
    """The patterns the stock method skips (see the module docstring)."""
    given = skip_modules_pattern is not None
    if given and (
        not isinstance(skip_modules_pattern, (tuple, list)) or not all(isinstance(p, str) for p in skip_modules_pattern)
    ):
        raise ValueError(
            "skip_modules_pattern: expected None or a tuple of regular-expression strings, "
            f"got {skip_modules_pattern!r}"
        )
    patterns = tuple(skip_modules_pattern) if given else tuple(DEFAULT_SKIP_MODULES_PATTERN)
    patterns += tuple(adapter._keep_in_fp32_modules or ())
    patterns += tuple(adapter._skip_layerwise_casting_patterns or ())
    if not given:
        # optional: peft, the PEFT entry points only
        from peft.tuners.loha.layer import LoHaLayer
        from peft.tuners.lokr.layer import LoKrLayer
        from peft.tuners.lora.layer import LoraLayer

        for layer in (LoHaLayer, LoKrLayer, LoraLayer):
            patterns += tuple(layer.adapter_layer_names)
    return tuple(dict.fromkeys(patterns))


def chosen(adapter, patterns, skip_classes) -> set[str]:
    """The adapter's parameter names the stock method would store in the storage dtype."""
    classes = stock_classes(adapter)
    compiled = [re.compile(p) for p in patterns]

    def skipped(path: str) -> bool:
        parts = path.split(".") if path else []
        for prefix in [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]:
            if skip_classes and issubclass(classes.get(prefix, object), skip_classes):
                return True
            if any(p.search(prefix) for p in compiled):
                return True
        return False

    out = set()
    for name, p in adapter.named_parameters(remove_duplicate=False):
        path = name.rpartition(".")[0]
        if p.is_floating_point() and issubclass(classes.get(path, object), _GO_LC_SUPPORTED_PYTORCH_LAYERS):
            if not skipped(path):
                out.add(name)
    return out


def _check(adapter, storage_dtype, compute_dtype, skip_modules_classes, non_blocking) -> None:
    registry = adapter.__dict__.get("_diffusers_hook")
    if registry is not None and registry.get_hook(HOOK_NAME) is not None:
        raise ValueError("enable_layerwise_casting: layerwise casting is already enabled on this model")
    if not isinstance(storage_dtype, torch.dtype) or not storage_dtype.is_floating_point:
        raise ValueError(f"storage_dtype: expected a floating torch.dtype, got {storage_dtype!r}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype: expected None or one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
    if skip_modules_classes is not None and (
        not isinstance(skip_modules_classes, (tuple, list))
        or not all(isinstance(c, type) for c in skip_modules_classes)
    ):
        raise ValueError(f"skip_modules_classes: expected None or a tuple of classes, got {skip_modules_classes!r}")
    if not isinstance(non_blocking, bool):
        raise ValueError(f"non_blocking: expected a bool, got {non_blocking!r}")


def _stored_size(t) -> int:
    """Bytes per element ``t`` is stored in (a sharded leaf's local shard's)."""
    return layerwise.stored_leaf(t.to_local() if is_dtensor(t) else t).element_size()


class LayerwiseMixin:
    """``enable_layerwise_casting`` and the guards it needs (see the module docstring)."""

    def layerwise_hook(self) -> LayerwiseCastingHook | None:
        registry = self.__dict__.get("_diffusers_hook")
        return None if registry is None else registry.get_hook(HOOK_NAME)

    def enable_layerwise_casting(
        self,
        storage_dtype: torch.dtype = torch.float8_e4m3fn,
        compute_dtype: torch.dtype | None = None,
        skip_modules_pattern: tuple[str, ...] | None = None,
        skip_modules_classes: tuple[type, ...] | None = None,
        non_blocking: bool = False,
    ) -> None:
        """The stock method (see its docstring and this module's): the chosen weights are
        stored in ``storage_dtype`` and read in ``compute_dtype`` (None: the model's dtype)
        at each op of `fd.apply`. ``non_blocking`` is accepted and has nothing to do: each
        cast runs on the device its weight is on, with no transfer to overlap."""
        compute_dtype = self.dtype if compute_dtype is None else compute_dtype
        _check(self, storage_dtype, compute_dtype, skip_modules_classes, non_blocking)
        names = chosen(self, skip_patterns(self, skip_modules_pattern), tuple(skip_modules_classes or ()))
        base = self._base_params(detached=True)
        keys = {self._param_key(n): n for n in names}
        cast = layerwise.layerwise_cast(base, storage_dtype, compute_dtype, skip=lambda key: key not in keys)
        new = {keys[k]: v for k, v in cast.flat().items() if k in keys}
        new.update({n: layerwise.cast_leaf(p.detach(), storage_dtype, compute_dtype) for n, p in self._factors(names)})
        self._replace_leaves(new)
        registry = HookRegistry.check_if_exists_or_initialize(self)
        registry.register_hook(LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking), HOOK_NAME)

    def get_memory_footprint(self, return_buffers: bool = True) -> int:
        """The stock method's bytes of parameters (and buffers), a layerwise-cast leaf
        counted in the dtype it is stored in (the stock module's fp8 weights are fp8)."""
        tensors = list(self.parameters()) + (list(self.buffers()) if return_buffers else [])
        return sum(t.nelement() * _stored_size(t) for t in tensors)

    def _param_key(self, name: str) -> str | None:
        layers = self._peft_layers()
        return base_key(name, layers) if layers else name

    def _factors(self, names):
        """The chosen parameters that are PEFT factors (not base-model leaves)."""
        return [
            (n, p)
            for n, p in self.named_parameters(remove_duplicate=False)
            if n in names and self._param_key(n) is None
        ]

    def _replace_leaves(self, new: dict) -> None:
        for name, t in new.items():
            parent, _, leaf = name.rpartition(".")
            node = self.get_submodule(parent)
            old = node._parameters[leaf]
            node._parameters[leaf] = torch.nn.Parameter(t, requires_grad=old.requires_grad)

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``to``, ``half``, ``cuda``...), refusing dtype changes of
        layerwise-cast leaves (device moves keep them stored)."""
        hook = self.layerwise_hook()
        if hook is not None:  # try fn on a one-element leaf first, so a refusal changes nothing
            probe = layerwise.cast_leaf(torch.zeros(1, device=self.device), hook.storage_dtype, hook.compute_dtype)
            out = fn(probe)
            if not layerwise.is_cast(out):
                raise ValueError(
                    f"dtype: layerwise casting is enabled (stored as {hook.storage_dtype}, computed in "
                    f"{hook.compute_dtype}); changing the dtype (to(dtype), half(), float()...) to {out.dtype} is not "
                    "supported: re-create the model in the dtype you want, then enable layerwise casting"
                )
        return super()._apply(fn, recurse)

"""Helpers shared by the family configs (frozen dataclasses whose field names are
the diffusers config keys)."""

from __future__ import annotations

import dataclasses
import inspect
import operator
import warnings
from collections.abc import Mapping
from typing import NamedTuple


class DiTConfig:
    """What every family config derives the same way from its diffusers fields; a family
    config is a frozen dataclass subclassing it (its fields are the diffusers keys)."""

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def out_dim(self) -> int:
        """Output channels per token: patch_size² · (out_channels or in_channels)."""
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def as_ints(values) -> tuple:
    """``values`` as a tuple whose integers (numpy's and 0-d tensors' too) are Python ints;
    anything else is kept as is, for the checks to refuse by name."""
    return tuple(
        operator.index(v) if not isinstance(v, bool) and not isinstance(v, float) and hasattr(v, "__index__") else v
        for v in values
    )


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _require_each(cfg, names, ok, expected: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        require(ok(value), f"{type(cfg).__name__}.{name}: expected {expected}, got {value!r}")


def require_positive(cfg, *names: str) -> None:
    _require_each(cfg, names, lambda v: is_int(v) and v > 0, "a positive int")


def require_non_negative(cfg, *names: str) -> None:
    _require_each(cfg, names, lambda v: is_int(v) and v >= 0, "an int >= 0")


def require_positive_or_none(cfg, *names: str) -> None:
    _require_each(cfg, names, lambda v: v is None or (is_int(v) and v > 0), "None or a positive int")


def require_positive_number(cfg, *names: str) -> None:
    _require_each(
        cfg, names, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a positive number"
    )


def require_bool(cfg, *names: str) -> None:
    _require_each(cfg, names, lambda v: isinstance(v, bool), "a bool")


def require_rope_axes(cfg, n_axes: int | None = None) -> None:
    """``axes_dims_rope``: (``n_axes``) positive even ints summing to ``attention_head_dim``."""
    name, dims = type(cfg).__name__, cfg.axes_dims_rope
    count = "" if n_axes is None else f"{n_axes} "
    require(
        (n_axes is None or len(dims) == n_axes) and all(is_int(d) and d > 0 and d % 2 == 0 for d in dims),
        f"{name}.axes_dims_rope: expected {count}positive even ints, got {dims}",
    )
    require(
        sum(dims) == cfg.attention_head_dim,
        f"{name}: sum(axes_dims_rope) = sum({dims}) = {sum(dims)} "
        f"must equal attention_head_dim = {cfg.attention_head_dim}",
    )


def from_mapping(cls, mapping: Mapping):
    """Build ``cls`` from a diffusers config mapping. Keys starting with ``_`` (diffusers
    bookkeeping) are dropped; any other unknown key is an error, not silently ignored."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in mapping if not k.startswith("_") and k not in names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown config keys {unknown}; expected a subset of {sorted(names)}")
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in mapping.items() if k in names}
    return cls(**kwargs)


def to_mapping(cfg, class_name: str) -> dict:
    """The diffusers ``config.json`` content for ``cfg``."""
    out = {"_class_name": class_name}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


class Pipeline(NamedTuple):
    """A stock diffusers pipeline that runs a family's transformer, as a family file declares
    it (names only: the core imports no diffusers): its class name, its kind in the tiny
    offline set (`functional_dit.pipelines.tiny`; None: not built there), and whether
    `fd.sample` drives it (False: only `fd.DiffusersTransformer` serves it)."""

    name: str
    tiny: str | None = None
    sample: bool = False


def drop_keys_diffusers_ignores(class_name: str, cfg: Mapping) -> dict:
    """Released configs carry keys the diffusers class does not take (Qwen-Image's
    ``pooled_projection_dim``); diffusers ignores them with a warning, and so do we.
    Every key the class does take must be a config field (checked by from_mapping)."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    accepted = set(inspect.signature(getattr(diffusers, class_name).__init__).parameters)
    ignored = sorted(k for k in cfg if not k.startswith("_") and k not in accepted)
    if ignored:
        warnings.warn(f"config keys {ignored} are not arguments of diffusers.{class_name}; ignored", stacklevel=3)
    return {k: v for k, v in cfg.items() if k not in ignored}

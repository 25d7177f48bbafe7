"""Helpers shared by the family configs (frozen dataclasses whose field names are
the diffusers config keys)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


def require_positive(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(cfg).__name__}.{name}: expected a positive int, got {value!r}")


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


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

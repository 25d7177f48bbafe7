"""The family registry: the one table of transformer families every caller reads.

Each family file declares its own facts as data (no diffusers import): ``KEY`` (its name
in code: ``"flux1"``), ``NAME`` (for messages: ``"FLUX.1"``), ``CONFIG`` (its config
class), ``DIFFUSERS_CLASS``, ``PRESETS``, ``TINY`` (its tiny preset), ``REPOS`` (presets
with released weights) and ``PIPELINES`` (the stock pipelines that run it,
`configs.Pipeline`). ``api``, the sampler, the adapter, the tiny pipelines, the CLI,
``lora`` and ``weights`` all ask this module "which family is this". Adding a family is
its file plus one line in `FAMILIES`.
"""

from __future__ import annotations

from . import flux1, flux2, flux3, qwenimage, qwenimage21
from .params import Params

FAMILIES = (flux1, flux2, qwenimage, flux3, qwenimage21)  # one line per family

# What every family module declares (tests/test_families.py checks each).
FIELDS = ("KEY", "NAME", "CONFIG", "DIFFUSERS_CLASS", "PRESETS", "TINY", "REPOS", "PIPELINES")

BY_KEY = {fam.KEY: fam for fam in FAMILIES}
BY_CONFIG = {fam.CONFIG: fam for fam in FAMILIES}
BY_DIFFUSERS_CLASS = {fam.DIFFUSERS_CLASS: fam for fam in FAMILIES}
# Every stock pipeline class name -> (the family module that runs it, its `configs.Pipeline`).
PIPELINES = {p.name: (fam, p) for fam in FAMILIES for p in fam.PIPELINES}
SAMPLED = tuple(name for name, (_, p) in PIPELINES.items() if p.sample)  # the ones `fd.sample` drives
TINY_KINDS = {p.tiny: (fam, p) for fam, p in PIPELINES.values() if p.tiny is not None}


def of(config):
    """The family module that owns ``config`` (a config instance or `Params`)."""
    config = config.config if isinstance(config, Params) else config
    fam = BY_CONFIG.get(type(config))
    if fam is None:
        known = [cls.__name__ for cls in BY_CONFIG]
        raise ValueError(f"config: expected one of {known}, got {type(config).__name__}")
    return fam


def key(config) -> str:
    """``"flux1"``, ``"flux2"``, ``"qwenimage"``, ``"flux3"`` or ``"qwenimage21"``: the
    family of ``config`` (a config or `Params`) as code names it."""
    return of(config).KEY


def of_pipeline(name: str):
    """The family module whose transformer the stock pipeline class ``name`` runs."""
    if name not in PIPELINES:
        raise ValueError(f"pipeline: expected one of {sorted(PIPELINES)}, got {name!r}")
    return PIPELINES[name][0]


def pipeline_names(fam, sample: bool | None = None) -> tuple[str, ...]:
    """The stock pipeline class names of family ``fam`` (all, or those `fd.sample` drives
    or does not)."""
    return tuple(p.name for p in fam.PIPELINES if sample is None or p.sample == sample)


def tiny_config(fam):
    """The family's tiny config (its ``TINY`` preset)."""
    return fam.PRESETS[fam.TINY]

"""The family registry: the one table of transformer families every caller reads.

Each family file declares its own facts as data (no diffusers import): ``KEY`` (its name
in code: ``"flux1"``), ``NAME`` (for messages: ``"FLUX.1"``), ``CONFIG`` (its config
class), ``DIFFUSERS_CLASS``, ``PRESETS``, ``TINY`` (its tiny preset), ``REPOS`` (presets
with released weights) and ``PIPELINES`` (the stock pipelines that run it,
`configs.Pipeline`). ``api``, the sampler, the adapter, the tiny pipelines, the CLI,
``lora`` and ``weights`` all ask this module "which family is this".

What the product does with a family (its sampling steps, the diffusers adapter's argument
maps, the tiny pipelines' recipes, the bench's inputs) is in the family's *product module*
(``functional_dit.pipelines.families.<KEY>``, or the module a family names in ``PRODUCT``),
which the product finds (`functional_dit.pipelines.families.product`): it may import
diffusers, and the core names no product module. Adding a
family is its core file, its product module and one line in `FAMILIES`
(docs/adding-a-family.md); `register` is that line at run time (a family defined outside
the package, as the tests' toy family).
"""

from __future__ import annotations

import contextlib

from . import flux1, flux2, flux3, qwenimage, qwenimage21
from .params import Params

FAMILIES = (flux1, flux2, qwenimage, flux3, qwenimage21)  # one line per family

# What every family module declares (tests/test_families.py checks each).
FIELDS = ("KEY", "NAME", "CONFIG", "DIFFUSERS_CLASS", "PRESETS", "TINY", "REPOS", "PIPELINES")

BY_KEY: dict = {}
BY_CONFIG: dict = {}
BY_DIFFUSERS_CLASS: dict = {}
# Every stock pipeline class name -> (the family module that runs it, its `configs.Pipeline`);
# a pipeline two families declare (a variant under another key) stays the first one's.
PIPELINES: dict = {}
SAMPLED: list = []  # the pipeline names `fd.sample` drives
TINY_KINDS: dict = {}
_WATCHERS: list = []  # (add, remove) callbacks of the tables kept elsewhere (`functional_dit.api`)


def _add(fam) -> None:
    missing = [f for f in FIELDS if not hasattr(fam, f)]
    if missing or fam.KEY in BY_KEY or fam.CONFIG in BY_CONFIG or fam.DIFFUSERS_CLASS in BY_DIFFUSERS_CLASS:
        why = f"misses {missing}" if missing else "has a KEY, CONFIG or DIFFUSERS_CLASS already registered"
        raise ValueError(f"fam: {getattr(fam, '__name__', fam)!r} {why}")
    BY_KEY[fam.KEY], BY_CONFIG[fam.CONFIG], BY_DIFFUSERS_CLASS[fam.DIFFUSERS_CLASS] = fam, fam, fam
    for p in fam.PIPELINES:
        if p.name not in PIPELINES:
            PIPELINES[p.name] = (fam, p)
            SAMPLED.extend([p.name] if p.sample else [])
        if p.tiny is not None and p.tiny not in TINY_KINDS:
            TINY_KINDS[p.tiny] = (fam, p)


for _fam in FAMILIES:
    _add(_fam)


def register(fam) -> None:
    """Add the family module ``fam`` (with every `FIELDS` name) to the registry, as a line
    in `FAMILIES` does; for a family defined outside the package. `unregister` undoes it."""
    global FAMILIES
    _add(fam)
    FAMILIES = (*FAMILIES, fam)
    for add, _ in _WATCHERS:
        add(fam)


def unregister(fam) -> None:
    """Remove a family `register` added (its pipelines and tiny kinds with it)."""
    global FAMILIES
    if fam not in FAMILIES[len(_BUILT_IN) :]:
        raise ValueError(f"fam: {getattr(fam, '__name__', fam)!r} was not added by register")
    FAMILIES = tuple(f for f in FAMILIES if f is not fam)
    for table in (BY_KEY, BY_CONFIG, BY_DIFFUSERS_CLASS, PIPELINES, TINY_KINDS):
        for k in [k for k, v in table.items() if v is fam or (isinstance(v, tuple) and v[0] is fam)]:
            del table[k]
    SAMPLED[:] = [name for name in SAMPLED if name in PIPELINES]
    for _, remove in _WATCHERS:
        remove(fam)


@contextlib.contextmanager
def registered(fam):
    """``fam`` registered for the ``with`` block (`register`, then `unregister`)."""
    register(fam)
    try:
        yield fam
    finally:
        unregister(fam)


def watch(add, remove) -> None:
    """Keep a table derived from the registry current: ``add(fam)`` now for every family
    and for each one `register` adds later, ``remove(fam)`` for each one `unregister` removes."""
    _WATCHERS.append((add, remove))
    for fam in FAMILIES:
        add(fam)


_BUILT_IN = FAMILIES


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


def by_key(key: str):
    """The family module whose ``KEY`` is ``key``."""
    if key not in BY_KEY:
        raise ValueError(f"fam: expected one of {sorted(BY_KEY)}, got {key!r}")
    return BY_KEY[key]


def presets() -> dict:
    """Every registered family's presets, ``{name: config}`` (what `fd.PRESETS` holds)."""
    return {name: config for fam in FAMILIES for name, config in fam.PRESETS.items()}


def tiny_config(fam):
    """The family's tiny config (its ``TINY`` preset)."""
    return fam.PRESETS[fam.TINY]

"""A toy family for tests/test_toy_family.py: FLUX.1's maths under a new key and a new
config class, added the way docs/adding-a-family.md says (this core family file, its
product module `_toy_family_product`, and the registry line, here
``functional_dit.families.register(_toy_family)`` because a test cannot edit the table).

Like every core family file it imports no diffusers: its facts are data, its maths
FLUX.1's functions (``param_specs``, ``check_inputs``, ``forward``, ``rope_table`` ...).
"""

from __future__ import annotations

import dataclasses

from functional_dit import flux1
from functional_dit.configs import Pipeline
from functional_dit.flux1 import *  # noqa: F403  (FLUX.1's maths: specs, checks, forward, tables)

KEY = "toy"  # the family in code
NAME = "Toy"  # for messages
DIFFUSERS_CLASS = "ToyTransformer2DModel"  # its stock class (`_toy_family_product.ToyTransformer2DModel`)
PRODUCT = "_toy_family_product"  # its product module (in the package: functional_dit.pipelines.families.toy)


@dataclasses.dataclass(frozen=True)
class ToyConfig(flux1.Flux1Config):
    """The toy's config: FLUX.1's fields (the stock class's keys) under a class of its own."""


CONFIG = ToyConfig
PRESETS = {"toy-tiny": ToyConfig(**dataclasses.asdict(flux1.PRESETS[flux1.TINY]))}
TINY = "toy-tiny"
REPOS = {}  # no released weights
# FluxPipeline drives its transformer; "toy" is its kind among the tiny pipelines.
PIPELINES = (Pipeline("FluxPipeline", tiny="toy", sample=True),)

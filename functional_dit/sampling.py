"""``functional_dit.sampling`` is `functional_dit.pipelines.sampling` (text-to-image
sampling as an explicit per-item state: `Request`, `init`, `step`, `decode`), kept at the
public name users import: this module replaces itself by it."""

import sys

from .pipelines import sampling as _sampling

sys.modules[__name__] = _sampling

"""``functional_dit.tiny`` is `functional_dit.pipelines.tiny` (the offline tiny
pipelines), kept at the public name users import: this module replaces itself by it."""

import sys

from .pipelines import tiny as _tiny

sys.modules[__name__] = _tiny

"""Names `functional_dit.lora` shares with the rest of the repository but not with its
users (the ``equinox.internal`` idea): what ``fd.apply(..., lora=...)`` and the diffusers
adapter run to check adapters and attach their factors to the layers, and DoRA's
magnitude initialisation."""

from ._adapter import magnitudes
from ._apply import attach, check, local_adapters

__all__ = ["attach", "check", "local_adapters", "magnitudes"]

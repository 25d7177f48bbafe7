"""weights: checkpoint IO for functional_dit.

`load` reads diffusers model and pipeline folders and single safetensors files in
diffusers or Black Forest Labs layout, streamed tensor by tensor and, with a mesh,
only this rank's slices. `save` writes a diffusers-format folder that diffusers'
``from_pretrained`` loads. Pickle-based checkpoints are refused.
"""

from ._format import CheckpointError, read_header
from ._layouts import BFL_TABLES, FLUX1_BFL, FLUX2_BFL, Rule
from ._load import inspect, load
from ._save import save

__all__ = ["BFL_TABLES", "FLUX1_BFL", "FLUX2_BFL", "CheckpointError", "Rule", "inspect", "load", "read_header", "save"]

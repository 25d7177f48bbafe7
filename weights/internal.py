"""Names `weights` shares with the other packages of this repository but not with its
users (the ``equinox.internal`` idea): the one safetensors/pickle policy, by which
`functional_dit.lora` reads LoRA files as `weights` reads checkpoints, and the file names
of a diffusers variant, which the diffusers adapter saves by; `write_file`, the one
atomic safetensors writer by which LoRA files are written as `save` writes its shards."""

from ._commit import write_file
from ._format import PICKLE_SUFFIXES, CheckpointError, read_header, read_tensors, refuse_pickle
from ._source import variant_names

__all__ = [
    "PICKLE_SUFFIXES",
    "CheckpointError",
    "read_header",
    "read_tensors",
    "refuse_pickle",
    "variant_names",
    "write_file",
]

"""Names `weights` shares with the other packages of this repository but not with its
users (the ``equinox.internal`` idea): the one safetensors/pickle policy, by which
`functional_dit.lora` reads LoRA files as `weights` reads checkpoints."""

from ._format import PICKLE_SUFFIXES, CheckpointError, read_header, read_tensors, refuse_pickle

__all__ = ["PICKLE_SUFFIXES", "CheckpointError", "read_header", "read_tensors", "refuse_pickle"]

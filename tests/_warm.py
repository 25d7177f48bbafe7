"""What every `_dist.spawn` rank would otherwise import on its own: torch (with its
distributed stack), our packages, and the diffusers / transformers classes the tiny
pipelines and the stock pipelines use. The forkserver that ranks fork from imports this
module once (`_dist.PRELOAD`); it only imports, never computes, so no thread pool
exists yet when a rank is forked."""

import diffusers
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import transformers

import functional_dit  # noqa: F401
import sharding  # noqa: F401
import weights  # noqa: F401
from functional_dit import families, tiny  # noqa: F401

TRANSFORMERS = (
    "CLIPTextModel",
    "T5EncoderModel",
    "Mistral3ForConditionalGeneration",
    "Qwen3ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen2VLProcessor",
    "Qwen3VLProcessor",
)

for _name in (*families.PIPELINES, *(fam.DIFFUSERS_CLASS for fam in families.FAMILIES)):
    getattr(diffusers, _name, None)  # diffusers imports lazily, on first attribute access
for _name in TRANSFORMERS:
    getattr(transformers, _name, None)

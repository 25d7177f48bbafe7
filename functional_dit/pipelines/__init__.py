"""The product around the core: the diffusers drop-in transformer (`adapter`), the
functional sampler (`sampler`) and its step caches (`cache`), and the offline tiny
pipelines (`tiny`). These modules may import diffusers, transformers and `weights`."""

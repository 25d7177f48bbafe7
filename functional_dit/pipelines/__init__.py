"""The product around the core, one subpackage per part (docs/architecture.md):

- `families`: the product per family, one module each (its sampling steps, the adapter's
  argument map, tiny recipes, bench inputs), found through `functional_dit.pipelines.families.product`;
- `sampler`: ``fd.sample`` (argument checks, requests, ranks, the image jobs, the loop);
  `sampling` the per-item sampling state over it, `sampler_xla` its fixed-graph loop,
  `schedule` the img2img schedule, `placement` where the encoders and the VAE run;
- `adapter`: ``fd.DiffusersTransformer``, the diffusers drop-in transformer;
- `cache`: the step caches (pure steps over the family's stages; for the rest of this
  package `cache.internal`: per item, `items`; diffusers' cache hooks on the adapter,
  `CacheHooks`);
- `tiny`: the offline tiny pipelines.

These modules may import diffusers, transformers and `weights`; this package's own import
loads none of them.
"""


def __getattr__(name):
    """``CacheHooks`` (the adapter's diffusers cache hooks, `cache._hooks`), loaded on first use."""
    if name == "CacheHooks":
        # diffusers' hooks: seconds to import, loaded when CacheHooks is first asked for
        from .cache.internal import CacheHooks

        return CacheHooks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

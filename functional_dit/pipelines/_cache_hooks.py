"""diffusers' ``CacheMixin`` for `fd.DiffusersTransformer`: ``enable_cache(config)`` with
diffusers' own configs runs `functional_dit.pipelines.cache` steps, one state per
``cache_context`` name ("cond", "uncond", as the pipelines open them), dropped by
``_reset_stateful_cache`` (which the pipelines call after each run) — the semantics of
diffusers' hooks, without hooks on modules. Configs it cannot honour raise a
``ValueError`` naming them.
"""

from __future__ import annotations

import contextlib

import diffusers
import torch

from ..api import apply
from . import cache as _cache


def from_diffusers_config(config):
    """Our cache config for a diffusers one: ``FirstBlockCacheConfig``,
    ``TaylorSeerCacheConfig(use_lite_mode=True)`` or ``MagCacheConfig`` (not calibrating)."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if isinstance(config, FirstBlockCacheConfig):
        return _cache.FirstBlockCache(config.threshold)
    if isinstance(config, TaylorSeerCacheConfig):
        if not config.use_lite_mode or config.skip_predict_identifiers or config.cache_identifiers:
            raise ValueError(
                f"config: {config!r} is not supported by functional_dit's adapter; it runs TaylorSeer on the model "
                "output only: TaylorSeerCacheConfig(use_lite_mode=True) without identifier patterns"
            )
        keys = ("cache_interval", "disable_cache_before_step", "disable_cache_after_step", "max_order")
        keys += ("taylor_factors_dtype",)
        return _cache.TaylorSeer(**{k: getattr(config, k) for k in keys})
    if isinstance(config, MagCacheConfig) and not config.calibrate:
        keys = ("threshold", "max_skip_steps", "retention_ratio", "num_inference_steps")
        return _cache.MagCache(tuple(config.mag_ratios.tolist()), **{k: getattr(config, k) for k in keys})
    raise ValueError(
        f"config: {type(config).__name__}{'(calibrate=True)' * bool(getattr(config, 'calibrate', False))} is not "
        "supported by functional_dit's adapter; expected FirstBlockCacheConfig, "
        "TaylorSeerCacheConfig(use_lite_mode=True) or MagCacheConfig(calibrate=False)"
    )


class CacheHooks(diffusers.CacheMixin):
    """``enable_cache`` / ``disable_cache`` / ``cache_context`` / ``_reset_stateful_cache``
    over `functional_dit.pipelines.cache`; the adapter's forward calls `cached_apply`."""

    def enable_cache(self, config) -> None:
        if self.is_cache_enabled:
            raise ValueError(f"Caching has already been enabled with {type(self._cache_config)}; disable it first.")
        self.__dict__.update(_fd_cache=from_diffusers_config(config), _fd_states={})
        self._cache_config = config

    def disable_cache(self) -> None:
        self.__dict__.update(_fd_cache=None, _fd_states={})
        self._cache_config = None

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs):
        """The pipelines' ``with transformer.cache_context("cond")``: the state to use."""
        self.__dict__["_fd_context"] = name
        try:
            yield
        finally:
            self.__dict__["_fd_context"] = None

    def _reset_stateful_cache(self, recurse: bool = True) -> None:
        self.__dict__["_fd_states"] = {}

    def cached_apply(self, params, x, t, txt, lora=None, checkpoint: bool = False, **kwargs):
        """`fd.apply`, or with a cache enabled one cached step in the current context's state."""
        cache = self.__dict__.get("_fd_cache")
        if cache is None:
            return apply(params, x, t, txt, lora=lora, checkpoint=checkpoint, **kwargs)
        if checkpoint and torch.is_grad_enabled():
            raise ValueError("enable_cache: step caching with gradient checkpointing under autograd is not supported")
        if lora:
            raise ValueError("lora: step caching with on-the-fly LoRA is not supported; merge it (lora.merge)")
        name = self.__dict__.get("_fd_context") or (
            "inference" if isinstance(cache, _cache.MagCache) else None  # as diffusers' MagCache
        )
        if name is None:
            raise ValueError(
                "No cache context is set. Wrap the denoiser call in `model.cache_context(name, ...)` before calling it."
            )
        states = self.__dict__["_fd_states"]
        state = states[name] if name in states else _cache.init(cache)
        out, states[name] = _cache.step(params, cache, state, x, t, txt, **kwargs)
        return out

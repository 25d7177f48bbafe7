"""diffusers' ``CacheMixin`` for `fd.DiffusersTransformer`: ``enable_cache(config)`` with
diffusers' own configs registers one stateful diffusers hook on the adapter itself
(`StepCacheHook`, under the stock leader hook's name) whose per-context state runs
`functional_dit.pipelines.cache` steps. diffusers' own ``cache_context``,
``_reset_stateful_cache`` and ``disable_cache`` reach it as they reach the stock hooks, so
contexts ("cond", "uncond"), resets and removal have the stock semantics; the forward
stays `fd.apply` (no hooks on blocks). Configs it cannot honour raise a ``ValueError``
naming them.
"""

from __future__ import annotations

import diffusers
import torch
from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, MagCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK
from diffusers.hooks.hooks import BaseState, CacheContext, ModelHook, StateManager
from diffusers.hooks.mag_cache import _MAG_CACHE_LEADER_BLOCK_HOOK
from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

from ..api import apply
from . import cache as _cache

# The stock hook each of our caches stands in for (what diffusers' disable_cache removes).
HOOK_NAMES = {
    _cache.FirstBlockCache: _FBC_LEADER_BLOCK_HOOK,
    _cache.TaylorSeer: _TAYLORSEER_CACHE_HOOK,
    _cache.MagCache: _MAG_CACHE_LEADER_BLOCK_HOOK,
}


def from_diffusers_config(config):
    """Our cache config for a diffusers one: ``FirstBlockCacheConfig``,
    ``TaylorSeerCacheConfig(use_lite_mode=True)`` or ``MagCacheConfig`` (not calibrating)."""
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


class _State(BaseState):
    """One context's cache state (`functional_dit.pipelines.cache`'s immutable value)."""

    def __init__(self, cache):
        self.cache, self.value = cache, _cache.init(cache)

    def reset(self) -> None:
        self.value = _cache.init(self.cache)


class StepCacheHook(ModelHook):
    """The adapter's step cache as a stateful diffusers hook: a `StateManager` of one state
    per ``cache_context`` name; the forward itself is left alone (the adapter's forward
    runs the step through `CacheHooks.cached_apply`)."""

    _is_stateful = True

    def __init__(self, cache):
        super().__init__()
        self.cache = cache
        self.state_manager = StateManager(_State, init_args=(cache,))

    def reset_state(self, module):
        self.state_manager.reset()
        return module

    def state(self) -> _State:
        """The current context's state; MagCache uses ``"inference"`` without one, as diffusers'."""
        if isinstance(self.cache, _cache.MagCache) and self.state_manager._context is None:
            self.state_manager.set_context(CacheContext(name="inference"))
        return self.state_manager.get_state()  # diffusers' "No cache context is set" otherwise


class CacheHooks(diffusers.CacheMixin):
    """diffusers' ``CacheMixin`` whose ``enable_cache`` maps the config onto our caches and
    registers a `StepCacheHook`; ``disable_cache``, ``cache_context`` and
    ``_reset_stateful_cache`` are diffusers' own. The adapter's forward calls `cached_apply`."""

    def enable_cache(self, config) -> None:
        if self.is_cache_enabled:
            raise ValueError(f"Caching has already been enabled with {type(self._cache_config)}; disable it first.")
        cache = from_diffusers_config(config)
        registry = HookRegistry.check_if_exists_or_initialize(self)
        registry.register_hook(StepCacheHook(cache), HOOK_NAMES[type(cache)])
        registry.invalidate_child_registries_cache()
        self._cache_config = config

    def step_cache_hook(self) -> StepCacheHook | None:
        """The registered `StepCacheHook`, None when no cache is enabled."""
        registry = self.__dict__.get("_diffusers_hook")
        hooks = [registry.get_hook(n) for n in HOOK_NAMES.values()] if registry is not None else []
        return next((h for h in hooks if isinstance(h, StepCacheHook)), None)

    def cached_apply(self, params, x, t, txt, lora=None, checkpoint: bool = False, **kwargs):
        """`fd.apply`, or with a cache enabled one cached step in the current context's state."""
        hook = self.step_cache_hook()
        if hook is None:
            return apply(params, x, t, txt, lora=lora, checkpoint=checkpoint, **kwargs)
        if checkpoint and torch.is_grad_enabled():
            raise ValueError("enable_cache: step caching with gradient checkpointing under autograd is not supported")
        if lora:
            raise ValueError("lora: step caching with on-the-fly LoRA is not supported; merge it (lora.merge)")
        state = hook.state()
        out, state.value = _cache.step(params, hook.cache, state.value, x, t, txt, **kwargs)
        return out

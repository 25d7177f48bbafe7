"""diffusers' ``CacheMixin`` for `fd.DiffusersTransformer`: ``enable_cache(config)`` with
diffusers' own configs registers one stateful diffusers hook on the adapter itself
(`StepCacheHook`, under the stock leader hook's name) whose per-context state runs
`functional_dit.pipelines.cache` steps. Where the stock ``enable_cache`` registers hooks that
code inspects (Pyramid Attention Broadcast's `PyramidAttentionBroadcastHook` on each attention
module; FasterCache's `FasterCacheDenoiserHook` on the model and `FasterCacheBlockHook` on each
attention module), instances of those classes are registered where and under the names the
stock registers them, each holding the stock state class (``iteration``, ``cache``,
``batch_size``, ...) with what the step cache holds after every step; they compute nothing
(their forward passes through: the adapter computes attention inside ``fd.apply``), and the
step is then run by a `StepCacheHook` under a name of ours. diffusers' own ``cache_context``,
``_reset_stateful_cache`` and ``disable_cache`` reach it as they reach the stock hooks, so
contexts ("cond", "uncond"), resets and removal have the stock semantics (FasterCache's
state, as the stock one's, ignores contexts); the forward stays `fd.apply` (no hooks on
modules: the attention-level caches hook the block functions' attention inside the step).
Configs it cannot honour raise a ``ValueError`` naming them.
"""

from __future__ import annotations

import re

import diffusers
import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    HookRegistry,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
)
from diffusers.hooks.faster_cache import (
    _FASTER_CACHE_BLOCK_HOOK,
    _FASTER_CACHE_DENOISER_HOOK,
    FasterCacheBlockHook,
    FasterCacheDenoiserHook,
)
from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK
from diffusers.hooks.hooks import BaseState, CacheContext, ModelHook, StateManager
from diffusers.hooks.mag_cache import _MAG_CACHE_LEADER_BLOCK_HOOK
from diffusers.hooks.pyramid_attention_broadcast import _PYRAMID_ATTENTION_BROADCAST_HOOK, PyramidAttentionBroadcastHook
from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK, _TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.utils import logging

from ... import api as _api
from ...api import apply
from .. import cache as _cache

_LOG = logging.get_logger("functional_dit.pipelines.cache")
# The step's hook where the stock registers diffusers' hook objects of its own (PAB, FasterCache):
# those are registered too, as state views (`_stock_views`), and the step runs under this name.
STEP_HOOK = "functional_dit_step_cache"
# The stock hook each of our caches stands in for (what diffusers' disable_cache removes).
HOOK_NAMES = {
    _cache.FirstBlockCache: _FBC_LEADER_BLOCK_HOOK,
    _cache.TaylorSeer: _TAYLORSEER_CACHE_HOOK,
    _cache.MagCache: _MAG_CACHE_LEADER_BLOCK_HOOK,
    _cache.FasterCache: STEP_HOOK,
}
_FASTER_FORMATS = ("BCFHW", "BFCHW", "BCHW")  # the tensor formats the stock FasterCache accepts


def from_diffusers_config(config, module=None):
    """Our cache config for a diffusers one: ``FirstBlockCacheConfig``,
    ``TaylorSeerCacheConfig`` (lite mode: on the output; default mode: on the attention
    modules its patterns name), ``MagCacheConfig`` (not calibrating) or
    ``FasterCacheConfig(is_guidance_distilled=True)``. ``module``: the adapter, whose
    attention modules FasterCache's weight callback is given, as the stock one's is."""
    if isinstance(config, FirstBlockCacheConfig):
        return _cache.FirstBlockCache(config.threshold)
    if isinstance(config, TaylorSeerCacheConfig):
        return _taylor(config)
    if isinstance(config, FasterCacheConfig):
        return _faster(config, module)
    if isinstance(config, PyramidAttentionBroadcastConfig):
        return _pab(config)
    if isinstance(config, MagCacheConfig) and not config.calibrate:
        keys = ("threshold", "max_skip_steps", "retention_ratio", "num_inference_steps")
        return _cache.MagCache(tuple(config.mag_ratios.tolist()), **{k: getattr(config, k) for k in keys})
    raise ValueError(
        f"config: {type(config).__name__}{'(calibrate=True)' * bool(getattr(config, 'calibrate', False))} is not "
        "supported by functional_dit's adapter; expected FirstBlockCacheConfig, TaylorSeerCacheConfig, "
        "MagCacheConfig(calibrate=False), FasterCacheConfig(is_guidance_distilled=True) or "
        "PyramidAttentionBroadcastConfig"
    )


def _taylor(config: TaylorSeerCacheConfig) -> _cache.TaylorSeer:
    """Lite mode on the output (user patterns overridden, with the stock warning); the
    default mode on the attention modules of ``cache_identifiers`` (default: the stock
    attention identifiers), ``skip_predict_identifiers`` giving zeros."""
    keys = ("cache_interval", "disable_cache_before_step", "disable_cache_after_step", "max_order")
    kw = {k: getattr(config, k) for k in (*keys, "taylor_factors_dtype")}
    if config.use_lite_mode:
        if config.skip_predict_identifiers or config.cache_identifiers:
            logging.get_logger("diffusers.hooks.taylorseer_cache").warning("Lite mode overrides user patterns.")
        return _cache.TaylorSeer(**kw)
    modules = tuple(config.cache_identifiers or _TRANSFORMER_BLOCK_IDENTIFIERS)
    return _cache.TaylorSeer(**kw, modules=modules, skip_modules=tuple(config.skip_predict_identifiers or ()))


def _faster(config: FasterCacheConfig, module) -> _cache.FasterCache:
    if not config.is_guidance_distilled:
        raise ValueError(
            "config: FasterCacheConfig(is_guidance_distilled=False) is not supported by functional_dit's adapter: "
            "its unconditional-branch approximation splits a [uncond; cond] batch and filters the output's last two "
            "dims as an image, which these models' (B, S, C) token outputs are not; expected is_guidance_distilled=True"
        )
    if config.tensor_format not in _FASTER_FORMATS:
        raise ValueError(f"`tensor_format` must be one of {list(_FASTER_FORMATS)}, but got {config.tensor_format}.")
    callback = config.attention_weight_callback
    weight = 0.5 if callback is None else (lambda name: callback(module.get_submodule(name)))  # stock default 0.5
    return _cache.FasterCache(
        block_skip_range=config.spatial_attention_block_skip_range,
        timestep_skip_range=tuple(config.spatial_attention_timestep_skip_range),
        weight=weight,
        timestep=config.current_timestep_callback,
        modules=tuple(config.spatial_attention_block_identifiers),
    )


def _pab(config: PyramidAttentionBroadcastConfig) -> _cache.FasterCache:
    """Pyramid Attention Broadcast on the spatial attention modules: the stock hook computes a
    module's attention at its first call, outside the timestep range and at every
    ``spatial_attention_block_skip_range``-th call, and returns its last output between:
    FasterCache's schedule (the same decision per call) with weight 0 (``last + (last - the one
    before) x 0`` is ``last``), one state for every call (the stock PAB state ignores contexts).
    These models have no temporal blocks and no cross-attention modules (their attention is
    joint: the stock hooks none of them for those ranges), so a temporal or cross range hooks
    nothing, as stock; none at all is the stock default (spatial 2, with its warning)."""
    skip = config.spatial_attention_block_skip_range
    if skip is None and config.temporal_attention_block_skip_range is None:
        if config.cross_attention_block_skip_range is None:
            logging.get_logger("diffusers.hooks.pyramid_attention_broadcast").warning(
                "Pyramid Attention Broadcast requires one or more of `spatial_attention_block_skip_range`, "
                "`temporal_attention_block_skip_range` or `cross_attention_block_skip_range` parameters to be set to "
                "an integer, not `None`. Defaulting to using `spatial_attention_block_skip_range=2`. To avoid this "
                "warning, please set one of the above parameters."
            )
            skip = config.spatial_attention_block_skip_range = 2
    return _cache.FasterCache(
        block_skip_range=skip,
        timestep_skip_range=tuple(config.spatial_attention_timestep_skip_range),
        weight=0.0,
        timestep=config.current_timestep_callback,
        modules=tuple(config.spatial_attention_block_identifiers),
    )


def _check_modules(cache, module) -> None:
    """TaylorSeer patterns that name modules other than attention modules cannot be
    honoured (the adapter hooks attention modules only), nor patterns that leave no module
    hooked (no cache at all): a ValueError naming them."""
    if not isinstance(cache, _cache.TaylorSeer) or cache.modules is None:
        return
    names = [n for n, _ in module.named_modules() if n]
    attention = {n for n, m in module.named_modules() if hasattr(m, "set_processor")}
    patterns = (*cache.modules, *cache.skip_modules)
    for p in patterns:
        other = [n for n in names if n not in attention and re.fullmatch(p, n)]
        if other:
            raise ValueError(
                f"config: TaylorSeerCacheConfig pattern {p!r} matches {other[0]!r}, which is not an attention "
                "module; functional_dit's adapter caches attention module outputs only"
            )
    if not any(re.fullmatch(p, n) for p in patterns for n in attention):
        raise ValueError(
            f"config: TaylorSeerCacheConfig patterns {list(patterns)} match none of the attention modules "
            f"({', '.join(sorted(attention)[:3])}, ...)"
        )


# ----------------------------------------------------------------------------- diffusers' hook objects


def _unwrap(outs: tuple):
    """A module's output as the stock module returns it: one tensor, or the tuple of them."""
    return outs[0] if len(outs) == 1 else outs


class _View:
    """A diffusers hook class registered for its state only: its forward passes through (the
    adapter computes attention inside ``fd.apply``, never by calling the module it sits on),
    and `show` sets its stock state from the step cache's after each step."""

    def new_forward(self, module, *args, **kwargs):
        return self.fn_ref.original_forward(*args, **kwargs)


class PyramidAttentionBroadcastView(_View, PyramidAttentionBroadcastHook):
    """diffusers' ``PyramidAttentionBroadcastHook`` on an attention module PAB hooks; its
    ``state``: ``iteration`` (the module's calls so far) and ``cache`` (its last output)."""

    def show(self, value, name: str) -> None:
        self.state.iteration, self.state.cache = value.iteration, _unwrap(value.outputs[name][1])


class FasterCacheBlockView(_View, FasterCacheBlockHook):
    """diffusers' ``FasterCacheBlockHook`` on an attention module FasterCache hooks; its
    ``state``: ``iteration``, ``batch_size`` (the first call's) and ``cache`` (the module's
    last two outputs, oldest first)."""

    def show(self, value, name: str) -> None:
        before, last = value.outputs[name]
        if self.state.batch_size is None:
            self.state.batch_size = last[0].shape[0]
        self.state.iteration, self.state.cache = value.iteration, [_unwrap(before), _unwrap(last)]


class FasterCacheDenoiserView(_View, FasterCacheDenoiserHook):
    """diffusers' ``FasterCacheDenoiserHook`` on the model; its ``state``: ``iteration``
    (the model's calls so far; the frequency deltas stay None, as for a guidance-distilled
    model)."""

    def show(self, value, name: str) -> None:
        self.state.iteration = value.iteration


def _stock_views(config, cache, module) -> list[tuple[str, str, _View]]:
    """``(module name, hook name, hook)`` of the diffusers hook objects the stock
    ``enable_cache(config)`` registers that ``cache`` (our `_faster` / `_pab` of ``config``)
    has the state of: PAB's on the attention modules it hooks; FasterCache's on the model ("")
    and the attention modules. None for the other configs (their stock hooks sit on whole
    blocks, which the adapter runs inside ``fd.apply``)."""
    if not isinstance(cache, _cache.FasterCache) or cache.block_skip_range is None:
        return []
    hooked = [n for n, m in module.named_modules() if hasattr(m, "set_processor") and _matches(cache.modules, n)]
    skip, when, now = cache.block_skip_range, cache.timestep_skip_range, config.current_timestep_callback
    if isinstance(config, PyramidAttentionBroadcastConfig):
        return [(n, _PYRAMID_ATTENTION_BROADCAST_HOOK, PyramidAttentionBroadcastView(when, skip, now)) for n in hooked]
    weight = config.attention_weight_callback or (lambda _: 0.5)
    model = FasterCacheDenoiserView(
        config.unconditional_batch_skip_range,
        config.unconditional_batch_timestep_skip_range,
        config.tensor_format,
        True,
        config._unconditional_conditional_input_kwargs_identifiers,
        now,
        config.low_frequency_weight_callback,
        config.high_frequency_weight_callback,
    )
    blocks = [(n, _FASTER_CACHE_BLOCK_HOOK, FasterCacheBlockView(skip, when, True, weight, now)) for n in hooked]
    return [("", _FASTER_CACHE_DENOISER_HOOK, model), *blocks]


def _matches(patterns, name: str) -> bool:
    """Whether a module name matches one of the patterns as the stock hooks match (``re.search``)."""
    return any(re.search(p, name) for p in patterns)


class _State(BaseState):
    """One context's cache state (`functional_dit.pipelines.cache`'s immutable value)."""

    def __init__(self, cache):
        self.cache, self.value = cache, _cache.init(cache)

    def reset(self) -> None:
        self.value = _cache.init(self.cache)


class StepCacheHook(ModelHook):
    """The adapter's step cache as a stateful diffusers hook: a `StateManager` of one state
    per ``cache_context`` name (FasterCache: one state for all, as the stock hooks hold);
    the forward itself is left alone (the adapter's forward runs the step through
    `CacheHooks.cached_apply`). ``views``: ``(module name, hook)`` of the diffusers hook
    objects showing its state (`_stock_views`), set after every step and reset with it."""

    _is_stateful = True

    def __init__(self, cache, views=()):
        super().__init__()
        self.cache, self.views = cache, tuple(views)
        self.state_manager = StateManager(_State, init_args=(cache,))
        self.shared = _State(cache) if isinstance(cache, _cache.FasterCache) else None

    def reset_state(self, module):
        self.state_manager.reset()
        if self.shared is not None:
            self.shared.reset()
        for _, view in self.views:
            view.state.reset()
        for key in ("_branch", "_auto", "_warned"):
            self.__dict__.pop(key, None)
        return module

    def show(self, value) -> None:
        """Set the views' stock states from ``value``, the state after a step."""
        for name, view in self.views:
            view.show(value, name)

    def state(self, t=None) -> _State:
        """The current context's state. MagCache without one (FluxInpaintPipeline and
        FluxKontextPipeline open none) decides per CFG branch: the n-th call at the same
        timestep ``t`` gets its own state (``"inference"``, ``"inference/1"``, ...), as
        `fd.sample` decides per CFG half and as the stock hook does where a pipeline opens
        "cond" / "uncond" contexts; the stock hook without contexts shares ``"inference"``
        between the cond and uncond calls (a warning says so, once per run)."""
        if self.shared is not None:
            return self.shared
        ctx = self.state_manager._context
        if isinstance(self.cache, _cache.MagCache) and (ctx is None or ctx is self.__dict__.get("_auto")):
            self.state_manager.set_context(self._branch_context(t))
        return self.state_manager.get_state()  # diffusers' "No cache context is set" otherwise

    def _branch_context(self, t) -> CacheContext:
        last, n = self.__dict__.get("_branch", (None, -1))
        n = n + 1 if last is not None and t is not None and last.shape == t.shape and torch.equal(last, t) else 0
        self.__dict__["_branch"] = (None if t is None else t.detach().clone(), n)
        if n == 1 and not self.__dict__.get("_warned"):
            self.__dict__["_warned"] = True
            _LOG.warning(
                "MagCache with true CFG and no cache_context (this pipeline opens none): functional_dit's adapter "
                "decides per CFG branch (one MagCache state for the conditional call, one for the unconditional), as "
                "fd.sample does; diffusers' MagCache hook on the stock transformer shares one state between the two "
                "calls here, so its images differ (docs/caching.md)"
            )
        self.__dict__["_auto"] = CacheContext(name="inference" if n == 0 else f"inference/{n}")
        return self.__dict__["_auto"]


class CacheHooks(diffusers.CacheMixin):
    """diffusers' ``CacheMixin`` whose ``enable_cache`` maps the config onto our caches and
    registers a `StepCacheHook`; ``disable_cache``, ``cache_context`` and
    ``_reset_stateful_cache`` are diffusers' own. The adapter's forward calls `cached_apply`."""

    def enable_cache(self, config) -> None:
        if self.is_cache_enabled:
            raise ValueError(f"Caching has already been enabled with {type(self._cache_config)}; disable it first.")
        _cache.check_family(_api.family(self.params), "config")  # a family without stages has no step cache
        cache = from_diffusers_config(config, self)
        _check_modules(cache, self)
        registry = HookRegistry.check_if_exists_or_initialize(self)
        views = _stock_views(config, cache, self)
        pab = isinstance(config, PyramidAttentionBroadcastConfig)  # the stock PAB registers no hook on the model
        registry.register_hook(
            StepCacheHook(cache, [(n, h) for n, _, h in views]), STEP_HOOK if pab else HOOK_NAMES[type(cache)]
        )
        for module_name, hook_name, hook in views:
            HookRegistry.check_if_exists_or_initialize(self.get_submodule(module_name)).register_hook(hook, hook_name)
        registry.invalidate_child_registries_cache()
        self._cache_config = config

    def disable_cache(self) -> None:
        """diffusers' ``disable_cache`` (the stock hooks' names removed), and our step's hook."""
        registry = self.__dict__.get("_diffusers_hook")
        if self.is_cache_enabled and registry is not None:
            registry.remove_hook(STEP_HOOK, recurse=False)
        super().disable_cache()

    def step_cache_hook(self) -> StepCacheHook | None:
        """The registered `StepCacheHook`, None when no cache is enabled."""
        registry = self.__dict__.get("_diffusers_hook")
        names = dict.fromkeys((*HOOK_NAMES.values(), STEP_HOOK))
        hooks = [registry.get_hook(n) for n in names] if registry is not None else []
        return next((h for h in hooks if isinstance(h, StepCacheHook)), None)

    def cached_apply(self, params, x, t, txt, lora=None, checkpoint: bool = False, **kwargs):
        """`fd.apply`, or with a cache enabled one cached step in the current context's state
        (``lora``, the adapter's on-the-fly LoRA pairs, in both)."""
        hook = self.step_cache_hook()
        if hook is None:
            return apply(params, x, t, txt, lora=lora, checkpoint=checkpoint, **kwargs)
        if checkpoint and torch.is_grad_enabled():
            raise ValueError("enable_cache: step caching with gradient checkpointing under autograd is not supported")
        state = hook.state(t)  # LoRA on the fly: the step applies it in every block it runs, as fd.apply
        out, state.value = _cache.step(params, hook.cache, state.value, x, t, txt, lora=lora, **kwargs)
        hook.show(state.value)
        return out

"""Step caching: fewer transformer block calls per image, as pure steps over an explicit state.

``out, state = step(params, cache, state, x, t, txt, branches=n, **apply_kwargs)`` is
`fd.apply` with a cache: ``cache`` is one of the configs below, ``state`` the value the
previous step returned (`init` for the first), ``branches`` how many equal groups of
batch items share a decision (2 for [cond; uncond] with CFG). Each method mirrors the
diffusers 0.42 hook of the same name (``diffusers.hooks``); docs/caching.md says what
is reproduced and how:

- `FirstBlockCache` (``FirstBlockCacheConfig``): run block 0; if the mean absolute
  change of its image residual since the last *computed* step, relative to that
  residual's mean magnitude, is at most ``threshold``, reuse the last computed
  residual of the other blocks instead of running them. Decided per branch: in one
  call the rest of the network runs for the branches that compute only.
- `TaylorSeer` (``TaylorSeerCacheConfig(use_lite_mode=True)``): on the steps its
  warm-up/interval schedule computes, run the model and update Taylor factors of its
  output; on the others, extrapolate the output and run no block at all.
- `MagCache` (``MagCacheConfig``): skip every block while the accumulated error of the
  calibrated magnitude ratios stays under ``threshold``, reusing the last computed
  residual of the whole block stack.

Under a mesh every rank holds its local part of the state (sp rows, dp items); the
First-Block metric is summed over sp and dp (one small all-reduce per axis) so that
every rank takes the same decision; TaylorSeer and MagCache decide from the step count
alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import NamedTuple

import torch

import sharding

from .. import api as _api
from ..nn import fused as _fuse
from ..nn import kernels as _kernels
from . import _stages

# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class FirstBlockCache:
    """First-Block Cache; ``threshold`` on the relative mean-absolute change of block 0's
    image residual (diffusers' ``FirstBlockCacheConfig``)."""

    threshold: float = 0.05

    def __post_init__(self):
        _check_number("threshold", self.threshold, 0.0)


@dataclasses.dataclass(frozen=True)
class TaylorSeer:
    """TaylorSeer on the model output (diffusers' ``TaylorSeerCacheConfig`` with
    ``use_lite_mode=True``): compute for steps < ``disable_cache_before_step``, then every
    ``cache_interval``-th step, and from ``disable_cache_after_step`` on; extrapolate to
    order ``max_order`` between, with factors stored in ``taylor_factors_dtype``."""

    cache_interval: int = 5
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1
    taylor_factors_dtype: torch.dtype | None = torch.bfloat16

    def __post_init__(self):
        _check_int("cache_interval", self.cache_interval, 1)
        _check_int("disable_cache_before_step", self.disable_cache_before_step, 1)
        _check_int("max_order", self.max_order, 0)
        if self.disable_cache_after_step is not None:
            _check_int("disable_cache_after_step", self.disable_cache_after_step, 0)
        dtype = self.taylor_factors_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"taylor_factors_dtype: expected a floating torch.dtype or None, got {dtype!r}")


@dataclasses.dataclass(frozen=True)
class MagCache:
    """MagCache (diffusers' ``MagCacheConfig``): ``mag_ratios`` the calibrated per-step
    magnitude ratios (interpolated to ``num_inference_steps`` as diffusers does; None:
    the sampling run's number of steps, set by `CacheRun.start`)."""

    mag_ratios: tuple
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    num_inference_steps: int | None = None

    def __post_init__(self):
        _check_number("threshold", self.threshold, 0.0)
        _check_int("max_skip_steps", self.max_skip_steps, 0)
        _check_number("retention_ratio", self.retention_ratio, 0.0)
        if self.num_inference_steps is not None:
            _check_int("num_inference_steps", self.num_inference_steps, 1)
        ratios = torch.as_tensor(self.mag_ratios, dtype=torch.float32).flatten()
        if ratios.numel() == 0:
            raise ValueError(f"mag_ratios: expected calibrated per-step ratios, got {self.mag_ratios!r}")
        object.__setattr__(self, "mag_ratios", tuple(float(r) for r in ratios))

    def ratios(self) -> torch.Tensor:
        """The ratios at ``num_inference_steps`` points, nearest-interpolated (float32)."""
        src = torch.tensor(self.mag_ratios, dtype=torch.float32)
        n = self.num_inference_steps
        if len(src) == n:
            return src
        if n == 1:
            return src[-1:]
        grid = torch.arange(n, dtype=torch.float32) * ((len(src) - 1) / (n - 1))
        return src[torch.round(grid).long()]


METHODS = {"fbcache": FirstBlockCache, "taylorseer": TaylorSeer, "magcache": MagCache}


def _check_number(name, v, lo) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo:
        raise ValueError(f"{name}: expected a number >= {lo}, got {v!r}")


def _check_int(name, v, lo) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")


def check(cache):
    """``cache`` as a config: a config itself, or a spec ``"fbcache:0.08"``,
    ``"taylorseer:interval=4,warmup=2,order=1"``, ``"magcache:0.06"`` (see `parse`)."""
    if isinstance(cache, str):
        return parse(cache)
    if not isinstance(cache, tuple(METHODS.values())):
        raise ValueError(
            f"cache: expected FirstBlockCache, TaylorSeer, MagCache or a spec such as 'fbcache:0.08', got {cache!r}"
        )
    return cache


_SPEC_KEYS = {
    "taylorseer": {
        "interval": "cache_interval",
        "warmup": "disable_cache_before_step",
        "until": "disable_cache_after_step",
        "order": "max_order",
        "dtype": "taylor_factors_dtype",
    },
    "magcache": {
        "threshold": "threshold",
        "max_skip": "max_skip_steps",
        "retention": "retention_ratio",
        "steps": "num_inference_steps",
    },
    "fbcache": {"threshold": "threshold"},
}


def parse(spec: str):
    """A config from ``"method[:value][,key=value...]"``: ``fbcache:0.08`` (threshold),
    ``taylorseer:interval=4,warmup=2,order=2,dtype=float32``, ``magcache:0.1,max_skip=2``
    (FLUX's published ratios, diffusers' ``FLUX_MAG_RATIOS``)."""
    method, _, rest = spec.partition(":")
    if method not in METHODS:
        raise ValueError(f"cache: expected one of {sorted(METHODS)}[:options], got {spec!r}")
    kw = {}
    for i, item in enumerate(p for p in rest.split(",") if p):
        key, eq, value = item.partition("=")
        if not eq and i == 0 and method != "taylorseer":
            key, value = "threshold", item
        if key not in _SPEC_KEYS[method]:
            raise ValueError(f"cache: {method} takes {sorted(_SPEC_KEYS[method])}, got {key!r} in {spec!r}")
        kw[_SPEC_KEYS[method][key]] = _spec_value(key, value, spec)
    if method == "magcache":
        kw.setdefault("mag_ratios", FLUX_MAG_RATIOS)
    return METHODS[method](**kw)


def label(cache) -> str:
    """The short spec `parse` reads back: ``fbcache:0.08``, ``taylorseer:interval=5,...``."""
    if isinstance(cache, FirstBlockCache):
        return f"fbcache:{cache.threshold:g}"
    if isinstance(cache, TaylorSeer):
        until = "" if cache.disable_cache_after_step is None else f",until={cache.disable_cache_after_step}"
        dtype = str(cache.taylor_factors_dtype).removeprefix("torch.")
        return (f"taylorseer:interval={cache.cache_interval},warmup={cache.disable_cache_before_step},"
                f"order={cache.max_order}{until},dtype={dtype}")  # fmt: skip
    steps = "" if cache.num_inference_steps is None else f",steps={cache.num_inference_steps}"
    return f"magcache:{cache.threshold:g},max_skip={cache.max_skip_steps},retention={cache.retention_ratio:g}{steps}"


def _spec_value(key: str, value: str, spec: str):
    try:
        if key == "dtype":
            return getattr(torch, value) if isinstance(getattr(torch, value, None), torch.dtype) else value
        return float(value) if key in ("threshold", "retention") else int(value)
    except ValueError:
        raise ValueError(f"cache: {key}={value!r} is not a number in {spec!r}") from None


# MagCache's published FLUX.1-dev ratios (the MagCache authors', shipped in diffusers as
# ``diffusers.hooks.mag_cache.FLUX_MAG_RATIOS``); calibrate per model and scheduler.
FLUX_MAG_RATIOS = (1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344, 1.03125)
FLUX_MAG_RATIOS += (1.02344, 0.98047, 1.01562, 1.00781, 1.0, 1.00781, 1.0, 1.00781, 1.0, 1.0, 0.99609)
FLUX_MAG_RATIOS += (0.99609, 0.98047, 0.98828, 0.96484, 0.95703, 0.93359, 0.89062)


# ----------------------------------------------------------------------------- states


class FBCState(NamedTuple):
    """Block 0's image residual and the other blocks' image residual (rest output - block
    0 output) of each item's last computed step (local view; None before any), and per
    step the per-branch decisions (True = computed)."""

    head: torch.Tensor | None = None
    tail: torch.Tensor | None = None
    log: tuple = ()


class TaylorState(NamedTuple):
    """Step counter, the step of the last update, the Taylor factors of the output
    (order 0, 1, ...), the per-step decisions and the output dtype."""

    step: int = -1
    last: int | None = None
    factors: tuple = ()
    log: tuple = ()
    dtype: torch.dtype | None = None


class MagState(NamedTuple):
    """The step within the run, MagCache's accumulators, the last computed residual of the
    block stack and the per-step decisions."""

    step: int = 0
    ratio: object = 1.0
    steps: int = 0
    err: object = 0.0
    residual: torch.Tensor | None = None
    log: tuple = ()


_STATES = {FirstBlockCache: FBCState, TaylorSeer: TaylorState, MagCache: MagState}


def init(cache):
    """The state before the first step."""
    return _STATES[type(check(cache))]()


def decisions(state) -> tuple:
    """Per step, per branch: True where the step ran the full network."""
    return state.log


# ----------------------------------------------------------------------------- apply


def step(params, cache, state, x, t, txt, *, branches: int = 1, **kwargs):
    """`fd.apply` with ``cache``: returns ``(out, new_state)``. The batch is ``branches``
    equal groups (e.g. [cond; uncond]), each with its own decision."""
    cache = check(cache)
    if not isinstance(state, _STATES[type(cache)]):
        raise ValueError(f"state: expected a {_STATES[type(cache)].__name__} for {type(cache).__name__}, got {state!r}")
    fam = _api.family(params)
    kwargs = _api._family_args(fam, kwargs)
    if kwargs.get("kv_cache") is not None:
        raise ValueError("kv_cache: step caching does not combine with FLUX.2's reference KV cache; expected None")
    if not isinstance(branches, int) or branches < 1 or x.shape[0] % branches:
        raise ValueError(f"branches: expected a positive divisor of the batch {x.shape[0]}, got {branches!r}")
    local, mesh = sharding.local_view(params)
    with sharding.bind(mesh) if mesh is not None else contextlib.nullcontext():
        return _step_local(fam, local, cache, state, x, t, txt, kwargs, branches)


def _step_local(fam, params, cache, state, x, t, txt, kwargs, branches):
    """`_api._apply_local` with the cache between the stages: prepare, dp split, step, gathers."""
    inputs = fam.check_inputs(params, x, t, txt, **kwargs)
    B = x.shape[0]
    x, t, txt = (sharding.shard(a, "dp", 0) for a in (x, t, txt))
    inputs = {k: sharding.shard(v, "dp", 0) if k in fam.BATCHED and v is not None else v for k, v in inputs.items()}
    info = _Items(B, branches)
    fast = _fuse.active(params, fam.FUSED, (x, t, txt, inputs))
    with _kernels.fast_kernels(fast):
        stages = lambda: _stages.STAGES[fam](params, x, t, txt, **inputs)  # noqa: E731
        out, state = _STEP[type(cache)](cache, state, stages, info)
    return sharding.gather(sharding.gather(out, "sp", 1, x.shape[1]), "dp", 0, B), state


class _Items:
    """This rank's batch items: each one's branch (-1 for dp padding)."""

    def __init__(self, B: int, branches: int):
        chunk, start = sharding.local_len(B, "dp"), sharding.axis_index("dp") * sharding.local_len(B, "dp")
        per = B // branches
        self.n = branches
        self.branch = [g // per if g < B else -1 for g in range(start, start + chunk)]

    def computes(self, per_branch) -> list[bool]:
        """Per local item: does it compute? dp padding follows the real items when they agree."""
        real = [per_branch[b] for b in self.branch if b >= 0]
        pad = bool(real) and all(real)
        return [per_branch[b] if b >= 0 else pad for b in self.branch]


# ----------------------------------------------------------------------------- First-Block Cache


def _fbc_step(cache: FirstBlockCache, state: FBCState, stages, info: _Items):
    s = stages()
    if len(s.blocks) < 2:
        raise ValueError("cache: First-Block Cache needs a model with at least 2 blocks")
    img0 = s.image(s.streams)
    head = s.run(s.streams, s.blocks[:1])
    img1 = s.image(head)
    r = img1 - img0
    if state.head is None:
        per_branch = [True] * info.n
    else:
        num, den = branch_sums(r, state.head, info, s.seq)
        per_branch = [bool(n / d > cache.threshold) for n, d in zip(num.tolist(), den.tolist())]
    computes = info.computes(per_branch)
    rest = _rest_image(s, head, img1, computes)
    log = state.log + (tuple(per_branch),)
    if all(computes):
        return s.final(rest, s.ctx), FBCState(r, rest - img1, log)
    mask = torch.tensor(computes, device=r.device).view(-1, 1, 1)
    final = torch.where(mask, rest, state.tail + img1)
    new = FBCState(torch.where(mask, r, state.head), torch.where(mask, rest - img1, state.tail), log)
    return s.final(final, s.ctx), new


def _rest_image(s, head: tuple, img1: torch.Tensor, computes: list[bool]) -> torch.Tensor:
    """The image rows after the last block for the items that compute (block 0's output
    elsewhere): the rest of the network on all items, a subset or none."""
    if all(computes):
        return s.image(s.run(head, s.blocks[1:]))
    if not any(computes):
        return img1
    idx = torch.tensor([i for i, c in enumerate(computes) if c], device=img1.device)
    sub = s.run(_stages.take_streams(head, idx), s.blocks[1:], s.take(idx))
    return img1.index_copy(0, idx, s.image(sub))


def branch_sums(r, prev, info: _Items, seq: int, reduce: bool = True):
    """Per branch: sum |r - prev| and sum |prev| over its items' real image rows (float64),
    summed over the sp and dp ranks (``reduce``) so that every rank sees the whole."""
    chunk = r.shape[1]
    valid = max(0, min(chunk, seq - sharding.axis_index("sp") * chunk))  # sp padding rows excluded
    num = (r - prev).abs()[:, :valid].double().sum((1, 2))
    den = prev.abs()[:, :valid].double().sum((1, 2))
    sums = torch.zeros(2, info.n, dtype=torch.float64, device=r.device)
    for i, b in enumerate(info.branch):
        if b >= 0:
            sums[0, b] += num[i]
            sums[1, b] += den[i]
    if reduce:
        sums = sharding.psum(sharding.psum(sums, "sp"), "dp")
    return sums[0], sums[1]


# ----------------------------------------------------------------------------- TaylorSeer


def _taylor_step(cache: TaylorSeer, state: TaylorState, stages, info: _Items):
    i = state.step + 1
    warm = i < cache.disable_cache_before_step
    on_interval = (i - cache.disable_cache_before_step - 1) % cache.cache_interval == 0
    cool = cache.disable_cache_after_step is not None and i >= cache.disable_cache_after_step
    compute = warm or on_interval or cool
    log = state.log + ((compute,) * info.n,)
    if compute:
        s = stages()
        out = s.final(s.image(s.run(s.streams, s.blocks)), s.ctx)
        return out, TaylorState(i, i, _taylor_update(cache, state, out, i), log, out.dtype)
    if state.last is None:
        raise ValueError(f"cache: {cache} would predict step {i} before any computed step")
    return _taylor_predict(state.factors, i - state.last, state.dtype), state._replace(step=i, log=log)


def _taylor_update(cache: TaylorSeer, state: TaylorState, out: torch.Tensor, i: int) -> tuple:
    """Factors [out, finite differences / step distance, ...] up to ``max_order``, stored in
    ``taylor_factors_dtype`` (differences taken against the stored, rounded factors)."""
    new = [out]
    if state.last is not None:
        for j in range(cache.max_order):
            if j >= len(state.factors) or state.factors[j].shape != new[j].shape:
                break
            new.append((new[j] - state.factors[j].to(out.dtype)) / (i - state.last))
    dtype = cache.taylor_factors_dtype or out.dtype
    return tuple(f.to(dtype) for f in new)


def _taylor_predict(factors: tuple, offset: int, dtype) -> torch.Tensor:
    """sum_k factor_k offset^k / k!, accumulated in the output dtype."""
    out = torch.zeros_like(factors[0], dtype=dtype)
    for order, f in enumerate(factors):
        out = out + f.to(dtype) * ((offset**order) / math.factorial(order))
    return out


# ----------------------------------------------------------------------------- MagCache


def _mag_decide(cache: MagCache, state: MagState) -> tuple[bool, MagState]:
    """MagCache's schedule: accumulate the ratios after the retention steps; skip while the
    error and the run of skipped steps stay within bounds, else compute and start over."""
    if cache.num_inference_steps is None:
        raise ValueError("cache: MagCache needs num_inference_steps (fd.sample sets it to its steps)")
    i, ratios = state.step, cache.ratios()
    scale = ratios[i] if i < len(ratios) else 1.0
    if i < int(cache.retention_ratio * cache.num_inference_steps + 0.5):
        return True, state
    ratio = state.ratio * scale
    err, n = state.err + abs(1.0 - ratio), state.steps + 1
    if state.residual is not None and err <= cache.threshold and n <= cache.max_skip_steps:
        return False, state._replace(ratio=ratio, steps=n, err=err)
    return True, state._replace(ratio=1.0, steps=0, err=0.0)


def _mag_step(cache: MagCache, state: MagState, stages, info: _Items):
    compute, state = _mag_decide(cache, state)
    s = stages()
    img0 = s.image(s.streams)
    if compute:
        img = s.image(s.run(s.streams, s.blocks))
        state = state._replace(residual=img - img0)
    else:
        img = img0 + state.residual
    state = state._replace(step=state.step + 1, log=state.log + ((compute,) * info.n,))
    if state.step >= cache.num_inference_steps:  # the run is over: start afresh, keep the log
        state = MagState(log=state.log)
    return s.final(img, s.ctx), state


_STEP = {FirstBlockCache: _fbc_step, TaylorSeer: _taylor_step, MagCache: _mag_step}


# ----------------------------------------------------------------------------- sampling runs


class CacheRun:
    """A step cache through one sampling run (what `fd.sample` carries): the config, the
    state after the last step (``state``) and so every step's decisions (``decisions``)."""

    def __init__(self, cache):
        self.config = self._given = check(cache)
        self.state, self.branches = init(self.config), 1

    @classmethod
    def of(cls, cache, kv: bool = False):
        """None for no cache, else a run (``cache`` itself when it is one)."""
        if cache is None:
            return None
        if kv:
            raise ValueError(
                "cache: step caching does not combine with FLUX.2's reference KV cache; pass kv_cache=False"
            )
        return cache if isinstance(cache, cls) else cls(cache)

    def start(self, branches: int = 1, steps: int | None = None):
        """A fresh state for a run of ``steps`` steps whose batch is ``branches`` groups
        (a MagCache without ``num_inference_steps`` takes ``steps``); returns `apply`."""
        self.config = self._given
        if isinstance(self.config, MagCache) and self.config.num_inference_steps is None and steps is not None:
            self.config = dataclasses.replace(self.config, num_inference_steps=steps)
        self.state, self.branches = init(self.config), branches
        return self.apply

    def apply(self, params, x, t, txt, **kwargs) -> torch.Tensor:
        """`fd.apply`'s signature: one cached step, the new state kept."""
        out, self.state = step(params, self.config, self.state, x, t, txt, branches=self.branches, **kwargs)
        return out

    @property
    def decisions(self) -> tuple:
        """Per step, per branch: True where the full network ran."""
        return self.state.log

    def skipped(self) -> int:
        """Branch-steps that did not run the full network."""
        return sum(not c for d in self.decisions for c in d)

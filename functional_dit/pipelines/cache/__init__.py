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
- `TaylorSeer` with ``modules`` (``TaylorSeerCacheConfig()``, its default mode): the same
  schedule, but what is extrapolated is each attention module's output, inside the
  blocks; the rest of every block is computed.
- `FasterCache` (``FasterCacheConfig`` of a guidance-distilled model): within a timestep
  range, each attention module's output is computed every ``block_skip_range``-th step
  and extrapolated linearly from its last two outputs between.

Every family's forward is its stages (``fam.stages``, `functional_dit.nn.stages`): the
caches run the blocks of those stages, one by one or some of them; the attention-level
caches hook the family's block functions at their attention module (the blocks' ``attn``
argument, every family); the others run whole blocks. A forward with a second output
(FLUX.2's reference KV cache, Qwen-Image 2.1's prefix KV cache, on their extract pass)
returns it beside the output, as `fd.apply` does: an extract pass is the first step of a
run, which every cache computes.

Under a mesh every rank holds its local part of the state (sequence rows over sp and
ring, dp and fsdp items); the First-Block metric is summed over sp, ring, dp and fsdp (one
small all-reduce per axis) so that every rank takes the same decision; TaylorSeer and
MagCache decide from the step count alone, FasterCache from the step count and the
timestep. Fully sharded params: the stages gather each block as ``fd.apply`` does, and a
rank whose items all reuse while others compute joins the blocks' all-gathers
(`nn.stages.Stages.gather_only`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable
from typing import NamedTuple

import torch

import sharding

from ... import api as _api
from ...nn import fused as _fuse
from ...nn import kernels as _kernels
from ...nn import stages as _stages

# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class FirstBlockCache:
    """First-Block Cache; ``threshold`` on the relative mean-absolute change of block 0's
    image residual (diffusers' ``FirstBlockCacheConfig``)."""

    threshold: float = 0.05

    def __post_init__(self):
        _check_number("threshold", self.threshold, 0.0)


# The stock names of the attention modules diffusers' attention-level caches hook by
# default (``diffusers.hooks``' spatial attention identifiers).
ATTENTION = ("^blocks.*attn", "^transformer_blocks.*attn", "^single_transformer_blocks.*attn")


@dataclasses.dataclass(frozen=True)
class TaylorSeer:
    """TaylorSeer (diffusers' ``TaylorSeerCacheConfig``): compute for steps <
    ``disable_cache_before_step``, then every ``cache_interval``-th step, and from
    ``disable_cache_after_step`` on; extrapolate to order ``max_order`` between, with
    factors stored in ``taylor_factors_dtype``. ``modules`` None: on the model output
    (``use_lite_mode=True``); else regex patterns (``re.fullmatch``) of the attention
    modules whose outputs are extrapolated (diffusers' default mode: `ATTENTION`), and
    ``skip_modules`` those that give zeros of their last shape instead (its
    ``skip_predict_identifiers``)."""

    cache_interval: int = 5
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1
    taylor_factors_dtype: torch.dtype | None = torch.bfloat16
    modules: tuple[str, ...] | None = None
    skip_modules: tuple[str, ...] = ()

    def __post_init__(self):
        _check_int("cache_interval", self.cache_interval, 1)
        _check_int("disable_cache_before_step", self.disable_cache_before_step, 1)
        _check_int("max_order", self.max_order, 0)
        if self.disable_cache_after_step is not None:
            _check_int("disable_cache_after_step", self.disable_cache_after_step, 0)
        dtype = self.taylor_factors_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"taylor_factors_dtype: expected a floating torch.dtype or None, got {dtype!r}")
        if self.modules is not None:
            object.__setattr__(self, "modules", _patterns("modules", self.modules))
        object.__setattr__(self, "skip_modules", _patterns("skip_modules", self.skip_modules))
        if self.modules is None and self.skip_modules:
            raise ValueError(f"skip_modules: needs attention modules (modules=...), got {self.skip_modules!r}")


@dataclasses.dataclass(frozen=True)
class FasterCache:
    """FasterCache's attention reuse (diffusers' ``FasterCacheConfig`` with
    ``is_guidance_distilled=True``): while the timestep (``timestep()``, or None: t x 1000)
    lies strictly inside ``timestep_skip_range``, each attention module matching
    ``modules`` (``re.search``) computes at every ``block_skip_range``-th call only, and
    between returns ``last + (last - the one before) x weight`` (``weight``: a number, or
    a function of the module's name). ``block_skip_range`` None: always compute."""

    block_skip_range: int | None = 2
    timestep_skip_range: tuple = (-1, 681)
    weight: float | Callable[[str], float] = 0.5
    timestep: Callable[[], float] | None = None
    modules: tuple[str, ...] = ATTENTION

    def __post_init__(self):
        if self.block_skip_range is not None:
            _check_int("block_skip_range", self.block_skip_range, 1)
        r = self.timestep_skip_range
        if not (isinstance(r, (tuple, list)) and len(r) == 2 and all(_is_number(v) for v in r)):
            raise ValueError(f"timestep_skip_range: expected (low, high) numbers, got {r!r}")
        object.__setattr__(self, "timestep_skip_range", tuple(r))
        if not (callable(self.weight) or _is_number(self.weight)):
            raise ValueError(f"weight: expected a number or a function of the module name, got {self.weight!r}")
        if self.timestep is not None and not callable(self.timestep):
            raise ValueError(f"timestep: expected None or a function returning the timestep, got {self.timestep!r}")
        object.__setattr__(self, "modules", _patterns("modules", self.modules))


def attention_level(cache) -> bool:
    """Whether ``cache`` works on the attention modules inside the blocks."""
    return isinstance(cache, FasterCache) or (isinstance(cache, TaylorSeer) and cache.modules is not None)


def _is_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


def _patterns(name: str, patterns) -> tuple[str, ...]:
    """``patterns`` as a tuple of regex strings (each compiled once to check it)."""
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"{name}: expected a sequence of regex strings, got {patterns!r}")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"{name}: {p!r} is not a regex ({e})") from None
    return tuple(patterns)


@dataclasses.dataclass(frozen=True)
class MagCache:
    """MagCache (diffusers' ``MagCacheConfig``): ``mag_ratios`` the calibrated per-step
    magnitude ratios (interpolated to ``num_inference_steps`` as diffusers does; None:
    the sampling run's number of steps, set by `CacheRun.begin`)."""

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


METHODS = {"fbcache": FirstBlockCache, "taylorseer": TaylorSeer, "magcache": MagCache, "fastercache": FasterCache}


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
        "attention": "modules",
    },
    "fastercache": {"skip": "block_skip_range", "weight": "weight", "low": "low", "high": "high"},
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
    ``taylorseer:interval=4,warmup=2,order=2,dtype=float32`` (``attention=1``: on the
    attention modules), ``magcache:0.1,max_skip=2`` (FLUX's published ratios, diffusers'
    ``FLUX_MAG_RATIOS``), ``fastercache:skip=2,weight=0.5,low=-1,high=681``."""
    method, _, rest = spec.partition(":")
    if method not in METHODS:
        raise ValueError(f"cache: expected one of {sorted(METHODS)}[:options], got {spec!r}")
    kw = {}
    for i, item in enumerate(p for p in rest.split(",") if p):
        key, eq, value = item.partition("=")
        if not eq and i == 0 and method in ("fbcache", "magcache"):
            key, value = "threshold", item
        if key not in _SPEC_KEYS[method]:
            raise ValueError(f"cache: {method} takes {sorted(_SPEC_KEYS[method])}, got {key!r} in {spec!r}")
        kw[_SPEC_KEYS[method][key]] = _spec_value(key, value, spec)
    if method == "magcache":
        kw.setdefault("mag_ratios", FLUX_MAG_RATIOS)
    if "modules" in kw:
        kw["modules"] = ATTENTION if kw["modules"] else None
    if method == "fastercache":
        low, high = FasterCache.timestep_skip_range
        kw["timestep_skip_range"] = (kw.pop("low", low), kw.pop("high", high))
    return METHODS[method](**kw)


def label(cache) -> str:
    """The short spec `parse` reads back: ``fbcache:0.08``, ``taylorseer:interval=5,...``."""
    if isinstance(cache, FirstBlockCache):
        return f"fbcache:{cache.threshold:g}"
    if isinstance(cache, TaylorSeer):
        until = "" if cache.disable_cache_after_step is None else f",until={cache.disable_cache_after_step}"
        dtype = str(cache.taylor_factors_dtype).removeprefix("torch.")
        attention = "" if cache.modules is None else ",attention=1" if cache.modules == ATTENTION else ",modules=..."
        return (f"taylorseer:interval={cache.cache_interval},warmup={cache.disable_cache_before_step},"
                f"order={cache.max_order}{until},dtype={dtype}{attention}")  # fmt: skip
    if isinstance(cache, FasterCache):
        weight = "fn" if callable(cache.weight) else f"{cache.weight:g}"
        low, high = cache.timestep_skip_range
        return f"fastercache:skip={cache.block_skip_range},weight={weight},low={low:g},high={high:g}"
    steps = "" if cache.num_inference_steps is None else f",steps={cache.num_inference_steps}"
    return f"magcache:{cache.threshold:g},max_skip={cache.max_skip_steps},retention={cache.retention_ratio:g}{steps}"


def _spec_value(key: str, value: str, spec: str):
    try:
        if key == "dtype":
            return getattr(torch, value) if isinstance(getattr(torch, value, None), torch.dtype) else value
        return float(value) if key in ("threshold", "retention", "weight", "low", "high") else int(value)
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
    (order 0, 1, ...) — with ``modules``, per attention module name a `ModuleFactors` —,
    the per-step decisions and the output dtype."""

    step: int = -1
    last: int | None = None
    factors: tuple = ()
    log: tuple = ()
    dtype: torch.dtype | None = None
    seq: int | None = None  # the output's full length (the steps that predict gather over sp with it)


class MagState(NamedTuple):
    """The step within the run, MagCache's accumulators, the last computed residual of the
    block stack and the per-step decisions."""

    step: int = 0
    ratio: object = 1.0
    steps: int = 0
    err: object = 0.0
    residual: torch.Tensor | None = None
    log: tuple = ()


class ModuleFactors(NamedTuple):
    """One attention module's TaylorSeer state: per output its factors (order 0, 1, ...),
    dtype and shape, and their device (a skipped module keeps no factors)."""

    factors: tuple = ()
    dtypes: tuple = ()
    shapes: tuple = ()
    device: torch.device | None = None


class FasterState(NamedTuple):
    """Calls so far, per attention module name its last two outputs (each a tuple of
    tensors, local view), and per step the per-branch decisions (True = computed)."""

    iteration: int = 0
    outputs: dict | None = None
    log: tuple = ()


_STATES = {FirstBlockCache: FBCState, TaylorSeer: TaylorState, MagCache: MagState, FasterCache: FasterState}


def init(cache):
    """The state before the first step."""
    return _STATES[type(check(cache))]()


def decisions(state) -> tuple:
    """Per step, per branch: True where the step ran the full network."""
    return state.log


# ----------------------------------------------------------------------------- apply


def step(params, cache, state, x, t, txt, *, branches: int = 1, lora=None, **kwargs):
    """`fd.apply` with ``cache``: returns ``(out, new_state)``. The batch is ``branches``
    equal groups (e.g. [cond; uncond]), each with its own decision. ``lora``: as `fd.apply`'s."""
    cache = check(cache)
    if not isinstance(state, _STATES[type(cache)]):
        raise ValueError(f"state: expected a {_STATES[type(cache)].__name__} for {type(cache).__name__}, got {state!r}")
    check_family(_api.family(params))
    call = _api.prepare_call(params, **kwargs)  # fd.apply's set-up: the one entry into the core
    if not isinstance(branches, int) or branches < 1 or x.shape[0] % branches:
        raise ValueError(f"branches: expected a positive divisor of the batch {x.shape[0]}, got {branches!r}")
    adapters = call.adapters(lora, x.shape[0])
    with sharding.bind(call.mesh) if call.mesh is not None else contextlib.nullcontext():
        local = call.model_params(adapters, x.shape[0])  # LoRA attached; fsdp: blocks gathered as the stages run
        return _step_local(call.fam, local, cache, state, x, t, txt, call.kwargs, branches)


def check_family(fam, name: str = "cache") -> None:
    """A ValueError naming ``name`` for a family whose forward has no stages to cache."""
    if not callable(getattr(fam, "stages", None)):
        raise ValueError(f"{name}: step caching is not supported for {fam.NAME}: its module has no stages()")


def check_no_controlnet(inputs: dict, cache=None) -> None:
    """ControlNet residuals with a step cache: an attention-level cache (TaylorSeer on the
    attention modules, FasterCache) runs every block and adds each block's residual after
    it, as diffusers' hooks leave the stock transformer's residual adds; a block-skipping
    cache (First-Block Cache, MagCache, TaylorSeer on the output) is refused, by choice
    (docs/controlnet.md, "Step caching"). ``cache`` None (the per-item batch): refused."""
    if inputs.get("controlnet") is not None and (cache is None or not attention_level(cache)):
        raise ValueError(
            "controlnet_block_samples: step caching with ControlNet residuals runs with the attention-level caches "
            f"only (TaylorSeer with modules=, FasterCache); expected one of them, got {cache}"
        )


def _step_local(fam, params, cache, state, x, t, txt, kwargs, branches):
    """`fd.apply`'s forward with the cache between the stages: inputs, dp split, step, gathers."""
    inputs = fam.check_inputs(params, x, t, txt, **kwargs)
    check_no_controlnet(inputs, cache)
    B, info = x.shape[0], _Items(x.shape[0], branches, t)
    x, t, txt = (sharding.shard(a, "dp", 0) for a in (x, t, txt))
    inputs = {k: sharding.shard(v, "dp", 0) if k in fam.BATCHED and v is not None else v for k, v in inputs.items()}
    fast = _fuse.active(params, fam.FUSED, (x, t, txt, inputs))
    made = []

    def stages() -> _stages.Stages:
        made.append(fam.stages(params, x, t, txt, **inputs))
        return made[-1]

    with _kernels.fast_kernels(fast):
        out, state = _STEP[type(cache)](cache, state, stages, info)
    seq = made[-1].seq if made else state.seq  # TaylorSeer's predicted steps build no stages
    if isinstance(state, TaylorState) and made:
        state = state._replace(seq=_kept_len(made[-1]))  # the rows its predicted steps give
    out = sharding.gather(sharding.gather(out, "sp", 1, seq), "dp", 0, B)
    extra = made[-1].extra if made else None
    return (out, extra(made[-1].ctx)) if extra is not None else out, state


def _kept(s: _stages.Stages, value):
    """What a cache keeps of a tensor (or tuple of them) of this step for later steps: all
    of it, or on an extract pass (``s.keep``) the trailing rows the later steps compute,
    laid out as they split them: over a sequence split (sp, ring) this rank's chunk of the
    joint rows is gathered, the trailing ``keep`` rows taken and split again (every rank of
    the split takes the same decisions, so every rank calls the gather)."""
    if s.keep is None:
        return value
    if isinstance(value, tuple):
        return tuple(_kept(s, v) for v in value)
    if sharding.split_size("sp") == 1:
        return value[:, value.shape[1] - s.keep :]
    return sharding.shard(sharding.gather(value, "sp", 1, s.seq)[:, s.seq - s.keep :], "sp", 1)


def _kept_len(s: _stages.Stages) -> int:
    """The full length of the rows a cache keeps of a step (`_kept`)."""
    return s.seq if s.keep is None else s.keep


class _Items:
    """This rank's batch items: each one's branch (-1 for dp padding); ``t`` the step's
    times of the whole batch."""

    def __init__(self, B: int, branches: int, t: torch.Tensor):
        chunk = sharding.local_len(B, "dp")  # the batch split: dp x fsdp
        start = sharding.chunk_index("dp") * chunk
        per = B // branches
        self.n, self.t = branches, t
        self.branch = [g // per if g < B else -1 for g in range(start, start + chunk)]

    def timestep(self) -> float:
        """The step's timestep on diffusers' scale (t x 1000, the first item's)."""
        return float(self.t.flatten()[0]) * 1000

    def computes(self, per_branch) -> list[bool]:
        """Per local item: does it compute? dp padding follows the real items when they agree;
        on a rank holding padding only (one image without CFG on dp=2 or fsdp=2), it computes
        when every branch does (on the first step, which has no cached residual to reuse)."""
        real = [per_branch[b] for b in self.branch if b >= 0]
        pad = all(real) if real else all(per_branch)
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
    rest = _rest_image(s, head, img1, computes, any(per_branch))
    log = state.log + (tuple(per_branch),)
    if all(computes):
        return s.final(rest, s.ctx), FBCState(_kept(s, r), _kept(s, rest - img1), log)
    mask = torch.tensor(computes, device=r.device).view(-1, 1, 1)
    final = torch.where(mask, rest, state.tail + img1)
    new = FBCState(torch.where(mask, r, state.head), torch.where(mask, rest - img1, state.tail), log)
    return s.final(final, s.ctx), new


def _rest_image(s, head: tuple, img1: torch.Tensor, computes: list[bool], anywhere: bool) -> torch.Tensor:
    """The image rows after the last block for the items that compute (block 0's output
    elsewhere): the rest of the network on all items, a subset or none. ``anywhere``: some
    rank's items compute (its fully sharded blocks' gathers need this rank too)."""
    if all(computes):
        return s.image(s.run(head, s.blocks[1:]))
    if not any(computes):
        if anywhere:
            s.gather_only(s.blocks[1:])
        return img1
    idx = torch.tensor([i for i, c in enumerate(computes) if c], device=img1.device)
    sub = s.run(_stages.take_streams(head, idx), s.blocks[1:], s.take(idx))
    return img1.index_copy(0, idx, s.image(sub))


def branch_sums(r, prev, info: _Items, seq: int, reduce: bool = True):
    """Per branch: sum |r - prev| and sum |prev| over its items' real image rows (float64),
    summed over the sp, ring and dp ranks (``reduce``) so that every rank sees the whole."""
    chunk = r.shape[1]
    valid = max(0, min(chunk, seq - sharding.chunk_index("sp") * chunk))  # sequence padding rows excluded
    num = (r - prev).abs()[:, :valid].double().sum((1, 2))
    den = prev.abs()[:, :valid].double().sum((1, 2))
    sums = torch.zeros(2, info.n, dtype=torch.float64, device=r.device)
    for i, b in enumerate(info.branch):
        if b >= 0:
            sums[0, b] += num[i]
            sums[1, b] += den[i]
    if reduce:
        for axis in ("sp", "ring", "dp", "fsdp"):
            sums = sharding.psum(sums, axis)
    return sums[0], sums[1]


# ----------------------------------------------------------------------------- TaylorSeer


def _taylor_schedule(cache: TaylorSeer, state: TaylorState) -> tuple[int, bool]:
    """The step index and whether TaylorSeer's warm-up / interval / cool-down computes it."""
    i = state.step + 1
    warm = i < cache.disable_cache_before_step
    on_interval = (i - cache.disable_cache_before_step - 1) % cache.cache_interval == 0
    cool = cache.disable_cache_after_step is not None and i >= cache.disable_cache_after_step
    return i, warm or on_interval or cool


def _taylor_step(cache: TaylorSeer, state: TaylorState, stages, info: _Items):
    if cache.modules is not None:
        return _taylor_modules_step(cache, state, stages, info)
    i, compute = _taylor_schedule(cache, state)
    log = state.log + ((compute,) * info.n,)
    if compute:
        s = stages()
        out = s.final(s.image(s.run(s.streams, s.blocks)), s.ctx)
        factors = _taylor_update(cache, state.factors, state.last, _kept(s, out), i)
        return out, TaylorState(i, i, factors, log, out.dtype)
    if state.last is None:
        raise ValueError(f"cache: {cache} would predict step {i} before any computed step")
    return _taylor_predict(state.factors, i - state.last, state.dtype), state._replace(step=i, log=log)


def _taylor_update(cache: TaylorSeer, factors: tuple, last: int | None, out: torch.Tensor, i: int) -> tuple:
    """Factors [out, finite differences / step distance, ...] up to ``max_order``, stored in
    ``taylor_factors_dtype`` (differences taken against the stored, rounded ``factors``)."""
    new = [out]
    if last is not None:
        for j in range(cache.max_order):
            if j >= len(factors) or factors[j].shape != new[j].shape:
                break
            new.append((new[j] - factors[j].to(out.dtype)) / (i - last))
    dtype = cache.taylor_factors_dtype or out.dtype
    return tuple(f.to(dtype) for f in new)


def _taylor_predict(factors: tuple, offset: int, dtype) -> torch.Tensor:
    """sum_k factor_k offset^k / k!, accumulated in the output dtype."""
    out = torch.zeros_like(factors[0], dtype=dtype)
    for order, f in enumerate(factors):
        out = out + f.to(dtype) * ((offset**order) / math.factorial(order))
    return out


def _taylor_modules_step(cache: TaylorSeer, state: TaylorState, stages, info: _Items):
    """TaylorSeer on the attention modules: every block runs, each hooked attention module
    computes (updating its factors) or is extrapolated (or zeros, for ``skip_modules``)."""
    i, compute = _taylor_schedule(cache, state)
    s = stages()
    skip = {n: any(re.fullmatch(p, n) for p in cache.skip_modules) for n in s.attention}
    names = [n for n in s.attention if skip[n] or any(re.fullmatch(p, n) for p in cache.modules)]
    _require_modules(cache, s, names)
    if not compute and state.last is None:
        raise ValueError(f"cache: {cache} would predict step {i} before any computed step")
    old, new = state.factors or {}, dict(state.factors or {})

    def hook(name):
        def run(module):
            if not compute:
                return _unwrap(_module_predict(old[name], i - state.last, skip[name]))
            outs = module()
            new[name] = _module_update(cache, old.get(name), state.last, _kept(s, _wrap(outs)), i, skip[name])
            return outs

        return run

    hooks = {n: hook(n) for n in names}
    out = s.final(s.image(s.run(s.streams, s.blocks, dict(s.ctx, attn=hooks))), s.ctx)
    log = state.log + ((compute,) * info.n,)
    return out, TaylorState(i, i if compute else state.last, new, log, out.dtype)


def _module_update(cache, prev: ModuleFactors | None, last, outs: tuple, i: int, skip: bool) -> ModuleFactors:
    dtypes, shapes, device = tuple(o.dtype for o in outs), tuple(o.shape for o in outs), outs[0].device
    if skip:
        return ModuleFactors((), dtypes, shapes, device)
    before = prev.factors if prev is not None else ((),) * len(outs)
    factors = tuple(_taylor_update(cache, f, last, o, i) for f, o in zip(before, outs))
    return ModuleFactors(factors, dtypes, shapes, device)


def _module_predict(m: ModuleFactors, offset: int, skip: bool) -> tuple:
    if skip:
        return tuple(torch.zeros(shape, dtype=d, device=m.device) for shape, d in zip(m.shapes, m.dtypes))
    return tuple(_taylor_predict(f, offset, d) for f, d in zip(m.factors, m.dtypes))


def _wrap(outs) -> tuple:
    return (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)


def _unwrap(outs: tuple):
    return outs[0] if len(outs) == 1 else outs


def _require_modules(cache, s, names: list) -> None:
    """A ValueError when the family's blocks take no attention hook, or no module matches."""
    if not s.attention:
        raise ValueError(f"cache: {cache} works inside the blocks; this family's blocks take no attention hook")
    if not names:
        raise ValueError(
            f"cache: {cache} matches none of the model's attention modules ({', '.join(s.attention[:3])}, ...)"
        )


# ----------------------------------------------------------------------------- FasterCache


def _faster_step(cache: FasterCache, state: FasterState, stages, info: _Items):
    """FasterCache's attention reuse: one decision per call (timestep range, iteration);
    a module with no output yet computes."""
    s = stages()
    hooked = cache.block_skip_range is not None
    names = [n for n in s.attention if hooked and any(re.search(p, n) for p in cache.modules)]
    if hooked:
        _require_modules(cache, s, names)
    low, high = cache.timestep_skip_range
    ts = cache.timestep() if cache.timestep is not None else info.timestep()
    n = state.iteration
    reuse = hooked and low < ts < high and not (n > 0 and n % cache.block_skip_range == 0)
    old, new = state.outputs or {}, dict(state.outputs or {})
    weight = cache.weight if callable(cache.weight) else (lambda _: cache.weight)
    computed = []

    def hook(name):
        def run(module):
            prev = old.get(name)
            if reuse and prev is not None:
                outs = tuple(t1 + (t1 - t2) * weight(name) for t2, t1 in zip(*prev))  # a weight per output, as stock
            else:
                outs = _wrap(module())
                computed.append(name)
            kept = _kept(s, outs)
            new[name] = (kept, kept) if prev is None else (prev[1], kept)
            return _unwrap(outs)

        return run

    hooks = {nm: hook(nm) for nm in names}
    out = s.final(s.image(s.run(s.streams, s.blocks, dict(s.ctx, attn=hooks))), s.ctx)
    log = state.log + ((len(computed) == len(names),) * info.n,)
    return out, FasterState(n + 1, new, log)


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
        state = state._replace(residual=_kept(s, img - img0))
    else:
        img = img0 + state.residual
    state = state._replace(step=state.step + 1, log=state.log + ((compute,) * info.n,))
    if state.step >= cache.num_inference_steps:  # the run is over: start afresh, keep the log
        state = MagState(log=state.log)
    return s.final(img, s.ctx), state


_STEP = {FirstBlockCache: _fbc_step, TaylorSeer: _taylor_step, MagCache: _mag_step, FasterCache: _faster_step}


# ----------------------------------------------------------------------------- sampling runs


class CacheRun:
    """A step cache through one sampling run (what `fd.sample` carries): the config, the
    state after the last step (``state``) and so every step's decisions (``decisions``)."""

    def __init__(self, cache):
        self.config = self._given = check(cache)
        self.states = [init(self.config)]

    @property
    def state(self):
        """The state after the last step (with several calls per step: the first call's)."""
        return self.states[0]

    @classmethod
    def of(cls, cache, kv: bool = False):
        """None for no cache, else a run (``cache`` itself when it is one). ``kv`` (a
        reference or prefix KV cache in the run) is accepted: the stages carry it."""
        if cache is None:
            return None
        return cache if isinstance(cache, cls) else cls(cache)

    def begin(self, steps: int | None = None, calls: int = 1):
        """A chunk's (config, state) for a run of ``steps`` steps (a MagCache without
        ``num_inference_steps`` takes ``steps``) that the sampling state carries
        (`functional_dit.pipelines.sampler._state`). ``calls``: the model calls per step,
        one per CFG branch (Qwen-Image 2.1, whose branches have their own token layouts):
        each call then keeps its own state (a tuple of them), as the stock hooks' "cond" /
        "uncond" contexts do."""
        self.config = self._given
        if isinstance(self.config, MagCache) and self.config.num_inference_steps is None and steps is not None:
            self.config = dataclasses.replace(self.config, num_inference_steps=steps)
        self.states = [init(self.config) for _ in range(calls)]
        return self.config, self.states[0] if calls == 1 else tuple(self.states)

    def end(self, state) -> None:
        """Keep a chunk's state after its last step (``state``, ``decisions``)."""
        self.states = list(state) if type(state) is tuple else [state]

    @property
    def decisions(self) -> tuple:
        """Per step, per branch: True where the full network ran."""
        return tuple(tuple(c for d in ds for c in d) for ds in zip(*(st.log for st in self.states)))

    def skipped(self) -> int:
        """Branch-steps that did not run the full network."""
        return sum(not c for d in self.decisions for c in d)

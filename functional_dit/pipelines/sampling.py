"""``functional_dit.sampling``: text-to-image sampling as an explicit per-item state.

A `Request` is one image: prompt, seed, size, steps, guidance, true CFG, negative prompt,
LoRA adapters with scales. `init` turns requests into `Item`\\ s (encoded text, the noise
drawn from the image's own seed, its shifted schedule, the family's per-size tables), all
of it by `fd.sample`'s own per-family preparation (`functional_dit.pipelines.sampler`):
nothing here re-implements a family. A `State` is a batch of items that share a latent
size and text length (`Item.key`); each item carries its own latents, step index,
schedule, guidance, CFG scale and adapters, so the items of one batch may sit at
different steps. ``step(params, state) -> state`` runs one model call for the whole batch
(one ``t`` per row, per-item LoRA as ``fd.apply``'s ``(adapter, scale, rows)`` form, true
CFG as two rows of the item) and each item's Euler update; it changes nothing it is given.
`decode` turns finished items into images. `merge` and `split` let a server add items to
a running batch and take finished ones out between steps (`functional_dit.serve`).

Each item's image equals ``fd.sample`` of that request alone (tests/test_sampling.py;
docs/serving.md gives the measured difference). Supported: the text-to-image pipelines of
FLUX.1, FLUX.2 (dev, klein), Qwen-Image, FLUX.3 (base and step-distilled: each item's
flow-map target is its own next timestep) and Qwen-Image 2.1 (whose batch is laid out by its
first item: each item takes its own model call and keeps its CFG branches' prefix KV
caches in its tables), each item with its own step cache (``Request.cache``:
`cache._items`, every item deciding alone; one state per model call where a step makes one
call per CFG branch, Qwen-Image 2.1); image inputs are
``fd.sample``'s alone for now (issue 35 moves ``fd.sample`` onto this module).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import torch

from .. import families as _families
from ..lora import internal as _lora
from . import sampler as _sampler
from .cache.internal import items as _cache_items
from .families import Prompt, combine

# A request's step cache, for callers outside this package (the server): its config from a
# spec string or config (``cache_config(spec, steps)``, a ValueError naming ``cache`` when
# malformed) and the branch-steps it skipped so far (``cache_skipped(item.cache_state)``).
cache_config = _cache_items.config
cache_skipped = _cache_items.skipped
cache_decisions = _cache_items.decisions


@dataclasses.dataclass(frozen=True)
class Request:
    """One image to make: ``fd.sample(params, pipe, prompt, height=, width=, steps=,
    seed=, guidance=, true_cfg=, negative_prompt=, lora=[(adapter, scale), ...])``
    of one prompt and one image (image ``j`` of a request for n images is seed + j)."""

    prompt: str
    height: int
    width: int
    steps: int
    seed: int = 0
    guidance: float | None = None
    true_cfg: float | None = None
    negative_prompt: str | None = None
    lora: tuple = ()  # ((adapter, scale), ...)
    max_sequence_length: int | None = None
    cache: object = None  # a step cache: a spec such as "fbcache:0.08" or a config (`cache._items`)


@dataclasses.dataclass(frozen=True, eq=False)
class Item:
    """One image in flight: its request, packed latents x (1, S, C), its text (1 row, or
    2 rows [cond; uncond] with true CFG), its step index ``i`` into ``timesteps``
    (``sigmas`` has one more entry), the per-size tables the family prepared (``tables``:
    its RoPE, its guidance default), the CFG scale and the latent grid (h, w)."""

    request: Request
    x: torch.Tensor
    cond: Prompt
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    tables: dict
    cfg: float | None
    hw: tuple[int, int]
    i: int = 0
    tag: object = None  # the caller's (a server's request id); never read here
    inputs: tuple = ()  # per step, the model's extra inputs for the item's rows (FLUX.3's flow-map target)
    cache: object = None  # its step cache's config (`_cache_items.config`), or None
    cache_state: object = None  # that cache's state after the item's last step

    @property
    def done(self) -> bool:
        return self.i >= len(self.timesteps)

    @property
    def key(self) -> tuple:
        """Items with equal keys share a batch: the latent grid and the text length."""
        return (*self.hw, self.cond.txt.shape[1])

    @property
    def rows(self) -> int:
        return 1 if self.cfg is None else 2


@dataclasses.dataclass(frozen=True, eq=False)
class Context:
    """What every step of one model shares: the family's sampling steps (`_Flux1`, ...),
    never changed after `context` (each step works on a copy), and the pipeline whose
    scheduler, VAE and text encoders it uses."""

    fam: str
    model: object
    pipe: object
    device: torch.device
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True, eq=False)
class State:
    """A batch: items of one key (possibly at different steps) and the shared context."""

    ctx: Context
    items: tuple[Item, ...] = ()

    def __len__(self) -> int:
        return len(self.items)


def context(params, encoders) -> Context:
    """The context of ``params`` with ``encoders`` (a diffusers pipeline of the family or
    its components, as ``fd.sample`` takes them)."""
    fam = _sampler._family_name(params)
    pipe = _sampler.as_pipeline(encoders, params)
    runs = _families.product(fam).PER_ITEM_PIPELINES  # the family's text-to-image pipelines
    name = type(pipe).__name__
    if name not in runs:
        raise ValueError(f"encoders: functional_dit.sampling runs text to image ({', '.join(runs)}); got {name}")
    model = _sampler._family_model(fam, params, pipe, None, None, {}, None)
    device, dtype = _sampler._param_device_dtype(params)
    return Context(fam, model, pipe, device, dtype)


def check(ctx: Context, params, req: Request) -> None:
    """``req``'s values as ``fd.sample`` checks them (ValueError naming the argument), cheap."""
    if not isinstance(req.prompt, str):
        raise ValueError(f"prompt: expected a string, got {req.prompt!r}")
    _sampler._check_args(ctx.pipe, req.height, req.width, "pil", None)
    _sampler._check_steps(req.steps, None)
    _sampler.check_max_sequence_length(ctx.fam, req.max_sequence_length)
    if not isinstance(req.seed, int) or isinstance(req.seed, bool):
        raise ValueError(f"seed: expected an int, got {req.seed!r}")
    _lora.check(params, list(req.lora))
    if _cache_items.config(req.cache, req.steps) is not None and not ctx.model.step_cache:
        raise ValueError(f"cache: step caching is not supported for {ctx.fam} yet; expected None")


def init(params, ctx: Context, requests, tags=None) -> State:
    """A state of ``requests`` at step 0 (prompts encoded, noise drawn, schedules set);
    their keys must agree (`Item.key`; a server batches by key)."""
    tags = [None] * len(requests) if tags is None else list(tags)
    with torch.no_grad():
        items = tuple(_item(params, ctx, r, tag) for r, tag in zip(requests, tags))
    return merge(State(ctx), State(ctx, items))


def _item(params, ctx: Context, req: Request, tag) -> Item:
    check(ctx, params, req)
    pipe, model = ctx.pipe, ctx.model.fork()  # what encoding and `prepare` set lands on the fork
    cfg = float(req.true_cfg) if req.true_cfg is not None and req.true_cfg > 1 else None
    cfg = _sampler._qi.true_cfg(ctx.fam, cfg, req.negative_prompt, None)
    reqs = _sampler.requests(ctx.fam, req.prompt, 1, req.seed, None, req.negative_prompt, cfg is not None, {})
    f = pipe.vae_scale_factor * 2
    hw = 2 * (req.height // f), 2 * (req.width // f)
    job = _sampler._Job(ctx.fam, hw, req.steps, None, req.guidance, cfg, "pil", req.max_sequence_length, None, None)
    chunk = _sampler._chunk(model, reqs, (0,), job, ctx.dtype, ctx.device)
    sched = _sampler._scheduler(pipe, ctx.fam, chunk.x.shape[1], req.steps, ctx.device)
    tables = _tables(ctx.model, model, chunk.cond, hw, req, sched)
    cache = _cache_items.config(req.cache, len(sched.timesteps))
    inputs = tuple(model.step_inputs(sched, chunk.x.shape[0] * (1 if cfg is None else 2), chunk.x.dtype))
    item = Item(req, chunk.x, chunk.cond, sched.timesteps, sched.sigmas, tables, cfg, hw, tag=tag, inputs=inputs)
    calls = getattr(model, "cfg_calls", 1) if cfg is not None else 1  # model calls per step
    state = _cache_items.init(cache)  # with several calls per step (Qwen-Image 2.1's CFG), one per call
    state = tuple(_cache_items.init(cache) for _ in range(calls)) if calls > 1 and state is not None else state
    return dataclasses.replace(item, cache=cache, cache_state=state)


def _tables(model, fork, cond: Prompt, hw, req: Request, sched) -> dict:
    """The attributes in which the item's ``fork`` of the shared steps ``model`` differs
    once encoded, prepared and scheduled (RoPE, guidance, Qwen-Image 2.1's layouts and CFG
    branches, ...): the shared steps object is never changed."""
    fork.prepare(cond, *hw, req.guidance, cond.txt.device)
    fork.schedule(sched)
    before = vars(model)
    return {k: v for k, v in vars(fork).items() if k not in before or before[k] is not v}


def merge(*states: State) -> State:
    """One state of every item of ``states`` (same context, same key)."""
    ctx = states[0].ctx
    items = tuple(it for s in states for it in s.items)
    if any(s.ctx is not ctx for s in states):
        raise ValueError("states: expected states of one context (one model), got several")
    keys = {it.key for it in items}
    if len(keys) > 1:
        raise ValueError(f"states: a batch needs one key (latent h, w, text length); got {sorted(keys)}")
    return State(ctx, items)


def split(state: State, keep=lambda item: True) -> tuple[State, State]:
    """(finished items, the rest that ``keep`` keeps): a server decodes the first."""
    done = tuple(it for it in state.items if it.done)
    rest = tuple(it for it in state.items if not it.done and keep(it))
    return State(state.ctx, done), State(state.ctx, rest)


def step(params, state: State) -> State:
    """One denoising step of every unfinished item: one model call over the batch (item
    rows in order, two per CFG item; one call per item where the family's items do not
    share calls, Qwen-Image 2.1), then each item's Euler update from its own sigmas."""
    items = [it for it in state.items if not it.done]
    if not items:
        return state
    groups = [items] if state.ctx.model.shares_calls else [[it] for it in items]
    with torch.no_grad():
        moved = iter(it for group in groups for it in _step(params, state.ctx, group))
    return State(state.ctx, tuple(next(moved) if not it.done else it for it in state.items))


def _step(params, ctx: Context, items) -> list:
    """``items`` after one step computed in one model call."""
    x = torch.cat([it.x.expand(it.rows, -1, -1) for it in items])
    t = torch.cat([it.timesteps[it.i].expand(it.rows).to(x.dtype) / 1000 for it in items])
    caches = [it.cache_state for it in items]  # `_model` puts the new cache states here
    keys = items[0].inputs[0] if items[0].inputs else ()  # the family's extra inputs, per row
    extra = {k: torch.cat([it.inputs[it.i][k] for it in items]) for k in keys}
    m = _model(params, ctx, items, caches)
    pred = m(x, t, _text(items), **extra)
    if m.call_state and len(items) > 1:
        raise TypeError(f"{type(m).__name__}: steps whose calls change call_state must set shares_calls = False")
    kept = {name: getattr(m, name) for name in m.call_state}  # the one item's new call state
    split = pred.split([it.rows for it in items])
    return [_euler(it, p, m.normalise_cfg, c, kept) for it, p, c in zip(items, split, caches)]


def _model(params, ctx: Context, items, caches: list):
    """A copy of the family's steps for this batch: its tables, ``params``, and an
    ``fd.apply`` with each item's adapters on its rows and each row's guidance; where an
    item has a step cache, `_cache_items.step` (each item's own decision), whose new
    states replace ``caches``' entries."""
    m = copy.copy(ctx.model)
    vars(m).update(items[0].tables, params=params)
    for name in m.call_state:  # the call updates its own copy, never the item's
        setattr(m, name, copy.copy(getattr(m, name)))
    guid = [it.tables.get("guidance") for it in items for _ in range(it.rows)]
    lora = _lora_rows(items)
    plain = type(ctx.model).apply
    call = itertools.count()  # the model call within the step

    def apply(p, x, t, txt, **kw):
        if kw.get("guidance") is not None:  # the family's guidance, per row
            kw["guidance"] = torch.tensor([float(g) for g in guid], device=x.device)
        if all(it.cache is None for it in items):
            return plain(p, x, t, txt, **({"lora": lora} if lora else {}), **kw)
        if type(caches[0]) is tuple:  # one call per CFG branch, each its own state (a tuple of NamedTuples)
            k, (it,) = next(call), items
            out, (new,) = _cache_items.step(p, [it.cache], [caches[0][k]], [x.shape[0]], x, t, txt, lora=lora, **kw)
            caches[0] = (*caches[0][:k], new, *caches[0][k + 1 :])
            return out
        configs, rows = [it.cache for it in items], [it.rows for it in items]
        out, caches[:] = _cache_items.step(p, configs, caches, rows, x, t, txt, lora=lora or None, **kw)
        return out

    m.apply = apply
    return m


def _lora_rows(items) -> list:
    """``fd.apply``'s per-row LoRA for the batch: each (adapter, scale) with its rows; a
    plain pair when it covers every row."""
    groups, r = {}, 0
    for it in items:
        for ad, s in it.request.lora:
            groups.setdefault((id(ad), s), (ad, s, []))[2].extend(range(r, r + it.rows))
        r += it.rows
    return [(ad, s) if len(rs) == r else (ad, s, tuple(rs)) for ad, s, rs in groups.values()]


def _text(items) -> Prompt:
    """The batch's text: each item's rows in order (masks filled with ones where absent)."""
    conds = [it.cond for it in items]
    cat = lambda f: None if getattr(conds[0], f) is None else torch.cat([getattr(c, f) for c in conds])  # noqa: E731
    mask = None
    if any(c.mask is not None for c in conds):
        ones = lambda c: torch.ones(c.txt.shape[:2], dtype=torch.long, device=c.txt.device)  # noqa: E731
        mask = torch.cat([ones(c) if c.mask is None else c.mask for c in conds])
    return Prompt(cat("txt"), cat("pooled"), mask, conds[0].txt_ids)


def _euler(it: Item, pred: torch.Tensor, normalise: bool, cache_state=None, kept: dict | None = None) -> Item:
    """The scheduler's Euler step (FlowMatchEulerDiscreteScheduler.step: fp32 update,
    cast back to the prediction's dtype) after the item's CFG combination; the item's new
    step-cache state with it, and what the call changed of its tables (``kept``)."""
    if it.cfg is not None:
        pred = combine(pred, it.cfg, normalise)
    dt = it.sigmas[it.i + 1] - it.sigmas[it.i]
    x = (it.x.to(torch.float32) + dt * pred).to(pred.dtype)
    tables = {**it.tables, **kept} if kept else it.tables
    return dataclasses.replace(it, x=x, i=it.i + 1, cache_state=cache_state, tables=tables)


def decode(state: State, output_type: str = "pil"):
    """The images of the state's finished items, in order (``fd.sample``'s decode)."""
    items = [it for it in state.items if it.done]
    if not items:
        return []
    if output_type not in ("pil", "np", "pt"):
        raise ValueError(f"output_type: expected 'pil', 'np' or 'pt', got {output_type!r}")
    ctx = state.ctx
    with torch.no_grad():
        x = torch.cat([it.x for it in items])
        return _sampler._decode(ctx.model, ctx.pipe, x, *items[0].hw, output_type)


def sample(params, ctx: Context, requests, output_type: str = "pil"):
    """All ``requests`` (one key) to images: `init`, `step` until done, `decode`."""
    state = init(params, ctx, requests)
    while not all(it.done for it in state.items):
        state = step(params, state)
    return decode(state, output_type)

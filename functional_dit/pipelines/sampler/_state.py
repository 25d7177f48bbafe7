"""The sampling state and its one pure step, shared by ``fd.sample`` and
`functional_dit.sampling` (which re-exports them) and so by ``serve``.

An `Item` is a run of ``n`` images sampled in lockstep: ``fd.sample``'s chunk (the images
of one model batch) or one request of `functional_dit.sampling` (n = 1). It holds its
latents, text, its own scheduler (set, never stepped: each step steps a copy), its step
index, its family tables (an immutable mapping its family's steps returned for it: RoPE,
guidance, reference and start latents, inpainting's blend inputs, a ControlNet's
conditions, a KV cache), its CFG scale, its per-image LoRA adapters, its step cache's config and state. `start` makes
one from an encoded chunk; ``step(params, state) -> state`` moves every unfinished item by
one step and changes nothing it is given; `decode` turns finished items into images (or
``output_type="latent"`` latents).

One step of one item is the stock loop's body: the family's ``predict(params, tables, x,
t, cond, apply)`` over ``[x; x]`` with true CFG (its rows ``[cond_1..n; uncond_1..n]``;
``apply`` the batch's `fd.apply`, with each item's adapters and step cache), the CFG
combination, the scheduler's step on a copy of the item's scheduler, then the family's
``after_step(tables, ...)`` (inpainting's blend); what a call returns to keep (a KV cache
extracted on the first step) joins the item's tables. Items
of one state share one model call where the family allows it (``Steps.shares_calls``):
their rows follow each other, each keeps its own timestep, guidance, adapters and step
cache (`cache._items`: each item decides alone). Steps whose items do not share calls
may lay several items into their own calls (``Steps.predict_items``: each call picks its
rows, and their adapters, by index).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Mapping

import numpy as np
import torch

from .. import cache as _cache
from ..cache import internal as _cache_int
from ..families import NO_TABLES, Prompt, combine, plain_apply, tables
from . import _lora as _lora_items
from . import _packing
from . import _stock_args as _stock


@dataclasses.dataclass(frozen=True, eq=False)
class Context:
    """What every step of one model shares: the family's sampling steps (`_Flux1`, ...: a
    frozen description whose hooks are pure), and the pipeline whose scheduler, VAE and
    text encoders it uses."""

    fam: str
    model: object
    pipe: object
    device: torch.device
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True, eq=False)
class Item:
    """``n`` images in flight: packed latents x (n, S, C), their text (n rows, or 2n rows
    [cond; uncond] with true CFG), the item's scheduler ``sched`` (set, never stepped),
    its step index ``i`` into ``sched.timesteps``, the tables its family's steps returned
    for it (``tables``, an immutable mapping: the run's, the chunk's and its own), the CFG
    scale, the latent grid (h, w), per step the model's extra inputs (FLUX.3's flow-map
    target), per image its LoRA ``(adapter, scale)`` pairs, the IP-Adapter's embeddings,
    whether CFG is rescaled, and its step cache."""

    x: torch.Tensor
    cond: Prompt
    sched: object
    tables: Mapping
    cfg: float | None
    hw: tuple[int, int]
    i: int = 0
    request: object = None  # `sampling.Request` (None for fd.sample's chunks)
    tag: object = None  # the caller's (a server's request id); never read here
    inputs: tuple = ()
    lora: tuple | None = None  # per image, its (adapter, scale) pairs; None: no adapters
    ip: tuple | None = None  # the IP-Adapter's (embeddings, negative embeddings)
    normalise: bool = False  # CFG rescaled to the conditional prediction's norm
    cache: object = None  # its step cache's config, or None
    cache_state: object = None  # that cache's state after the item's last step (a tuple: one per model call)
    own: Context | None = None  # its own context (an image job's steps), else the state's

    @property
    def timesteps(self) -> torch.Tensor:
        return self.sched.timesteps

    @property
    def sigmas(self) -> torch.Tensor:
        return self.sched.sigmas

    @property
    def done(self) -> bool:
        return self.i >= len(self.sched.timesteps)

    @property
    def key(self) -> tuple:
        """Items with equal keys share a batch: the latent grid and the text length."""
        return (*self.hw, self.cond.txt.shape[1])

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def rows(self) -> int:
        return self.n if self.cfg is None else 2 * self.n


@dataclasses.dataclass(frozen=True, eq=False)
class State:
    """A batch: items of one key (possibly at different steps) and the shared context."""

    ctx: Context
    items: tuple[Item, ...] = ()

    def __len__(self) -> int:
        return len(self.items)


# ----------------------------------------------------------------------------- start


def start(ctx: Context, run: Mapping, x, cond: Prompt, sched, hw, *, guidance=None, cfg=None, images=None, **fields):
    """The item of an encoded chunk at step 0: the context's steps prepare its tables for
    the grid ``hw`` over ``run`` (the run's and the chunk's tables), set its scheduler
    ``sched`` (an image job cuts a copy) and begin (an image job starts from its noised
    image; ``images``: the chunk's image indices). ``fields``: the `Item`'s others."""
    m = ctx.model
    tab = tables(run, **m.prepare(run, cond, *hw, guidance, x.device))
    sched = m.schedule(tab, sched)
    x, tab = m.begin(tab, sched, x, images)
    rows = x.shape[0] * (1 if cfg is None else 2)
    inputs = tuple(m.step_inputs(sched, rows, x.dtype))
    return Item(x, cond, sched, tab, cfg, hw, inputs=inputs, **fields)


@dataclasses.dataclass(frozen=True, eq=False)
class Bound:
    """One item's model for a loop of its own (`sampler_xla.denoise`): its steps, params,
    tables and the batch's ``apply``. Calling it predicts; `call` also returns the model
    with what the call returned to keep (a KV cache) in its tables."""

    steps: object
    params: object
    tables: Mapping
    apply: object

    def __call__(self, x, t, cond, **extra):
        return self.call(x, t, cond, **extra)[0]

    def call(self, x, t, cond, **extra) -> tuple:
        pred, updates = self.steps.predict(self.params, self.tables, x, t, cond, self.apply, **extra)
        return pred, self if not updates else dataclasses.replace(self, tables=tables(self.tables, **updates))

    @property
    def kv(self):
        return self.steps.kv

    def step_inputs(self, sched, batch: int, dtype) -> list[dict]:
        return self.steps.step_inputs(sched, batch, dtype)

    def blend_parts(self):
        return self.steps.blend_parts(self.tables)


def bound(params, ctx: Context, it: Item) -> Bound:
    """The item's model over ``params`` (`Bound`), with its adapters, IP-Adapter inputs
    and step cache in ``apply``."""
    return Bound((it.own or ctx).model, params, it.tables, _apply(it.own or ctx, [it], [it.cache_state]))


# ----------------------------------------------------------------------------- step


def step(params, state: State) -> State:
    """One denoising step of every unfinished item: one model call over the batch (item
    rows in order; items of several sizes in one padded call where the family packs
    them, else one call per size; where the family's items do not share calls,
    Qwen-Image 2.1, the calls its steps lay the items into where they pack, else one call
    per item: `_packing.calls`), then each item's CFG combination, scheduler step and
    ``after_step``."""
    items = [it for it in state.items if not it.done]
    if not items:
        return state
    moved = {}
    with torch.no_grad():
        for ctx, same in _by_context(state.ctx, items):
            for group in _packing.calls(params, ctx, same):
                moved.update(zip(map(id, group), _step(params, ctx, group)))
    return State(state.ctx, tuple(moved.get(id(it), it) for it in state.items))


def _by_context(ctx: Context, items) -> list:
    """``items`` grouped by their context (the state's, or an image job's own), in order."""
    groups: dict = {}
    for it in items:
        groups.setdefault(id(it.own or ctx), (it.own or ctx, []))[1].append(it)
    return list(groups.values())


def _step(params, ctx: Context, items) -> list:
    """``items`` after one step computed in one model call (padded where their sizes differ)."""
    if len(items) > 1 and ctx.model.predicts_items:
        return _step_items(params, ctx, items)
    pad = _packing.layout(items)
    x = (
        pad.latents(items)
        if pad
        else torch.cat([torch.cat([it.x, it.x]) if it.cfg is not None else it.x for it in items])
    )
    t = torch.cat([it.timesteps[it.i].expand(it.rows).to(x.dtype) / 1000 for it in items])
    keys = items[0].inputs[0] if items[0].inputs else ()  # the family's extra inputs, per row
    extra = {k: torch.cat([it.inputs[it.i][k] for it in items]) for k in keys}
    caches = [it.cache_state for it in items]  # the call puts the new cache states here
    cond = items[0].cond if len(items) == 1 else pad.text(items) if pad else _text(items)
    m = ctx.model
    pred, updates = m.predict(
        params, items[0].tables, x, t, cond, _padded(_apply(ctx, items, caches), items, pad), **extra
    )
    if len(items) > 1 and updates:
        raise TypeError(f"{type(m).__name__}: steps whose calls return tables to keep must set shares_calls = False")
    split = pad.unpad(pred, items) if pad else pred.split([it.rows for it in items])
    return [_advance(ctx, it, p, c, updates) for it, p, c in zip(items, split, caches)]


def _step_items(params, ctx: Context, items) -> list:
    """``items`` after one step in the calls their steps lay them into themselves
    (`Steps.predict_items`: no step cache, IP-Adapter or per-step inputs, `_packing.packs`),
    each call's rows taking their adapters by index (`_rows_apply`)."""
    xs = [torch.cat([it.x, it.x]) if it.cfg is not None else it.x for it in items]
    ts = [it.timesteps[it.i].expand(it.rows).to(it.x.dtype) / 1000 for it in items]
    tabs, conds = [it.tables for it in items], [it.cond for it in items]
    preds, updates = ctx.model.predict_items(params, tabs, xs, ts, conds, _rows_apply(items))
    return [_advance(ctx, it, p, it.cache_state, u) for it, p, u in zip(items, preds, updates)]


def _rows_apply(items):
    """``fd.apply`` over some of the items' rows (``rows``: indices into their rows in
    order), each with its image's adapters."""
    pairs = [p for it in items for p in _row_pairs(it)]

    def apply(p, x, t, txt, *, rows, **kw):
        lora = _lora_items.group([pairs[r] for r in rows])
        return plain_apply(p, x, t, txt, **({"lora": lora} if lora else {}), **kw)

    return apply


def _padded(apply, items, pad):
    """The call's ``apply`` over a padded layout ``pad`` (each row's RoPE, the image mask:
    `_packing.Layout.inputs`); ``apply`` itself where there is none."""
    if pad is None:
        return apply
    return lambda p, x, t, txt, **kw: apply(p, x, t, txt, **pad.inputs(items, kw))


def _apply(ctx: Context, items, caches: list):
    """The batch's ``fd.apply``: with each item's adapters on its rows (and the
    IP-Adapter's inputs), its step cache (whose new states replace ``caches``' entries)
    and, for several items, each row's guidance."""
    plain = plain_apply
    lora = _lora_items.group([pairs for it in items for pairs in _row_pairs(it)])
    if len(items) == 1:
        (it,) = items
        apply = plain if it.cache is None else _item_cache(it, caches)
        return _with_lora(_stock.ip_calls(apply, it.ip, it.cfg is not None), lora)
    guid = [it.tables.get("guidance") for it in items for _ in range(it.rows)]

    def apply(p, x, t, txt, **kw):
        if kw.get("guidance") is not None:  # the family's guidance, per row
            kw["guidance"] = torch.tensor([float(g) for g in guid], device=x.device)
        if all(it.cache is None for it in items):
            return plain(p, x, t, txt, **({"lora": lora} if lora else {}), **kw)
        configs, rows = [it.cache for it in items], [it.rows for it in items]
        out, caches[:] = _cache_int.items.step(p, configs, caches, rows, x, t, txt, lora=lora or None, **kw)
        return out

    return apply


def _row_pairs(it: Item) -> list:
    """Per row of the item's model batch, its image's (adapter, scale) pairs."""
    none = ()
    return [none if it.lora is None else it.lora[r % it.n] for r in range(it.rows)]


def _with_lora(apply, lora: list):
    if not lora:
        return apply
    return lambda p, x, t, txt, **kw: apply(p, x, t, txt, lora=lora, **kw)


def _item_cache(it: Item, caches: list):
    """One item's step cache over its call(s): the batch decision per CFG branch (the
    stock hooks' and ``fd.CacheRun``'s); with one call per branch (Qwen-Image 2.1), each
    call its own state."""
    step, call = _cache.step, itertools.count()

    def apply(p, x, t, txt, **kw):
        state = caches[0]
        if type(state) is tuple:  # one state per call (each a NamedTuple)
            k = next(call)
            out, new = step(p, it.cache, state[k], x, t, txt, branches=1, **kw)
            caches[0] = (*state[:k], new, *state[k + 1 :])
            return out
        out, caches[0] = step(p, it.cache, state, x, t, txt, branches=1 if it.cfg is None else 2, **kw)
        return out

    return apply


def _text(items) -> Prompt:
    """The batch's text: each item's rows in order (masks filled with ones where absent)."""
    conds = [it.cond for it in items]
    cat = lambda f: None if getattr(conds[0], f) is None else torch.cat([getattr(c, f) for c in conds])  # noqa: E731
    mask = None
    if any(c.mask is not None for c in conds):
        ones = lambda c: torch.ones(c.txt.shape[:2], dtype=torch.long, device=c.txt.device)  # noqa: E731
        mask = torch.cat([ones(c) if c.mask is None else c.mask for c in conds])
    return Prompt(cat("txt"), cat("pooled"), mask, conds[0].txt_ids)


def _advance(ctx: Context, it: Item, pred, cache_state, updates: Mapping = NO_TABLES) -> Item:
    """The item after its prediction: CFG combined, the scheduler's step on a copy of its
    scheduler (at the item's step index), the family's ``after_step``; its new cache state
    and the tables its call returned to keep (``updates``)."""
    if it.cfg is not None:
        pred = combine(pred, it.cfg, it.normalise)
    sched = copy.copy(it.sched)
    sched._step_index = (sched.begin_index or 0) + it.i
    x = sched.step(pred, it.timesteps[it.i], it.x, return_dict=False)[0]
    tab = tables(it.tables, **updates) if updates else it.tables
    x = ctx.model.after_step(tab, it.i, sched, x)
    return dataclasses.replace(it, x=x, i=it.i + 1, cache_state=cache_state, tables=tab)


# ----------------------------------------------------------------------------- decode


def decode(state: State, output_type: str = "pil"):
    """The outputs of the state's finished items, in order: images through the VAE and
    the pipeline's image processor, or with ``output_type="latent"`` what the stock
    pipeline returns (the family's ``latent_output``); a list where their sizes differ."""
    items = [it for it in state.items if it.done]
    if not items:
        return []
    groups = [(ctx, g) for ctx, same in _by_context(state.ctx, items) for g in _packing.by_size(same)]
    if len(groups) == 1:
        return _decode(*groups[0], output_type)
    outs = {}  # each item's output: its image (or its layers), in the order of ``items``
    for ctx, group in groups:
        outs.update(zip(map(id, group), _decode(ctx, group, output_type)))
    rows = [outs[id(it)] for it in items]
    if output_type == "pil" or _packing.resolutions(items) > 1:
        return rows
    return np.stack(rows) if output_type == "np" else torch.stack(rows)


def _decode(ctx: Context, items, output_type: str):
    """The outputs of finished ``items`` of one context."""
    model, pipe, hw, tab = ctx.model, ctx.pipe, items[0].hw, items[0].tables
    with torch.no_grad():
        x = torch.cat([it.x for it in items])
        if output_type == "latent":
            return model.latent_output(x, *hw)
        if hasattr(model, "decode"):  # Qwen-Image-Layered: several images per latent
            return model.decode(x, *hw, output_type)
        z = model.decode_latents(x, *hw).to(pipe.vae.device, pipe.vae.dtype)
        img = pipe.vae.decode(z, return_dict=False)[0]
        img = img[:, :, 0] if img.ndim == 5 else img  # Qwen-Image's VAE has a frame axis
        out = pipe.image_processor.postprocess(img, output_type=output_type)
        return model.overlay(tab, out)

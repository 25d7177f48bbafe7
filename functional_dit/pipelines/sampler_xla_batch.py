"""A running batch of `functional_dit.sampling` items as one fixed-shape step graph: the
step of the XLA server (``serve --device xla``, docs/xla.md "Serving").

On a lazy device every distinct traced graph compiles, and a continuous-batching server
changes its batch at every step: items join and leave, sit at different steps, carry
different guidance, CFG scales and adapters. Here none of that reaches the graph:

- **Buckets.** A batch of n items runs padded to the smallest bucket ``>= n`` (`bucket`):
  the missing slots are `Pads`, zero latents, text, timesteps and increments held as
  device data of their own (one set per slot, so every slot is a distinct graph input,
  as an item is). A pad's ``dt`` is 0 and its outputs are dropped: no active row reads a
  pad's row (each row is its own image), so pads change no active result.
- **Per-row data, not constants.** Each item's schedule is moved to the device once when
  it joins (`slot`: `sampler_xla.plan`'s ``t`` and ``dt`` per step, the family's extra
  inputs, `sampler_xla.extras`), as are its guidance, CFG scale and adapter scales; a step
  concatenates the slots' tensors of their own step index (host bookkeeping only), so items
  at different steps share one graph. The step itself is `sampler_xla.step` (the model call,
  CFG as ``[cond rows; uncond rows]``, the Euler update) with ``dt`` and the CFG scale as
  (B, 1, 1) tensors.
- **Adapters as data.** Every adapter the server holds is attached to every row, each row
  scaling its update by its own (rows,) scale, 0 where the item has no such adapter
  (``nn.layers``' per-row scale): which item uses which adapter at what scale is data;
  the graph depends only on the set of adapters held (fixed at start-up).
- **Keys.** Items share a batch when they share the sampler's key (latent grid, text
  length) and whether they run true CFG (`key`): one graph per (key, CFG or not, bucket).
  Qwen-Image's text, as long as its prompt, is padded (masked) to one length (`pad_text`),
  so its prompts share a key as FLUX's (padded by their pipelines) do.

Refused by name (a ValueError): step caches (their skip decisions are made on the host),
requests made by ``fd.sample``'s whole preparation (image inputs, sigmas, embeddings: their
own contexts), families whose items do not share calls (Qwen-Image 2.1), DoRA adapters.
On the CPU every step runs eagerly and gives ``sampling.step``'s results within float
rounding (a batch's GEMMs block differently); tests/test_sample_xla_batch.py checks the
rest under `sampler_xla.NoHostSync`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import sharding

from .. import families as _families
from ..lora import internal as _lora
from . import sampler_xla as _xla
from . import sampling as _sampling
from .families import Prompt, plain_apply, tables
from .sampler.internal import state as _state


@dataclasses.dataclass(frozen=True, eq=False)
class Slot:
    """One item in a fixed-shape batch: the `sampling.Item` (host bookkeeping: its scheduler,
    step index, request, tag; its ``x`` the latents on the device) and its device data,
    moved once when it joins: per step ``(t (rows,), dt (1, 1, 1))`` and the family's extra
    inputs, its guidance (rows,), CFG scale (1, 1, 1) and adapter scales (rows, adapters)."""

    item: _sampling.Item
    plan: tuple
    extras: tuple
    guidance: torch.Tensor | None
    cfg: torch.Tensor | None
    scales: torch.Tensor | None

    # what the engine and `sampling.merge` / `split` read of an item
    tag = property(lambda self: self.item.tag)
    i = property(lambda self: self.item.i)
    done = property(lambda self: self.item.done)
    request = property(lambda self: self.item.request)
    cache_state = property(lambda self: None)
    own = property(lambda self: None)

    @property
    def key(self) -> tuple:
        return key(self.item)

    def inputs(self) -> tuple:
        """This step's ``(x, t, dt, extra)``."""
        t, dt = self.plan[self.item.i]
        return self.item.x, t, dt, self.extras[self.item.i]


def key(item) -> tuple:
    """Items of equal keys share a graph: the sampler's key, CFG or not, CFG rescaled or not."""
    return (*item.key, item.cfg is not None, item.normalise)


def bucket(n: int, buckets) -> int:
    """The smallest bucket that holds ``n`` items."""
    fits = [b for b in sorted(buckets) if b >= n]
    if not fits:
        raise ValueError(f"batch: {n} items exceed the largest bucket {max(buckets)} (buckets {sorted(buckets)})")
    return fits[0]


def check_context(ctx, adapters=()) -> None:
    """``ctx``'s family steps run in fixed-shape batches (text to image, items sharing calls),
    with ``adapters`` on every row (not DoRA: its factor depends on the scale)."""
    if any(ad.config.use_dora for ad in adapters):
        raise ValueError("lora: DoRA adapters do not run per row in the XLA step graphs; expected plain LoRA")
    model = ctx.model
    if model is None or not model.shares_calls or not model.fixed_graph:
        raise ValueError(
            f"encoders: {type(ctx.pipe).__name__} ({ctx.fam}) does not run in the fixed-shape XLA step graphs; "
            "expected the text-to-image pipeline of FLUX.1, FLUX.2, FLUX.3 or Qwen-Image"
        )


def check_item(ctx, item, adapters=()) -> None:
    """``item`` runs in a fixed-shape batch (module docstring), or a ValueError naming why."""
    check_context(ctx, adapters)
    if item.cache is not None:
        raise ValueError(
            "cache: step caches decide on the host at every step, so they do not run in the fixed-shape XLA "
            "step graphs; expected no cache under --device xla"
        )
    if item.own is not None:
        raise ValueError(
            "request: image inputs, sigmas and embeddings do not run in the fixed-shape XLA step graphs; "
            "expected a text-to-image request"
        )
    held = {id(ad) for ad in adapters}
    for ad, _ in () if item.lora is None else item.lora[0]:
        if id(ad) not in held:
            raise ValueError("lora: an adapter the server does not hold; expected one of its named adapters")


def slot(ctx, item, adapters=(), text: int | None = None) -> Slot:
    """``item``'s `Slot`: its schedule and per-item values made on the host and moved to its
    latents' device once, each a tensor of its own (no view: on torch_xla a view of a moved
    tensor enters a graph as a slice of it, another graph). ``text``: where the family's
    model takes a text mask (Qwen-Image), the text padded to that many tokens (`pad_text`)."""
    check_item(ctx, item, adapters)
    if text is not None and "txt_mask" in _families.by_key(ctx.fam).ARGS:
        item = pad_text(ctx, item, text)
    dev, dtype = item.x.device, item.x.dtype
    move = lambda v: None if v is None else v.clone().to(dev)  # noqa: E731
    plan = tuple((move(t[:1]), move(dt.reshape(1, 1, 1))) for t, dt in _xla.plan(item.sched, 1, dtype, "cpu"))
    extras = tuple({k: move(v) for k, v in e.items()} for e in item.inputs)
    g = item.tables.get("guidance")
    guidance = None if g is None else move(torch.tensor([float(g)], dtype=torch.float32))
    cfg = None if item.cfg is None else move(torch.tensor([[[item.cfg]]], dtype=torch.float32))
    pairs = {id(ad): s for ad, s in (() if item.lora is None else item.lora[0])}
    scales = torch.tensor([[float(pairs.get(id(ad), 0.0)) for ad in adapters]], dtype=torch.float32)
    return Slot(item, plan, extras, guidance, cfg, move(scales) if adapters else None)


def pad_text(ctx, item, length: int):
    """``item`` with its text padded to ``length`` tokens (zero rows, masked out) and its
    tables prepared again for that length (the family's ``prepare``: Qwen-Image's RoPE
    table): every prompt one key, one graph, whatever its token count."""
    c, n, dev = item.cond, item.cond.txt.shape[1], item.cond.txt.device
    if n > length:
        raise ValueError(f"prompt: {n} tokens, more than the {length} the XLA step graphs pad the text to")
    # padded on the host (once per item: on the device each token count would be a graph of its own)
    mask = torch.ones(c.txt.shape[:2], dtype=torch.long) if c.mask is None else c.mask.cpu()
    txt, mask = F.pad(c.txt.cpu(), (0, 0, 0, length - n)), F.pad(mask, (0, length - n))
    cond = Prompt(txt.to(dev), c.pooled, mask.to(dev), c.txt_ids)
    g = item.tables.get("guidance")
    tab = tables(item.tables, **ctx.model.prepare(item.tables, cond, *item.hw, g, item.x.device))
    return dataclasses.replace(item, cond=cond, tables=tab)


@dataclasses.dataclass(frozen=True, eq=False)
class Pads:
    """The zero slots of one key, one set of device tensors per slot index (every pad a
    distinct graph input): latents x, text rows (a `Prompt`), ``t``, ``dt``, extras,
    guidance, CFG scale (0) and adapter scales."""

    slots: tuple

    def __len__(self) -> int:
        return len(self.slots)


def pads(template: Slot, n: int) -> Pads:
    """``n`` zero slots shaped like ``template``'s (its item at any step)."""
    return Pads(tuple(_pad(template) for _ in range(n)))


def _pad(s: Slot):
    """One zero slot: (x, t, dt, cond, extra, guidance, cfg, scales), fresh zeros each."""
    it = s.item  # zeros made on the host and moved: device data, as an item's are
    z = lambda v: None if v is None else torch.zeros(v.shape, dtype=v.dtype).to(v.device)  # noqa: E731
    cond = Prompt(z(it.cond.txt), z(it.cond.pooled), z(it.cond.mask), it.cond.txt_ids)
    t, dt = s.plan[0]
    extra = {k: z(v) for k, v in s.extras[0].items()}
    return z(it.x), z(t), z(dt), cond, extra, z(s.guidance), z(s.cfg), z(s.scales)


def _rows(parts: list, cfg: bool) -> torch.Tensor | None:
    """Per-slot tensors of 1 row (2 with CFG: cond, uncond) as the batch's rows
    ``[cond rows of every slot; uncond rows of every slot]``."""
    if parts[0] is None or parts[-1] is None:
        if any(p is not None for p in parts):
            raise ValueError("slots: some items of one batch carry a text mask and some do not; expected one key")
        return None
    first = [p[:1] for p in parts]
    return torch.cat(first + [p[1:2] for p in parts] if cfg else first)


def _twice(parts: list, cfg: bool) -> torch.Tensor | None:
    """Per-slot tensors of one row, repeated for the uncond rows with CFG."""
    return None if parts[0] is None else torch.cat(parts + parts if cfg else parts)


def padded(slots, pad: Pads):
    """The batch's device inputs, padded to ``len(slots) + len(pad)`` slots: x (B, S, C),
    t (rows,), dt (B, 1, 1), the text `Prompt`, the extras, guidance (rows,), CFG scale
    (B, 1, 1) or None, adapter scales (rows, adapters) or None."""
    cfg = slots[0].item.cfg is not None
    live = [(*s.inputs()[:3], s.item.cond, s.inputs()[3], s.guidance, s.cfg, s.scales) for s in slots]
    x, t, dt, conds, extras, guid, scale, scales = (list(c) for c in zip(*live, *pad.slots))
    txt_ids = conds[0].txt_ids
    cond = Prompt(*(_rows([getattr(c, f) for c in conds], cfg) for f in ("txt", "pooled", "mask")), txt_ids)
    extra = {k: _rows([e[k] for e in extras], cfg) for k in extras[0]}
    scale = torch.cat(scale) if cfg else None
    return torch.cat(x), _twice(t, cfg), torch.cat(dt), cond, extra, _twice(guid, cfg), scale, _twice(scales, cfg)


def step(params, ctx, slots, pad: Pads, adapters=()) -> tuple[list[Slot], list]:
    """One step of ``slots`` padded with ``pad`` (``adapters``: every adapter held, in a
    fixed order): (each slot after it, its latents its own copy of its rows of the output
    and its step index one on; the pad rows' copies). Hold the second until the graph is cut
    (``torch_xla.sync``): then every slot's rows are an output of the graph, which so is the
    same whichever slots hold items. Pure: nothing given is changed; no tensor is read on
    the host."""
    x, t, dt, cond, extra, guid, cfg, scales = padded(slots, pad)
    m = _model(params, ctx, slots[0].item, guid, scales, adapters)
    out = _xla.step(m, x, t, dt, cond, cfg, slots[0].item.normalise, extra)
    # each row a tensor of its own, not a view of the output (on torch_xla a view stays a
    # slice of that output: a graph input of another shape when its item steps in another bucket)
    rows = [out[k : k + 1].clone() for k in range(out.shape[0])]
    moved = [dataclasses.replace(s, item=dataclasses.replace(s.item, x=r, i=s.item.i + 1)) for s, r in zip(slots, rows)]
    return moved, rows[len(slots) :]


def _model(params, ctx, item, guidance, scales, adapters):
    """The family's steps bound to ``params`` and ``item``'s tables (those of its key: RoPE
    tables, shapes) with an ``apply`` taking the batch's per-row guidance and adapter
    scales (`sampler._state.Bound`)."""
    return _state.Bound(ctx.model, params, item.tables, _apply(plain_apply, guidance, scales, adapters))


def _apply(plain, guidance, scales, adapters):
    """``plain`` (``fd.apply``) with the family's guidance replaced by ``guidance`` (rows,)
    and every adapter attached to every row at its column of ``scales`` (rows, adapters).

    Sharded params (torchrun's ``--tp`` / ``--sp``: DTensor leaves) take the adapters as
    ``fd.apply`` does: params and adapters in their local view (each factor split like its
    base weight), attached and run under their mesh bound (as `fd.apply`'s own set-up)."""

    def apply(p, x, t, txt, **kw):
        if kw.get("guidance") is not None:
            kw = {**kw, "guidance": guidance}
        if not adapters:
            return plain(p, x, t, txt, **kw)
        local, mesh = sharding.local_view(p)
        pairs = _lora.local_adapters([(ad, scales[:, j]) for j, ad in enumerate(adapters)], mesh)
        if mesh is None:
            return plain(_lora.attach(local, pairs), x, t, txt, **kw)
        with sharding.bind(mesh):  # attach reads the bound mesh (its column- / row-parallel layers)
            return plain(_lora.attach(local, pairs), x, t, txt, **kw)

    return apply

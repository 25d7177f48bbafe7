"""Step caches per batch item (`functional_dit.sampling`, ``serve``'s ``cache`` field).

Each item of a batch keeps its own cache config and state and makes its own decision, so
its output equals `functional_dit.pipelines.cache.step` of that item alone (``fd.sample``
of that one image with that cache), whatever else shares the call: items with no cache,
with another cache, at another step. ``step(params, configs, states, rows, x, t, txt,
lora=..., **apply_kwargs) -> (out, states)`` is that call; item ``k`` owns ``rows[k]``
consecutive batch rows (2 with true CFG: two branches, as ``fd.sample`` decides them).

One call over the batch, in the order of `cache._fbc_step` / `_mag_step` /
`_taylor_step`:

1. the family's stages (``fam.stages``, `functional_dit.nn.stages`) for every row: the embedders and modulations;
2. MagCache and TaylorSeer (on the model output) decide from their own step counts;
   their skipping rows run no block;
3. every other row runs block 0; First-Block Cache rows then decide per branch from
   their own residual change (one sum over sp and ring for all of them, so every rank
   takes the same decisions);
4. the rest of the blocks run on the rows that compute only (a row-subset of the batch,
   its per-row LoRA re-indexed to the subset);
5. each skipping row takes its cached value (FBC: block 0's output + its last tail
   residual; MagCache: the input + its last residual); the final layer runs on every row;
   TaylorSeer's skipping rows take their extrapolated output.

What is saved: every block of a MagCache / TaylorSeer row that skips, and every block
after the first of an FBC row that skips. What is not: the embedders, modulations and
final layer of skipping rows (cheap, all rows), and, with per-row LoRA and some rows
skipping, the embedders once more for the computing subset. The attention-level caches
(TaylorSeer on attention modules, FasterCache) run every block for their rows and decide
per item at each attention module (`_Attention`): the module runs for the call's rows
when any of them computes (reusing rows then take their own values: compute not saved),
and not at all when every row reuses. Meshes: sp, ring, tp; not dp (a dp mesh splits the
batch across ranks, whose items then decide apart: `step` refuses it); fsdp: every fsdp
rank runs every row (the batch is not split here), so all take the same decisions and
gather each block's weights together (`nn.stages.Stages.run`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import types

import torch

import sharding

from ... import api as _api
from ...nn import fused as _fuse
from ...nn import kernels as _kernels
from ...nn import stages as _stages
from .. import cache as _cache


def config(cache, steps: int):
    """The item's cache config, or None for none (None, "" or "none"): a spec string or a
    config, checked (ValueError naming ``cache``); MagCache's ``num_inference_steps``
    defaults to the item's ``steps``, as ``fd.sample`` sets it."""
    if cache is None or (isinstance(cache, str) and cache in ("", "none")):
        return None
    c = _cache.check(cache)
    if isinstance(c, _cache.FasterCache) and c.timestep is not None:
        raise ValueError("cache: a FasterCache with its own timestep() is fd.sample's only; expected timestep=None")
    if isinstance(c, _cache.MagCache) and c.num_inference_steps is None:
        c = dataclasses.replace(c, num_inference_steps=steps)
    return c


def init(config, calls: int = 1):
    """The item's state before its first step (None without a cache); with several model
    calls per step (Qwen-Image 2.1's CFG branches) a tuple of one state per call."""
    if config is None:
        return None
    return _cache.init(config) if calls == 1 else tuple(_cache.init(config) for _ in range(calls))


def decisions(state) -> tuple:
    """An item's decisions per step, as `CacheRun.decisions` gives them: its state's log, or
    with a state per model call of the step (Qwen-Image 2.1's CFG branches) their logs side by
    side; () without a cache."""
    if state is None:
        return ()
    if type(state) is tuple:  # a tuple of states (each state a NamedTuple)
        return tuple(tuple(c for d in ds for c in d) for ds in zip(*(st.log for st in state)))
    return state.log


def skipped(state) -> int:
    """Branch-steps of one item that did not run the full network (`CacheRun.skipped`)."""
    return sum(not c for d in decisions(state) for c in d)


def step(params, configs, states, rows, x, t, txt, *, lora=None, **kwargs):
    """One call over the batch with each item's own cache (module docstring): returns the
    output and each item's new state."""
    _cache.check_family(_api.family(params))
    call = _api.prepare_call(params, **kwargs)  # fd.apply's set-up: the one entry into the core
    if sum(rows) != x.shape[0]:
        raise ValueError(f"rows: expected item rows summing to the batch {x.shape[0]}, got {list(rows)}")
    with sharding.bind(call.mesh) if call.mesh is not None else contextlib.nullcontext():
        if sharding.axis_size("dp") > 1:
            raise ValueError("cache: per-item step caches run on a mesh without dp (each dp group its own batch)")
        batch = _Batch(call, x, t, txt, lora)
        with _kernels.fast_kernels(batch.fast):
            return _step(batch, list(configs), list(states), list(rows))


class _Batch:
    """The call's inputs and the family's stages over all rows or a subset of them."""

    def __init__(self, call, x, t, txt, lora):
        self.call, self.fam = call, call.fam
        self.x, self.t, self.txt, self.lora, self.B = x, t, txt, lora or [], x.shape[0]
        self.inputs = call.fam.check_inputs(call.local, x, t, txt, **call.kwargs)
        _cache.check_no_controlnet(self.inputs)
        self.fast = _fuse.active(call.local, call.fam.FUSED, (x, t, txt, self.inputs))
        self.all = self.stages(tuple(range(self.B)))

    def stages(self, idx: tuple) -> _stages.Stages:
        """The stages of rows ``idx`` (their LoRA re-indexed to the subset)."""
        whole = len(idx) == self.B
        lora = self.lora if whole else _sub_lora(self.lora, idx)
        ads = self.call.adapters(lora, len(idx)) if lora else []
        p = self.call.model_params(ads, len(idx), split=False)  # every row on every rank here; fsdp gathers
        if whole:
            return self.fam.stages(p, self.x, self.t, self.txt, **self.inputs)
        i = torch.tensor(idx, device=self.x.device)
        pick = lambda v: v.index_select(0, i)  # noqa: E731
        ins = {k: pick(v) if k in self.fam.BATCHED and v is not None else v for k, v in self.inputs.items()}
        return self.fam.stages(p, pick(self.x), pick(self.t), pick(self.txt), **ins)

    def run(self, streams: tuple, idx: tuple, blocks: slice, hooks=None) -> tuple:
        """``blocks`` of the stack on rows ``idx`` whose streams are ``streams``;
        ``hooks(idx)``: the attention hooks for those rows (`_Attention`), or None."""
        if len(idx) == self.B:
            s, ctx = self.all, self.all.ctx
        elif not any(len(e) > 2 for e in self.lora):  # no per-row LoRA: the rows' ctx suffices
            s = self.all
            ctx = s.take(torch.tensor(idx, device=self.x.device))
        else:
            s = self.stages(idx)
            ctx = s.ctx
        attn = None if hooks is None else hooks(idx)
        return s.run(streams, s.blocks[blocks], ctx if not attn else dict(ctx, attn=attn))


def _sub_lora(lora, idx: tuple) -> list:
    """``fd.apply``'s per-row LoRA restricted to the rows ``idx`` (renumbered 0..)."""
    out = []
    for ad, scale, *rows in lora:
        if not rows:
            out.append((ad, scale))
            continue
        keep = [k for k, r in enumerate(idx) if r in set(rows[0])]
        if keep:
            out.append((ad, scale) if len(keep) == len(idx) else (ad, scale, tuple(keep)))
    return out


def _take(streams: tuple, pos: list, n: int) -> tuple:
    return (
        streams if pos == list(range(n)) else _stages.take_streams(streams, torch.tensor(pos, device=streams[0].device))
    )


def _step(b: _Batch, configs: list, states: list, rows: list):
    s = b.all
    owner = [k for k, r in enumerate(rows) for _ in range(r)]
    first = [sum(rows[:k]) for k in range(len(rows))]
    img0 = s.image(s.streams)
    new = list(states)
    pre = {}  # item -> computes (MagCache, TaylorSeer: from the step count alone)
    for k, c in enumerate(configs):
        if isinstance(c, _cache.MagCache):
            pre[k], new[k] = _cache._mag_decide(c, states[k])
        elif isinstance(c, _cache.TaylorSeer) and c.modules is None:
            i, pre[k] = _cache._taylor_schedule(c, states[k])
            if not pre[k] and states[k].last is None:
                raise ValueError(f"cache: {c} would predict step {i} before any computed step")
    active = tuple(r for r in range(b.B) if pre.get(owner[r], True))
    attention = _Attention(b, configs, states, rows, first, owner)
    hooks = attention.hooks if attention.items else None
    img1 = r0 = head = None
    if active:
        head = b.run(_take(s.streams, list(active), b.B), active, slice(0, 1), hooks)
        img1 = s.image(head)
        r0 = img1 - img0.index_select(0, torch.tensor(active, device=img0.device))
    decide = _fbc_decisions(configs, states, rows, first, active, r0, s.seq)
    computes = tuple(r for r in active if decide.get(r, True))
    rest = None
    if computes:
        pos = [active.index(r) for r in computes]
        rest = s.image(b.run(_take(head, pos, len(active)), computes, slice(1, None), hooks))
    img = _assemble(configs, states, owner, first, img0, img1, rest, active, computes)
    out = s.final(img, s.ctx)
    kp = functools.partial(_cache._kept, s)  # an extract pass keeps the rows later steps compute
    out = _finish(configs, states, new, rows, first, pre, decide, out, img, img0, img1, r0, rest, active, computes, kp)
    attention.finish(out[1], out[0])
    gathered = sharding.gather(out[0], "sp", 1, s.seq)
    return (gathered, s.extra(s.ctx)) if s.extra is not None else gathered, out[1]


def _fbc_decisions(configs, states, rows, first, active, r0, seq) -> dict:
    """Row -> computes, for First-Block Cache rows: True on an item's first step, else its
    branch's relative change above the threshold (one sum over sp / ring for all rows)."""
    fbc = [k for k, c in enumerate(configs) if isinstance(c, _cache.FirstBlockCache)]
    out = {r: True for k in fbc if states[k].head is None for r in range(first[k], first[k] + rows[k])}
    compared = [k for k in fbc if states[k].head is not None]
    if not compared:
        return out
    rs = [r for k in compared for r in range(first[k], first[k] + rows[k])]
    pos = torch.tensor([active.index(r) for r in rs], device=r0.device)
    prev = torch.cat([states[k].head for k in compared])
    info = types.SimpleNamespace(n=len(rs), branch=list(range(len(rs))))
    num, den = _cache.branch_sums(r0.index_select(0, pos), prev, info, seq)
    ratio = iter(zip(num.tolist(), den.tolist()))
    for k in compared:
        for r in range(first[k], first[k] + rows[k]):
            n, d = next(ratio)
            out[r] = bool(n / d > configs[k].threshold)
    return out


def _assemble(configs, states, owner, first, img0, img1, rest, active, computes) -> torch.Tensor:
    """The image rows after the last block, each by its own decision."""
    parts = []
    for r in range(img0.shape[0]):
        k, j = owner[r], r - first[owner[r]]
        if r in computes:
            parts.append(rest[computes.index(r)])
        elif r in active:  # First-Block Cache skipping: block 0's output + its last tail
            parts.append(states[k].tail[j] + img1[active.index(r)])
        elif isinstance(configs[k], _cache.MagCache):
            parts.append(img0[r] + states[k].residual[j])
        else:  # TaylorSeer skipping: replaced by its extrapolated output after the final layer
            parts.append(img0[r])
    return torch.stack(parts)


def _finish(configs, states, new, rows, first, pre, decide, out, img, img0, img1, r0, rest, active, computes, kept):
    """The output (TaylorSeer's skipping rows extrapolated) and every item's new state
    (of what it keeps, ``kept``'s rows: on an extract pass, those the later steps compute)."""
    outs = list(out.split(rows))
    for k, c in enumerate(configs):
        sl = slice(first[k], first[k] + rows[k])
        st = new[k]
        if isinstance(c, _cache.FirstBlockCache):
            per = tuple(decide[r] for r in range(sl.start, sl.stop))
            pos = torch.tensor([active.index(r) for r in range(sl.start, sl.stop)], device=img.device)
            r_k, img1_k = kept(r0.index_select(0, pos)), img1.index_select(0, pos)
            tail = kept(img[sl] - img1_k)
            if all(per):
                new[k] = _cache.FBCState(r_k, tail, st.log + (per,))
            else:
                mask = torch.tensor(per, device=img.device).view(-1, 1, 1)
                new[k] = _cache.FBCState(
                    torch.where(mask, r_k, st.head), torch.where(mask, tail, st.tail), st.log + (per,)
                )
        elif isinstance(c, _cache.MagCache):
            if pre[k]:
                st = st._replace(residual=kept(img[sl] - img0[sl]))
            st = st._replace(step=st.step + 1, log=st.log + ((pre[k],) * rows[k],))
            new[k] = _cache.MagState(log=st.log) if st.step >= c.num_inference_steps else st
        elif isinstance(c, _cache.TaylorSeer) and c.modules is None:
            i, log = states[k].step + 1, st.log + ((pre[k],) * rows[k],)
            if pre[k]:
                factors = _cache._taylor_update(c, st.factors, st.last, kept(outs[k]), i)
                new[k] = _cache.TaylorState(i, i, factors, log, outs[k].dtype)
            else:
                outs[k] = _cache._taylor_predict(st.factors, i - st.last, st.dtype)
                new[k] = st._replace(step=i, log=log)
    return torch.cat(outs), new


class _Attention:
    """The attention-level caches of the batch (TaylorSeer with ``modules``, FasterCache):
    every block runs for their rows, and at each hooked attention module each item
    computes or reuses by its own decision. The module runs once for the rows of the call
    whenever any of them computes (its skipping rows' outputs are then replaced by their
    own extrapolation: compute is not saved there); when every row reuses, it does not
    run. `finish` writes each item's new state."""

    def __init__(self, b: _Batch, configs, states, rows, first, owner):
        self.owner, self.rows, self.first, self.configs, self.states = owner, rows, first, configs, states
        self.items, s = {}, b.all
        self.stages = s  # what an extract pass keeps (`cache._kept`)
        for k, c in enumerate(configs):
            if isinstance(c, _cache.TaylorSeer) and c.modules is not None:
                self.items[k] = self._taylor(c, states[k], s)
            elif isinstance(c, _cache.FasterCache):
                self.items[k] = self._faster(c, states[k], s, float(b.t[first[k]]) * 1000)

    @staticmethod
    def _taylor(c, st, s) -> dict:
        i, compute = _cache._taylor_schedule(c, st)
        skip = {n: any(re.fullmatch(p, n) for p in c.skip_modules) for n in s.attention}
        names = [n for n in s.attention if skip[n] or any(re.fullmatch(p, n) for p in c.modules)]
        _cache._require_modules(c, s, names)
        if not compute and st.last is None:
            raise ValueError(f"cache: {c} would predict step {i} before any computed step")
        return dict(i=i, compute=compute, skip=skip, names=set(names), old=st.factors or {}, new=dict(st.factors or {}))

    @staticmethod
    def _faster(c, st, s, ts: float) -> dict:
        hooked = c.block_skip_range is not None
        names = [n for n in s.attention if hooked and any(re.search(p, n) for p in c.modules)]
        if hooked:
            _cache._require_modules(c, s, names)
        low, high = c.timestep_skip_range
        n = st.iteration
        reuse = hooked and low < ts < high and not (n > 0 and n % c.block_skip_range == 0)
        weight = c.weight if callable(c.weight) else (lambda _: c.weight)
        old = st.outputs or {}
        return dict(reuse=reuse, weight=weight, names=set(names), old=old, new=dict(old), computed=0)

    def _reused(self, k: int, name: str):
        """Item ``k``'s own output of module ``name`` this step, or None when it computes."""
        e, c = self.items[k], self.configs[k]
        if isinstance(c, _cache.FasterCache):
            prev = e["old"].get(name)
            if not e["reuse"] or prev is None:
                return None
            return tuple(t1 + (t1 - t2) * e["weight"](name) for t2, t1 in zip(*prev))
        if e["compute"]:
            return None
        return _cache._module_predict(e["old"][name], e["i"] - self.states[k].last, e["skip"][name])

    def _record(self, k: int, name: str, outs: tuple, computed: bool) -> None:
        e, c = self.items[k], self.configs[k]
        if isinstance(c, _cache.FasterCache):
            prev = e["old"].get(name)
            e["new"][name] = (outs, outs) if prev is None else (prev[1], outs)
            e["computed"] += computed
        elif computed:
            st = self.states[k]
            e["new"][name] = _cache._module_update(c, e["old"].get(name), st.last, outs, e["i"], e["skip"][name])

    def hooks(self, idx: tuple) -> dict:
        """{module name: hook} for a call over the rows ``idx``."""
        names = set().union(*(e["names"] for e in self.items.values()))
        return {n: self._hook(n, idx) for n in names}

    def _hook(self, name: str, idx: tuple):
        def run(module):
            mine = {}  # item -> its positions in idx
            for p, r in enumerate(idx):
                mine.setdefault(self.owner[r], []).append(p)
            users = [k for k in mine if k in self.items and name in self.items[k]["names"]]
            reused = {k: self._reused(k, name) for k in users}
            everyone = len(users) == len(mine) and all(v is not None for v in reused.values())
            outs = None if everyone else _cache._wrap(module())
            parts = []
            for k, pos in mine.items():
                if k not in users:
                    continue
                if reused[k] is None:
                    own = tuple(o.index_select(0, torch.tensor(pos, device=o.device)) for o in outs)
                    self._record(k, name, _cache._kept(self.stages, own), True)
                else:
                    self._record(k, name, reused[k], False)
                    parts.append((pos, reused[k]))
            if outs is None:  # every row reuses: its items' rows, in order
                order = [k for k in mine]
                return _cache._unwrap(
                    tuple(torch.cat([reused[k][j] for k in order]) for j in range(len(reused[order[0]])))
                )
            for pos, vals in parts:
                i = torch.tensor(pos, device=outs[0].device)
                outs = tuple(o.index_copy(0, i, v.to(o.dtype)) for o, v in zip(outs, vals))
            return _cache._unwrap(outs)

        return run

    def finish(self, new: list, out: torch.Tensor) -> None:
        """Each attention-level item's new state (in ``new``)."""
        for k, e in self.items.items():
            c, st, n = self.configs[k], self.states[k], self.rows[k]
            if isinstance(c, _cache.FasterCache):
                log = st.log + ((e["computed"] == len(e["names"]),) * n,)
                new[k] = _cache.FasterState(st.iteration + 1, e["new"], log)
            else:
                log = st.log + ((e["compute"],) * n,)
                last = e["i"] if e["compute"] else st.last
                new[k] = _cache.TaylorState(e["i"], last, e["new"], log, out.dtype)

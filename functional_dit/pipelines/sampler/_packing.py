"""Items of several latent sizes in one model call (mixed resolutions, `functional_dit.sampling`).

The variable-length layout: each item's rows are padded to the call's longest image
(and, where the family masks text, its longest prompt), with ``fd.apply``'s ``img_valid``
hiding the padded image tokens from every key (and the text mask the padded text), a
RoPE table per row (each item's own positions) and, as in any call over several items,
a timestep, guidance and adapters per row. No item attends to another (attention is
per row) and a padded token is never attended to, so each item's prediction is its
prediction alone up to the summation order of a longer call (docs/serving.md). Padding
rather than one packed row with a block-diagonal mask: the core's modulation, RoPE and
key masks are already per row, so it adds one key mask and a per-row table to the
families, where packing would need per-token modulation in every block.

Which calls a step makes (`calls`): one over every item of a context where the family's
steps pack sizes (``Steps.packs_sizes``) and take each item (``Steps.packs``: not FLUX.2's
with reference images), no item has a step cache or an IP-Adapter
(their states are per call and per key), the params are not sharded and, for a family
without a text mask, the items share a text length; else one call per key, as before.
Steps whose items do not share calls (``shares_calls = False``) may still take several
items at once, those that pack (``Steps.predicts_items``: Qwen-Image 2.1 lays them into a
padded call per CFG branch itself, `Steps.predict_items`), and the others a call each.
"""

from __future__ import annotations

import dataclasses

import torch

from sharding.internal import is_dtensor

from ..families import Prompt, pad_to


def calls(params, ctx, items) -> list[list]:
    """The model calls a step makes over ``items`` of context ``ctx``: groups of items,
    in order (one per item where the family's items do not share calls)."""
    model = ctx.model
    if not model.shares_calls:  # one call per item, or the steps lay the items out themselves
        return _own_calls(params, ctx, items)
    keys = {it.key for it in items}
    if len(keys) == 1 or packs(params, ctx, items):
        return [list(items)]
    groups: dict = {}
    for it in items:
        groups.setdefault(it.key, []).append(it)
    return list(groups.values())


def _own_calls(params, ctx, items) -> list[list]:
    """Where the family's items do not share calls: the items that pack (`packs`, each
    alone: no step cache, IP-Adapter or context of its own) in the calls the steps lay
    them into (``Steps.predicts_items``), then one call for each other item."""
    together = [it for it in items if ctx.model.predicts_items and packs(params, ctx, [it])]
    if len(together) < 2:
        return [[it] for it in items]
    return [together] + [[it] for it in items if not any(it is o for o in together)]


def packs(params, ctx, items) -> bool:
    """Whether ``items`` (of context ``ctx``) may share one model call across sizes."""
    model = ctx.model
    if not getattr(model, "packs_sizes", False) or _sharded(params):
        return False
    if any(it.cache is not None or it.ip is not None or it.own is not None for it in items):
        return False
    if not all(model.packs(it.tables) for it in items):
        return False
    return model.masks_text or len({it.cond.txt.shape[1] for it in items}) == 1


def _sharded(params) -> bool:
    return is_dtensor(next(iter(params.flat().values())))


def padding(items) -> float:
    """A call's padded tokens over its real ones (1.0: nothing padded): each item's rows
    (two with true CFG) of text and image tokens, against the call's longest of each."""
    T, S = max(it.cond.txt.shape[1] for it in items), max(it.x.shape[1] for it in items)
    real = sum(it.rows * (it.cond.txt.shape[1] + it.x.shape[1]) for it in items)
    return sum(it.rows for it in items) * (T + S) / real


def by_size(items) -> list[list]:
    """``items`` grouped by their latent grid, in order (what one VAE decode takes)."""
    groups: dict = {}
    for it in items:
        groups.setdefault(it.hw, []).append(it)
    return list(groups.values())


def resolutions(items) -> int:
    """The image sizes (latent grids) among ``items``: a call with two or more is mixed."""
    return len({it.hw for it in items})


@dataclasses.dataclass(frozen=True)
class Layout:
    """One call's rows: text padded to ``T`` tokens, images to ``S``; None where every
    item has one key (the plain concatenation)."""

    T: int
    S: int

    def latents(self, items) -> torch.Tensor:
        """The call's latents: each item's rows (``[x; x]`` with true CFG) padded to S."""
        rows = [torch.cat([it.x, it.x]) if it.cfg is not None else it.x for it in items]
        return torch.cat([pad_to(x, 1, self.S) for x in rows])

    def text(self, items) -> Prompt:
        """The call's text: each item's rows padded to T with masked tokens."""
        conds = [it.cond for it in items]
        txt = torch.cat([pad_to(c.txt, 1, self.T) for c in conds])
        pooled = None if conds[0].pooled is None else torch.cat([c.pooled for c in conds])
        masks = [_ones(c) if c.mask is None else c.mask for c in conds]
        mask = torch.cat([pad_to(m, 1, self.T) for m in masks])
        mask = None if bool(mask.all()) else mask
        return Prompt(txt, pooled, mask, conds[0].txt_ids)

    def inputs(self, items, kw: dict) -> dict:
        """``fd.apply``'s keywords for the call: each row's RoPE table, the image mask (none
        where no row is padded: the unmasked attention kernel) and
        (Qwen-Image) each row's image shapes, in place of the first item's."""
        rows = [r for it in items for r in [it] * it.rows]
        tables = [self._table(it.tables["rope"], it) for it in items]
        rope = tuple(torch.cat([tb[k].expand(it.rows, -1, -1) for tb, it in zip(tables, items)]) for k in (0, 1))
        mask = torch.zeros(len(rows), self.S, dtype=torch.long, device=items[0].x.device)
        for r, it in enumerate(rows):
            mask[r, : it.x.shape[1]] = 1
        out = {**kw, "rope": rope} if bool(mask.all()) else {**kw, "rope": rope, "img_valid": mask}
        if "img_shapes" in kw:
            out["img_shapes"] = [it.tables["shapes"] for it in rows]
        return out

    def _table(self, pe, it) -> tuple:
        """An item's (cos, sin), its text then its image rows, each padded: (1, T + S, D)."""
        T = it.cond.txt.shape[1]
        return tuple(torch.cat([pad_to(a[:T], 0, self.T), pad_to(a[T:], 0, self.S)])[None] for a in pe)

    def unpad(self, pred: torch.Tensor, items) -> list:
        """The call's prediction, per item: its rows, its own image tokens."""
        return [p[:, : it.x.shape[1]] for p, it in zip(pred.split([it.rows for it in items]), items)]


def layout(items) -> Layout | None:
    """The padded layout of one call over ``items``; None where they share one key."""
    if len({it.key for it in items}) == 1:
        return None
    return Layout(max(it.cond.txt.shape[1] for it in items), max(it.x.shape[1] for it in items))


def _ones(c: Prompt) -> torch.Tensor:
    return torch.ones(c.txt.shape[:2], dtype=torch.long, device=c.txt.device)

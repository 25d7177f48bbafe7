"""``fd.sample(..., lora=...)``: LoRA adapters per request, as `fd.apply`'s per-row form.

``lora`` is a list of ``(adapter, scale)`` pairs for every prompt, or one such list per
prompt (``[[(a, 1.0)], [(b, 0.5)], []]``). Image ``i`` takes its prompt's list (prompt
``i // num_images_per_prompt``). Each model call of a chunk passes ``fd.apply`` the
adapters as ``(adapter, scale, rows)`` triples (`group`): the rows are Python ints known
before the call, and the model's batch is the chunk's images tiled once per CFG branch
(``[cond; uncond]``: row ``r`` is image ``r % n``), so an image's adapters act on both its
branches; ``fd.apply`` maps the rows to each dp rank's share. An adapter every row uses
goes as a plain pair (no gather). Nothing is merged: each row computes only its own
adapters' low-rank updates (docs/sampling.md, "LoRA").
"""

from __future__ import annotations

import hashlib

import torch

from ...lora import Adapter
from ...lora import internal as _lora


def _is_pair(entry) -> bool:
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], Adapter)


def per_image(params, lora, prompts: int, per_prompt: int) -> tuple | None:
    """``lora`` checked against ``params`` (before anything heavy) as one tuple of
    ``(adapter, scale)`` pairs per image; None for no adapters at all."""
    if lora is None:
        return None
    if isinstance(lora, Adapter) or not isinstance(lora, (list, tuple)):
        raise ValueError(
            f"lora: expected a list of (adapter, scale) pairs or one such list per prompt, got {type(lora).__name__}"
        )
    if all(_is_pair(e) for e in lora):  # one list for every prompt
        lists = [tuple(_lora.check(params, lora))] * prompts
    else:
        if len(lora) != prompts or not all(isinstance(e, (list, tuple)) and not _is_pair(e) for e in lora):
            raise ValueError(
                f"lora: expected a list of (adapter, scale) pairs (every prompt) or {prompts} lists of them (one per "
                f"prompt), got {len(lora)} entries: {lora!r:.120}"
            )
        lists = [tuple(_lora.check(params, e, f"lora[{p}]")) for p, e in enumerate(lora)]
    if not any(lists):
        return None
    return tuple(lists[i // per_prompt] for i in range(prompts * per_prompt))


def local(items: tuple | None, mesh) -> tuple | None:
    """``items`` with each adapter as its local view (checked to be on ``mesh``), for a dp
    group that calls ``fd.apply`` on the params' local view; each adapter converted once."""
    if items is None:
        return None
    seen: dict = {}
    for pairs in items:
        for ad, s in pairs:
            if id(ad) not in seen:
                seen[id(ad)] = _lora.local_adapters([(ad, s)], mesh)[0][0]
    return tuple(tuple((seen[id(ad)], s) for ad, s in pairs) for pairs in items)


def fingerprint(items: tuple | None):
    """Per image, a digest of each adapter's config (base, modules, ranks, alphas) and its
    scale: what the ranks that compute the same images must agree on (`_ranks.check`; the
    factors themselves are per-rank shards)."""
    if items is None:
        return None
    key = {id(ad): hashlib.sha1(repr(ad.config).encode()).hexdigest()[:16] for pairs in items for ad, _ in pairs}
    return tuple(tuple((key[id(ad)], float(s)) for ad, s in pairs) for pairs in items)


def group(per_row: list) -> list[tuple]:
    """``fd.apply``'s ``lora=`` from each row's (adapter, scale) pairs: each distinct
    (adapter, scale) with its rows, a plain pair when it covers every row."""
    groups: dict = {}
    for r, pairs in enumerate(per_row):
        for ad, s in pairs:
            key = (id(ad), id(s) if isinstance(s, torch.Tensor) else s)
            groups.setdefault(key, (ad, s, []))[2].append(r)
    batch = len(per_row)
    return [(ad, s) if len(rs) == batch else (ad, s, tuple(rs)) for ad, s, rs in groups.values()]

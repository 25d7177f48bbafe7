"""A family's forward as stages: embed → block segments → final, written once.

Each family module builds its forward as `Stages` (``fam.stages(params, x, t, txt,
**check_inputs_output)``) and its ``forward`` runs them (`Stages.forward`): the streams
entering the first block, the segments of identical blocks in order, the final layer.
Whatever needs to stop between blocks uses the same object: the step caches
(`functional_dit.pipelines.cache`) run block 0, decide, then run the rest on all, some or
none of the batch items (`Stages.blocks`, `Stages.run`, `Stages.take`); the XLA
fixed-graph sampler hands a whole segment to `nn.scan.layers` (`Stages.forward`); the
attention-level caches pass a hook per attention module (a ctx entry ``"attn"``,
``{stock module name: hook}``, given to each block's ``attn`` argument).

Streams are a tuple of (B, S, C) tensors in the local view: ``(img, txt)`` through FLUX's
double blocks, ``(x,)`` = (txt; img) through its single blocks; each family says which
rows are the image's (``image``). ``ctx`` holds what the blocks read besides the streams
(RoPE table, key bias, per-block modulations and residuals); ``batched`` names its
batch-first entries, so `Stages.take` can cut it to a subset of batch items.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import sharding
from sharding.internal import gathered_blocks

from ..params import ordered_blocks
from . import scan as _scan


def same(streams: tuple) -> tuple:
    """A segment's ``enter`` that takes the streams as they are."""
    return streams


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of blocks of one kind: ``step(carry, p, layer, ctx, static) -> carry`` per
    block (the `nn.scan.layers` step; ``carry`` a tuple of streams), ``layer`` the block's
    entries of the ctx lists ``per_layer``, ``ctx`` the stages' ctx (scanned: only its
    ``consts`` entries), with ``"hook"`` the block's attention hook when one is given.
    ``enter(streams) -> carry`` makes the previous segment's streams this one's (and
    leaves its own as they are). ``name``: the params' block list (the scan's key);
    ``blocks``: its params when not ``ordered_blocks(params, name)``; ``attention``: the
    stock name of block i's attention module (``attention.format(i)``), None when the
    block takes no hook; ``scan``: whether `Stages.forward` may scan it."""

    name: str
    step: Callable
    per_layer: tuple = ()
    consts: tuple = ()
    static: tuple = ()
    enter: Callable = same
    attention: str | None = None
    blocks: list | None = None
    scan: bool = True


@dataclasses.dataclass(frozen=True)
class Block:
    """Block ``i`` of segment ``segment``, its params ``p`` (under fsdp a `sharding`
    ``GatheredBlock`` of its local shards, gathered by `Stages.run`)."""

    segment: Segment
    p: object
    i: int

    @property
    def attention(self) -> str | None:
        """The stock name of its attention module (where hooks attach), or None."""
        return None if self.segment.attention is None else self.segment.attention.format(self.i)

    def run(self, p, streams: tuple, ctx: dict) -> tuple:
        """The block on ``streams`` with its gathered params ``p``."""
        seg = self.segment
        hook = ctx.get("attn", {}).get(self.attention) if self.attention is not None else None
        layer = tuple(ctx[k][self.i] for k in seg.per_layer)
        return seg.step(seg.enter(streams), p, layer, ctx if hook is None else dict(ctx, hook=hook), seg.static)


@dataclasses.dataclass
class Stages:
    """``streams`` before block 0, ``segments`` in order, ``ctx`` what they read,
    ``final(img, ctx) -> out`` on the image rows ``image(streams)``; ``txt_len`` the
    local text rows, ``seq`` the full length of the output rows, ``batched`` the ctx keys
    whose tensors (or lists/tuples of them) are batch-first, ``halved`` those stacked as
    [a; b] halves of (2B, ...); ``extra(ctx)``: the forward's second output (an
    extracted KV cache), or None; ``keep``: on such an extract pass whose later steps
    compute fewer rows (Qwen-Image 2.1's target only), the trailing rows they compute,
    what a step cache keeps; ``params`` the (local) params the blocks come from."""

    params: object
    streams: tuple
    segments: tuple
    ctx: dict
    final: Callable
    image: Callable
    txt_len: int
    seq: int
    batched: tuple = ()
    halved: tuple = ()
    extra: Callable | None = None
    keep: int | None = None

    @property
    def blocks(self) -> list[Block]:
        """Every block of every segment, in order."""
        out = []
        for seg in self.segments:
            ps = ordered_blocks(self.params, seg.name) if seg.blocks is None else seg.blocks
            out += [Block(seg, p, i) for i, p in enumerate(ps)]
        return out

    @property
    def attention(self) -> tuple[str, ...]:
        """The stock names of the attention modules that take a hook, in block order."""
        return tuple(b.attention for b in self.blocks if b.attention is not None)

    def run(self, streams: tuple, blocks, ctx: dict | None = None) -> tuple:
        """``blocks`` (`Block`s, in order) on ``streams``. Fully sharded params: each
        block's weights all-gathered before it computes, the next block's gather issued
        first (`sharding.internal.gathered_blocks`)."""
        ctx = self.ctx if ctx is None else ctx
        blocks = list(blocks)
        for block, p in zip(blocks, gathered_blocks([b.p for b in blocks])):
            streams = block.run(p, streams, ctx)
        return streams

    def forward(self):
        """The family's forward on these stages: every segment (a scannable one through
        `nn.scan.layers`), the final layer; returns (out, extra or None)."""
        streams = self.streams
        for seg in self.segments:
            if seg.scan and seg.blocks is None:
                per_layer = tuple(self.ctx[k] for k in seg.per_layer)
                consts = {k: self.ctx[k] for k in seg.consts}
                streams = _scan.layers(
                    self.params, seg.name, seg.step, seg.enter(streams), per_layer, consts, seg.static
                )
            else:
                streams = self.run(streams, [b for b in self.blocks if b.segment is seg])
        out = self.final(self.image(streams), self.ctx)
        return out, None if self.extra is None else self.extra(self.ctx)

    def gather_only(self, blocks) -> None:
        """Take part in ``blocks``' all-gathers over "fsdp" without computing: a fully
        sharded rank whose batch items all reuse a cached value while its peers' compute
        (their gathers need every fsdp rank). Nothing without an fsdp axis."""
        if sharding.axis_size("fsdp") > 1:
            for _ in gathered_blocks([b.p for b in blocks]):
                pass

    def take(self, idx: torch.Tensor) -> dict:
        """ctx for the batch items ``idx`` (a long tensor of local indices)."""
        out = {}
        for k, v in self.ctx.items():
            out[k] = _take(v, idx, k in self.halved) if k in self.batched or k in self.halved else v
        return out


def _take(v, idx, halved: bool = False):
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a NamedTuple (a block's cached keys and values)
        return type(v)(*(_take(a, idx, halved) for a in v))
    if isinstance(v, (list, tuple)):
        return type(v)(_take(a, idx, halved) for a in v)
    if not isinstance(v, torch.Tensor):  # None, a scale
        return v
    if halved:  # (2B, ...) = [a; b]: each half's items
        return v.unflatten(0, (2, -1)).index_select(1, idx).flatten(0, 1)
    return v.index_select(0, idx)


def take_streams(streams: tuple, idx: torch.Tensor) -> tuple:
    """The batch items ``idx`` of every stream."""
    return tuple(s.index_select(0, idx) for s in streams)


def joint(streams: tuple) -> tuple:
    """``(img, txt)`` as the joint ``((txt; img),)``; a joint stream as it is (a single
    block segment's ``enter``)."""
    return streams if len(streams) == 1 else (torch.cat([streams[1], streams[0]], 1),)


def image_rows(txt_len: int) -> Callable:
    """``image`` for FLUX-style streams: ``img`` of ``(img, txt)``, the rows after the
    ``txt_len`` text rows of a joint ``(x,)``."""

    def image(streams: tuple) -> torch.Tensor:
        return streams[0] if len(streams) == 2 else streams[0][:, txt_len:]

    return image

"""Fully sharded parameters in the local view: just-in-time all-gathers over "fsdp".

A `FullyShard` leaf holds 1/N of its tp slice per rank. ``fd.apply`` gathers the
non-block leaves (embedders, final layer) once per call and wraps every block of the
tree in a `GatheredBlock`: a read-only mapping over the block's local shards that
all-gathers a leaf when the model reads it, keeps nothing, and lets the block loop
(`functional_dit.nn.scan.layers`) *prefetch* the next block — issue its all-gathers
(async functional collectives) before the current block computes, and wait only when a
leaf is read. Peak parameter memory per rank is then about params / N + the block
computing + the one prefetched (docs/sharding.md, "Fully sharded parameters"), as
torch's FSDP2 and ZeRO-3 do.

Autograd: a gathered leaf's backward reduce-scatters its gradient over "fsdp" (the sum
of every fsdp rank's share, this rank's slice), so each rank keeps only its gradient
shard; with ``fsdp_options(reduce="all_reduce")`` it all-reduces and slices instead
(runtimes where consecutive reduce-scatters are unsafe, the Neuron runtime). The
gathered weights a block's backward needs are kept by autograd (also under
``fd.apply(checkpoint=True)``, whose recomputation takes the gathered block as input);
with ``fsdp_options(reshard_after_forward=True)`` autograd keeps the local shard instead
and backward all-gathers the weight again when it needs it (`resharded`; eager only).

Under torch.compile the gathers trace as they run: each is the raw functional collective
op (``_c10d_functional.all_gather_into_tensor``), waited (``wait_tensor``) where the block
reads its leaves, so the prefetch stays in the compiled graph. A fused layout
(`fd.prepare`: leaves that are consecutive segments of one local buffer) survives the
gather (`_keep_row_groups`); a scan over stacked shards gathers its block in the body
(`BlockGather`).

Leaves attached to the tree in tuples (LoRA factors, ``layer["lora"] = ((A, B, ...), ...)``)
are gathered with their block when ``wrap_tree`` is told their dims (``extra``). A leaf
stored in another dtype than it reads as (layerwise fp8 storage: a wrapper tensor subclass
over one inner tensor) is gathered as its stored bytes and wrapped again (`_stored`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from . import _autodiff
from ._axes import _axis, _group, _layout, _name, current_mesh
from ._plan import FSDP, FullyShard, plan
from .tree import leaves

_OPTIONS: list = [{"prefetch": True, "reduce": "reduce_scatter", "reshard": False}]  # innermost last
_REDUCES = ("reduce_scatter", "all_reduce")


@contextlib.contextmanager
def fsdp_options(prefetch: bool | None = None, reduce: str | None = None, reshard_after_forward: bool | None = None):
    """Within: how fully sharded params are gathered and reduced.

    ``prefetch``: issue the next block's all-gathers before the current block computes
    (default True); False gathers each block when it starts (for comparison).
    ``reduce``: the gradient reduction of a gathered leaf, "reduce_scatter" (default) or
    "all_reduce" (an all-reduce and this rank's slice: no reduce-scatter anywhere, for the
    Neuron runtime, where consecutive reduce-scatters are unsafe).
    ``reshard_after_forward``: False (default) keeps the gathered block weights that
    autograd saves for backward; True saves the local shard instead and all-gathers the
    weight again when backward needs it (FSDP2's ``reshard_after_forward=True``): parameter
    memory between forward and backward stays at params / N, for one more all-gather per
    saved weight in backward. Blocks under ``fd.apply(checkpoint=True)`` keep their gathered
    inputs either way (the checkpoint holds them for the recomputation).
    Read when the forward runs; the backward uses what the forward recorded."""
    if prefetch is not None and not isinstance(prefetch, bool):
        raise ValueError(f"prefetch: expected True, False or None, got {prefetch!r}")
    if reduce is not None and reduce not in _REDUCES:
        raise ValueError(f"reduce: expected one of {_REDUCES} or None, got {reduce!r}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward: expected True, False or None, got {reshard_after_forward!r}")
    now = dict(_OPTIONS[-1])
    given = (("prefetch", prefetch), ("reduce", reduce), ("reshard", reshard_after_forward))
    now.update({k: v for k, v in given if v is not None})
    _OPTIONS.append(now)
    try:
        yield
    finally:
        _OPTIONS.pop()


def prefetching() -> bool:
    """Whether block gathers are issued one block ahead now (`fsdp_options`' ``prefetch``)."""
    return _OPTIONS[-1]["prefetch"]


def fsdp_size() -> int:
    """The size of the bound mesh's "fsdp" axis (1 when none)."""
    return _axis(FSDP)[0]


@functools.lru_cache(maxsize=64)
def _dims(config, names: tuple, shape: tuple) -> dict:
    """``{dotted path: dim}`` of the leaves the default plan fully shards on the mesh."""
    return {p: pl.dim for p, pl in leaves(plan(config, dict(zip(names, shape)))) if isinstance(pl, FullyShard)}


def _constant(fn):
    """``fn`` (pure, over a config and a mesh layout; its result nested dicts) read eagerly
    under torch.compile, its result a constant of the traced graph (as `_axes._layout`):
    dynamo would otherwise trace the whole `plan` at every compile (~60 % of the bytecode
    it traced for a tiny FLUX.1). The constant crosses as nested tuples of items (dynamo
    cannot guard a dict constant) and is rebuilt as dicts in the traced code."""
    mark = getattr(torch.compiler, "assume_constant_result", None)
    if mark is None:
        return fn
    frozen = mark(lambda *args: _freeze(fn(*args)))  # a plain function: dynamo looks through lru_cache
    return lambda *args: _thaw(frozen(*args)) if torch.compiler.is_compiling() else fn(*args)


def _freeze(x):
    if isinstance(x, dict):
        return ("dict", tuple((k, _freeze(v)) for k, v in x.items()))
    return ("tuple", tuple(_freeze(v) for v in x)) if isinstance(x, tuple) else x


def _thaw(x):
    if not isinstance(x, tuple):
        return x
    kind, items = x
    return {k: _thaw(v) for k, v in items} if kind == "dict" else tuple(_thaw(v) for v in items)


_dims = _constant(_dims)


def _is_dtensor(x) -> bool:
    """Whether ``x`` is a DTensor (`sharding.internal.is_dtensor`, which imports this module)."""
    if not dist.is_available():
        return False
    return isinstance(x, DTensor)


def fsdp_degree(params) -> int:
    """The "fsdp" size of the mesh of ``params``' DTensor leaves (``Params`` or a tree); 1 when
    plain or when the mesh has no fsdp axis."""
    tree = params.tree if hasattr(params, "tree") and hasattr(params, "config") else params
    for _, x in leaves(tree):
        if _is_dtensor(x):
            return mesh_fsdp(x.device_mesh)
    return 1


def mesh_fsdp(mesh) -> int:
    """The size of ``mesh``'s "fsdp" axis (1 when it has none); traceable by dynamo."""
    names, sizes, _ = _layout(mesh)
    return sizes[names.index(FSDP)] if FSDP in names else 1


def refuse_fsdp(params, feature: str, instead: str = "") -> None:
    """A ValueError when ``params`` are fully sharded (an fsdp axis > 1) and ``feature``
    does not support that yet, naming both."""
    n = fsdp_degree(params)
    if n > 1:
        raise ValueError(
            f"fsdp: {feature} is not supported with fully sharded params (a mesh with fsdp={n}) yet"
            + (f"; {instead}" if instead else "")
        )


def gather_dims(config, mesh) -> dict[str, int]:
    """``{dotted path: dim}`` of the leaves the default plan fully shards on ``mesh``."""
    return _dims(config, tuple(mesh.mesh_dim_names), tuple(mesh.shape))


# ----------------------------------------------------------------------------- stored leaves


def _stored(x: torch.Tensor) -> torch.Tensor | None:
    """The inner tensor of ``x`` when ``x`` is a wrapper tensor subclass over one inner
    tensor (torch's ``__tensor_flatten__`` protocol) that reads as another dtype than it
    holds: layerwise storage (``functional_dit.nn.layerwise.CastTensor``, fp8 held, read as
    bf16), whose gather moves the stored bytes, not the computed dtype. None otherwise."""
    if type(x) is torch.Tensor or not hasattr(x, "__tensor_flatten__"):
        return None
    names, _ = x.__tensor_flatten__()
    inner = getattr(x, names[0]) if len(names) == 1 else None
    return inner if isinstance(inner, torch.Tensor) and inner.dtype != x.dtype else None


def _rewrap(x: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (a gathered inner tensor of the wrapper ``x``) wrapped as ``x`` is."""
    names, ctx = x.__tensor_flatten__()
    return type(x).__tensor_unflatten__({names[0]: full}, ctx, full.shape, full.stride())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous ``t`` as raw bytes (its last dim times the item size): what an
    all-gather moves for any storage dtype (gloo has no float8)."""
    return t.contiguous().view(torch.uint8)


# ----------------------------------------------------------------------------- the collective


def _start(x: torch.Tensor, dim: int):
    """Issue the all-gather of ``x`` over fsdp along ``dim`` (async; nothing waits); a
    stored leaf (`_stored`) sends its stored bytes."""
    inner = _stored(x)
    sent = _bytes(inner.detach().movedim(dim, 0)) if inner is not None else x.detach().movedim(dim, 0).contiguous()
    return _autodiff.issue_all_gather(sent, _axis(FSDP)[0], _name(FSDP))


def _finish(x: torch.Tensor, dim: int, pending) -> torch.Tensor:
    """The gathered leaf from the `_start` handle ``pending``, differentiable w.r.t. ``x``."""
    inner = _stored(x)
    if inner is None:
        full = _autodiff.waited(pending).movedim(0, dim)
    else:
        full = _rewrap(x, _autodiff.waited(pending).view(inner.dtype).movedim(0, dim))
    if not (torch.is_grad_enabled() and x.requires_grad):
        return full
    n, index = _axis(FSDP)
    return Gathered.apply(x, full, dim, n, index, _group(FSDP), _OPTIONS[-1]["reduce"])


def gather_leaf(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` (a local shard) all-gathered over fsdp along ``dim``, now."""
    return _finish(x, dim, _start(x, dim))


class Gathered(torch.autograd.Function):
    """Forward: the gathered ``full`` (computed outside, possibly prefetched). Backward:
    the gradient summed over fsdp, this rank's slice (reduce-scatter, or all-reduce and
    slice)."""

    @staticmethod
    def forward(x, full, dim, n, index, group, reduce):
        return full.view_as(full)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, ctx.dim, ctx.n, ctx.index, ctx.group, ctx.reduce = inputs

    @staticmethod
    def backward(ctx, g):
        return _reduce(g, ctx.dim, ctx.n, ctx.index, ctx.group, ctx.reduce), None, None, None, None, None, None


def _reduce(g: torch.Tensor, dim: int, n: int, index: int, group, reduce: str) -> torch.Tensor:
    funcol = _autodiff._funcol()
    if reduce == "all_reduce":
        chunk = g.shape[dim] // n
        return _autodiff.all_reduce(g.contiguous(), group).narrow(dim, index * chunk, chunk).contiguous()
    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    out = _autodiff._done(scatter(g.movedim(dim, 0).contiguous(), "sum", 0, group))
    return out.movedim(0, dim).contiguous()  # see BlockGathered.backward


# ----------------------------------------------------------------------------- one block at once


def _pack(xs, dims) -> torch.Tensor:
    """Every leaf with its fsdp dim moved first, flattened and concatenated: (sum of numels,).
    Outside autocast: the leaves are of one dtype, and autocast's ``cat`` rejects fp8 ones
    (`fd.layerwise_cast` storages) under a bf16 autocast region."""
    with torch.autocast(xs[0].device.type, enabled=False):
        return torch.cat([x.detach().movedim(d, 0).reshape(-1) for x, d in zip(xs, dims)])


def _start_block(xs, dims, axis: str = FSDP) -> list:
    """Issue the all-gathers of a block's fully sharded leaves (async) over the bound mesh's
    ``axis``: one per dtype among them (bf16 weights and fp32 LoRA factors are not promoted
    to one buffer; stored leaves, `_stored`, by their storage dtype, sent as bytes), as a
    list of ``(indices into xs, handle)``. ``axis`` is "fsdp" for ``fd.apply``; callers
    gathering torch modules' layers may name another axis (the pipeline text encoders gather
    over "tp" on a mesh without fsdp)."""
    groups: dict = {}
    for i, x in enumerate(xs):
        inner = _stored(x)
        groups.setdefault((x.dtype, None if inner is None else inner.dtype), []).append(i)
    out, n, name = [], _axis(axis)[0], _name(axis)
    for (_, stored), ix in groups.items():
        leaves = [xs[i] if stored is None else _stored(xs[i]) for i in ix]
        buf = _pack(leaves, [dims[i] for i in ix])
        out.append((ix, _autodiff.issue_all_gather(buf if stored is None else _bytes(buf), n, name)))
    return out


def _unpack(rows: torch.Tensor, xs, dims) -> list:
    """The leaves from (n, L) rows (row r: rank r's packed shards), each gathered on its dim."""
    out, offset, n = [], 0, rows.shape[0]
    for x, d in zip(xs, dims):
        moved = x.movedim(d, 0).shape
        piece = rows[:, offset : offset + x.numel()].reshape(n * moved[0], *moved[1:])
        out.append(piece.movedim(0, d))
        offset += x.numel()
    return out


def _finish_block(xs, dims, pending, axis: str = FSDP) -> list:
    """The gathered leaves of `_start_block`'s ``pending`` (over ``axis``); those that
    require grad are differentiable w.r.t. their shards through one `BlockGathered` (one
    reduce-scatter for all of them in backward; frozen leaves, such as base weights under
    LoRA training, send no gradient)."""
    n, index = _axis(axis)
    fulls = [None] * len(xs)
    for ix, handle in pending:
        rows = _autodiff.waited(handle).view(n, -1)
        inner = [_stored(xs[i]) for i in ix]
        if inner[0] is not None:  # stored leaves: the bytes back in their storage dtype, each rewrapped
            rows = rows.view(inner[0].dtype)
            for i, full in zip(ix, _unpack(rows, inner, [dims[i] for i in ix])):
                fulls[i] = _rewrap(xs[i], full)
            continue
        for i, full in zip(ix, _unpack(rows, [xs[i] for i in ix], [dims[i] for i in ix])):
            fulls[i] = full
    req = [i for i, x in enumerate(xs) if x.requires_grad] if torch.is_grad_enabled() else []
    if not req:
        return fulls
    meta = (tuple(dims[i] for i in req), n, index, _group(axis), _OPTIONS[-1]["reduce"], len(req))
    for i, full in zip(req, BlockGathered.apply(meta, *(xs[i] for i in req), *(fulls[i] for i in req))):
        fulls[i] = full
    return fulls


class BlockGathered(torch.autograd.Function):
    """Forward: a block's gathered leaves (computed outside, possibly prefetched). Backward:
    every leaf's gradient packed into one buffer, summed over fsdp with one reduce-scatter
    (or one all-reduce and this rank's rows), and unpacked into this rank's shards."""

    @staticmethod
    def forward(meta, *args):
        k = meta[-1]
        return tuple(f.view_as(f) for f in args[k:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.meta = inputs[0]
        ctx.shapes = [(tuple(x.shape), x.dtype, x.device) for x in inputs[1 : 1 + inputs[0][-1]]]

    @staticmethod
    def backward(ctx, *gs):
        dims, n, index, group, reduce, k = ctx.meta
        rows = []
        for g, (shape, dtype, device), d in zip(gs, ctx.shapes, dims):
            full = list(shape)
            full[d] *= n
            g = torch.zeros(full, dtype=dtype, device=device) if g is None else g
            rows.append(g.movedim(d, 0).reshape(n, -1))  # row r: rank r's slice of this leaf
        flat = torch.cat(rows, 1).contiguous()  # (n, L)
        if reduce == "all_reduce":
            mine = _autodiff.all_reduce(flat, group)[index]
        else:
            funcol = _autodiff._funcol()
            scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
            mine = _autodiff._done(scatter(flat.view(-1), "sum", 0, group))
        out, offset = [], 0
        for (shape, dtype, _), d in zip(ctx.shapes, dims):
            moved = (shape[d], *shape[:d], *shape[d + 1 :])
            numel = math.prod(shape)
            # contiguous like the leaf: a strided grad makes DTensor run an op (sharding propagation
            # over the 5-dim mesh: seconds) to accumulate it
            out.append(mine[offset : offset + numel].view(moved).movedim(0, d).to(dtype).contiguous())
            offset += numel
        return (None, *out, *([None] * k))


# ----------------------------------------------------------------------------- the blocks


class GatheredBlock(Mapping):
    """One block's local shards, read as the block's full (tp-local) leaves: reading a
    fully sharded leaf all-gathers it (a prefetched one waits for its gather). Nothing is
    kept: a leaf read twice is gathered twice. A pytree node whose leaves are the local
    shards (so autograd checks and ``torch.utils.checkpoint`` see them).

    ``dims``: ``{path in the block: dim}``; ``pending`` (shared by the views of sub-dicts)
    and ``prefix`` (this view's path in the block) are internal."""

    __slots__ = ("_tree", "_dims", "_pending", "_prefix", "_flat")

    def __init__(self, tree: Mapping, dims: Mapping[str, int], pending: dict | None = None, prefix: str = ""):
        self._tree, self._dims, self._prefix = tree, dims, prefix
        self._pending = {} if pending is None else pending
        self._flat = None  # the block's one coalesced all-gather, once issued (`prefetch`)

    def __getitem__(self, key):
        x, path = self._tree[key], f"{self._prefix}{key}"
        if isinstance(x, Mapping):
            return GatheredBlock(x, self._dims, self._pending, f"{path}.")
        if isinstance(x, tuple):  # a tuple of leaves (LoRA factors attached to a layer): each gathered now
            inner = {p[len(path) + 1 :]: d for p, d in self._dims.items() if p.startswith(f"{path}.")}
            return _replaced(x, {p: gather_leaf(_get(x, p), d) for p, d in inner.items()}, "") if inner else x
        dim = self._dims.get(path)
        if dim is None:
            return x
        pending = self._pending.pop(path, None)
        return _finish(x, dim, pending if pending is not None else _start(x, dim))

    def __iter__(self):
        return iter(self._tree)

    def __len__(self):
        return len(self._tree)

    def _leaves(self) -> tuple[list, list, list]:
        paths = list(self._dims)
        return paths, [_get(self._tree, p) for p in paths], [self._dims[p] for p in paths]

    def prefetch(self) -> None:
        """Issue the block's all-gather (one for all its fully sharded leaves, async)."""
        if self._flat is None and self._dims:
            _, xs, dims = self._leaves()
            self._flat = _start_block(xs, dims)

    def gathered(self, saved: dict | None = None) -> dict:
        """The block as plain nested dicts of its gathered leaves: the one coalesced gather
        (`prefetch`'s, or issued now), waited here. What a block loop computes with.
        ``saved`` (a dict) receives ``{storage pointer of a gathered leaf: (its shard, dim)}``
        (`resharded`)."""
        if not self._dims:
            return self._tree
        paths, xs, dims = self._leaves()
        pending, self._flat = self._flat if self._flat is not None else _start_block(xs, dims), None
        fulls = _finish_block(xs, dims, pending)
        if saved is not None:
            saved.update({f.untyped_storage().data_ptr(): (x, d) for f, x, d in zip(fulls, xs, dims)})
        return _replaced(self._tree, _keep_row_groups(self._tree, dict(zip(paths, fulls))), "")


def stored_block(block):
    """A block's stored leaves (this rank's shards) as they are, gathering nothing: a
    `GatheredBlock`'s tree; anything else itself. For code that inspects the stored layout
    (`fd.prepare`'s fused buffers) rather than computing with the block."""
    return block._tree if isinstance(block, GatheredBlock) else block


class BlockGather:
    """Gathers a block's local shards as `GatheredBlock.gathered` does (one coalesced
    all-gather, waited at once), for a block loop that holds the shards itself: a scan over
    stacked blocks gathers each block in its body. Hashable by its dims (a scan caches its
    body by identity)."""

    __slots__ = ("dims", "_key")

    def __init__(self, dims: Mapping[str, int]):
        self.dims, self._key = dict(dims), tuple(sorted(dims.items()))

    def __call__(self, tree: Mapping) -> dict:
        return GatheredBlock(tree, self.dims).gathered()

    def __eq__(self, other):
        return isinstance(other, BlockGather) and other._key == self._key

    def __hash__(self):
        return hash(self._key)


def block_gather(block) -> BlockGather | None:
    """How to gather blocks shaped like ``block`` (a `GatheredBlock`) from their shards;
    None for a block that is not fully sharded."""
    return BlockGather(block._dims) if isinstance(block, GatheredBlock) and block._dims else None


def _keep_row_groups(tree: Mapping, full: dict) -> dict:
    """``full`` (``{path: gathered leaf}`` of the block ``tree``'s fully sharded leaves) with
    each run of the block's leaves that are consecutive segments of one local buffer (a
    fused layout: `fd.prepare` lays q, k, v out as row views of one buffer) made rows of one
    gathered buffer too, so the layout survives the gather (one more copy of those leaves).
    A leaf that is not fully sharded joins its run as it is (a bias kept whole over fsdp).
    Eager inference only: traced code and autograd never read the fused layout."""
    if torch.compiler.is_compiling() or any(f.requires_grad for f in full.values()):
        return full
    runs: dict = {}
    for path, x in leaves(tree):
        if type(x) is torch.Tensor and x.ndim and x.is_contiguous():
            runs.setdefault(x.untyped_storage().data_ptr(), []).append((x, full.get(path, x), path))
    out = dict(full)
    for run in runs.values():
        if len(run) < 2:
            continue
        run.sort(key=lambda r: r[0].storage_offset())
        group = run[:1]
        for item in [*run[1:], None]:
            if item is not None and _follows(group[-1], item):
                group.append(item)
                continue
            if len(group) > 1:
                buffer = torch.cat([f for _, f, _ in group])
                out.update({p: v for (_, f, p), v in zip(group, buffer.split([f.shape[0] for _, f, _ in group]))})
            group = [item]
    return out


def _follows(first: tuple, then: tuple) -> bool:
    """Whether local leaf ``then[0]`` starts where ``first[0]`` ends in their storage and
    their gathered leaves (``[1]``) stack as rows (same dtype and trailing shape)."""
    (a, full_a, _), (b, full_b, _) = first, then
    return (
        b.storage_offset() == a.storage_offset() + a.numel()
        and full_a.dtype == full_b.dtype
        and full_a.shape[1:] == full_b.shape[1:]
    )


def _items(node):
    """A container's ``(key, child)`` pairs: a mapping's items, a tuple's ``("0", x0), ...``
    (LoRA attaches ``(A, B, ...)`` tuples to layer dicts; their factors are leaves too)."""
    return node.items() if isinstance(node, Mapping) else ((str(i), x) for i, x in enumerate(node))


def _replaced(tree, full: dict, prefix: str):
    """``tree`` (nested dicts and tuples) with the leaves at the paths of ``full`` replaced."""
    out = {
        k: _replaced(x, full, f"{prefix}{k}.") if isinstance(x, (Mapping, tuple)) else full.get(f"{prefix}{k}", x)
        for k, x in _items(tree)
    }
    return out if isinstance(tree, Mapping) else tuple(out.values())


def _get(tree, path: str):
    for part in path.split("."):
        tree = tree[part] if isinstance(tree, Mapping) else tree[int(part)]
    return tree


def _flatten_block(b: GatheredBlock):
    return [b._tree], (b._dims, b._prefix)


def _unflatten_block(children, context):
    dims, prefix = context
    return GatheredBlock(children[0], dims, None, prefix)


pytree.register_pytree_node(GatheredBlock, _flatten_block, _unflatten_block)


@functools.lru_cache(maxsize=64)
def _grouped(config, names: tuple, shape: tuple) -> tuple[dict, dict]:
    """(``{block path: {path in block: dim}}``, ``{other path: dim}``) of `gather_dims`: a
    block is ``name.i`` or ``name.sub.i`` (the first all-digit part among the second and third)."""
    blocks, other = {}, {}
    for path, dim in _dims(config, names, shape).items():
        parts = path.split(".")
        j = next((j for j in (1, 2) if j < len(parts) - 1 and parts[j].isdigit()), None)
        if j is None:
            other[path] = dim
        else:
            blocks.setdefault(".".join(parts[: j + 1]), {})[".".join(parts[j + 1 :])] = dim
    return blocks, other


_grouped = _constant(_grouped)


def _with_extra(blocks: dict, other: dict, extra: Mapping[str, int]) -> tuple[dict, dict]:
    """`_grouped`'s pair with the ``extra`` ``{path: dim}`` (leaves attached to the tree, such
    as LoRA factors) added: to the block whose path prefixes theirs, else to the others."""
    if not extra:
        return blocks, other
    blocks, other = {b: dict(d) for b, d in blocks.items()}, dict(other)
    for path, dim in extra.items():
        block = next((b for b in blocks if path.startswith(f"{b}.")), None)
        if block is None:
            other[path] = dim
        else:
            blocks[block][path[len(block) + 1 :]] = dim
    return blocks, other


def wrap_tree(tree: Mapping, config, mesh, extra: Mapping[str, int] | None = None) -> dict:
    """``tree`` (local shards on ``mesh``) for the forward: every block (``name.i``, see
    `_grouped`) a `GatheredBlock`; every other fully sharded leaf gathered now (all issued,
    then waited). ``extra``: ``{path: fsdp dim}`` of further fully sharded leaves in the
    tree, paths through tuples numbered (``"...to_q.lora.0.1"``: the first LoRA entry's ``B``),
    gathered with their block (in its one all-gather) or, outside blocks, now."""
    blocks, other = _with_extra(*_grouped(config, tuple(mesh.mesh_dim_names), tuple(mesh.shape)), extra or {})
    pending = {}

    def walk(node, prefix):
        out = {}
        for k, x in _items(node):
            path = f"{prefix}{k}"
            if path in blocks:
                out[k] = GatheredBlock(x, blocks[path])
            elif isinstance(x, (Mapping, tuple)):
                out[k] = walk(x, f"{path}.")
            elif path in other:
                pending[path] = _start(x, other[path])
                out[k] = x
            else:
                out[k] = x
        return out if isinstance(node, Mapping) else tuple(out.values())

    def done(node, prefix):
        out = {
            k: done(x, f"{prefix}{k}.")
            if isinstance(x, (dict, tuple))
            else _finish(x, other[f"{prefix}{k}"], pending[f"{prefix}{k}"])
            if f"{prefix}{k}" in pending
            else x
            for k, x in _items(node)
        }
        return out if isinstance(node, Mapping) else tuple(out.values())

    return done(walk(tree, ""), "")


def gathered_blocks(blocks: list):
    """Iterate ``blocks`` (a segment's blocks, in order) for a block loop, each as plain
    dicts of its gathered leaves (`GatheredBlock.gathered`): block i+1's all-gather is
    issued before block i is handed out (with ``fsdp_options(prefetch=False)``, none
    ahead). Blocks that are not `GatheredBlock` come as they are. With
    ``fsdp_options(reshard_after_forward=True)`` under autograd, each block computes
    (between this generator's yield and its next step) under `resharded`."""
    ahead = _OPTIONS[-1]["prefetch"] and current_mesh() is not None
    reshard = _OPTIONS[-1]["reshard"] and torch.is_grad_enabled() and current_mesh() is not None
    if reshard and torch.compiler.is_compiling():
        raise ValueError(
            "fsdp_options: reshard_after_forward=True is for eager training (its saved-tensor hooks read "
            "storage addresses, which torch.compile does not trace); run the compiled fd.apply without it"
        )
    for i, block in enumerate(blocks):
        if not isinstance(block, GatheredBlock):
            yield block
            continue
        if ahead:
            block.prefetch()  # (a no-op when the previous step issued it)
            if i + 1 < len(blocks) and isinstance(blocks[i + 1], GatheredBlock):
                blocks[i + 1].prefetch()
        if not reshard:
            yield block.gathered()
            continue
        saved: dict = {}
        gathered = block.gathered(saved)
        with resharded(saved, _group(FSDP)):
            yield gathered


class _Resharded:
    """A gathered weight autograd saved, as what gathers it again: its shard, fsdp dim, the
    fsdp group and the saved tensor's view of the gathered storage."""

    __slots__ = ("shard", "dim", "group", "view")

    def __init__(self, shard, dim, group, view):
        self.shard, self.dim, self.group, self.view = shard, dim, group, view


def resharded(saved: dict, group):
    """Within: a tensor autograd saves for backward that is a view of a gathered leaf's
    storage (``saved``: ``{storage pointer: (shard, dim)}``, `GatheredBlock.gathered`) is kept
    as its local shard, and all-gathered over ``group`` again when backward unpacks it
    (``torch.autograd.graph.saved_tensors_hooks``). Every rank runs the same backward graph
    in the same order, so the re-gathers match across ranks."""

    def pack(t):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            return t
        hit = saved.get(t.untyped_storage().data_ptr())
        if hit is None or hit[0].dtype != t.dtype:
            return t
        return _Resharded(hit[0], hit[1], group, (tuple(t.size()), tuple(t.stride()), t.storage_offset()))

    def unpack(p):
        if not isinstance(p, _Resharded):
            return p
        x = p.shard.detach().movedim(p.dim, 0).contiguous()
        full = _autodiff._done(_autodiff._all_gather_dim0()(x, 0, p.group))  # laid out as `_unpack`'s copy
        return full.as_strided(*p.view)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

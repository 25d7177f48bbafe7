"""The parameter pytree: `Params` and `ParamSpec` (dotted paths: `sharding.tree`).

A `Params` is a config (static metadata) plus nested dicts of tensors whose dotted
paths equal the diffusers ``state_dict`` keys. It is registered with both optree and
``torch.utils._pytree`` so ``torch.func``, ``torch.export`` and optree see through it,
as an equinox module is a JAX pytree.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import optree
import torch
import torch.utils._pytree as torch_pytree

from sharding.tree import flatten, mismatch_report

PACKED = "packed"  # logical axis of a dim that concatenates several blocks


class Segment(NamedTuple):
    """One segment of a fused dim (e.g. q of [q; k; v]): ``name`` for humans, ``size``
    rows, logical ``axis``."""

    name: str
    size: int
    axis: str | None


Block = Segment  # the old name, kept (`fd.Block`); "blocks" elsewhere are a model's layers


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What a parameter is: its full shape, a logical axis name per dim and, for a
    fused projection, the blocks of the dim whose axis is ``"packed"``.

    The model declares *what* a parameter is; `sharding` decides *where* it goes.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    blocks: tuple[Segment, ...] | None = None

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamSpec: shape {self.shape} and axes {self.axes} differ in rank")
        if (PACKED in self.axes) != (self.blocks is not None):
            raise ValueError(f"ParamSpec: axes {self.axes} and blocks {self.blocks} disagree")
        if self.blocks is not None:
            d = self.axes.index(PACKED)
            if sum(b.size for b in self.blocks) != self.shape[d]:
                raise ValueError(f"ParamSpec: blocks {self.blocks} do not add up to dim {d} of {self.shape}")

    @property
    def block_dim(self) -> int | None:
        return self.axes.index(PACKED) if self.blocks is not None else None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def linear_spec(out_dim, in_dim, out_axis, in_axis, bias: bool = True, blocks=None) -> dict:
    """Specs of an ``nn.Linear(in_dim, out_dim)``: weight (out, in) and bias (out,); a
    packed output dim carries its ``blocks`` on the bias too (sliced per block alike)."""
    w = ParamSpec((out_dim, in_dim), (out_axis, in_axis), blocks)
    if not bias:
        return {"weight": w}
    return {"weight": w, "bias": ParamSpec((out_dim,), (out_axis,), blocks if out_axis == PACKED else None)}


MOD6 = ("shift", "scale", "gate", "shift2", "scale2", "gate2")  # double blocks: attn and MLP
MOD3 = ("shift", "scale", "gate")  # single blocks
MOD_OUT = ("scale", "shift")  # the final AdaLN: diffusers' (scale, shift) order


def mod_spec(dim: int, chunks: tuple[str, ...], bias: bool = True) -> dict:
    """Specs of an AdaLN modulation projection ``nn.Linear(dim, len(chunks) * dim)``: its
    output is ``len(chunks)`` vectors (shift, scale, gate, ...) of ``dim`` each. Its rows
    shard contiguously over ``"mod"``: the model all-gathers the small (B, k·C) output
    whole, so no per-chunk layout is needed and the sharded leaf is a plain ``Shard(0)``."""
    return linear_spec(len(chunks) * dim, dim, "mod", "embed", bias=bias)


def units(blocks, size: int) -> tuple[Segment, ...]:
    """``blocks`` cut into equal units of ``size`` rows each (a block of 4 units ``mlp``
    becomes ``mlp.0`` ... ``mlp.3``), in order. A dim fused from equal units shards as one
    ``_StridedShard`` DTensor (rank r holds the r-th slice of every unit), which
    ``full_tensor()`` reads right; splitting an MLP block this way only reorders its hidden
    units, the same for every parameter of the block that reads or writes them."""
    if any(b.size % size for b in blocks):
        raise ValueError(f"units: blocks {[(b.name, b.size) for b in blocks]} do not divide into units of {size}")
    out = []
    for b in blocks:
        k = b.size // size
        out += [b] if k == 1 else [Segment(f"{b.name}.{i}", size, b.axis) for i in range(k)]
    return tuple(out)


def unit_linear_spec(block: Segment, in_dim: int, in_axis, size: int, bias: bool = True) -> dict:
    """Specs of a column-parallel ``nn.Linear(in_dim, block.size)`` whose output rows are
    cut into `units` of ``size`` (plain when it is one unit): the projection feeding a
    fused consumer cut alike (FLUX.1's ``proj_mlp`` into ``proj_out``)."""
    if block.size == size:
        return linear_spec(block.size, in_dim, block.axis, in_axis, bias=bias)
    return linear_spec(block.size, in_dim, PACKED, in_axis, bias=bias, blocks=units((block,), size))


def norm_spec(dim: int, axis: str = "head_dim") -> dict:
    """Specs of a norm's scale (QK RMS norms: over head_dim, replicated)."""
    return {"weight": ParamSpec((dim,), (axis,))}


class Params:
    """A model's parameters: ``config`` (static) and ``tree`` (nested dicts of tensors).

    ``params["transformer_blocks"]["0"]`` indexes the tree; ``params.flat()`` gives
    the diffusers ``state_dict`` view. Treat it as immutable.
    """

    __slots__ = ("config", "tree")

    def __init__(self, config, tree: Mapping[str, Any]):
        self.config = config
        self.tree = dict(tree)

    def __getitem__(self, key: str):
        return self.tree[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tree

    def flat(self) -> dict:
        return flatten(self.tree)

    def leaves(self) -> Iterator[Any]:
        return iter(self.flat().values())

    def replace(self, tree: Mapping[str, Any]) -> Params:
        """The same config with a new tree of full tensors, checked (`check_leaves`)."""
        check_leaves(self.config, flatten(tree))
        return Params(self.config, tree)

    def __repr__(self) -> str:
        n = sum(t.numel() for t in self.leaves() if isinstance(t, torch.Tensor))
        return f"Params({type(self.config).__name__}, {len(self.flat())} tensors, {n:,} elements)"


COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_leaves(config, flat: Mapping[str, Any]) -> None:
    """Where parameters enter (`from_state_dict`, `Params.replace`): one ValueError listing
    every missing, unexpected and mis-shaped key, every leaf that is not a tensor or not
    floating point, and, if the leaves mix dtypes or devices, the leaves of each. Reads
    only shapes, dtypes and devices (DTensor leaves: their global shape)."""
    specs = flatten(config.param_specs())
    name = f"state dict does not match {type(config).__name__}"
    missing = [k for k in specs if k not in flat]
    unexpected = [k for k in flat if k not in specs]
    bad = [
        f"{k}: expected a tensor, got {type(v).__name__}" for k, v in flat.items() if not isinstance(v, torch.Tensor)
    ]
    tensors = {k: v for k, v in flat.items() if k in specs and isinstance(v, torch.Tensor)}
    shapes = [
        f"{k}: expected {specs[k].shape}, got {tuple(v.shape)}"
        for k, v in tensors.items()
        if tuple(v.shape) != specs[k].shape
    ]
    if missing or unexpected or bad or shapes:
        raise ValueError(mismatch_report(name, missing, unexpected, shapes, other={"not tensors": bad}))
    bad = [f"{k}: {v.dtype}" for k, v in tensors.items() if not v.is_floating_point()]
    if bad:
        raise ValueError(
            mismatch_report(
                f"params: expected floating-point tensors {COMPUTE_DTYPES}", other={"not floating point": bad}
            )
        )
    for what, of in (("dtype", lambda v: v.dtype), ("device", lambda v: v.device)):
        groups: dict = {}
        for k, v in tensors.items():
            groups.setdefault(of(v), []).append(k)
        if len(groups) > 1:
            found = {str(g): (len(ks), ks[:3]) for g, ks in groups.items()}
            raise ValueError(
                f"params: expected one {what} for every tensor (the model computes in one), got {len(groups)}: "
                f"{found} as (count, first keys); convert with .to() first"
            )


def config_to_json(config) -> str:
    """A family config as JSON (class name and fields): a tree spec holding it then
    serialises, so `torch.export.save` can write a program that takes `Params`."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return json.dumps({"class": type(config).__name__, "fields": fields})


def config_from_json(text: str, classes: Mapping[str, type]):
    """Inverse of `config_to_json`; ``classes``: ``{class name: config class}``."""
    data = json.loads(text)
    if data.get("class") not in classes:
        raise ValueError(f"config: expected one of {sorted(classes)}, got {data.get('class')!r}")
    return classes[data["class"]](**data["fields"])


def register_tree_node(cls, context, rebuild, *, name=None, to_json=None, from_json=None, safe=()) -> None:
    """Make ``cls`` — a node holding one nested dict ``.tree`` and static metadata — a pytree
    node of ``torch.utils._pytree`` and optree: its one child is the tree, its context
    ``context(obj)``, rebuilt as ``rebuild(context, tree)``. ``name``, ``to_json`` and
    ``from_json`` let a tree spec holding it be serialised (``torch.export.save``);
    ``safe`` lists the classes besides ``cls`` that ``torch.load(weights_only=True)`` — the
    first, safe attempt of ``torch.export.load`` — may rebuild from a saved program."""
    serialised = {} if name is None else dict(
        serialized_type_name=name, to_dumpable_context=to_json, from_dumpable_context=from_json
    )  # fmt: skip
    torch_pytree.register_pytree_node(
        cls,
        lambda obj: ([obj.tree], context(obj)),
        lambda children, ctx: rebuild(ctx, children[0]),
        flatten_with_keys_fn=lambda obj: ([(torch_pytree.GetAttrKey("tree"), obj.tree)], context(obj)),
        **serialised,
    )
    optree.register_pytree_node(
        cls,
        lambda obj: ((obj.tree,), context(obj), ("tree",)),
        lambda ctx, children: rebuild(ctx, children[0]),
        namespace=optree.registry.__GLOBAL_NAMESPACE,
    )
    if name is not None:
        torch.serialization.add_safe_globals([cls, *safe])


def register_pytree(config_classes) -> None:
    """Make `Params` a pytree node (`register_tree_node`); a serialised tree spec names its
    config by class, resolved among ``config_classes``. Called once, by `_api`, which
    holds the families table."""
    classes = {cls.__name__: cls for cls in config_classes}
    register_tree_node(
        Params,
        lambda p: p.config,
        Params,
        name="functional_dit.Params",
        to_json=config_to_json,
        from_json=lambda text: config_from_json(text, classes),
        safe=(*config_classes, (Params, "functional_dit._pytree.Params")),  # its name before the layout change
    )


def ordered_blocks(params, name: str) -> list:
    """The blocks ``params[name]`` (a ``{"0": ..., "1": ...}`` dict) in numeric order; none
    when the model has zero such blocks (`nest` makes no key for an empty dict)."""
    blocks = params.tree.get(name, {})
    return [blocks[k] for k in sorted(blocks, key=int)]


# `Params` pickled before the package layout changed names its class
# ``functional_dit._pytree.Params``: that module name stays importable (docs/architecture.md).
sys.modules.setdefault("functional_dit._pytree", sys.modules[__name__])


def init_leaf(key: str, spec: ParamSpec, gen: torch.Generator) -> torch.Tensor:
    """One leaf of `init`, drawn (fp32) on ``gen``'s device."""
    draw = torch.randn(spec.shape, generator=gen, device=gen.device)
    if key.endswith("bias"):
        return draw * 0.02
    if len(spec.shape) == 1:  # norm scales
        return 1.0 + draw * 0.02
    return draw / spec.shape[-1] ** 0.5

"""The parameter pytree: `Params`, `ParamSpec` and dotted-path helpers.

A `Params` is a config (static metadata) plus nested dicts of tensors whose dotted
paths equal the diffusers ``state_dict`` keys. It is registered with both optree and
``torch.utils._pytree`` so ``torch.func``, ``torch.export`` and optree see through it,
as an equinox module is a JAX pytree.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import optree
import torch
import torch.utils._pytree as torch_pytree

PACKED = "packed"  # logical axis of a dim that concatenates several blocks


class Block(NamedTuple):
    """One block of a fused dim: ``name`` for humans, ``size`` rows, logical ``axis``."""

    name: str
    size: int
    axis: str | None


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What a parameter is: its full shape, a logical axis name per dim and, for a
    fused projection, the blocks of the dim whose axis is ``"packed"``.

    The model declares *what* a parameter is; `sharding` decides *where* it goes.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    blocks: tuple[Block, ...] | None = None

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
        n = 1
        for s in self.shape:
            n *= s
        return n


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
    output is ``len(chunks)`` vectors (shift, scale, gate, ...) of ``dim`` each, so the
    output dim is packed from one ``"mod"`` block per chunk and shards per chunk (rank r
    holds the r-th slice of every chunk; the model all-gathers the small (B, k·C) output)."""
    blocks = tuple(Block(name, dim, "mod") for name in chunks)
    return linear_spec(len(chunks) * dim, dim, PACKED, "embed", bias=bias, blocks=blocks)


def norm_spec(dim: int, axis: str = "head_dim") -> dict:
    """Specs of a norm's scale (QK RMS norms: over head_dim, replicated)."""
    return {"weight": ParamSpec((dim,), (axis,))}


def nest(flat: Mapping[str, Any]) -> dict:
    """``{"a.b.c": v}`` -> ``{"a": {"b": {"c": v}}}``, keeping insertion order."""
    tree: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict:
    """The inverse of `nest`: nested dicts -> ``{dotted path: leaf}``."""
    flat = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, key + "."))
        else:
            flat[key] = value
    return flat


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
        return Params(self.config, tree)

    def __repr__(self) -> str:
        n = sum(t.numel() for t in self.leaves() if isinstance(t, torch.Tensor))
        return f"Params({type(self.config).__name__}, {len(self.flat())} tensors, {n:,} elements)"


def _flatten(p: Params):
    return [p.tree], p.config


def _unflatten(children, config) -> Params:
    (tree,) = children
    return Params(config, tree)


def config_to_json(config) -> str:
    """A family config as JSON (class name and fields): a tree spec holding it then
    serialises, so `torch.export.save` can write a program that takes `Params`."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return json.dumps({"class": type(config).__name__, "fields": fields})


def config_from_json(text: str):
    """Inverse of `config_to_json`, for the config classes the families register."""
    from . import _api  # late: _api imports this module

    data = json.loads(text)
    classes = {fam.CONFIG.__name__: fam.CONFIG for fam in _api._FAMILIES}
    if data.get("class") not in classes:
        raise ValueError(f"config: expected one of {sorted(classes)}, got {data.get('class')!r}")
    return classes[data["class"]](**data["fields"])


torch_pytree.register_pytree_node(
    Params,
    _flatten,
    _unflatten,
    serialized_type_name="functional_dit.Params",
    to_dumpable_context=config_to_json,
    from_dumpable_context=config_from_json,
    flatten_with_keys_fn=lambda p: ([(torch_pytree.GetAttrKey("tree"), p.tree)], p.config),
)
optree.register_pytree_node(
    Params,
    lambda p: ((p.tree,), p.config, ("tree",)),
    lambda config, children: Params(config, children[0]),
    namespace=optree.registry.__GLOBAL_NAMESPACE,
)


def ordered_blocks(blocks: Mapping[str, Any]) -> list:
    """The values of a ``{"0": ..., "1": ...}`` block dict in numeric order."""
    return [blocks[k] for k in sorted(blocks, key=int)]

"""Trees of dotted paths: the one home of the nested-dict helpers every package uses.

Parameters, specs, plans and checkpoints are nested dicts whose dotted paths are the
diffusers ``state_dict`` keys (``"transformer_blocks.0.attn.to_q.weight"``). This module
converts between the nested and the flat form, walks several trees of the same keys
together, and reports how two key sets differ. It lives in `sharding` because that is
the package the others build on (`functional_dit` and `weights` import it; it imports
neither).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any


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


def leaves(tree: Mapping, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, leaf)`` pairs of nested dicts, in order."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from leaves(value, f"{path}{key}.")
        else:
            yield f"{path}{key}", value


def flatten(tree: Mapping) -> dict:
    """The inverse of `nest`: nested dicts -> ``{dotted path: leaf}``."""
    return dict(leaves(tree))


def get(tree: Mapping, path: str):
    """The leaf (or subtree) at dotted ``path``."""
    node = tree
    for key in path.split("."):
        node = node[key]
    return node


def put(tree: dict, path: str, value) -> None:
    """Set the leaf at dotted ``path`` of nested dicts in place (its parents must exist)."""
    parent, _, leaf = path.rpartition(".")
    (get(tree, parent) if parent else tree)[leaf] = value


def copy_path(tree: dict, path: str) -> dict:
    """The node at dotted ``path``, after replacing every dict from ``tree``'s children down
    to it by a shallow copy: edits of it leave the trees ``tree`` was copied from alone."""
    node = tree
    for key in path.split("."):
        node[key] = dict(node[key])
        node = node[key]
    return node


def map_tree(fn: Callable, tree: Mapping, *rest: Mapping, path: str = "") -> dict:
    """``fn(dotted_path, leaf, *other_leaves)`` over nested dicts with the same keys."""
    out = {}
    for key, value in tree.items():
        p = f"{path}{key}"
        others = [r[key] for r in rest]
        out[key] = map_tree(fn, value, *others, path=p + ".") if isinstance(value, Mapping) else fn(p, value, *others)
    return out


def mismatch_report(
    name: str,
    missing: Iterable = (),
    unexpected: Iterable = (),
    mis_shaped: Iterable = (),
    limit: int = 20,
    other: Mapping[str, Iterable] | None = None,
) -> str:
    """``"<name>: 2 missing: [...]; 1 unexpected: [...]; 1 mis-shaped: [...]"``, each list
    cut at ``limit`` items, then any ``other`` ``{title: items}``; the one format of every
    "these keys do not match" error."""
    parts = []
    groups = {"missing": missing, "unexpected": unexpected, "mis-shaped": mis_shaped, **(other or {})}
    for title, items in ((t, list(i)) for t, i in groups.items()):
        if items:
            more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
            parts.append(f"{len(items)} {title}: {items[:limit]}{more}")
    return f"{name}: " + "; ".join(parts)


def check_same_keys(name: str, tree: Mapping, ref: Mapping, ref_name: str) -> None:
    """ValueError naming the dotted paths in which ``tree`` and ``ref`` differ."""
    a, b = {p for p, _ in leaves(tree)}, {p for p, _ in leaves(ref)}
    if a != b:
        raise ValueError(mismatch_report(f"{name}: expected the keys of {ref_name}", sorted(b - a), sorted(a - b)))

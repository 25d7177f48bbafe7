"""No module imports another package's private module, read from the code's own imports (``ast``).

A package's private modules (``_x.py``) are its own: another package reaches them only
through names the owner exports (``__init__`` or an ``internal`` module, the equinox
idea), so the owner can change them without breaking its neighbours.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = (
    "functional_dit",
    "functional_dit.nn",
    "functional_dit.pipelines",
    "functional_dit.cli",
    "functional_dit.lora",
    "sharding",
    "weights",
)

# (importing module, private module it reaches) pairs left to the engineers who own them.
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> dict[str, pathlib.Path]:
    """``{dotted module name: file}`` of every module of the packages."""
    out = {}
    for top in {p.split(".")[0] for p in PACKAGES}:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _package_of(module: str, modules: dict) -> str:
    """The package a module belongs to: itself for a package, else its parent."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def _is_private(module: str) -> bool:
    return module.rpartition(".")[2].startswith("_")


def _imported(module: str, tree: ast.Module, modules: dict) -> set[str]:
    """The project modules ``module``'s imports name (at any depth, functions included),
    and those reached as attributes of an imported module (``sharding._shard.x``)."""
    base = module if _package_of(module, modules) == module else module.rpartition(".")[0]
    found, aliases = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.add(a.name)
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            anchor = base.split(".")[: len(base.split(".")) - node.level + 1] if node.level else []
            source = ".".join(anchor + ([node.module] if node.module else []))
            found.add(source)
            for a in node.names:
                if f"{source}.{a.name}" in modules:
                    found.add(f"{source}.{a.name}")
                    aliases[a.asname or a.name] = f"{source}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id in aliases:
                dotted = aliases[node.id]
                for attr in reversed(chain):
                    dotted = f"{dotted}.{attr}"
                    if dotted in modules:
                        found.add(dotted)
    return found & set(modules)


def test_no_private_imports_across_packages():
    modules = _modules()
    assert set(PACKAGES) <= set(modules), sorted(set(PACKAGES) - set(modules))
    crossings = set()
    for module, path in modules.items():
        for target in _imported(module, ast.parse(path.read_text()), modules):
            if _is_private(target) and _package_of(target, modules) != _package_of(module, modules):
                crossings.add((module, target))
    assert crossings - ALLOWED == set(), sorted(crossings - ALLOWED)
    assert ALLOWED - crossings == set(), f"no longer needed in ALLOWED: {sorted(ALLOWED - crossings)}"


def test_the_private_import_check_sees_what_it_must():
    """The check above on known snippets: a relative, an absolute and an attribute route
    into another package's private module are found; the package's own are not."""
    modules = _modules()
    snippets = {
        "functional_dit.api": "from .lora import _apply",
        "functional_dit.nn.fused": "import sharding\nsharding._shard.dtensor_from_local",
        "functional_dit.pipelines.sampler._ranks": "from sharding._replicated import describe",
        "weights._load": "from . import _format\nfrom ._layouts import resolve",
    }
    found = {m: _imported(m, ast.parse(s), modules) for m, s in snippets.items()}
    assert "functional_dit.lora._apply" in found["functional_dit.api"]
    assert "sharding._shard" in found["functional_dit.nn.fused"]
    assert "sharding._replicated" in found["functional_dit.pipelines.sampler._ranks"]
    assert {"weights._format", "weights._layouts"} <= found["weights._load"]
    assert _package_of("weights._format", modules) == _package_of("weights._load", modules) == "weights"
    assert _package_of("functional_dit.lora", modules) == "functional_dit.lora"

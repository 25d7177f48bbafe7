"""The package layout holds (docs/architecture.md): the dependency order between the
layers, no import cycle among the project's modules, and a light ``import functional_dit``.
Measured from the code's own import statements, function-level ones included."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("functional_dit", "sharding", "weights")
# What each layer may import, lowest first (docs/architecture.md, "Packages").
LAYERS = {
    "sharding": {"sharding"},
    "core": {"sharding", "core"},
    "weights": {"sharding", "core", "weights"},
    "pipelines": {"sharding", "core", "weights", "pipelines"},
    "cli": {"sharding", "core", "weights", "pipelines", "cli"},
}


def _layer(module: str) -> str:
    parts = module.split(".")
    if module in ("functional_dit.tiny", "functional_dit.sampling"):  # public aliases of functional_dit.pipelines.*
        return "pipelines"
    if module in ("functional_dit.lora._io", "functional_dit.lora._layouts"):  # LoRA file IO, through weights;
        return "weights"  # resolved on first use (docs/architecture.md)
    if parts[0] != "functional_dit":
        return parts[0]
    if len(parts) > 1 and parts[1] in ("pipelines", "cli"):
        return parts[1]
    if parts[1:2] in (["serve"], ["train"]):  # the server, the trainer: commands' machinery, beside cli
        return "cli"
    if parts[1:2] == ["__main__"]:
        return "cli"
    return "core"


def _module_name(path: pathlib.Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The project modules an ``import`` names: ``from . import a`` names the module ``a``
    where one exists, else the package it comes from."""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] not in PACKAGES:
        return []
    found = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        found.append(sub if sub in GRAPH_MODULES else source)
    return found


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name, is_package = _module_name(path)
            out[name] = (path, is_package)
    return out


GRAPH_MODULES = _modules()


def _imports() -> dict[str, set[str]]:
    graph = {}
    for module, (path, is_package) in GRAPH_MODULES.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
            elif isinstance(node, ast.ImportFrom):
                edges |= set(_resolve(module, is_package, node))
        graph[module] = {e for e in edges if e != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_imports():
    graph = _imports()  # a check that cannot see imports would pass vacuously
    assert "functional_dit.api" in graph["functional_dit"]
    assert "sharding.tree" in graph["functional_dit.params"]
    assert "functional_dit.pipelines.cache" in graph["functional_dit.cli._args"]  # a function-level import
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(_imports()) == []


def test_dependency_order():
    wrong = sorted(
        f"{m} ({_layer(m)}) imports {d} ({_layer(d)})"
        for m, deps in _imports().items()
        for d in deps
        if _layer(d) not in LAYERS[_layer(m)]
    )
    assert wrong == []


def test_import_functional_dit_loads_no_product_dependencies():
    code = (
        "import sys, functional_dit as fd; fd.apply; "
        "print(sorted(m for m in ('diffusers', 'transformers', 'weights', 'functional_dit.pipelines') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_lazy_product_names_resolve():
    import functional_dit as fd
    from functional_dit.pipelines import adapter, sampler

    assert fd.DiffusersTransformer is adapter.DiffusersTransformer and fd.sample is sampler.sample
    import functional_dit.tiny as tiny_by_path
    from functional_dit import tiny

    assert tiny is tiny_by_path and tiny.__name__ == "functional_dit.pipelines.tiny"

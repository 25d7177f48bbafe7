"""The layout figures of issue 48, read statically from the code (``ast``; nothing of the
library is imported): lines of ``functional_dit/pipelines/`` per subpackage; in the sampling
files, ``self.<attr> =`` outside ``__init__`` and ``copy.copy`` / ``copy.deepcopy`` /
``vars(...)`` calls; functions over 40 lines (docstring excluded); import cycles among the
project's modules; imports inside functions; the size of ``fd.sample``.

    python examples/layout_report.py

The import graph counts what Python runs: function-level imports, the packages an import
passes through (importing ``functional_dit.cli.generate`` runs ``functional_dit/cli/__init__.py``
unless the importer is inside that package), and modules named by a string
(``importlib.import_module``, a table of module names). tests/test_layout.py enforces the
same graph.
"""

from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("functional_dit", "sharding", "weights")
SAMPLING = ("functional_dit/pipelines/sampler", "functional_dit/pipelines/families")
MAX_LINES = 40
# Lazy names a package re-exports on first use (PEP 562), across layers by design: LoRA's file
# IO reads through `weights`, which imports the core; `functional_dit.lora` resolves it on use
# (docs/architecture.md, "Packages"). Left out of the graph; every other lazy import counts.
LAZY_FACADES = frozenset({("functional_dit.lora", "functional_dit.lora._io")})


def modules(root: pathlib.Path = ROOT) -> dict[str, tuple[pathlib.Path, bool]]:
    """``{dotted name: (file, is a package)}`` of every module of the three packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _through(name: str, importer: str, known) -> set[str]:
    """``name`` and the packages Python runs to reach it, less the importer's own packages
    (already running when the importer runs)."""
    parts, out = name.split("."), set()
    for i in range(1, len(parts) + 1):
        step = ".".join(parts[:i])
        if step in known and not (importer == step or importer.startswith(step + ".")):
            out.add(step)
    return out


def _base(module: str, is_package: bool, level: int) -> list[str]:
    base = module.split(".") if is_package else module.split(".")[:-1]
    return base[: len(base) - level + 1]


def _from_import(module: str, is_package: bool, node: ast.ImportFrom, known) -> set[str]:
    """``from X import a, b``: X (and its packages), and X.a where it is a module."""
    head = _base(module, is_package, node.level) if node.level else []
    source = ".".join(head + ([node.module] if node.module else []))
    if source.split(".")[0] not in PACKAGES:
        return set()
    out = _through(source, module, known)
    for alias in node.names:
        out |= _through(f"{source}.{alias.name}", module, known) if f"{source}.{alias.name}" in known else set()
    return out


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "string"`` assignments (an f-string may name a module through one)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _named(module: str, is_package: bool, tree: ast.Module, known) -> set[str]:
    """Modules named by a string: an absolute dotted name of a project module anywhere (a
    table of modules to import), a relative one passed to ``importlib.import_module``, and
    an f-string whose constant head is a package (``f"{PACKAGE}.{key}"``)."""
    consts, out = _constants(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            out |= _through(node.value, module, known)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("."):
                level = len(arg.value) - len(arg.value.lstrip("."))
                name = ".".join(_base(module, is_package, level) + [arg.value.lstrip(".")])
                out |= _through(name, module, known) if name in known else set()
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            text = head.value if isinstance(head, ast.Constant) else consts.get(getattr(head.value, "id", ""), "")
            if text.rstrip(".") in known:
                out |= _through(text.rstrip("."), module, known)
    return out


def import_graph(root: pathlib.Path = ROOT, facades=LAZY_FACADES) -> dict[str, set[str]]:
    """``{module: the project modules it runs}``, function-level imports included, less
    the ``facades`` edges."""
    known = modules(root)
    graph = {}
    for module, (path, is_package) in known.items():
        tree, edges = ast.parse(path.read_text()), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    edges |= _through(a.name, module, known) if a.name.split(".")[0] in PACKAGES else set()
            elif isinstance(node, ast.ImportFrom):
                edges |= _from_import(module, is_package, node, known)
        edges |= _named(module, is_package, tree, known)
        graph[module] = {e for e in edges if e != module and (module, e) not in facades}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _functions(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def body_lines(fn) -> int:
    """Lines of a function from its ``def`` to its end, less its docstring."""
    first = fn.body[0]
    docstring = first.end_lineno - first.lineno + 1 if _has_docstring(fn) else 0
    return fn.end_lineno - fn.lineno + 1 - docstring


def _has_docstring(fn) -> bool:
    first = fn.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def long_functions(limit: int = MAX_LINES, root: pathlib.Path = ROOT) -> list[tuple[str, str, int]]:
    """``(file, function, lines)`` of every function of the three packages over ``limit``
    lines, its docstring excluded."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for fn in _functions(ast.parse(path.read_text())):
                if body_lines(fn) > limit:
                    out.append((str(path.relative_to(root)), fn.name, body_lines(fn)))
    return out


def _self_writes(fn) -> int:
    """``self.<attr> =`` (plain, augmented, annotated, in a tuple) in ``fn``'s own statements."""
    count = 0
    for child in ast.iter_child_nodes(fn):
        for node in _statements(child):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                flat = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
                count += sum(isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self" for t in flat)
    return count


def sampling_writes() -> tuple[dict[str, int], dict[str, int]]:
    """Per sampling file: ``self.<attr> =`` outside ``__init__``; copy and ``vars(`` calls."""
    writes, copies = {}, {}
    for folder in SAMPLING:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree, name = ast.parse(path.read_text()), str(path.relative_to(ROOT))
            writes[name] = sum(_self_writes(f) for f in _functions(tree) if f.name != "__init__")
            copies[name] = sum(_is_copy(n) for n in ast.walk(tree))
    return writes, copies


def _is_copy(node) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    copy = isinstance(f, ast.Attribute) and f.attr in ("copy", "deepcopy") and getattr(f.value, "id", None) == "copy"
    return copy or (isinstance(f, ast.Name) and f.id == "vars")


def function_imports() -> tuple[int, int]:
    """Import statements inside functions: all of them, and those of project modules."""
    every = project = 0
    for path, _ in modules().values():
        for fn in _functions(ast.parse(path.read_text())):
            for node in ast.iter_child_nodes(fn):
                for inner in _statements(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        every += 1
                        project += _is_project(inner)
    return every, project


def _statements(node):
    """The statements under ``node`` outside nested functions (each function counts its own)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        return
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _statements(child)


def _is_project(node) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").split(".")[0] in PACKAGES
    return any(a.name.split(".")[0] in PACKAGES for a in node.names)


def _lines(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def pipelines_lines() -> dict[str, int]:
    """Lines of ``functional_dit/pipelines/``: per subpackage, its top-level files, the total."""
    root, out = ROOT / "functional_dit" / "pipelines", collections.Counter()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        out[rel[0] + "/" if len(rel) > 1 else "(top-level files)"] += _lines(path)
    out["total"] = sum(out.values())
    return dict(sorted(out.items()))


def sample_size() -> tuple[int, int, int]:
    """``fd.sample``: its lines, its parameters, its body lines (signature and docstring excluded)."""
    path = ROOT / "functional_dit" / "pipelines" / "sampler" / "__init__.py"
    fn = next(f for f in _functions(ast.parse(path.read_text())) if f.name == "sample")
    a = fn.args
    n_args = len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    first = fn.body[1] if _has_docstring(fn) else fn.body[0]
    return fn.end_lineno - fn.lineno + 1, n_args, fn.end_lineno - first.lineno + 1


def main() -> None:
    total_library = sum(_lines(p) for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
    print(f"library: {total_library} lines in {', '.join(PACKAGES)}")
    print("functional_dit/pipelines/ lines:")
    for part, n in pipelines_lines().items():
        print(f"  {part:20} {n:6}")
    writes, copies = sampling_writes()
    print(f"self.<attr> = outside __init__ in {', '.join(SAMPLING)}: {sum(writes.values())}")
    for name, n in sorted(writes.items(), key=lambda kv: -kv[1]):
        print(f"  {name:55} {n:3}") if n else None
    print(f"copy.copy / copy.deepcopy / vars( calls there: {sum(copies.values())}")
    for name, n in sorted(copies.items(), key=lambda kv: -kv[1]):
        print(f"  {name:55} {n:3}") if n else None
    long = long_functions()
    print(f"functions over {MAX_LINES} lines (docstring excluded): {len(long)}")
    for path, name, n in long:
        print(f"  {path}:{name} {n}")
    found = cycles(import_graph())
    print(f"import cycles: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    every, project = function_imports()
    print(f"imports inside functions: {every} ({project} of project modules)")
    lines, n_args, body = sample_size()
    print(f"fd.sample: {lines} lines, {n_args} parameters, {body} body lines (signature and docstring excluded)")


if __name__ == "__main__":
    main()

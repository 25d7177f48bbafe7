"""No family is named in the product's control flow: outside the registry
(`functional_dit.families`), the core family modules and the per-family product modules
(`functional_dit.pipelines.families`), nothing compares a value with a family's key
(``fam == "flux1"``, ``fam in ("qwenimage", "qwenimage21")``, ``x.KEY == ...``,
``name.startswith("qwen")``) or keys a table by family keys (``{"flux1": ...}``): the
sampler, the adapter, the tiny pipelines, the CLI, bench, LoRA and weights ask the
registry and the family's product module instead (docs/adding-a-family.md). The package's
source is parsed (not imported), so a new comparison anywhere fails here.
"""

from __future__ import annotations

import ast
import pathlib

from functional_dit import families

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("functional_dit", "weights", "sharding")
KEYS = {fam.KEY for fam in families.FAMILIES}
PREFIXES = ("flux", "qwen")  # what a family key starts with (a startswith test on them is a dispatch)
# The registry and the families themselves: where a family names itself.
ALLOWED = {
    "functional_dit/families.py",
    *(f"functional_dit/{fam.__name__.rsplit('.', 1)[1]}.py" for fam in families.FAMILIES),
    "functional_dit/flux2_kv.py",  # FLUX.2's KV cache, part of the family
}
ALLOWED_DIRS = ("functional_dit/pipelines/families/",)


def _keys_in(node) -> set[str]:
    """The family keys an expression spells as string constants (alone or in a tuple/list/set)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & KEYS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_keys_in(e) for e in node.elts)) if node.elts else set()
    return set()


def _is_key_attr(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "KEY"


def dispatches(source: str) -> list[tuple[int, str]]:
    """(line, what) of every family-name dispatch in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = set().union(*(_keys_in(s) for s in sides))
            if named:
                found.append((node.lineno, f"compares with {sorted(named)}"))
            elif any(_is_key_attr(s) for s in sides) and not all(
                isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops
            ):
                found.append((node.lineno, "compares a family's KEY"))
        elif isinstance(node, ast.Dict):
            named = set().union(*(_keys_in(k) for k in node.keys if k is not None))
            if named:
                found.append((node.lineno, f"a table keyed by {sorted(named)}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith(PREFIXES):
                found.append((node.lineno, f"startswith({arg.value!r})"))
    return found


def _checked_files():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in ALLOWED and not rel.startswith(ALLOWED_DIRS):
                yield rel, path


def test_no_family_name_dispatch_outside_the_registry_and_the_family_modules():
    bad = [f"{rel}:{line}: {what}" for rel, path in _checked_files() for line, what in dispatches(path.read_text())]
    assert not bad, "family names compared outside the registry and the family modules:\n" + "\n".join(bad)


def test_the_check_finds_each_kind_of_dispatch():
    # the check itself can fail: each form it must catch, and what it must let through
    caught = [
        'if fam == "flux1": pass',
        'if fam != "qwenimage21": pass',
        'ok = fam in ("qwenimage", "qwenimage21")',
        "ok = fam.KEY == name",
        'T = {"flux2": 1}',
        'ok = name.startswith("qwenimage")',
    ]
    for src in caught:
        assert dispatches(src), src
    passed = ["ok = fam is families.BY_KEY[name]", 'x = tiny.mid_configs()["flux1"]', 'ok = kind == "flux-kontext"']
    for src in passed:
        assert not dispatches(src), src


# The generic sampler (fd.sample, the per-item sampling, the fixed-graph loop): a stock
# pipeline's image job is the family's (its product module's ``JOBS`` and ``image_job``),
# so no stock pipeline class name is compared or used as a table key there; nor in the
# LoRA trainer, whose encode steps are the families' (``TRAIN_PIPELINES``, ``train_latent``, ...),
# the server or the CLI, which read what a pipeline does with images from the families
# (``IMAGE_INPUTS``, ``CONTROLNET_PIPELINES``).
SAMPLER = (
    "functional_dit/pipelines/sampler",
    "functional_dit/pipelines/sampling.py",
    "functional_dit/pipelines/sampler_xla.py",
    "functional_dit/train",
    "functional_dit/serve",
    "functional_dit/cli",
)


def _is_pipeline_name(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith("Pipeline")


def pipeline_dispatches(source: str) -> list[tuple[int, str]]:
    """(line, what) of every comparison with a stock pipeline class name (``"...Pipeline"``),
    and every table keyed by one, in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            elts = [e for s in sides for e in (s.elts if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [s])]
            found += [(node.lineno, f"compares with {e.value!r}") for e in elts if _is_pipeline_name(e)]
        elif isinstance(node, ast.Dict):
            found += [(node.lineno, f"a table keyed by {k.value!r}") for k in node.keys if _is_pipeline_name(k)]
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.value.elts if _is_pipeline_name(e)]  # a list of them, compared later
            found += [(node.lineno, f"a list of {names}")] if names else []
    return found


def test_the_generic_sampler_compares_no_pipeline_class_name():
    files = [p for s in SAMPLER for p in sorted((ROOT / s).rglob("*.py") if (ROOT / s).is_dir() else [ROOT / s])]
    assert len(files) > 5
    bad = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in files for line, what in pipeline_dispatches(p.read_text())]
    assert not bad, (
        "pipeline class names compared in the generic sampler, the trainer, the server or the CLI:\n" + "\n".join(bad)
    )
    caught = ['ok = type(pipe).__name__ == "FluxKontextPipeline"', 'ok = name in ("QwenImageEditPlusPipeline",)',
              'T = {"FluxInpaintPipeline": 1}', 'P = ("FluxControlNetPipeline", "QwenImagePipeline")']  # fmt: skip
    assert all(pipeline_dispatches(src) for src in caught)
    assert not pipeline_dispatches('msg = f"a {name} takes none"; ok = name == other')

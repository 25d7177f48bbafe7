"""docs/architecture.md names only what exists: every backticked path is a file or folder
of the repository, and every backticked dotted name (``fd.apply``, ``sharding.plan``,
``functional_dit.pipelines.cache.step``, ``flux1.check_inputs``, a call such as
``fd.prepare(params, kernels="auto")``) resolves to a module or an attribute. Names rooted
in other libraries or in a value of the text (``torch.*``, ``pipe.*``, ``leaf.*``) are
skipped by their root, listed here.
"""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = {"fd": "functional_dit", "functional_dit": "functional_dit", "sharding": "sharding", "weights": "weights"}
# Roots that are not this repository's: other libraries, and values the text talks about.
OTHER = {"torch", "F", "diffusers", "transformers", "optree", "peft", "dcp", "pipe", "leaf", "config", "loss", "x"}
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
PATH = re.compile(r"^[\w][\w./-]*(?:\.(?:py|md|toml|json)|/)$")


def spans() -> list[str]:
    text = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.S)  # code blocks: diagrams, not names
    return sorted(set(SPAN.findall(text)))


def _resolve(dotted: str) -> bool:
    """Import the longest module prefix of ``dotted``, then read the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def resolves(name: str) -> bool:
    """A dotted name of the repository: rooted at a package (``fd`` is functional_dit), or
    relative to one (``flux1.forward``, ``nn.layers.modulations``, ``pipelines.cache``)."""
    root, _, rest = name.partition(".")
    if root in PACKAGES:
        return _resolve(f"{PACKAGES[root]}.{rest}")
    return any(_resolve(f"{pkg}.{name}") for pkg in ("functional_dit", "sharding", "weights"))


def test_the_doc_names_things():
    names = [s for s in spans() if DOTTED.match(s) or PATH.match(s)]
    assert len(names) > 40, names  # the module map alone names more


@pytest.mark.parametrize("span", [s for s in spans() if PATH.match(s)])
def test_paths_exist(span):
    assert (ROOT / span).exists(), f"docs/architecture.md names `{span}`, which is not in the repository"


@pytest.mark.parametrize("span", [s for s in spans() if DOTTED.match(s) and not PATH.match(s)])
def test_dotted_names_resolve(span):
    name = DOTTED.match(span).group(1)
    if name.split(".")[0] in OTHER:
        return
    assert resolves(name), f"docs/architecture.md names `{span}`, which no module or attribute of the repository is"

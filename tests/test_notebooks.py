"""The notebooks in examples/notebooks execute, offline on the CPU, each within two
minutes (nbclient runs them in a fresh kernel from the repository root). They are
stored with their outputs stripped; this test also checks that."""

from __future__ import annotations

import os
import pathlib
import time

import nbclient  # noqa: E402
import nbformat  # noqa: E402
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "examples" / "notebooks").glob("*.ipynb"))
BUDGET_S = 120  # the bound per notebook, offline on a CPU


def test_three_notebooks_exist():
    assert [p.stem for p in NOTEBOOKS] == ["01_quickstart", "02_sharding", "03_research"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    stored = [c for c in nb.cells if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not stored, f"{path.name}: outputs are not stripped"
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(
        nb, timeout=BUDGET_S, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    start = time.monotonic()
    client.execute()
    elapsed = time.monotonic() - start
    print(f"{path.name}: executed in {elapsed:.1f} s")
    assert elapsed < BUDGET_S, f"{path.name} took {elapsed:.0f} s"

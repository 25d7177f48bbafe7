"""The README's set-up as a new user meets it: a virtual environment first, the CPU
build of torch, the demo's install without the [dev] extra, the test command .ci/run
extracts unchanged; the demo's tolerance and rows as the README and docs/status.md state
them; demo output not tracked."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_block() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Set-up\n.*?```bash\n(.*?)```", text, re.S).group(1)
    return block.splitlines()


def test_setup_makes_a_venv_first_and_keeps_the_ci_command():
    lines = _setup_block()
    venv = next(i for i, ln in enumerate(lines) if "-m venv" in ln)
    installs = [i for i, ln in enumerate(lines) if "pip install" in ln]
    assert venv < min(installs) and "activate" in lines[venv]
    assert any("--index-url" in ln and "/whl/cpu" in ln and "torch==" in ln for ln in lines)  # the CPU build
    marker = next(ln for ln in lines if ln.startswith("# the whole test suite"))  # what .ci/run's awk finds
    suite = lines[lines.index(marker) + 1]
    assert suite == 'python -m pip install -q -e ".[dev]" "torch==2.13.0" && python -m pytest -n 2 -q'
    commands = [ln for ln in lines if ln and not ln.startswith("#")]
    assert len(commands) == 4 and "[dev]" not in commands[2], commands  # venv, CPU torch, demo, suite
    assert commands[2] == 'python -m pip install -q -e . "torch==2.13.0" && python -m functional_dit demo'


def test_demo_tolerance_and_rows_are_the_ones_the_docs_state():
    from functional_dit import families
    from functional_dit.cli import demo

    readme = open(os.path.join(ROOT, "README.md")).read()
    assert re.search(r"within\s+the fp32 bound " + re.escape(f"{demo.TOLERANCE:g}"), readme)  # the pass column
    status = open(os.path.join(ROOT, "docs", "status.md")).read()
    table = re.search(r"## The demo\n.*?```\n(.*?)```", status, re.S).group(1).splitlines()
    body = [ln for ln in table if ln.startswith(("FLUX", "Qwen"))]
    assert len(body) == len(demo.rows()) + 1, body  # every row, and FLUX.1 on tp=2 ranks
    for row, line in zip(demo.rows(), body):
        stock = row.stock_class or families.TINY_KINDS[row.kind][1].name
        assert f" {stock} " in line and line.endswith(f"demo_out/{row.name}.png"), line
        assert " pass " in line, line


def test_demo_output_is_git_ignored():
    done = subprocess.run(["git", "check-ignore", "-q", "demo_out/flux1-dev.png"], cwd=ROOT)
    assert done.returncode == 0


def test_tiny_and_generate_raise_no_warnings_of_ours(tmp_path):
    """The demo's noise: tiny's needless ``to(float32)`` (diffusers warns for it) and
    generate's deprecated ``torch_dtype``; both must stay quiet."""
    import logging
    import warnings

    import diffusers
    import torch

    from functional_dit import tiny

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("diffusers.models.modeling_utils")
    logger.addHandler(handler)
    try:
        tiny.stock_transformer("flux")
    finally:
        logger.removeHandler(handler)
    assert not [r.getMessage() for r in records if "float32" in r.getMessage()]
    tiny.pipeline("flux").save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        diffusers.DiffusionPipeline.from_pretrained(tmp_path, transformer=None, dtype=torch.float32)
    assert "dtype=dtype" in open(os.path.join(ROOT, "functional_dit", "cli", "generate.py")).read()

"""The README's set-up as a new user meets it: a virtual environment first, the CPU
build of torch, the two commands .ci/run extracts unchanged; demo output not tracked."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_block() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Set-up: two commands\n.*?```bash\n(.*?)```", text, re.S).group(1)
    return block.splitlines()


def test_setup_makes_a_venv_first_and_keeps_the_ci_command():
    lines = _setup_block()
    venv = next(i for i, ln in enumerate(lines) if "-m venv" in ln)
    installs = [i for i, ln in enumerate(lines) if "pip install" in ln]
    assert venv < min(installs) and "activate" in lines[venv]
    assert any("--index-url" in ln and "/whl/cpu" in ln and "torch==" in ln for ln in lines)  # the CPU build
    suite = lines[lines.index("# the whole test suite (what .ci/run runs)") + 1]  # what .ci/run's awk takes
    assert suite == 'python -m pip install -q -e ".[dev]" "torch==2.13.0" && python -m pytest -n 2 -q'


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

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

"""Repository-wide checks: lint and format (ruff, configured in pyproject.toml), the
report scripts in examples/ run, and our types load under ``torch.load(weights_only=True)``."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch
from cases_flux2 import TINY_KLEIN, inputs

import functional_dit as fd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(command):
    run = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_parity_report_prints_every_case():
    run = subprocess.run(
        [sys.executable, "examples/parity_report.py"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith(("flux1 ", "flux2 ", "qwen-image "))]
    assert len(rows) == 7, run.stdout
    for row in rows:  # fp32 and bf16 errors, both within the tests' tolerances
        fp32, bf16 = (float(v) for v in row.split()[-2:])
        assert fp32 <= 1e-5 and bf16 == 0.0, row


def _weights_only_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name", ["flux1-tiny", "flux2-tiny", "qwen-image-tiny"])
def test_params_and_configs_load_with_weights_only(name):
    """What `torch.export.load` tries first: a safe load of our types, no fallback."""
    params = fd.init(fd.PRESETS[name], seed=0)
    back = _weights_only_round_trip(params)
    assert isinstance(back, fd.Params) and back.config == params.config
    assert all(torch.equal(a, b) for a, b in zip(back.leaves(), params.leaves()))


def test_kv_cache_loads_with_weights_only():
    params = fd.init(TINY_KLEIN, seed=0)
    _, cache = fd.apply(params, **inputs(TINY_KLEIN, batch=2, ref_hw=(1, 3)))
    back = _weights_only_round_trip(cache)
    assert isinstance(back, fd.Flux2KVCache) and (back.config, back.num_ref_tokens) == (TINY_KLEIN, 3)
    assert all(torch.equal(a, b) for a, b in zip(back.flat().values(), cache.flat().values()))

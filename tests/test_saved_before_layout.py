"""Artefacts written before the package layout changed (issue 20) still load: a
`torch.export` program taking `Params`, and `Params` saved with `torch.save`. Both were
made from the tiny FLUX.1 case by the code of commit 6fac622 (functional_dit/_pytree.py
then held `Params`)."""

from __future__ import annotations

import pathlib

import torch

import functional_dit as fd

DATA = pathlib.Path(__file__).parent / "data" / "before_layout"


def test_saved_params_load_and_apply():
    saved = torch.load(DATA / "flux1_tiny_params.pt", weights_only=False)
    params = saved["params"]
    assert isinstance(params, fd.Params) and isinstance(params.config, fd.Flux1Config)
    # The saved output was computed on another machine's CPU: GEMM order differs by CPU
    # (docs/numerics.md), so fp32 tolerance, not bitwise.
    torch.testing.assert_close(fd.apply(params, **saved["inputs"]), saved["output"], rtol=1e-5, atol=1e-5)


def test_exported_program_loads_and_runs():
    saved = torch.load(DATA / "flux1_tiny_params.pt", weights_only=False)
    program = torch.export.load(DATA / "flux1_tiny.pt2")
    out = program.module()(saved["params"], *saved["inputs"].values())
    torch.testing.assert_close(out, fd.apply(saved["params"], **saved["inputs"]), rtol=0, atol=0)  # same ops, same CPU

"""`torch.export` (strict) of `fd.apply`: the XLA-readiness check for Neuron and TPU
(no data-dependent shapes, no host syncs, no complex dtypes, no untraceable Python)."""

from __future__ import annotations

import importlib

import pytest
import torch

import functional_dit as fd

FAMILIES = ["cases_flux1", "cases_flux2", "cases_qwenimage"]


class _Apply(torch.nn.Module):
    def __init__(self, names):
        super().__init__()
        self.names = names

    def forward(self, params, *args):
        return fd.apply(params, **dict(zip(self.names, args)))


@pytest.mark.parametrize("cases", FAMILIES)
def test_strict_export_of_apply(cases):
    try:
        mod = importlib.import_module(cases)
    except ImportError:
        pytest.skip(f"{cases} not available yet")
    params = fd.init(mod.TINY, seed=0)
    kw = {k: v for k, v in mod.inputs(mod.TINY, batch=2, seed=0).items() if v is not None}
    names = list(kw)
    program = torch.export.export(_Apply(names), (params, *kw.values()), strict=True)
    graph_ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    banned = ("aten.item", "aten._local_scalar_dense", "aten.nonzero", "aten.view_as_complex", "aten.polar")
    assert not [op for op in graph_ops if op.startswith(banned)], graph_ops
    torch.testing.assert_close(program.module()(params, *kw.values()), fd.apply(params, **kw), rtol=0, atol=0)

"""`torch.export` (strict) of `fd.apply`: the XLA-readiness check for Neuron and TPU
(no data-dependent shapes, no host syncs, no complex dtypes, no untraceable Python)."""

from __future__ import annotations

import importlib
import io

import pytest
import torch
from diffusers.utils import torch_utils
from oracle import diffusers_model
from torch.utils._python_dispatch import TorchDispatchMode

import functional_dit as fd
from functional_dit.nn import layers

FAMILIES = ["cases_flux1", "cases_flux2", "cases_qwenimage"]


class _Apply(torch.nn.Module):
    def __init__(self, names):
        super().__init__()
        self.names = names

    def forward(self, params, *args):
        return fd.apply(params, **dict(zip(self.names, args)))


@pytest.mark.parametrize("cases", FAMILIES)
def test_strict_export_of_apply(cases):
    mod = importlib.import_module(cases)
    params = fd.init(mod.TINY, seed=0)
    kw = {k: v for k, v in mod.inputs(mod.TINY, batch=2, seed=0).items() if v is not None}
    names = list(kw)
    program = torch.export.export(_Apply(names), (params, *kw.values()), strict=True)
    graph_ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    banned = ("aten.item", "aten._local_scalar_dense", "aten.nonzero", "aten.view_as_complex", "aten.polar")
    assert not [op for op in graph_ops if op.startswith(banned)], graph_ops
    torch.testing.assert_close(program.module()(params, *kw.values()), fd.apply(params, **kw), rtol=0, atol=0)
    buf = io.BytesIO()  # an AOT artefact: the Params input (config as static metadata) serialises
    torch.export.save(program, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    torch.testing.assert_close(loaded.module()(params, *kw.values()), fd.apply(params, **kw), rtol=0, atol=0)


class _WideDtypes(TorchDispatchMode):
    """Records every op that produces a float64 or int64 tensor."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor) and o.dtype in (torch.float64, torch.int64):
                self.ops.add(f"{func} -> {o.dtype}")
        return out


@pytest.mark.parametrize("cases", FAMILIES)
def test_no_float64_or_int64_on_devices_without_them(cases, monkeypatch):
    """Neuron, MPS and NPU have no float64 and no int64 (diffusers' torch_utils lists them).
    Pretend the CPU is such a device, for us and for diffusers: `fd.apply` then creates no
    float64 or int64 tensor from fp32/int32 inputs, and still equals diffusers (whose FLUX
    RoPE also drops to fp32 frequencies there)."""
    mod = importlib.import_module(cases)
    monkeypatch.setattr(layers, "FP64_UNSUPPORTED", ("cpu",))
    monkeypatch.setitem(torch_utils._DTYPE_UNSUPPORTED_DEVICES, torch.float64, frozenset({"cpu"}))
    module, params = diffusers_model(mod.TINY, seed=0)
    kw = mod.inputs(mod.TINY, batch=2, seed=1)
    kw = {
        k: v.to(torch.int32) if isinstance(v, torch.Tensor) and not v.is_floating_point() else v for k, v in kw.items()
    }
    kw.update({k: kw[k].to(torch.int32) for k in ("img_ids", "txt_ids") if k in kw})
    (ref,) = module(**mod.diffusers_kwargs(kw))
    with _WideDtypes() as seen:
        out = fd.apply(params, **kw)
    assert not seen.ops
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

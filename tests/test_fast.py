"""The fast eager kernels `fd.prepare`'d params run (`nn.kernels.fast_kernels`): each kernel
against the exact one it replaces, every family against diffusers at fp32 (1e-5) and bf16,
and the places where the exact kernels must run instead (autograd, torch.func, LoRA)."""

from __future__ import annotations

import cases_flux1
import cases_flux2
import cases_qwenimage
import pytest
import torch
import torch.nn.functional as F
from oracle import diffusers_model, max_err

import functional_dit as fd
from functional_dit import api
from functional_dit.nn import fused as _fuse
from functional_dit.nn import kernels as _kernels
from functional_dit.nn import layers as L

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=3e-2, atol=3e-2)  # a few bf16 ulps at |y| ~ 4: another rounding order, not bitwise


def _both(fn, *args):
    """(exact, fast) results of ``fn(*args)``."""
    exact = fn(*args)
    with _kernels.fast_kernels():
        fast = fn(*args)
    return exact, fast


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("mod_shape", [(1, 8), (3, 8), (1, 1, 8), (2, 5, 8)], ids=["B1", "B3", "B1-row", "B2-rows"])
def test_norm_modulate(mod_shape):
    B = mod_shape[0]
    x = _rand(B, 5, 8) * 3 + 1
    shift, scale = _rand(*mod_shape, seed=1), _rand(*mod_shape, seed=2)
    exact, fast = _both(L.norm_modulate, x, shift, scale)
    torch.testing.assert_close(fast, exact, **FP32)


def test_gated_and_swiglu_and_split_rows():
    x, gate, y = _rand(2, 5, 8), _rand(2, 1, 8, seed=1), _rand(2, 5, 8, seed=2)
    torch.testing.assert_close(*_both(L.gated, x, gate, y), **FP32)
    from functional_dit import flux2

    exact, fast = _both(lambda: flux2.swiglu(_rand(2, 5, 8, seed=3), _rand(2, 5, 8, seed=4)))
    torch.testing.assert_close(fast, exact, **FP32)
    (a0, b0), (a1, b1) = _both(L.split_rows, _rand(2, 7, 8), 3)
    assert torch.equal(a0, a1) and torch.equal(b0, b1) and a0.is_contiguous() and b0.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_as_one_complex_product(dtype):
    x = _rand(2, 6, 3, 16, dtype=dtype)
    ids = _rand(6, 3, seed=1) * 4
    cos, sin = L.rope(ids, (4, 6, 6), theta=10000.0)
    exact, fast = _both(L.apply_rope, x, cos, sin)
    assert fast.dtype == exact.dtype == dtype
    torch.testing.assert_close(fast, exact, **(FP32 if dtype == torch.float32 else BF16))
    odd = _rand(2, 6, 3, 17)[..., 1:]  # pairs not aligned to complex numbers: the exact kernel runs
    torch.testing.assert_close(*_both(L.apply_rope, odd, cos, sin), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [L.rms_norm, L.rms_norm_fp32], ids=["rms", "rms_fp32"])
def test_rms_norms(norm, dtype):
    x = (_rand(2, 5, 3, 16) * 3)[..., :16].to(dtype)
    p = {"weight": _rand(16, seed=1, dtype=dtype) + 1}
    exact, fast = _both(norm, p, x)
    assert fast.dtype == exact.dtype
    torch.testing.assert_close(fast, exact, **(FP32 if dtype == torch.float32 else BF16))
    strided = _rand(2, 5, 48)[..., 16:32].to(dtype)  # a slice of a fused projection's output
    torch.testing.assert_close(*_both(norm, p, strided), **(FP32 if dtype == torch.float32 else BF16))


@pytest.mark.parametrize("bias", [True, False])
def test_linear_gelu_and_split_and_cat(bias):
    x = _rand(2, 5, 8)
    p = {"weight": _rand(12, 8, seed=1) * 0.3, "bias": _rand(12, seed=2) if bias else None}
    exact, fast = _both(L.linear_gelu, p, x)
    torch.testing.assert_close(fast, exact, **FP32)
    ex, fa = _both(L.col_linear_split, p, x, [4, 3, 5])
    assert [t.shape[-1] for t in fa] == [4, 3, 5] and all(t.is_contiguous() for t in fa)
    for a, b in zip(ex, fa):
        torch.testing.assert_close(b, a, **FP32)
    out = {"weight": _rand(6, 12, seed=3), "bias": _rand(6, seed=4) if bias else None}
    parts = [_rand(2, 5, 7, seed=5), _rand(2, 5, 5, seed=6)]
    exact, fast = _both(L.row_linear_cat, out, parts)
    torch.testing.assert_close(fast, exact, **FP32)


def test_fast_kernels_are_off_outside_the_context_and_under_compile():
    assert not _kernels.fast()
    with _kernels.fast_kernels():
        assert _kernels.fast()
        assert not torch.compile(lambda: _kernels.fast(), fullgraph=True)()
        with _kernels.fast_kernels(False):
            assert not _kernels.fast()
        assert _kernels.fast()
    assert not _kernels.fast()


# ----------------------------------------------------------------------------- models


def _flux1(batch):
    module, params = diffusers_model(cases_flux1.TINY, seed=11)
    kw = cases_flux1.inputs(params.config, batch=batch, seed=batch)
    return module, params, kw, cases_flux1.diffusers_kwargs(kw)


def _flux2(batch, config=cases_flux2.TINY):
    module, params = diffusers_model(config, seed=12)
    kw = cases_flux2.inputs(params.config, batch=batch, txt_len=5, h=3, w=4, seed=batch)
    return module, params, kw, cases_flux2.diffusers_kwargs(kw)


def _qwen(batch, config=cases_qwenimage.TINY):
    module, params = diffusers_model(config, seed=13)
    kw = cases_qwenimage.inputs(params.config, batch=batch, seed=batch)
    return module, params, kw, cases_qwenimage.diffusers_kwargs(kw)


MODELS = {
    "flux1-b1": lambda: _flux1(1),
    "flux1-b2": lambda: _flux1(2),
    "flux2-b1": lambda: _flux2(1),
    "flux2-klein-b2": lambda: _flux2(2, cases_flux2.TINY_KLEIN),
    "qwen-b1": lambda: _qwen(1),
    "qwen-b2-ragged": lambda: _qwen(2),
    "qwen-edit-b1": lambda: _qwen(1, cases_qwenimage.TINY_EDIT),  # zero_cond_t: per-row modulation
    "qwen-layered-b2": lambda: _qwen(2, cases_qwenimage.TINY_LAYERED),
}


def _family_of(params):
    return api.family(params)


@pytest.mark.parametrize("case", list(MODELS))
def test_prepared_model_runs_the_fast_kernels_and_equals_diffusers(case):
    module, params, kw, dkw = MODELS[case]()
    prepared = fd.prepare(params)
    fam = _family_of(params)
    assert _fuse.active(prepared, fam.FUSED, kw) and not _fuse.active(params, fam.FUSED, kw)
    with torch.no_grad():
        (ref,) = module(**dkw)
        out = fd.apply(prepared, **kw)
    print(f"{case}: fast kernels, max |ours - diffusers| = {max_err(out, ref):.3g}")
    torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.parametrize("case", ["flux1-b2", "flux2-b1", "qwen-b2-ragged"])
def test_prepared_model_in_bf16(case):
    module, params, kw, dkw = MODELS[case]()
    module = module.to(torch.bfloat16)
    params = fd.from_diffusers(module)
    kw = {k: v.to(torch.bfloat16) if k in ("x", "txt", "pooled") else v for k, v in kw.items()}
    dkw = {k: kw[n] if n else v for (k, v), n in zip(dkw.items(), _renamed(dkw, kw))}
    with torch.no_grad():
        (ref,) = module(**dkw)
        out = fd.apply(fd.prepare(params), **kw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, **BF16)


def _renamed(dkw, kw):
    """For each diffusers keyword, the fd.apply keyword holding the same (cast) input, or None."""
    names = {"hidden_states": "x", "encoder_hidden_states": "txt", "pooled_projections": "pooled"}
    return [names.get(k) for k in dkw]


def test_fast_path_is_off_for_autograd_and_torch_func():
    """Inputs that need gradients, or sit in a torch.func transform, run the exact kernels
    on prepared params (the fast ones work in place and have no batching rules)."""
    _, params, kw, _ = _flux1(1)
    prepared, fam = fd.prepare(params), _family_of(params)
    x = kw["x"].clone().requires_grad_(True)
    assert not _fuse.active(prepared, fam.FUSED, dict(kw, x=x))
    rest = {k: v for k, v in kw.items() if k != "x"}
    (gp,) = torch.autograd.grad(fd.apply(prepared, x=x, **rest).square().sum(), x)
    (g,) = torch.autograd.grad(fd.apply(params, x=x, **rest).square().sum(), x)
    torch.testing.assert_close(gp, g, **FP32)
    with torch.no_grad():
        xs = torch.stack([kw["x"], kw["x"] * 0.5])
        vm = torch.func.vmap(lambda xi: fd.apply(prepared, x=xi, **rest))(xs)
        loop = torch.stack([fd.apply(params, x=xi, **rest) for xi in xs])
    torch.testing.assert_close(vm, loop, **FP32)


def test_lora_on_some_layers_with_the_fast_kernels():
    """An adapter on the output and MLP projections only: the fused q/k/v groups stay fused
    (fast kernels on), the adapted layers take their exact per-layer path with LoRA."""
    from functional_dit import lora

    _, params, kw, _ = _flux1(2)
    targets = ("attn.to_out.0", "ff.net.0.proj", "ff.net.2", "proj_out")
    adapter = lora.init(params, rank=3, targets=targets, alpha=3.0, seed=7, zero_b=False)
    assert not any(".to_q" in k or "proj_mlp" in k for k in adapter.flat())
    prepared = fd.prepare(params)
    with torch.no_grad():
        want = fd.apply(lora.merge(params, adapter, 0.5), **kw)
        got = fd.apply(prepared, **kw, lora=[(adapter, 0.5)])
        base = fd.apply(prepared, **kw)
    torch.testing.assert_close(got, want, **FP32)
    assert max_err(got, base) > 1e-3  # the adapter matters


def test_fast_kernels_match_a_plain_gelu_without_onednn(monkeypatch):
    """Where torch has no oneDNN linear (or off the CPU), the GELU runs in place on the GEMM output."""
    monkeypatch.setattr(_kernels, "onednn_linear_pointwise", lambda: None)
    x, p = _rand(2, 5, 8), {"weight": _rand(12, 8, seed=1), "bias": _rand(12, seed=2)}
    exact, fast = _both(L.linear_gelu, p, x)
    torch.testing.assert_close(fast, exact, **FP32)
    assert torch.equal(fast, F.gelu(F.linear(x, p["weight"], p["bias"]), approximate="tanh"))

"""Mistakes that used to pass silently: ``t`` outside [0, 1] and non-finite inputs to
`fd.apply` (checked in eager mode only, docs/numerics.md), a LoRA file without alpha,
a LoRA for another model."""

from __future__ import annotations

import warnings

import pytest
import torch

import functional_dit as fd
import functional_dit.lora as lora


def _flux_inputs(config, B=2, S=4, T=3):
    g = torch.Generator().manual_seed(0)
    return dict(
        x=torch.randn(B, S, config.in_channels, generator=g),
        t=torch.rand(B, generator=g),
        txt=torch.randn(B, T, config.joint_attention_dim, generator=g),
        pooled=torch.randn(B, config.pooled_projection_dim, generator=g),
        guidance=torch.full((B,), 3.5),
        img_ids=torch.zeros(S, 3),
        txt_ids=torch.zeros(T, 3),
    )


def test_t_out_of_range_and_non_finite_inputs_raise_in_eager_mode():
    params = fd.init("flux1-tiny", seed=0)
    kw = _flux_inputs(params.config)
    fd.apply(params, **{**kw, "t": torch.tensor([0.0, 1.0])})  # the bounds are valid
    with pytest.raises(ValueError, match=r"^t: expected timesteps in \[0, 1\] .* got values in \[250, 1000\]"):
        fd.apply(params, **{**kw, "t": torch.tensor([1000.0, 250.0])})  # raw scheduler timesteps
    with pytest.raises(ValueError, match=r"^t: expected timesteps in \[0, 1\].*\[-0.5, 0.5\]"):
        fd.apply(params, **{**kw, "t": torch.tensor([-0.5, 0.5])})
    for name in ("x", "txt", "pooled", "guidance", "t"):
        bad = kw[name].clone()
        bad.view(-1)[-1] = float("nan") if name != "guidance" else float("inf")
        with pytest.raises(ValueError, match=rf"^{name}: expected finite values, got NaN or inf"):
            fd.apply(params, **{**kw, name: bad})


def test_value_checks_are_skipped_where_they_would_sync():
    """Under torch.compile (dynamo: fullgraph, so no graph break either) and torch.func
    transforms no value is read: an out-of-range t goes through, as documented."""
    from functional_dit.nn.values import check_values

    t, x = torch.tensor([500.0]), torch.randn(1, 4)
    traced = torch.compile(lambda t, x: (check_values(t, x=x), x + t)[1], backend="eager", fullgraph=True)
    assert torch.equal(traced(t, x), x + t)
    params = fd.init("flux1-tiny", seed=0)
    kw = {**_flux_inputs(params.config, B=1), "t": torch.tensor([500.0])}
    xs = torch.stack([kw.pop("x")[0]] * 2)
    out = torch.func.vmap(lambda xi: fd.apply(params, xi[None], **kw))(xs)
    assert out.shape == (2, 1, *xs.shape[1:]) and torch.isfinite(out).all()


def _state(config, **kw):
    return lora.to_state_dict(lora.init(config, rank=4, seed=0, zero_b=False, **kw))


def test_lora_without_alpha_warns_naming_the_assumption():
    config = fd.PRESETS["flux1-tiny"]
    with pytest.warns(UserWarning, match=r"no alpha for 22 of 22 layers .* assuming alpha = rank \(scale 1\)"):
        ad = lora.from_state_dict(_state(config), config)
    assert all(alpha == rank for _, rank, alpha in ad.config.modules)
    with warnings.catch_warnings():  # alpha given (.alpha keys or metadata): no warning
        warnings.simplefilter("error")
        lora.from_state_dict(_state(config), config, {"lora_adapter_metadata": '{"transformer.lora_alpha": 8}'})
        alphas = {k.replace("lora_A.weight", "alpha"): torch.tensor(8.0) for k in _state(config) if "lora_A" in k}
        ad = lora.from_state_dict({**_state(config), **alphas}, config)
    assert {alpha for _, _, alpha in ad.config.modules} == {8.0}


def test_lora_for_another_model_is_one_error_with_the_family():
    """An attention-only Qwen-Image LoRA has FLUX.1's module names; the shapes tell them
    apart, and the error says whose they are, with a few examples, not all of them."""
    qwen, flux = fd.PRESETS["qwen-image-tiny"], fd.PRESETS["flux1-tiny"]
    with pytest.raises(ValueError) as e:
        lora.from_state_dict(_state(qwen), flux)
    msg = str(e.value)
    assert msg.startswith("lora: not a LoRA for this Flux1Config: its factors fit ") and "qwen-image-tiny" in msg
    assert "16 problems, e.g. " in msg and msg.endswith("... and 13 more"), msg

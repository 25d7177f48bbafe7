"""FLUX.3 against diffusers' Flux3Transformer2DModel at the same weights (the oracle)."""

from __future__ import annotations

import pytest
import torch
from cases_flux3 import TINY, TINY_BASE, diffusers_kwargs, inputs
from diffusers import Flux3Transformer2DModel
from oracle import assert_bf16_equal, diffusers_model

import functional_dit as fd
from functional_dit import flux3
from functional_dit.nn import layers

# docs/architecture.md#numerics. Not bitwise in fp32: diffusers projects each token's
# (identical) modulation row, we project one row per mode and broadcast, so the GEMMs
# differ in M and may block their sums differently (measured ≤ 2e-6 at |y| ≈ 3).
FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny():
    return diffusers_model(TINY, seed=1)


@pytest.fixture(scope="module")
def base():
    return diffusers_model(TINY_BASE, seed=2)


def _pe(module, c, n, g):
    ids = torch.randn(n, 4, generator=g) * 4
    return module.pos_embed(ids), layers.rope(ids, c.axes_dims_rope, c.rope_theta)


@pytest.mark.parametrize("case", ["tiny", "base"])
def test_blocks_parity(case, request):
    module, params = request.getfixturevalue(case)
    c, g = params.config, torch.Generator().manual_seed(0)
    x, txt = torch.randn(2, 6, c.inner_dim, generator=g), torch.randn(2, 5, c.inner_dim, generator=g)
    temb = torch.randn(2, 1, c.inner_dim, generator=g)
    mods = flux3.modulations(params, temb, temb * 0.5, True)
    ref_mod = module.early_stream_modulations["image"](torch.nn.functional.silu(temb.expand(2, 6, -1)))
    ref_pe, pe = _pe(module, c, 6, g)
    ref = module.mode_blocks["image"][0](x, ref_mod, ref_pe)
    out = flux3.mode_block(params["mode_blocks"]["image"]["0"], x, mods["image"][0], pe, c.attention_head_dim, c.eps)
    torch.testing.assert_close(out, ref, **FP32)
    ref_pe, pe = _pe(module, c, 11, g)
    silu = torch.nn.functional.silu
    s_img = module.single_stream_modulations["image"](silu(temb.expand(2, 6, -1)))
    s_txt = module.single_stream_modulations["txt"](silu((temb * 0.5).expand(2, 5, -1)))
    ref_txt, ref_x = module.single_transformer_blocks[0](x, txt, s_img, s_txt, ref_pe)
    p = params["single_transformer_blocks"]["0"]
    out_txt, out_x = flux3.single_block(
        p, [txt, x], [mods["txt"][1], mods["image"][1]], pe, c.attention_head_dim, c.eps
    )
    torch.testing.assert_close(out_x, ref_x, **FP32)
    torch.testing.assert_close(out_txt, ref_txt, **FP32)


MODEL_CASES = [  # (fixture, batch, txt_len, (h, w), reference grid)
    ("tiny", 1, 1, (2, 2), None),
    ("tiny", 2, 7, (3, 5), (2, 3)),
    ("base", 2, 5, (4, 3), None),
    ("base", 3, 9, (1, 7), (3, 3)),
]


@pytest.mark.parametrize("case,batch,txt_len,hw,ref_hw", MODEL_CASES)
def test_model_parity(case, batch, txt_len, hw, ref_hw, request):
    module, params = request.getfixturevalue(case)
    kw = inputs(params.config, batch, txt_len, *hw, ref_hw=ref_hw, seed=batch + txt_len)
    ref = module(**diffusers_kwargs(kw))[0]
    torch.testing.assert_close(fd.apply(params, **kw), ref, **FP32)
    rope = flux3.rope_table(params.config, kw["img_ids"], kw["txt_ids"], kw.get("image_cond_ids"))
    no_ids = {k: v for k, v in kw.items() if not k.endswith("ids")}
    torch.testing.assert_close(fd.apply(params, **no_ids, rope=rope), ref, **FP32)


def test_bf16_parity_and_prepared(tiny):
    module, _ = tiny
    m16 = Flux3Transformer2DModel(**{k: v for k, v in module.config.items() if not k.startswith("_")})
    m16.load_state_dict(module.state_dict())
    m16 = m16.to(torch.bfloat16).eval()
    p16 = fd.from_diffusers(m16)
    kw = inputs(TINY, 2, 6, 3, 3, ref_hw=(2, 2), dtype=torch.bfloat16)
    with torch.no_grad():
        ref = m16(**diffusers_kwargs(kw))[0]
        assert_bf16_equal(fd.apply(p16, **kw), ref)
        fast = fd.apply(fd.prepare(p16), **kw)  # fast eager kernels: equal within bf16 rounding
    torch.testing.assert_close(fast, ref, rtol=2e-2, atol=2e-2)  # about one bf16 ulp at |y| ≈ 4


def test_keys_count_and_config_round_trip():
    with torch.device("meta"):
        for name in ("flux3-klein-base", "flux3-klein"):
            c = fd.PRESETS[name]
            module = Flux3Transformer2DModel(**{k: v for k, v in fd.config_to_diffusers(c).items() if k[0] != "_"})
            assert set(module.state_dict()) == set(fd.init(c, device="meta").flat())
            assert fd.num_params(c) == sum(t.numel() for t in module.state_dict().values())
            assert fd.config_from_diffusers(module.config) == c
    assert fd.num_params("flux3-klein") - fd.num_params("flux3-klein-base") == 256 * 3072 + 3072 * 3072


def test_bad_inputs(tiny):
    _, params = tiny
    kw = inputs(TINY, 2, 4, 2, 2, ref_hw=(2, 2))
    for change, match in [
        (dict(target_timestep=None), "target_timestep: this model has flow_map=True"),
        (dict(image_cond_ids=None), "image_cond_ids: required with image_cond"),
        (dict(image_cond=kw["image_cond"][..., :3]), r"image_cond: expected shape \(2, \*, 12\)"),
        (dict(img_ids=kw["img_ids"][:3]), r"img_ids: expected shape \(4, 4\)"),
        (dict(guidance=torch.ones(2)), "guidance: FLUX.3 takes no guidance"),
    ]:
        with pytest.raises(ValueError, match=match):
            fd.apply(params, **{**kw, **change})
    with pytest.raises(ValueError, match="target_timestep: this model has flow_map=False"):
        fd.apply(fd.init(TINY_BASE), **inputs(TINY_BASE), target_timestep=torch.ones(2))
    with pytest.raises(ValueError, match="Flux3Config.timestep_channels: expected an even int"):
        fd.Flux3Config(timestep_channels=7)

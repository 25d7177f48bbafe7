"""Qwen-Image 2.1 against diffusers' QwenImage21Transformer2DModel at the same weights."""

from __future__ import annotations

import pytest
import torch
from cases_qwenimage21 import LAYOUTS, TINY, TINY_NC, diffusers_kwargs, fix_bf16_buffers, inputs
from diffusers import QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache as DiffusersCache
from oracle import assert_bf16_equal, diffusers_model

import functional_dit as fd
from functional_dit import qwenimage21 as q21

# docs/architecture.md#numerics. Not bitwise in fp32 (≤ 1e-6 at |y| ≈ 3): diffusers'
# RoPE is a complex product, ours its real form (bitwise in bf16, below).
FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny():
    return diffusers_model(TINY, seed=1)


@pytest.fixture(scope="module")
def nc():
    return diffusers_model(TINY_NC, seed=2)


def test_layout_matches_diffusers():
    """Positions (RoPE), image blocks and prefix segments as diffusers derives them."""
    module = QwenImage21Transformer2DModel(**{k: v for k, v in fd.config_to_diffusers(TINY).items() if k[0] != "_"})
    for name in LAYOUTS:
        kw = inputs(TINY, name, batch=1)
        mask = kw["img_mask"][0]
        pad = torch.repeat_interleave(mask, torch.where(mask, 4, 1))
        shapes = kw["img_shapes"][0]
        ref_rope = module.pos_embed(shapes, pad, device="cpu")
        lay = q21.layout(mask.tolist(), shapes, kw["txt"].shape[1])
        cos, sin = fd.qwenimage.rope(lay.ids, TINY.axes_dims_rope)
        # the same angles; torch.polar's cos may differ from torch.cos by one fp32 ulp at 1
        torch.testing.assert_close(cos[:, 0::2], ref_rope.real, rtol=0, atol=1.2e-7, msg=name)
        torch.testing.assert_close(sin[:, 0::2], ref_rope.imag, rtol=0, atol=1.2e-7, msg=name)
        ids, target = module.build_token_metadata(pad, shapes)
        from diffusers.models.transformers.transformer_qwenimage21 import _qwenimage21_prefix_segments

        prefix = int((~target).sum())
        assert lay.prefix == prefix and target[prefix:].all(), name
        assert lay.segments == tuple(_qwenimage21_prefix_segments(ids, prefix)), name


MODEL_CASES = [  # (fixture, layout, batch, ragged)
    ("tiny", "t2i", 1, False),
    ("tiny", "edit", 2, True),
    ("tiny", "adjacent", 2, False),
    ("tiny", "text-last", 3, True),
    ("nc", "edit", 2, True),
    ("nc", "adjacent", 1, False),
]


@pytest.mark.parametrize("case,layout,batch,ragged", MODEL_CASES)
def test_model_parity(case, layout, batch, ragged, request):
    module, params = request.getfixturevalue(case)
    kw = inputs(params.config, layout, batch, ragged, seed=batch)
    torch.testing.assert_close(fd.apply(params, **kw), module(**diffusers_kwargs(kw))[0], **FP32)


def test_block_parity(tiny):
    module, params = tiny
    kw = inputs(TINY, "edit", 2, ragged=True)
    x = torch.randn(2, 17, TINY.inner_dim)
    temb = torch.randn(3, TINY.inner_dim)
    lay = q21.layout(kw["img_mask"][0].tolist(), kw["img_shapes"][0], kw["txt"].shape[1])
    pad = torch.repeat_interleave(kw["img_mask"][0], torch.where(kw["img_mask"][0], 4, 1))
    ids, target = module.build_token_metadata(pad, kw["img_shapes"][0])
    key_valid = torch.ones(2, 17, dtype=torch.bool)
    key_valid[1, 16 - 4] = False  # a text key (row 12 is the last text row before the target)
    ref = module.transformer_blocks[0](
        x,
        module.modulation(temb),
        module.pos_embed(kw["img_shapes"][0], pad, "cpu"),
        target_token_mask=target,
        segments=q21._segments(ids.tolist(), lay.prefix),
        key_valid=key_valid,
    )
    mod, _ = q21.modulations(params, temb, target[:, None])
    bias = fd.qwenimage.mask_bias(key_valid)
    pe = fd.qwenimage.rope(lay.ids, TINY.axes_dims_rope)
    how = q21.Attn(q21.block_causal(lay.segments, lay.prefix))
    out, _, _ = q21.block(params["transformer_blocks"]["0"], x, mod, pe, TINY.attention_head_dim, TINY.eps, bias, how)
    torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.parametrize("layout,ragged", [("edit", True), ("t2i", False)])
def test_kv_cache_matches_diffusers(tiny, layout, ragged):
    """Extract returns diffusers' output and cache; a cached step reads the prefix from the
    cache: garbage in the prefix inputs (txt, condition latents) changes nothing."""
    module, params = tiny
    kw = inputs(TINY, layout, 2, ragged)
    dcache = DiffusersCache(TINY.num_layers)
    ref = module(**diffusers_kwargs(kw, dcache, "extract"))[0]
    out, cache = fd.apply(params, **kw, kv_cache="extract")
    torch.testing.assert_close(out, ref, **FP32)
    for i, layer in enumerate(dcache.layer_caches):
        torch.testing.assert_close(cache["transformer_blocks"][str(i)]["k"], layer.k, **FP32)
        torch.testing.assert_close(cache["transformer_blocks"][str(i)]["v"], layer.v, **FP32)
    step = {**kw, "x": torch.randn_like(kw["x"]), "t": kw["t"] * 0.5}
    ref = module(**diffusers_kwargs(step, dcache, "cached"))[0]
    out = fd.apply(params, **step, kv_cache=cache)
    assert out.shape == ref.shape == (2, 8 if layout == "t2i" else 4, TINY.out_dim)
    torch.testing.assert_close(out, ref, **FP32)
    n = out.shape[1]
    garbage = {**step, "txt": torch.randn_like(kw["txt"]) * 100}
    garbage["x"] = torch.cat([torch.randn_like(kw["x"][:, :-n]) * 100, step["x"][:, -n:]], 1)
    assert torch.equal(fd.apply(params, **garbage, kv_cache=cache), out)


def test_bf16_parity(tiny):
    module, _ = tiny
    m16 = QwenImage21Transformer2DModel(**{k: v for k, v in module.config.items() if not k.startswith("_")})
    m16.load_state_dict(module.state_dict())
    m16 = m16.to(torch.bfloat16).eval()
    fix_bf16_buffers(m16)
    p16 = fd.from_diffusers(m16)
    kw = inputs(TINY, "edit", 2, ragged=True, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = m16(**diffusers_kwargs(kw))[0]
        assert_bf16_equal(fd.apply(p16, **kw), ref)
        fast = fd.apply(fd.prepare(p16), **kw)  # fast eager kernels: equal within bf16 rounding
    torch.testing.assert_close(fast, ref, rtol=2e-2, atol=2e-2)  # about one bf16 ulp at |y| ≈ 4


def test_keys_count_and_config_round_trip():
    c = fd.PRESETS["qwen-image-2.1"]
    with torch.device("meta"):
        module = QwenImage21Transformer2DModel(**{k: v for k, v in fd.config_to_diffusers(c).items() if k[0] != "_"})
    assert set(module.state_dict()) == set(fd.init(c, device="meta").flat())
    assert fd.num_params(c) == sum(t.numel() for t in module.state_dict().values())
    assert fd.config_from_diffusers(module.config) == c


def test_bad_inputs(tiny):
    _, params = tiny
    kw = inputs(TINY, "edit", 2, ragged=True)
    bad_mask = kw["img_mask"].clone()
    bad_mask[1, 0] = True
    for change, match in [
        (dict(img_mask=None), "img_shapes, img_mask: Qwen-Image 2.1 needs both"),
        (dict(img_mask=kw["img_mask"].int()), "img_mask: expected a bool tensor"),
        (dict(img_mask=kw["img_mask"][:, :-1]), r"img_mask: expected shape \(2, 8\)"),
        (dict(img_mask=bad_mask), "img_mask: every sample must share one layout"),
        (dict(img_shapes=[[(1, 2, 4), (2, 1, 2)]] * 2), r"img_shapes: Qwen-Image 2.1 takes single-frame images"),
        (dict(txt_mask=kw["txt_mask"].float()), "txt_mask: expected a bool or integer"),
        (dict(kv_cache="prefill"), "kv_cache: expected None, 'extract' or a QwenImage21KVCache"),
        (dict(guidance=torch.ones(2)), "guidance: Qwen-Image 2.1 takes no guidance"),
    ]:
        with pytest.raises(ValueError, match=match):
            fd.apply(params, **{**kw, **change})
    _, cache = fd.apply(params, **kw, kv_cache="extract")
    other = inputs(TINY, "t2i", 2)
    with pytest.raises(ValueError, match="kv_cache: holds 13 prefix tokens; this layout has 5"):
        fd.apply(params, **other, kv_cache=cache)
    with pytest.raises(ValueError, match="kv_cache: needs causal_condition=True"):
        fd.apply(fd.init(TINY_NC), **inputs(TINY_NC), kv_cache="extract")


def test_layout_read_once_gives_the_same_output(tiny):
    """``layout=`` (`read_layout`, read once on the host) in place of img_mask: the same
    output bit for bit; a layout of another call, or both, refused."""
    _, params = tiny
    kw, other = inputs(TINY, "edit", 2, ragged=True), inputs(TINY, "t2i", 2)
    lay = q21.read_layout(kw["img_mask"], kw["img_shapes"], kw["txt"].shape[1], kw["x"].shape[1])
    got = fd.apply(params, **{**kw, "img_mask": None}, layout=lay)
    torch.testing.assert_close(got, fd.apply(params, **kw), rtol=0, atol=0)  # the same ops on the same inputs
    with pytest.raises(ValueError, match="img_mask, layout: expected one of them"):
        fd.apply(params, **kw, layout=lay)
    with pytest.raises(ValueError, match="layout: expected one for"):
        fd.apply(params, **{**other, "img_mask": None}, layout=lay)

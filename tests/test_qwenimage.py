"""Qwen-Image (incl. Edit, Edit-2511, Layered) against diffusers' QwenImageTransformer2DModel
at the same weights (the oracle)."""

from __future__ import annotations

import dataclasses
import json
import math

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from cases_qwenimage import TINY, TINY_EDIT, TINY_LAYERED, diffusers_kwargs, inputs
from diffusers import QwenImageTransformer2DModel
from oracle import assert_bf16_equal, diffusers_model, max_err

import functional_dit as fd
import sharding
from functional_dit import qwenimage as Q
from functional_dit.nn import layers

FP32 = dict(rtol=1e-5, atol=1e-5)
CPU = torch.device("cpu")
TINY_ALL = dataclasses.replace(TINY_LAYERED, zero_cond_t=True)  # every flag at once


@pytest.fixture(scope="module")
def tiny():
    return diffusers_model(TINY, seed=1)


@pytest.fixture(scope="module")
def edit():
    return diffusers_model(TINY_EDIT, seed=2)


@pytest.fixture(scope="module")
def layered():
    return diffusers_model(TINY_LAYERED, seed=3)


@pytest.fixture(scope="module")
def all_flags():
    return diffusers_model(TINY_ALL, seed=4)


# ----------------------------------------------------------------------------- RoPE

ROPE_CASES = [  # (img_shapes of one item, layer3d, txt_len)
    ([(1, 3, 4)], False, 7),
    ([(1, 5, 2), (1, 2, 2), (1, 7, 3)], False, 9),
    ([(3, 2, 3)], False, 4),
    ([(1, 40, 64), (1, 30, 20)], False, 300),  # realistic extents: angles up to ~330 rad
    ([(1, 2, 3)] * 3 + [(1, 4, 3)], True, 5),
    ([(1, 3, 4)], True, 6),  # only the condition image
    ([(1, 1, 1)] * 9 + [(1, 2, 2)], True, 3),  # the layer count sets the text start
]


@pytest.mark.parametrize("shapes,layer3d,txt_len", ROPE_CASES)
def test_rope_matches_diffusers(shapes, layer3d, txt_len, tiny, layered):
    """Our real cos/sin equal the real/imaginary parts of diffusers' complex (polar) RoPE.
    torch.polar's vectorised CPU kernel rounds cos/sin of some angles one ulp differently
    from torch.cos/sin on the same fp32 angles, so allow 1 ulp of |x| <= 1: 1.2e-7."""
    module, params = layered if layer3d else tiny
    c = params.config
    ref_img, ref_txt = module.pos_embed([shapes], max_txt_seq_len=txt_len, device=CPU)
    ref = torch.cat([ref_txt, ref_img])
    cos, sin = Q.pos_embed(shapes, txt_len, c.axes_dims_rope, layer3d, CPU)
    assert cos.shape == (txt_len + sum(math.prod(s) for s in shapes), c.attention_head_dim)
    torch.testing.assert_close(cos[:, ::2], ref.real, rtol=0, atol=1.2e-7)
    torch.testing.assert_close(sin[:, ::2], ref.imag, rtol=0, atol=1.2e-7)
    assert torch.equal(cos[:, ::2], cos[:, 1::2]) and torch.equal(sin[:, ::2], sin[:, 1::2])


def test_positions_by_hand():
    """Centred rows/cols, frame = image index, text on the diagonal after the largest half-extent."""
    ids = Q.image_ids([(1, 2, 3), (1, 1, 2)])
    rows_cols = [(-1, -2), (-1, -1), (-1, 0), (0, -2), (0, -1), (0, 0)]
    expected = [(0, r, c) for r, c in rows_cols] + [(1, -1, -1), (1, -1, 0)]
    assert ids.tolist() == [list(map(float, e)) for e in expected]
    assert Q.text_ids([(1, 2, 3), (1, 1, 2)], 3).tolist() == [[1.0] * 3, [2.0] * 3, [3.0] * 3]
    layered = Q.image_ids([(1, 1, 1), (1, 1, 1), (1, 1, 2)], layer3d=True)
    assert layered[:, 0].tolist() == [0.0, 1.0, -1.0, -1.0]  # the condition image at frame -1
    assert Q.text_ids([(1, 1, 1)] * 4, 1, layer3d=True).tolist() == [[3.0] * 3]  # start >= #layers


# ----------------------------------------------------------------------------- per block


def _block_inputs(module, c, shapes, B=2, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, C = sum(math.prod(s) for s in shapes), c.inner_dim
    img, txt = torch.randn(B, S, C, generator=g), torch.randn(B, T, C, generator=g)
    temb = torch.randn(2 * B if c.zero_cond_t else B, C, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.4
    mask[:, 0] = True
    ref_pe = module.pos_embed([shapes] * B, max_txt_seq_len=T, device=CPU)
    pe = Q.pos_embed(shapes, T, c.axes_dims_rope, c.use_layer3d_rope, CPU)
    return img, txt, temb, mask, ref_pe, pe


BLOCK_CASES = [("tiny", [(1, 3, 4)]), ("tiny", [(1, 2, 3), (1, 3, 3)]), ("edit", [(1, 3, 4), (1, 2, 3), (1, 1, 2)])]
BLOCK_CASES += [("layered", [(1, 2, 2)] * 2 + [(1, 3, 2)])]


def _mods(params, temb, txt):
    """Block 0's (img, txt) modulations as `qwenimage.modulations` computes them: img from
    temb (2B rows with zero_cond_t), txt from its first B rows."""
    p = params["transformer_blocks"]["0"]
    (img_mod,) = layers.modulations([(p["img_mod"]["1"], 6)], temb)
    (txt_mod,) = layers.modulations([(p["txt_mod"]["1"], 6)], temb[: txt.shape[0]])
    return img_mod, txt_mod


@pytest.mark.parametrize("case,shapes", BLOCK_CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_block_parity(case, shapes, masked, request):
    module, params = request.getfixturevalue(case)
    c = params.config
    img, txt, temb, mask, ref_pe, pe = _block_inputs(module, c, shapes, seed=len(shapes))
    index, ref = None, None
    if c.zero_cond_t:  # diffusers' modulate_index: 0 for the target's tokens, 1 for references
        index = torch.tensor([[0] * math.prod(shapes[0]) + [1] * (img.shape[1] - math.prod(shapes[0]))] * 2)
        ref = Q.ref_mask(shapes)
    ref_txt, ref_img = module.transformer_blocks[0](
        img, txt, mask if masked else None, temb, ref_pe, modulate_index=index
    )
    bias = torch.cat([Q.mask_bias(mask), torch.zeros(img.shape[:2])], 1) if masked else None  # (B, T + S)
    out_img, out_txt = Q.block(
        params["transformer_blocks"]["0"], img, txt, *_mods(params, temb, txt), pe, c.attention_head_dim, bias, ref
    )
    torch.testing.assert_close(out_img, ref_img, **FP32)
    torch.testing.assert_close(out_txt, ref_txt, **FP32)


@pytest.mark.parametrize("case,shapes", [BLOCK_CASES[0], BLOCK_CASES[2]])  # plain; zero_cond_t (Edit-2511)
def test_attention_hook_is_the_stock_attention_module(case, shapes, request):
    """The block's ``attn`` hook sits where the stock ``attn`` module is: the function it is
    given computes the module's (img, txt) output after to_out.0 / to_add_out, and a
    stand-in it returns takes that output's place in the block, as a forward hook's return
    value does in the stock block; with zero_cond_t the modulation around it still reads
    the reference rows' t = 0 half."""
    module, params = request.getfixturevalue(case)
    c = params.config
    img, txt, temb, mask, ref_pe, pe = _block_inputs(module, c, shapes, seed=len(shapes))
    index, ref = None, None
    if c.zero_cond_t:
        index = torch.tensor([[0] * math.prod(shapes[0]) + [1] * (img.shape[1] - math.prod(shapes[0]))] * 2)
        ref = Q.ref_mask(shapes)
    stock_block, p = module.transformer_blocks[0], params["transformer_blocks"]["0"]
    bias = torch.cat([Q.mask_bias(mask), torch.zeros(img.shape[:2])], 1)
    mods = _mods(params, temb, txt)

    def stock(out=None):
        seen = []
        handle = stock_block.attn.register_forward_hook(lambda m, args, y: seen.append(y) or out)
        try:
            txt_out, img_out = stock_block(img, txt, mask, temb, ref_pe, modulate_index=index)
        finally:
            handle.remove()
        return (img_out, txt_out), seen[0]

    ours = lambda attn: Q.block(p, img, txt, *mods, pe, c.attention_head_dim, bias, ref, attn=attn)  # noqa: E731
    want, stock_out = stock()
    given = []
    torch.testing.assert_close(ours(lambda fn: given.append(fn()) or given[-1]), want, **FP32)
    torch.testing.assert_close(given[0], stock_out, **FP32)
    stand_in = tuple(y * 0.5 for y in stock_out)
    want, _ = stock(stand_in)
    torch.testing.assert_close(ours(lambda fn: stand_in), want, **FP32)


def test_time_embed_parity(layered, edit):
    t = torch.rand(3)
    for module, params in (layered, edit):
        c = params.config
        t_cond = torch.tensor([0, 1, 1]) if c.use_additional_t_cond else None
        tt = torch.cat([t, t * 0]) if c.zero_cond_t else t
        ref = module.time_text_embed(tt, tt[:, None], t_cond)
        out = Q.time_embed(params["time_text_embed"], t, t_cond, c.zero_cond_t)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


# ----------------------------------------------------------------------------- full model

MODEL_CASES = {  # id: (config fixture, inputs(...) keyword arguments)
    "b1-nomask": ("tiny", dict(batch=1, mask=False)),
    "b1-fullmask": ("tiny", dict(batch=1, ragged=False)),
    "b2-ragged": ("tiny", dict(batch=2, img_shapes=[(1, 4, 3)])),
    "b3-ragged-holes": ("tiny", dict(batch=3, img_shapes=[(1, 3, 5)], holes=True)),
    "b2-holes-long-text": ("tiny", dict(batch=2, txt_len=40, ragged=False, holes=True)),
    "b2-multi-image": ("tiny", dict(batch=2, img_shapes=[(1, 3, 4), (1, 2, 2), (1, 3, 3)])),
    "b1-frames": ("tiny", dict(batch=1, img_shapes=[(2, 2, 3)])),
    "edit-zero-cond-t-b2": ("edit", dict(batch=2)),
    "edit-zero-cond-t-b3-3refs": ("edit", dict(batch=3, img_shapes=[(1, 2, 3), (1, 3, 3), (1, 1, 4), (1, 2, 2)])),
    "edit-zero-cond-t-b1-no-ref": ("edit", dict(batch=1, img_shapes=[(1, 3, 3)], holes=True)),
    "layered-b2": ("layered", dict(batch=2)),
    "layered-b3-holes": ("layered", dict(batch=3, holes=True)),
    "layered-b1-condition-only": ("layered", dict(batch=1, img_shapes=[(1, 3, 4)])),
    # diffusers adds the (B, C) additional_t_cond embedding to the (2B, C) zero_cond_t temb by
    # broadcasting, which it can only do at B = 1 (it raises for B > 1); we add it to both halves.
    "all-flags-b1": ("all_flags", dict(batch=1)),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_parity(case, request):
    fixture, kwargs = MODEL_CASES[case]
    module, params = request.getfixturevalue(fixture)
    kw = inputs(params.config, seed=len(case), **kwargs)
    (ref,) = module(**diffusers_kwargs(kw))
    out = fd.apply(params, **kw)
    assert out.shape == ref.shape == (*kw["x"].shape[:2], params.config.out_dim)
    print(f"{case}: max |ours - diffusers| = {max_err(out, ref):.3g}")
    torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.parametrize("config", [TINY, TINY_EDIT, TINY_LAYERED], ids=["tiny", "edit", "layered"])
def test_bf16_parity(config):
    """bf16 weights and activations, ragged masks with holes. We follow diffusers' op order
    and casts (fp32 RMS variance, RoPE and sinusoid; contiguous slices into the output
    projections), so bitwise equal on the CPU (`assert_bf16_equal` says what other devices get)."""
    module, params = diffusers_model(config, seed=5, dtype=torch.bfloat16)
    kw = inputs(config, batch=2, dtype=torch.bfloat16, seed=6, holes=True)
    (ref,) = module(**diffusers_kwargs(kw))
    assert_bf16_equal(fd.apply(params, **kw), ref)


def test_fp16_clipping_as_diffusers():
    """diffusers clips both fp16 streams of a block to +-65504. Streams at the fp16 maximum
    and an MLP gate of 1000 (which overflows the residual): the same clipped result."""
    module, params = diffusers_model(TINY, seed=7, dtype=torch.float16)
    n, block = TINY.inner_dim, module.transformer_blocks[0]
    with torch.no_grad():
        for mod in (block.img_mod[1], block.txt_mod[1]):  # (shift, scale, gate) x (attn, mlp)
            mod.weight.zero_()
            mod.bias.zero_()
            mod.bias[5 * n :] = 1000.0
    shapes = [(1, 2, 3)]
    img, txt = (torch.full((2, L, n), 65504.0, dtype=torch.float16) for L in (6, 5))
    temb = torch.randn(2, n).half()
    ref_txt, ref_img = block(img, txt, None, temb, module.pos_embed([shapes] * 2, max_txt_seq_len=5, device=CPU))
    pe = Q.pos_embed(shapes, 5, TINY.axes_dims_rope)
    out_img, out_txt = Q.block(
        params["transformer_blocks"]["0"], img, txt, *_mods(params, temb, txt), pe, TINY.attention_head_dim
    )
    for out, ref in ((out_img, ref_img), (out_txt, ref_txt)):
        assert ref.abs().max() == 65504 and not ref.isinf().any()  # the case we mean to test
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


# ------------------------------------------------- masks: static text RoPE == dropping padding


@pytest.mark.parametrize("fixture", ["tiny", "edit"])
def test_masked_padding_equals_trimmed_prompt(fixture, request):
    """Each item of a ragged batch equals the item alone with its prompt cut to its real
    tokens and no mask: masked keys drop out and real tokens keep their RoPE positions,
    whatever the padded length (diffusers gives every one of the S_txt tokens a position)."""
    _, params = request.getfixturevalue(fixture)
    kw = inputs(params.config, batch=3, txt_len=9, seed=11)
    out = fd.apply(params, **kw)
    for b in range(3):
        n = int(kw["txt_mask"][b].sum())
        one = fd.apply(
            params, kw["x"][b : b + 1], kw["t"][b : b + 1], kw["txt"][b : b + 1, :n], img_shapes=kw["img_shapes"][:1]
        )
        torch.testing.assert_close(out[b : b + 1], one, **FP32)


def test_extra_masked_tokens_change_nothing(tiny):
    """Appending masked tokens to the prompt (any values) leaves the image output unchanged,
    in ours and in diffusers: the static all-S_txt positions equal any data-dependent length."""
    module, params = tiny
    kw = inputs(TINY, batch=2, txt_len=7, holes=True, seed=12)
    longer = dict(kw, txt=torch.cat([kw["txt"], torch.randn(2, 5, TINY.joint_attention_dim)], 1))
    longer["txt_mask"] = torch.cat([kw["txt_mask"], torch.zeros(2, 5, dtype=torch.bool)], 1)
    out, out_long = fd.apply(params, **kw), fd.apply(params, **longer)
    torch.testing.assert_close(out_long, out, **FP32)
    (ref_long,) = module(**diffusers_kwargs(longer))
    torch.testing.assert_close(out_long, ref_long, **FP32)


def test_mask_changes_output(tiny):
    """The mask is not ignored: dropping a real token changes the result."""
    _, params = tiny
    kw = inputs(TINY, batch=1, ragged=False, seed=13)
    dropped = dict(kw, txt_mask=kw["txt_mask"].clone())
    dropped["txt_mask"][0, 3] = 0
    assert max_err(fd.apply(params, **kw), fd.apply(params, **dropped)) > 1e-3


def test_zero_cond_t_changes_output(edit):
    """zero_cond_t is not ignored: the same weights without it give another output."""
    _, params = edit
    kw = inputs(TINY_EDIT, batch=1, seed=14)
    plain = fd.from_state_dict(dataclasses.replace(TINY_EDIT, zero_cond_t=False), fd.to_state_dict(params))
    assert max_err(fd.apply(params, **kw), fd.apply(plain, **kw)) > 1e-3


# ----------------------------------------------------------------------------- params


@pytest.mark.parametrize("name", [n for n, c in fd.PRESETS.items() if isinstance(c, fd.QwenImageConfig)])
def test_param_specs_equal_diffusers_meta_state_dict(name):
    config = fd.PRESETS[name]
    with torch.device("meta"):
        module = QwenImageTransformer2DModel(
            **{k: v for k, v in fd.config_to_diffusers(config).items() if not k.startswith("_")}
        )
    ref = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    specs = {k: s.shape for k, s in sharding.tree.flatten(fd.param_specs(config)).items()}
    assert list(specs) == list(ref)  # same keys, same (state_dict) order
    assert specs == ref
    assert fd.num_params(config) == sum(p.numel() for p in module.parameters())


def test_num_params_qwen_image():
    assert fd.num_params(fd.PRESETS["qwen-image"]) == 20_430_401_088
    assert fd.num_params(fd.PRESETS["qwen-image-layered"]) == 20_430_401_088 + 2 * 3072


def test_spec_axes():
    specs = fd.param_specs(TINY)["transformer_blocks"]["0"]
    assert specs["attn"]["to_q"]["weight"].axes == ("heads", "embed")
    assert specs["attn"]["add_k_proj"]["bias"].axes == ("heads",)
    assert specs["attn"]["to_out"]["0"]["weight"].axes == ("embed", "heads")
    assert specs["attn"]["to_add_out"]["weight"].axes == ("embed", "heads")
    assert specs["img_mlp"]["net"]["0"]["proj"]["weight"].axes == ("mlp", "embed")
    assert specs["txt_mlp"]["net"]["2"]["weight"].axes == ("embed", "mlp")
    mod = specs["img_mod"]["1"]["weight"]  # AdaLN modulation: 6 chunks, split contiguously (output all-gathered)
    assert mod.axes == ("mod", "embed") and mod.blocks is None and mod.shape[0] == 6 * TINY.inner_dim


@pytest.mark.parametrize("fixture", ["tiny", "edit", "layered"])
def test_config_round_trip(fixture, request, tmp_path):
    module, params = request.getfixturevalue(fixture)
    name = "QwenImageTransformer2DModel"
    assert fd.config_from_diffusers(dict(module.config, _class_name=name)) == params.config
    module.save_config(tmp_path)
    assert fd.config_from_diffusers(tmp_path) == params.config
    assert json.loads((tmp_path / "config.json").read_text())["_class_name"] == name


def test_functional_call_of_diffusers_module_equals_apply(edit):
    module, _ = edit
    params = fd.init(TINY_EDIT, seed=9)  # weights the module does not hold
    kw = inputs(TINY_EDIT, batch=2, holes=True)
    (ref,) = torch.func.functional_call(module, fd.to_state_dict(params), (), diffusers_kwargs(kw))
    torch.testing.assert_close(fd.apply(params, **kw), ref, **FP32)


@pytest.mark.parametrize("lib", ["optree", "torch"])
def test_pytree_flatten_unflatten(lib):
    params = fd.init(TINY_LAYERED)
    flat = params.flat()
    if lib == "optree":
        paths, leaves, spec = optree.tree_flatten_with_path(params)
        back = optree.tree_unflatten(spec, [t * 2 for t in leaves])
        keys = [".".join(path[1:]) for path in paths]  # path[0] is Params' "tree" entry
    else:
        pairs, spec = torch_pytree.tree_flatten_with_path(params)
        leaves = [t for _, t in pairs]
        back = torch_pytree.tree_unflatten([t * 2 for t in leaves], spec)
        keys = [".".join(k.key for k in path[1:]) for path, _ in pairs]
    assert sorted(keys) == sorted(flat)  # leaf paths are the diffusers state_dict keys
    assert isinstance(back, fd.Params) and back.config == params.config
    assert all(torch.equal(back.flat()[k], 2 * t) for k, t in flat.items())


def test_from_diffusers_shares_storage(layered):
    module, params = layered
    state = module.state_dict()
    assert all(t.data_ptr() == state[k].data_ptr() for k, t in fd.to_state_dict(params).items())


# ----------------------------------------------------------------------------- bad input


def test_config_validation():
    with pytest.raises(ValueError, match=r"sum\(axes_dims_rope\).*= 18.*attention_head_dim = 16"):
        fd.QwenImageConfig(attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(6, 6, 6))
    with pytest.raises(ValueError, match=r"axes_dims_rope: expected 3 positive even ints.*\(4, 4, 4, 4\)"):
        fd.QwenImageConfig(attention_head_dim=16, axes_dims_rope=(4, 4, 4, 4))
    with pytest.raises(ValueError, match=r"axes_dims_rope: expected 3 positive even ints.*\(5, 5, 6\)"):
        fd.QwenImageConfig(attention_head_dim=16, axes_dims_rope=(5, 5, 6))
    with pytest.raises(ValueError, match="num_attention_heads: expected a positive int, got 0"):
        fd.QwenImageConfig(num_attention_heads=0)
    with pytest.raises(ValueError, match="num_layers: expected an int >= 0, got -1"):
        fd.QwenImageConfig(num_layers=-1)
    with pytest.raises(ValueError, match="out_channels: expected None or a positive int, got 0"):
        fd.QwenImageConfig(out_channels=0)
    with pytest.raises(ValueError, match="zero_cond_t: expected a bool, got 1"):
        fd.QwenImageConfig(zero_cond_t=1)


def _set(**changes):
    return lambda kw: kw.update(changes)


def _x_tokens(delta):
    return lambda kw: kw.update(x=torch.randn(kw["x"].shape[0], kw["x"].shape[1] + delta, kw["x"].shape[2]))


B, T = 2, 7  # batch and text length of the inputs below
BAD = {  # id: (config, mutate kw, error pattern)
    "x-channels": (TINY, _set(x=torch.randn(B, 12, 5)), r"x: expected shape \(\*, \*, 16\), got \(2, 12, 5\)"),
    "x-dtype": (TINY, _set(x=torch.randn(B, 12, 16, dtype=torch.float64)), "x: expected dtype torch.float32"),
    "x-device": (TINY, _set(x=torch.randn(B, 12, 16, device="meta")), "x: expected device cpu"),
    "x-rank": (TINY, _set(x=torch.randn(12, 16)), r"x: expected shape \(\*, \*, 16\), got \(12, 16\)"),
    "txt-batch": (TINY, _set(txt=torch.randn(3, T, 32)), r"txt: expected shape \(2, \*, 32\), got \(3, 7, 32\)"),
    "txt-dim": (TINY, _set(txt=torch.randn(B, T, 31)), r"txt: expected shape \(2, \*, 32\), got \(2, 7, 31\)"),
    "txt-dtype": (TINY, _set(txt=torch.randn(B, T, 32).bfloat16()), "txt: expected dtype torch.float32"),
    "t-shape": (TINY, _set(t=torch.rand(B, 1)), r"t: expected shape \(2,\), got \(2, 1\)"),
    "t-dtype": (TINY, _set(t=torch.ones(B, dtype=torch.bool)), "t: expected a real floating or integer tensor"),
    "t-complex": (TINY, _set(t=torch.ones(B, dtype=torch.complex64)), "t: expected a real floating .* torch.complex64"),
    "t-device": (TINY, _set(t=torch.ones(B, device="meta")), "t: expected device cpu .* got meta"),
    "mask-device": (TINY, _set(txt_mask=torch.ones(B, T, dtype=torch.long, device="meta")), "txt_mask: .* got meta"),
    "mask-half": (TINY, _set(txt_mask=torch.ones(B, T, dtype=torch.half)), "txt_mask: expected a bool .*float16"),
    "mask-length": (TINY, _set(txt_mask=torch.ones(B, T + 1)), r"txt_mask: expected shape \(2, 7\), got \(2, 8\)"),
    "mask-batch": (TINY, _set(txt_mask=torch.ones(1, T, dtype=torch.long)), r"txt_mask: expected shape \(2, 7\)"),
    "mask-float": (TINY, _set(txt_mask=torch.ones(B, T)), "txt_mask: expected a bool or integer 0/1 mask.*float32"),
    "mask-not-tensor": (TINY, _set(txt_mask=[[1] * T] * B), "txt_mask: expected a tensor of shape"),
    "shapes-missing": (TINY, _set(img_shapes=None), "img_shapes: Qwen-Image needs per batch item"),
    "shapes-batch": (TINY, _set(img_shapes=[[(1, 3, 4)]] * 3), "img_shapes: expected a list of 2 items.*length 3"),
    "shapes-type": (TINY, _set(img_shapes=torch.tensor([[1, 3, 4]] * 2)), "img_shapes: expected a list of 2.*Tensor"),
    "shapes-empty": (TINY, _set(img_shapes=[[], []]), r"img_shapes\[0\]: expected a non-empty list"),
    "shapes-float": (TINY, _set(img_shapes=[[(1, 3.0, 4)]] * 2), r"img_shapes\[0\]: expected a non-empty list"),
    "shapes-zero": (TINY, _set(img_shapes=[[(1, 0, 4)]] * 2), r"img_shapes\[0\]: .* positive ints"),
    "shapes-pair": (TINY, _set(img_shapes=[[(3, 4)]] * 2), r"img_shapes\[0\]: expected .*\(frames, height, width\)"),
    "shapes-differ": (TINY, _set(img_shapes=[[(1, 3, 4)], [(1, 4, 3)]]), r"img_shapes\[1\]: expected the same"),
    "shapes-tokens": (TINY, _x_tokens(1), r"img_shapes: \[\(1, 3, 4\)\] make 12 tokens; expected .* 13"),
    "guidance": (
        TINY,
        _set(guidance=torch.ones(B)),
        "guidance: Qwen-Image takes no guidance; expected None, got Tensor",
    ),
    "pooled": (TINY, _set(pooled=torch.ones(B, 8)), "pooled: Qwen-Image takes no pooled"),
    "img-ids": (TINY, _set(img_ids=torch.zeros(12, 3)), "img_ids: Qwen-Image takes no img_ids"),
    "t-cond-given": (TINY, _set(additional_t_cond=torch.zeros(B, dtype=torch.long)), "use_additional_t_cond=False"),
    "t-cond-missing": (TINY_LAYERED, _set(additional_t_cond=None), r"additional_t_cond: .*needs \(2,\) ints"),
    "t-cond-float": (TINY_LAYERED, _set(additional_t_cond=torch.zeros(B)), "additional_t_cond: expected int64 or"),
    "t-cond-uint8": (TINY_LAYERED, _set(additional_t_cond=torch.zeros(B, dtype=torch.uint8)), "got torch.uint8"),
    "t-cond-shape": (TINY_LAYERED, _set(additional_t_cond=torch.zeros(3, dtype=torch.long)), r"expected shape \(2,\)"),
    "layer3d-frames": (
        TINY_LAYERED,
        lambda kw: kw.update(img_shapes=[[(1, 2, 3)] * 3 + [(2, 2, 3)]] * 2, x=torch.randn(B, 30, 16)),
        r"use_layer3d_rope needs 1 frame in the last \(condition\) image, got \(2, 2, 3\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    config, mutate, pattern = BAD[case]
    params = fd.init(config)
    kw = inputs(config, batch=B, txt_len=T, img_shapes=[(1, 3, 4)] if config is TINY else None)
    mutate(kw)
    with pytest.raises(ValueError, match=pattern):
        fd.apply(params, **kw)


def test_bad_params_dtype():
    params = fd.init(TINY, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x: expected dtype torch.bfloat16 \(the params' dtype\), got torch.float32"):
        fd.apply(params, **inputs(TINY))


def test_img_shapes_flat_form_equals_nested(tiny):
    """diffusers' older pipelines passed one (frames, h, w) per item instead of a list of them."""
    _, params = tiny
    kw = inputs(TINY, batch=2, img_shapes=[(1, 3, 4)])
    flat = dict(kw, img_shapes=[(1, 3, 4)] * 2)
    assert torch.equal(fd.apply(params, **kw), fd.apply(params, **flat))


def test_torch_export_strict():
    """apply traces under strict torch.export with every flag on and a ragged mask: no
    data-dependent shapes, no host syncs; img_shapes are Python constants of the graph."""
    config = dataclasses.replace(TINY_ALL, num_layers=1)
    params = fd.init(config, seed=8)
    kw = inputs(config, batch=2, holes=True, seed=15)
    shapes = kw.pop("img_shapes")

    class Apply(torch.nn.Module):
        def forward(self, params, x, t, txt, txt_mask, additional_t_cond):
            return fd.apply(
                params, x, t, txt, txt_mask=txt_mask, img_shapes=shapes, additional_t_cond=additional_t_cond
            )

    ep = torch.export.export(Apply(), (params,), kwargs=kw, strict=True)
    assert torch.equal(ep.module()(params, **kw), fd.apply(params, img_shapes=shapes, **kw))

"""FLUX.1 against diffusers' FluxTransformer2DModel at the same weights (the oracle)."""

from __future__ import annotations

import dataclasses
import json

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from cases_flux1 import TINY, TINY_SCHNELL, diffusers_kwargs, inputs
from diffusers import FluxTransformer2DModel
from oracle import assert_bf16_equal, diffusers_model, max_err

import functional_dit as fd
import sharding
from functional_dit import configs, flux1
from functional_dit.nn import layers

FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny():
    return diffusers_model(TINY, seed=1)


@pytest.fixture(scope="module")
def schnell():
    return diffusers_model(TINY_SCHNELL, seed=2)


# ----------------------------------------------------------------------------- per block


def _block_inputs(config, module, B=2, T=5, S=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = config.inner_dim
    img, txt, vec = (torch.randn(B, n, C, generator=g) for n in (S, T, 1))
    ids = torch.randn(T + S, 3, generator=g) * 4
    return img, txt, vec[:, 0], module.pos_embed(ids), layers.rope(ids, config.axes_dims_rope, 10000.0)


def _double_mods(params, vec, block="0"):
    """A double block's (img, txt) modulations (B, 6C) from vec, as `flux1.forward` computes them."""
    p = params["transformer_blocks"][block]
    return layers.modulations([(p["norm1"]["linear"], 6), (p["norm1_context"]["linear"], 6)], vec)


def _single_mod(params, vec, block):
    return layers.modulations([(params["single_transformer_blocks"][block]["norm"]["linear"], 3)], vec)[0]


@pytest.mark.parametrize("case", ["tiny", "schnell"])
def test_double_block_parity(case, request):
    module, params = request.getfixturevalue(case)
    c = params.config
    img, txt, vec, ref_pe, pe = _block_inputs(c, module)
    ref_txt, ref_img = module.transformer_blocks[0](img, txt, vec, ref_pe)
    out_img, out_txt = flux1.double_block(
        params["transformer_blocks"]["0"], img, txt, *_double_mods(params, vec), pe, c.attention_head_dim
    )
    torch.testing.assert_close(out_img, ref_img, **FP32)
    torch.testing.assert_close(out_txt, ref_txt, **FP32)


@pytest.mark.parametrize("case", ["tiny", "schnell"])
def test_single_block_parity(case, request):
    module, params = request.getfixturevalue(case)
    c = params.config
    img, txt, vec, ref_pe, pe = _block_inputs(c, module)
    ref_txt, ref_img = module.single_transformer_blocks[1](img, txt, vec, ref_pe)
    out = flux1.single_block(
        params["single_transformer_blocks"]["1"],
        torch.cat([txt, img], 1),
        _single_mod(params, vec, "1"),
        pe,
        c.attention_head_dim,
    )
    torch.testing.assert_close(out, torch.cat([ref_txt, ref_img], 1), **FP32)


def test_rope_matches_diffusers(tiny):
    module, params = tiny
    ids = torch.randn(11, 3) * 50
    ref_cos, ref_sin = module.pos_embed(ids)
    cos, sin = layers.rope(ids, TINY.axes_dims_rope, 10000.0)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=0)


# ----------------------------------------------------------------------------- full model

MODEL_CASES = [  # (config fixture, batch, txt_len, (h, w), ids_3d)
    ("tiny", 1, 1, (2, 2), False),
    ("tiny", 3, 7, (3, 5), True),
    ("tiny", 1, 77, (4, 3), False),
    ("tiny", 3, 77, (1, 7), True),
    ("schnell", 1, 7, (5, 2), True),
    ("schnell", 3, 1, (3, 4), False),
    ("schnell", 3, 77, (2, 3), False),
]


@pytest.mark.parametrize("case,batch,txt_len,hw,ids_3d", MODEL_CASES)
def test_model_parity(case, batch, txt_len, hw, ids_3d, request):
    module, params = request.getfixturevalue(case)
    kw = inputs(params.config, batch=batch, txt_len=txt_len, h=hw[0], w=hw[1], ids_3d=ids_3d, seed=batch + txt_len)
    (ref,) = module(**diffusers_kwargs(kw))
    out = fd.apply(params, **kw)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, **FP32)


def test_bf16_parity():
    """bf16 weights and activations: the same ops in the same order as diffusers, so
    bitwise equal on the CPU (`assert_bf16_equal` says what other devices get)."""
    module, params = diffusers_model(TINY, seed=3, dtype=torch.bfloat16)
    kw = inputs(TINY, batch=2, txt_len=7, dtype=torch.bfloat16)
    (ref,) = module(**diffusers_kwargs(kw))
    assert_bf16_equal(fd.apply(params, **kw), ref)


def test_functional_call_of_diffusers_module_equals_apply(tiny):
    module, _ = tiny
    params = fd.init(TINY, seed=7)  # weights the module does not hold
    kw = inputs(TINY, batch=2)
    (ref,) = torch.func.functional_call(module, fd.to_state_dict(params), (), diffusers_kwargs(kw))
    torch.testing.assert_close(fd.apply(params, **kw), ref, **FP32)


# ----------------------------------------------------------------------------- params


@pytest.mark.parametrize("name", [n for n, c in fd.PRESETS.items() if isinstance(c, fd.Flux1Config)])
def test_param_specs_equal_diffusers_meta_state_dict(name):
    config = fd.PRESETS[name]
    with torch.device("meta"):
        module = FluxTransformer2DModel(
            **{k: v for k, v in fd.config_to_diffusers(config).items() if not k.startswith("_")}
        )
    ref = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    specs = {k: s.shape for k, s in sharding.tree.flatten(fd.param_specs(config)).items()}
    assert list(specs) == list(ref)  # same keys, same (state_dict) order
    assert specs == ref
    assert fd.num_params(config) == sum(p.numel() for p in module.parameters())


def test_num_params_flux1_dev():
    assert fd.num_params(fd.PRESETS["flux1-dev"]) == 11_901_408_320


def test_presets_match_the_released_models():
    """FLUX.1-dev and -schnell ship the same transformer config but for guidance_embeds
    (FluxPipeline passes guidance only when the transformer has it); that config is
    diffusers' FluxTransformer2DModel default."""
    dev, schnell = fd.PRESETS["flux1-dev"], fd.PRESETS["flux1-schnell"]
    assert dev.guidance_embeds and not schnell.guidance_embeds
    assert dataclasses.replace(dev, guidance_embeds=False) == schnell
    with torch.device("meta"):
        defaults = FluxTransformer2DModel().config
    assert fd.config_from_diffusers(dict(defaults, _class_name="FluxTransformer2DModel")) == schnell


def test_packed_spec_of_single_block_proj_out():
    spec = fd.param_specs(TINY)["single_transformer_blocks"]["0"]["proj_out"]["weight"]
    n = TINY.inner_dim
    assert spec.axes == ("embed", fd.PACKED)
    # [attn, mlp] cut into equal units of gcd(n, 4n) = n, so it shards as one strided DTensor
    assert spec.blocks == (fd.Block("attn", n, "heads"), *(fd.Block(f"mlp.{i}", n, "mlp") for i in range(4)))
    mlp = fd.param_specs(TINY)["single_transformer_blocks"]["0"]["proj_mlp"]
    for leaf in (mlp["weight"], mlp["bias"]):  # the MLP's rows cut alike: the hidden units agree
        assert leaf.axes[0] == fd.PACKED and leaf.blocks == spec.blocks[1:]


def test_init_is_deterministic_per_seed():
    a, b, c = fd.init(TINY, seed=0), fd.init(TINY, seed=0), fd.init(TINY, seed=1)
    for x, y, z in zip(a.leaves(), b.leaves(), c.leaves()):
        assert torch.equal(x, y)
        assert not torch.equal(x, z)
    bf = fd.init(TINY, dtype=torch.bfloat16, device="meta")
    assert all(t.dtype == torch.bfloat16 and t.is_meta for t in bf.leaves())


def test_state_dict_round_trip():
    params = fd.init(TINY, seed=4)
    state = fd.to_state_dict(params)
    back = fd.from_state_dict(TINY, state)
    assert list(fd.to_state_dict(back)) == list(state)
    assert all(back_t is t for back_t, t in zip(back.leaves(), params.leaves()))


def test_from_diffusers_shares_storage(tiny):
    module, params = tiny
    state = module.state_dict()
    for key, t in fd.to_state_dict(params).items():
        assert t.data_ptr() == state[key].data_ptr(), key


@pytest.mark.parametrize("lib", ["optree", "torch"])
def test_pytree_flatten_unflatten(lib):
    params = fd.init(TINY_SCHNELL)
    if lib == "optree":
        leaves, spec = optree.tree_flatten(params)
        back = optree.tree_unflatten(spec, [t * 2 for t in leaves])
    else:
        leaves, spec = torch_pytree.tree_flatten(params)
        back = torch_pytree.tree_unflatten([t * 2 for t in leaves], spec)
    assert len(leaves) == len(params.flat())
    assert isinstance(back, fd.Params) and back.config == params.config
    for key, t in params.flat().items():
        assert torch.equal(back.flat()[key], 2 * t)


def test_config_from_diffusers_mapping_and_path(tmp_path, tiny):
    module, _ = tiny
    assert fd.config_from_diffusers(dict(module.config, _class_name="FluxTransformer2DModel")) == TINY
    module.save_config(tmp_path)
    assert fd.config_from_diffusers(tmp_path / "config.json") == TINY
    assert fd.config_from_diffusers(tmp_path) == TINY
    json.loads((tmp_path / "config.json").read_text())  # a real diffusers config.json


# ----------------------------------------------------------------------------- bad input


def test_config_validation():
    with pytest.raises(ValueError, match=r"sum\(axes_dims_rope\).*= 18.*attention_head_dim = 16"):
        fd.Flux1Config(attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(6, 6, 6))
    with pytest.raises(ValueError, match="num_attention_heads: expected a positive int, got 0"):
        fd.Flux1Config(num_attention_heads=0)
    with pytest.warns(UserWarning, match=r"\['not_a_key'\] are not arguments of diffusers.FluxTransformer2DModel"):
        # diffusers ignores keys its class does not take (released configs carry some); so do we
        assert fd.config_from_diffusers({"_class_name": "FluxTransformer2DModel", "not_a_key": 1}) == fd.Flux1Config()
    with pytest.raises(ValueError, match=r"unknown config keys \['zero_cond_t'\]"):
        # a key diffusers does take but our config lacks would be silently lost: an error
        configs.from_mapping(fd.Flux1Config, {"zero_cond_t": True})
    with pytest.raises(ValueError, match="_class_name 'UNet2DModel'"):
        fd.config_from_diffusers({"_class_name": "UNet2DModel"})


def test_from_state_dict_reports_every_problem():
    state = dict(fd.to_state_dict(fd.init(TINY)))
    state.pop("x_embedder.weight")
    state.pop("proj_out.bias")
    state["extra.weight"] = torch.zeros(1)
    state["context_embedder.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as err:
        fd.from_state_dict(TINY, state)
    msg = str(err.value)
    assert "2 missing: ['x_embedder.weight', 'proj_out.bias']" in msg
    assert "1 unexpected: ['extra.weight']" in msg
    assert "context_embedder.weight: expected (32, 32), got (3, 3)" in msg


def _bad(kw, **changes):
    return {**kw, **changes}


BAD_INPUTS = [
    (lambda kw: _bad(kw, x=kw["x"][..., :-1]), r"x: expected shape \(\*, \*, 16\), got \(2, 12, 15\)"),
    (lambda kw: _bad(kw, txt=kw["txt"][:1]), r"txt: expected shape \(2, \*, 32\), got \(1, 7, 32\)"),
    (lambda kw: _bad(kw, pooled=kw["pooled"][:1]), r"pooled: expected shape \(2, 24\), got \(1, 24\)"),
    (lambda kw: _bad(kw, t=kw["t"][:1]), r"t: expected shape \(2,\), got \(1,\)"),
    (lambda kw: _bad(kw, t=torch.tensor(0.5)), r"t: expected shape \(2,\), got \(\)"),
    (lambda kw: _bad(kw, guidance=kw["guidance"][None]), r"guidance: expected shape \(2,\), got \(1, 2\)"),
    (lambda kw: _bad(kw, pooled=None), r"pooled: FLUX.1 needs pooled text embeddings of shape \(2, 24\)"),
    (lambda kw: _bad(kw, guidance=None), "guidance: this model has guidance_embeds=True"),
    (lambda kw: _bad(kw, img_ids=None), r"img_ids: FLUX.1 needs image position ids of shape \(12, 3\)"),
    (lambda kw: _bad(kw, img_ids=kw["img_ids"][:-1]), r"img_ids: expected shape \(12, 3\) .* got \(11, 3\)"),
    (lambda kw: _bad(kw, img_ids=kw["img_ids"][:, :2]), r"img_ids: expected shape \(12, 3\) .* got \(12, 2\)"),
    (lambda kw: _bad(kw, txt_ids=kw["txt_ids"].expand(3, -1, -1)), r"txt_ids: .* got \(3, 7, 3\)"),
    (lambda kw: _bad(kw, x=kw["x"].double()), "x: expected dtype torch.float32 .* got torch.float64"),
    (lambda kw: _bad(kw, txt=kw["txt"].half()), "txt: expected dtype torch.float32 .* got torch.float16"),
    (lambda kw: _bad(kw, pooled=kw["pooled"].to(torch.bfloat16)), "pooled: expected dtype torch.float32"),
    (lambda kw: _bad(kw, x=kw["x"].to("meta")), "x: expected device cpu .* got meta"),
    (lambda kw: _bad(kw, txt=kw["txt"].to("meta")), "txt: expected device cpu .* got meta"),
    (lambda kw: _bad(kw, pooled=kw["pooled"].to("meta")), "pooled: expected device cpu .* got meta"),
    (lambda kw: _bad(kw, t=kw["t"].to("meta")), "t: expected device cpu .* got meta"),
    (lambda kw: _bad(kw, guidance=kw["guidance"].to("meta")), "guidance: expected device cpu .* got meta"),
    (lambda kw: _bad(kw, x=kw["x"].numpy()), r"x: expected a tensor of shape \(\*, \*, 16\), got ndarray"),
    # timesteps, guidance and ids are cast like diffusers casts them, but not from bool or complex
    (lambda kw: _bad(kw, t=kw["t"] > 0.5), "t: expected a real floating or integer tensor, got torch.bool"),
    (lambda kw: _bad(kw, t=kw["t"].to(torch.complex64)), "t: expected a real floating .* got torch.complex64"),
    (lambda kw: _bad(kw, guidance=kw["guidance"].to(torch.complex64)), "guidance: expected a real .* torch.complex64"),
    (lambda kw: _bad(kw, img_ids=kw["img_ids"] > 0), "img_ids: expected a real tensor, got torch.bool"),
    (
        lambda kw: _bad(kw, txt_ids=kw["txt_ids"].to(torch.complex64)),
        "txt_ids: expected a real tensor, got torch.complex64",
    ),
    (lambda kw: _bad(kw, img_ids=kw["img_ids"].to("meta")), "img_ids: expected device cpu .* got meta"),
    (lambda kw: _bad(kw, txt_ids=kw["txt_ids"].to("meta")), "txt_ids: expected device cpu .* got meta"),
    # the other families' arguments (the common signature, docs/architecture.md): accepted as None, an error otherwise
    (lambda kw: _bad(kw, txt_mask=torch.ones(2, 7)), "txt_mask: FLUX.1 takes no txt_mask; expected None"),
    (lambda kw: _bad(kw, img_shapes=[[(1, 3, 4)]] * 2), "img_shapes: FLUX.1 takes no img_shapes; expected None"),
]


@pytest.mark.parametrize("make,message", BAD_INPUTS)
def test_bad_input_raises(make, message):
    params = fd.init(TINY)
    with pytest.raises(ValueError, match=message):
        fd.apply(params, **make(inputs(TINY, batch=2, txt_len=7, h=3, w=4)))


def test_other_families_arguments_as_none_are_accepted(tiny):
    """The one signature for every family (docs/architecture.md): a generic caller may pass txt_mask=None and
    img_shapes=None to a FLUX.1 model."""
    _, params = tiny
    kw = inputs(TINY, batch=2)
    torch.testing.assert_close(fd.apply(params, **kw, txt_mask=None, img_shapes=None), fd.apply(params, **kw))


def _fp16_overflowing(module, linear, gate2: int):
    """Make an AdaLN ``linear`` of ``module`` (fp16) emit shift = scale = gate = 0 except the
    chunk ``gate2`` = 1000, so a residual stream held at 65504 (the fp16 maximum) overflows."""
    n = module.inner_dim
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.zero_()
        linear.bias[gate2 * n : (gate2 + 1) * n] = 1000.0


def test_fp16_clipping_as_diffusers():
    """diffusers clips fp16 activations to +-65504 after the text stream of a double block
    and after a single block, but not after the image stream of a double block (there an
    overflow stays inf). Same weights, streams at the fp16 maximum: the same infs."""
    module, params = diffusers_model(TINY, seed=6, dtype=torch.float16)
    double, single = module.transformer_blocks[0], module.single_transformer_blocks[0]
    _fp16_overflowing(module, double.norm1.linear, 5)  # img: gate_mlp
    _fp16_overflowing(module, double.norm1_context.linear, 5)  # txt: c_gate_mlp
    _fp16_overflowing(module, single.norm.linear, 2)  # gate
    B, S, T, C = 2, 6, 5, TINY.inner_dim
    img, txt = torch.full((B, S, C), 65504.0, dtype=torch.float16), torch.full((B, T, C), 65504.0, dtype=torch.float16)
    vec = torch.randn(B, C).half()
    ids = torch.randn(T + S, 3) * 4
    ref_txt, ref_img = double(img, txt, vec, module.pos_embed(ids))
    pe = layers.rope(ids, TINY.axes_dims_rope, 10000.0)
    out_img, out_txt = flux1.double_block(
        params["transformer_blocks"]["0"], img, txt, *_double_mods(params, vec), pe, TINY.attention_head_dim
    )
    assert ref_img.isinf().any() and not ref_txt.isinf().any()  # the case we mean to test
    torch.testing.assert_close(out_img, ref_img, rtol=0, atol=0)
    torch.testing.assert_close(out_txt, ref_txt, rtol=0, atol=0)
    ref = torch.cat(single(img, txt, vec, module.pos_embed(ids)), 1)
    out = flux1.single_block(
        params["single_transformer_blocks"]["0"], torch.cat([txt, img], 1), _single_mod(params, vec, "0"), pe, 16
    )
    assert ref.abs().max() == 65504 and not ref.isinf().any()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_guidance_given_to_unguided_model():
    params = fd.init(TINY_SCHNELL)
    kw = inputs(TINY_SCHNELL, batch=2)
    with pytest.raises(ValueError, match="guidance: this model has guidance_embeds=False; expected None"):
        fd.apply(params, **kw, guidance=torch.ones(2))


def test_timesteps_and_ids_are_cast_like_diffusers(tiny):
    """t, guidance and ids may come in other dtypes (diffusers casts them)."""
    module, params = tiny
    kw = inputs(TINY, batch=2)
    kw = _bad(
        kw,
        t=kw["t"].double(),
        guidance=kw["guidance"].half(),
        img_ids=kw["img_ids"].round().long(),
        txt_ids=kw["txt_ids"].double(),
    )
    (ref,) = module(**diffusers_kwargs(kw))
    torch.testing.assert_close(fd.apply(params, **kw), ref, **FP32)
    ints = _bad(kw, t=torch.tensor([0, 1], dtype=torch.int16), guidance=torch.tensor([3, 4], dtype=torch.uint8))
    (ref,) = module(**diffusers_kwargs(ints))  # integer timesteps of any width, as diffusers casts them
    torch.testing.assert_close(fd.apply(params, **ints), ref, **FP32)


def test_max_errors_are_reported(tiny, capsys):
    """Not an assertion on speed: prints the fp32 max error for the closing note."""
    module, params = tiny
    kw = inputs(TINY, batch=3, txt_len=77, h=4, w=5)
    (ref,) = module(**diffusers_kwargs(kw))
    err = max_err(fd.apply(params, **kw), ref)
    print(f"flux1 fp32 max abs error {err:.3g}")
    assert err <= 1e-5


def test_torch_func_grad_matches_diffusers_autograd(tiny):
    """Params is a pytree: torch.func.grad returns a Params of gradients equal to the
    diffusers module's autograd gradients (summation order differs: rtol=atol=1e-4)."""
    module, _ = tiny
    params = fd.init(TINY, seed=5)
    kw = inputs(TINY, batch=2)
    grads = torch.func.grad(lambda p: fd.apply(p, **kw).square().mean())(params)
    assert isinstance(grads, fd.Params)
    ref_module = diffusers_model(TINY, seed=5)[0].requires_grad_(True)
    ref_module(**diffusers_kwargs(kw))[0].square().mean().backward()
    ref = {k: v.grad for k, v in ref_module.named_parameters()}
    for key, g in grads.flat().items():
        torch.testing.assert_close(g, ref[key], rtol=1e-4, atol=1e-4, msg=key)

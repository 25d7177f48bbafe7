"""FLUX.2 against diffusers' Flux2Transformer2DModel at the same weights (the oracle)."""

from __future__ import annotations

import io
import json

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from cases_flux2 import TINY, TINY_KLEIN, diffusers_kwargs, inputs, next_step, use_kv_processors
from diffusers import Flux2Transformer2DModel
from oracle import assert_bf16_equal, diffusers_model, max_err

import functional_dit as fd
import sharding
from functional_dit import configs, flux2
from functional_dit.nn import layers

FP32 = dict(rtol=1e-5, atol=1e-5)


def _close(name, out, ref):
    """fp32 parity, naming the case on failure (figures: examples/parity_report.py)."""
    torch.testing.assert_close(out, ref, **FP32, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def tiny():
    module, params = diffusers_model(TINY, seed=1)
    use_kv_processors(module)  # identical to the default processors without KV arguments
    return module, params


@pytest.fixture(scope="module")
def klein():
    module, params = diffusers_model(TINY_KLEIN, seed=2)
    use_kv_processors(module)
    return module, params


@pytest.fixture(scope="module")
def tiny_default():
    """diffusers' default attention processors, as Flux2Pipeline / Flux2KleinPipeline use them."""
    return diffusers_model(TINY, seed=1)


@pytest.fixture(scope="module")
def klein_default():
    return diffusers_model(TINY_KLEIN, seed=2)


# ----------------------------------------------------------------------------- per block


def _block_inputs(module, params, B=2, T=5, S=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = params.config
    img, txt = (torch.randn(B, n, c.inner_dim, generator=g) for n in (S, T))
    temb = torch.randn(B, c.inner_dim, generator=g)
    ids = torch.randn(T + S, 4, generator=g) * 4
    pe = layers.rope(ids, c.axes_dims_rope, c.rope_theta)
    return img, txt, temb, module.pos_embed(ids), pe


@pytest.mark.parametrize("case", ["tiny", "klein"])
def test_double_block_parity(case, request):
    module, params = request.getfixturevalue(case)
    c = params.config
    img, txt, temb, ref_pe, pe = _block_inputs(module, params)
    mod_img, mod_txt = module.double_stream_modulation_img(temb), module.double_stream_modulation_txt(temb)
    ref_txt, ref_img = module.transformer_blocks[0](img, txt, mod_img, mod_txt, ref_pe)
    m_img, m_txt, _ = flux2.modulations(params, temb)
    p = params["transformer_blocks"]["0"]
    out_img, out_txt, _ = flux2.double_block(p, img, txt, m_img, m_txt, pe, c.attention_head_dim, c.eps)
    _close(f"{case} double block", out_img, ref_img)
    _close(f"{case} double block", out_txt, ref_txt)


@pytest.mark.parametrize("case", ["tiny", "klein"])
def test_single_block_parity(case, request):
    module, params = request.getfixturevalue(case)
    c = params.config
    img, txt, temb, ref_pe, pe = _block_inputs(module, params)
    x = torch.cat([txt, img], 1)
    ref = module.single_transformer_blocks[1](x, None, module.single_stream_modulation(temb), ref_pe)
    _, _, mod = flux2.modulations(params, temb)
    out, _ = flux2.single_block(params["single_transformer_blocks"]["1"], x, mod, pe, c.attention_head_dim, c.eps)
    _close(f"{case} single block", out, ref)


def _hooked(stock_attn, run, out=None):
    """``run()`` with a forward hook on the stock attention module: returns (its result,
    the module's output); ``out`` given: the module's output replaced by it."""
    seen = []
    handle = stock_attn.register_forward_hook(lambda m, args, y: seen.append(y) or out)
    try:
        return run(), seen[0]
    finally:
        handle.remove()


def _scaled(y, f: float):
    return tuple(t * f for t in y) if isinstance(y, tuple) else y * f


@pytest.mark.parametrize("case", ["tiny", "klein"])
def test_attention_hook_is_the_stock_attention_module(case, request):
    """The blocks' ``attn`` hook sits where the stock attention modules are: the function it
    is given computes the stock module's output (Flux2Attention's (img, txt) after to_out /
    to_add_out; Flux2ParallelSelfAttention's whole fused projection, attention, SwiGLU and
    to_out), and a stand-in it returns takes that output's place in the block, as a
    forward hook's return value does in the stock block."""
    module, params = request.getfixturevalue(case)
    c, D = params.config, params.config.attention_head_dim
    img, txt, temb, ref_pe, pe = _block_inputs(module, params)
    mod_img, mod_txt = module.double_stream_modulation_img(temb), module.double_stream_modulation_txt(temb)
    m_img, m_txt, m_single = flux2.modulations(params, temb)
    x, mod_single = torch.cat([txt, img], 1), module.single_stream_modulation(temb)
    double, single = module.transformer_blocks[0], module.single_transformer_blocks[1]
    p_double, p_single = params["transformer_blocks"]["0"], params["single_transformer_blocks"]["1"]
    runs = {  # name: (stock attention module, stock block call, ours given a hook); (txt, img) order
        "double": (
            double.attn,
            lambda: double(img, txt, mod_img, mod_txt, ref_pe),
            lambda attn: flux2.double_block(p_double, img, txt, m_img, m_txt, pe, D, c.eps, attn=attn)[1::-1],
        ),
        "single": (
            single.attn,
            lambda: single(x, None, mod_single, ref_pe),
            lambda attn: flux2.single_block(p_single, x, m_single, pe, D, c.eps, attn=attn)[0],
        ),
    }
    for name, (stock_attn, stock_block, ours) in runs.items():
        want, stock_out = _hooked(stock_attn, stock_block)
        given = []
        _close(f"{case} {name} block", ours(lambda fn, given=given: given.append(fn()) or given[-1]), want)
        _close(f"{case} {name} attention module", given[0], stock_out)
        stand_in = _scaled(stock_out, 0.5)
        want, _ = _hooked(stock_attn, stock_block, stand_in)
        _close(f"{case} {name} block with a stand-in", ours(lambda fn, y=stand_in: y), want)
    # with cached reference keys and values a computing hook gives the block's own outputs
    g = torch.Generator().manual_seed(5)
    ref = flux2.Ref(*(None,) * 3, *(torch.randn(2, 3, c.num_attention_heads, D, generator=g) for _ in "kv"))
    for block, args in (
        (flux2.double_block, (p_double, img, txt, m_img, m_txt)),
        (flux2.single_block, (p_single, x, m_single)),
    ):
        extra = (pe, D, c.eps, None) if block is flux2.double_block else (pe, D, c.eps, None, txt.shape[1])
        want, got = block(*args, *extra, ref), block(*args, *extra, ref, attn=lambda fn: fn())
        assert all(torch.equal(a, b) for a, b in zip(want[:-1], got[:-1])), block.__name__
    # an extract pass (reference rows given) needs the module computed: a reusing hook is refused
    ref_x = flux2.Ref(x=img[:, :3], mod=m_img, pe=tuple(a[:3] for a in pe))
    with pytest.raises(ValueError, match="attn: extracting the reference KV cache needs the attention computed"):
        flux2.double_block(p_double, img, txt, m_img, m_txt, pe, D, c.eps, None, ref_x, attn=lambda fn: (img, txt))


def test_rope_matches_diffusers(tiny, klein):
    for module, params in (tiny, klein):
        ids = torch.randn(11, 4) * 50
        ref_cos, ref_sin = module.pos_embed(ids)
        cos, sin = layers.rope(ids, params.config.axes_dims_rope, params.config.rope_theta)
        torch.testing.assert_close(cos, ref_cos, rtol=0, atol=0)
        torch.testing.assert_close(sin, ref_sin, rtol=0, atol=0)


def test_time_guidance_embedding_matches_diffusers(tiny):
    module, params = tiny
    t, g = torch.rand(3) * 1000, torch.rand(3) * 4000
    ref = module.time_guidance_embed(t, g)
    out = flux2.time_guidance_embed(params["time_guidance_embed"], t, g, TINY.timestep_guidance_channels)
    _close("tiny time+guidance embedding", out, ref)


# ----------------------------------------------------------------------------- full model

MODEL_CASES = [  # (config fixture, batch, txt_len, (h, w), ids_3d)
    ("tiny", 1, 1, (2, 2), False),
    ("tiny", 2, 7, (3, 5), True),
    ("tiny", 2, 13, (1, 7), False),
    ("klein", 1, 9, (4, 3), True),
    ("klein", 2, 1, (3, 4), False),
    ("klein", 2, 5, (2, 3), True),
]


@pytest.mark.parametrize("processors", ["default", "kv"])
@pytest.mark.parametrize("case,batch,txt_len,hw,ids_3d", MODEL_CASES)
def test_model_parity(case, batch, txt_len, hw, ids_3d, processors, request):
    """Against the stock module with its default attention processors and with the KV-cache
    processors the KV pipeline installs (equal without KV arguments)."""
    module, params = request.getfixturevalue(case if processors == "kv" else f"{case}_default")
    kw = inputs(params.config, batch=batch, txt_len=txt_len, h=hw[0], w=hw[1], ids_3d=ids_3d, seed=batch + txt_len)
    (ref,) = module(**diffusers_kwargs(kw))
    out = fd.apply(params, **kw)
    assert out.shape == ref.shape == (batch, hw[0] * hw[1], params.config.out_dim)
    _close(f"{case} ({processors}) model B={batch} T={txt_len} {hw[0]}x{hw[1]}{' 3-D ids' if ids_3d else ''}", out, ref)


def test_3d_ids_use_the_first_item_like_diffusers(tiny):
    """diffusers' Flux2Transformer2DModel.forward takes ``img_ids[0]`` / ``txt_ids[0]`` of
    3-D ids, so other items' ids do not matter; we do the same."""
    _, params = tiny
    kw = inputs(TINY, batch=2, ids_3d=True)
    other = {**kw, "img_ids": kw["img_ids"][[0, 0]], "txt_ids": kw["txt_ids"][[0, 0]]}
    assert not torch.equal(kw["img_ids"][1], kw["img_ids"][0])
    torch.testing.assert_close(fd.apply(params, **kw), fd.apply(params, **other), rtol=0, atol=0)
    torch.testing.assert_close(fd.apply(params, **kw), fd.apply(params, **{**other, "img_ids": kw["img_ids"][0]}))


KV_CASES = [  # (config fixture, batch, txt_len, (h, w), reference (h, w), ref_fixed_timestep, ids_3d)
    ("tiny", 1, 5, (2, 3), (3, 3), None, False),
    ("tiny", 2, 7, (3, 2), (2, 5), 0.3, True),
    ("klein", 2, 3, (2, 2), (1, 3), None, True),
    ("klein", 1, 9, (3, 3), (2, 2), 0.7, False),
]


@pytest.mark.parametrize("case,batch,txt_len,hw,ref_hw,t_ref,ids_3d", KV_CASES)
def test_kv_cache_step_for_step(case, batch, txt_len, hw, ref_hw, t_ref, ids_3d, request):
    """Flux2KleinKVPipeline's loop: step 0 extracts the reference tokens' K/V, steps 1 and 2
    reuse them. Outputs and every cached tensor equal diffusers' at each step."""
    module, params = request.getfixturevalue(case)
    name = f"{case} kv B={batch} ref {ref_hw[0]}x{ref_hw[1]}"
    kw = inputs(params.config, batch, txt_len, *hw, seed=batch, ids_3d=ids_3d, ref_hw=ref_hw, ref_fixed_timestep=t_ref)
    ref, ref_cache = module(**diffusers_kwargs(kw))
    out, cache = fd.apply(params, **kw)
    assert out.shape == ref.shape == (batch, hw[0] * hw[1], params.config.out_dim)
    _close(f"{name} extract", out, ref)
    assert isinstance(cache, fd.Flux2KVCache) and cache.num_ref_tokens == ref_cache.num_ref_tokens
    assert len(cache.flat()) == 2 * (params.config.num_layers + params.config.num_single_layers)
    layers = [
        ("transformer_blocks", ref_cache.double_block_caches),
        ("single_transformer_blocks", ref_cache.single_block_caches),
    ]
    for kind, refs in layers:
        for i, layer in enumerate(refs):
            _close(f"{name} cache", cache[kind][str(i)]["k"], layer.k_ref)
            _close(f"{name} cache", cache[kind][str(i)]["v"], layer.v_ref)
    for step in (1, 2):
        kw_step = next_step(kw, cache, seed=step)
        (ref,) = module(**diffusers_kwargs(kw_step, kv_cache=ref_cache))
        _close(f"{name} cached", fd.apply(params, **kw_step), ref)


def test_cached_step_uses_the_cache(tiny):
    """A cached step differs from the same step without reference tokens."""
    _, params = tiny
    kw = inputs(TINY, batch=2, ref_hw=(2, 2))
    _, cache = fd.apply(params, **kw)
    step = next_step(kw, cache)
    plain = {k: v for k, v in step.items() if k != "kv_cache"}
    assert max_err(fd.apply(params, **step), fd.apply(params, **plain)) > 1e-3  # the cache matters


def test_cache_key_order_does_not_matter(tiny):
    """A cache is a tree keyed by block: one rebuilt with its keys in another order (say
    sorted as strings, or single blocks first) is the same cache."""
    _, params = tiny
    kw = inputs(TINY, batch=2, ref_hw=(2, 2))
    _, cache = fd.apply(params, **kw)
    shuffled = fd.Flux2KVCache(
        cache.config, cache.num_ref_tokens, sharding.tree.nest(dict(reversed(cache.flat().items())))
    )
    assert list(shuffled.flat()) != list(cache.flat())
    step = next_step(kw, cache)
    torch.testing.assert_close(
        fd.apply(params, **{**step, "kv_cache": shuffled}), fd.apply(params, **step), rtol=0, atol=0
    )


def test_bf16_parity():
    """bf16 weights and activations, plain and both KV-cache modes: the same ops in the same
    order as diffusers, so bitwise equal on the CPU (`assert_bf16_equal` says what other
    devices get)."""
    module, params = diffusers_model(TINY, seed=3, dtype=torch.bfloat16)
    use_kv_processors(module)
    kw = inputs(TINY, batch=2, txt_len=7, dtype=torch.bfloat16)
    (ref,) = module(**diffusers_kwargs(kw))
    assert_bf16_equal(fd.apply(params, **kw), ref)
    kw = inputs(TINY, batch=2, txt_len=7, dtype=torch.bfloat16, ref_hw=(2, 3), ref_fixed_timestep=0.1)
    ref, ref_cache = module(**diffusers_kwargs(kw))
    out, cache = fd.apply(params, **kw)
    assert_bf16_equal(out, ref)
    step = next_step(kw, cache)
    (ref,) = module(**diffusers_kwargs(step, kv_cache=ref_cache))
    assert_bf16_equal(fd.apply(params, **step), ref)


def test_functional_call_of_diffusers_module_equals_apply(tiny):
    module, _ = tiny
    params = fd.init(TINY, seed=7)  # weights the module does not hold
    kw = inputs(TINY, batch=2)
    (ref,) = torch.func.functional_call(module, fd.to_state_dict(params), (), diffusers_kwargs(kw))
    _close("tiny functional_call", fd.apply(params, **kw), ref)


# ----------------------------------------------------------------------------- params


def _meta_module(config):
    with torch.device("meta"):
        return Flux2Transformer2DModel(**{k: v for k, v in fd.config_to_diffusers(config).items() if k[0] != "_"})


@pytest.mark.parametrize("name", [n for n, c in fd.PRESETS.items() if isinstance(c, fd.Flux2Config)])
def test_param_specs_equal_diffusers_meta_state_dict(name):
    config = fd.PRESETS[name]
    module = _meta_module(config)
    ref = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    specs = {k: s.shape for k, s in sharding.tree.flatten(fd.param_specs(config)).items()}
    assert list(specs) == list(ref)  # same keys, same (state_dict) order
    assert specs == ref
    assert fd.num_params(config) == sum(p.numel() for p in module.parameters())


def test_num_params_of_the_released_models():
    assert fd.num_params(fd.PRESETS["flux2-dev"]) == 32_223_281_152
    assert fd.num_params(fd.PRESETS["flux2-klein-4b"]) == 3_875_544_576
    assert fd.num_params(fd.PRESETS["flux2-klein-9b"]) == 9_078_581_248


def test_presets_match_what_the_pipelines_pass():
    """Flux2Pipeline passes guidance; the klein pipelines pass guidance=None."""
    assert fd.PRESETS["flux2-dev"].guidance_embeds
    assert not fd.PRESETS["flux2-klein-4b"].guidance_embeds and not fd.PRESETS["flux2-klein-9b"].guidance_embeds
    with torch.device("meta"):
        defaults = Flux2Transformer2DModel().config  # diffusers' defaults are FLUX.2-dev's
    assert fd.config_from_diffusers(dict(defaults, _class_name="Flux2Transformer2DModel")) == fd.PRESETS["flux2-dev"]


def test_packed_specs():
    c = TINY
    n, m = c.inner_dim, c.mlp_hidden_dim
    specs = fd.param_specs(c)
    qkv_mlp = specs["single_transformer_blocks"]["0"]["attn"]["to_qkv_mlp_proj"]["weight"]
    assert qkv_mlp.axes == (fd.PACKED, "embed")
    # [q, k, v, gate, up] and [attn, mlp] cut into equal units of gcd(n, m) = n (m = 3n), so
    # each shards as one strided DTensor; gate, up and to_out's MLP columns cut alike
    assert m == 3 * n
    assert [(b.name, b.size, b.axis) for b in qkv_mlp.blocks] == [
        ("q", n, "heads"),
        ("k", n, "heads"),
        ("v", n, "heads"),
        *((f"mlp_gate.{i}", n, "mlp") for i in range(3)),
        *((f"mlp_up.{i}", n, "mlp") for i in range(3)),
    ]
    to_out = specs["single_transformer_blocks"]["0"]["attn"]["to_out"]["weight"]
    assert to_out.axes == ("embed", fd.PACKED)
    assert to_out.blocks == (fd.Block("attn", n, "heads"), *(fd.Block(f"mlp.{i}", n, "mlp") for i in range(3)))
    for ff in ("ff", "ff_context"):
        lin = specs["transformer_blocks"]["1"][ff]["linear_in"]["weight"]
        assert lin.axes == (fd.PACKED, "embed") and lin.blocks == (fd.Block("gate", m, "mlp"), fd.Block("up", m, "mlp"))
        assert specs["transformer_blocks"]["1"][ff]["linear_out"]["weight"].axes == ("embed", "mlp")
    assert not any(k.endswith("bias") for k in sharding.tree.flatten(specs))


def test_single_block_split_reads_the_local_width_from_shapes(tiny):
    """Under TP a rank holds each packed block's slice; the fused split must follow."""
    _, params = tiny
    c, p = TINY, params["single_transformer_blocks"]["0"]["attn"]
    n, m, D = c.inner_dim, c.mlp_hidden_dim, c.attention_head_dim
    w = p["to_qkv_mlp_proj"]["weight"]
    half = lambda t, size: t.narrow(0, 0, size // 2)  # noqa: E731  rank 0 of 2
    blocks = w.split([n, n, n, m, m])
    local = {**p, "to_qkv_mlp_proj": {"weight": torch.cat([half(b, b.shape[0]) for b in blocks])}}
    wo = p["to_out"]["weight"]
    local["to_out"] = {"weight": torch.cat([wo[:, : n // 2], wo[:, n : n + m // 2]], 1)}
    x = torch.randn(1, 3, n)
    q, k, v, mlp = flux2._single_in(local, x, D, c.eps)
    fq, fk, fv, fmlp = flux2._single_in(p, x, D, c.eps)
    H = c.num_attention_heads
    for a, b in ((q, fq), (k, fk), (v, fv)):
        torch.testing.assert_close(a, b[:, :, : H // 2], rtol=0, atol=0)
    mlp, fmlp = torch.cat(mlp, -1), torch.cat(fmlp, -1)  # (gate, up) each
    torch.testing.assert_close(mlp, torch.cat([fmlp[..., : m // 2], fmlp[..., m : m + m // 2]], -1), rtol=0, atol=0)


class _Extract(torch.nn.Module):
    def forward(self, params, x, t, txt, img_ids, txt_ids):
        return fd.apply(params, x, t, txt, img_ids=img_ids, txt_ids=txt_ids, kv_cache="extract", num_ref_tokens=3)


class _Cached(torch.nn.Module):
    def forward(self, params, x, t, txt, img_ids, txt_ids, cache):
        return fd.apply(params, x, t, txt, img_ids=img_ids, txt_ids=txt_ids, kv_cache=cache)


def _save_load(program):
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    return torch.export.load(buf)


def test_torch_export_strict_returns_the_cache():
    """The extract step (the cache is an output pytree) and the cached step (the cache an
    input, like params) export with strict tracing, and survive `torch.export.save` / `load`
    (the cache's static metadata serialises)."""
    params = fd.init(TINY_KLEIN, seed=6)
    kw = inputs(TINY_KLEIN, batch=2, txt_len=3, h=2, w=2, ref_hw=(1, 3))
    args = (params, kw["x"], kw["t"], kw["txt"], kw["img_ids"], kw["txt_ids"])
    out, cache = _save_load(torch.export.export(_Extract(), args, strict=True)).module()(*args)
    ref, ref_cache = fd.apply(params, **kw)
    torch.testing.assert_close(out, ref, **FP32)
    assert isinstance(cache, fd.Flux2KVCache) and (cache.config, cache.num_ref_tokens) == (TINY_KLEIN, 3)
    for a, b in zip(cache.flat().values(), ref_cache.flat().values()):
        torch.testing.assert_close(a, b, **FP32)
    step = next_step(kw, ref_cache)
    args = (params, step["x"], step["t"], step["txt"], step["img_ids"], step["txt_ids"], ref_cache)
    program = _save_load(torch.export.export(_Cached(), args, strict=True))
    torch.testing.assert_close(program.module()(*args), fd.apply(params, **step), **FP32)


@pytest.mark.parametrize("lib", ["optree", "torch"])
def test_params_are_a_pytree(lib):
    params = fd.init(TINY_KLEIN)
    if lib == "optree":
        leaves, spec = optree.tree_flatten(params)
        back = optree.tree_unflatten(spec, [t * 2 for t in leaves])
    else:
        leaves, spec = torch_pytree.tree_flatten(params)
        back = torch_pytree.tree_unflatten([t * 2 for t in leaves], spec)
    assert len(leaves) == len(params.flat())
    assert isinstance(back, fd.Params) and back.config == params.config
    assert all(torch.equal(back.flat()[k], 2 * t) for k, t in params.flat().items())


@pytest.mark.parametrize("lib", ["optree", "torch"])
def test_cache_is_a_pytree(lib):
    params = fd.init(TINY_KLEIN)
    _, cache = fd.apply(params, **inputs(TINY_KLEIN, batch=2, ref_hw=(1, 3)))
    if lib == "optree":
        leaves, spec = optree.tree_flatten(cache)
        back = optree.tree_unflatten(spec, [t * 2 for t in leaves])
    else:
        leaves, spec = torch_pytree.tree_flatten(cache)
        back = torch_pytree.tree_unflatten([t * 2 for t in leaves], spec)
    assert len(leaves) == 2 * 3
    assert isinstance(back, fd.Flux2KVCache) and (back.config, back.num_ref_tokens) == (TINY_KLEIN, 3)
    for key, t in cache.flat().items():
        assert t.shape == (2, 3, 2, 12)
        assert torch.equal(back.flat()[key], 2 * t)


def test_config_from_diffusers_mapping_and_path(tmp_path, klein):
    module, _ = klein
    assert fd.config_from_diffusers(dict(module.config, _class_name="Flux2Transformer2DModel")) == TINY_KLEIN
    module.save_config(tmp_path)
    assert fd.config_from_diffusers(tmp_path) == TINY_KLEIN
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert fd.config_to_diffusers(TINY_KLEIN) == {k: v for k, v in cfg.items() if not k.startswith("_")} | {
        "_class_name": "Flux2Transformer2DModel"
    }


def test_from_diffusers_shares_storage(tiny):
    module, params = tiny
    state = module.state_dict()
    for key, t in fd.to_state_dict(params).items():
        assert t.data_ptr() == state[key].data_ptr(), key


# ----------------------------------------------------------------------------- bad input

BAD_CONFIGS = [
    (dict(attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4, 4, 4, 2)), r"sum\(axes_dims_rope\).* = 14"),
    (dict(num_attention_heads=0), "num_attention_heads: expected a positive int, got 0"),
    (dict(num_single_layers=-1), "num_single_layers: expected an int >= 0, got -1"),
    (dict(mlp_ratio=0), "mlp_ratio: expected a positive number, got 0"),
    (dict(mlp_ratio=1e-9), r"int\(inner_dim \* mlp_ratio\) = 0"),
    (dict(eps=-1.0), "eps: expected a positive number, got -1.0"),
    (dict(rope_theta=0), "rope_theta: expected a positive number, got 0"),
    (dict(timestep_guidance_channels=255), "timestep_guidance_channels: expected an even int, got 255"),
    (dict(out_channels=0), "out_channels: expected None or a positive int, got 0"),
    (dict(guidance_embeds="yes"), "guidance_embeds: expected a bool, got 'yes'"),
    (dict(axes_dims_rope=(33, 31, 32, 32)), r"axes_dims_rope: expected positive even ints, got \(33, 31, 32, 32\)"),
]


@pytest.mark.parametrize("changes,message", BAD_CONFIGS)
def test_config_validation(changes, message):
    with pytest.raises(ValueError, match=message):
        fd.Flux2Config(**changes)


def test_unknown_diffusers_key():
    """A key the diffusers class does not take is ignored with a warning, as diffusers does;
    a key it does take that Flux2Config lacks is an error (it would be silently lost)."""
    with pytest.warns(UserWarning, match=r"\['pooled_projection_dim'\] are not arguments"):
        cfg = fd.config_from_diffusers({"_class_name": "Flux2Transformer2DModel", "pooled_projection_dim": 768})
    assert cfg == fd.Flux2Config()
    with pytest.raises(ValueError, match=r"unknown config keys \['pooled_projection_dim'\]"):
        configs.from_mapping(fd.Flux2Config, {"pooled_projection_dim": 768})


def _bad(kw, **changes):
    return {**kw, **changes}


BAD_INPUTS = [  # TINY, inputs(batch=2, txt_len=7, h=3, w=4): x (2, 12, 16), txt (2, 7, 40)
    (lambda kw: _bad(kw, x=kw["x"][..., :-1]), r"x: expected shape \(\*, \*, 16\), got \(2, 12, 15\)"),
    (lambda kw: _bad(kw, x=kw["x"][0]), r"x: expected shape \(\*, \*, 16\), got \(12, 16\)"),
    (lambda kw: _bad(kw, txt=kw["txt"][:1]), r"txt: expected shape \(2, \*, 40\), got \(1, 7, 40\)"),
    (lambda kw: _bad(kw, txt=kw["txt"][..., :-2]), r"txt: expected shape \(2, \*, 40\), got \(2, 7, 38\)"),
    (lambda kw: _bad(kw, t=kw["t"][:1]), r"t: expected shape \(2,\), got \(1,\)"),
    (lambda kw: _bad(kw, t=torch.tensor(0.5)), r"t: expected shape \(2,\), got \(\)"),
    (lambda kw: _bad(kw, t=kw["t"] > 0), "t: expected a real floating or integer tensor, got torch.bool"),
    (lambda kw: _bad(kw, guidance=kw["guidance"][None]), r"guidance: expected shape \(2,\), got \(1, 2\)"),
    (lambda kw: _bad(kw, guidance=None), r"guidance: this model has guidance_embeds=True and needs .* \(2,\)"),
    (lambda kw: _bad(kw, img_ids=None), r"img_ids: FLUX.2 needs position ids of shape \(12, 4\) or \(2, 12, 4\)"),
    (lambda kw: _bad(kw, txt_ids=None), r"txt_ids: FLUX.2 needs position ids of shape \(7, 4\)"),
    (lambda kw: _bad(kw, img_ids=kw["img_ids"][:-1]), r"img_ids: expected shape \(12, 4\) .* got \(11, 4\)"),
    (lambda kw: _bad(kw, img_ids=kw["img_ids"][:, :3]), r"img_ids: expected shape \(12, 4\) .* got \(12, 3\)"),
    (lambda kw: _bad(kw, txt_ids=kw["txt_ids"].expand(3, -1, -1)), r"txt_ids: .* got \(3, 7, 4\)"),
    (lambda kw: _bad(kw, txt_ids=kw["txt_ids"][None, None]), r"txt_ids: .* got \(1, 1, 7, 4\)"),
    (lambda kw: _bad(kw, img_ids=kw["img_ids"].bool()), "img_ids: expected a real tensor, got torch.bool"),
    (
        lambda kw: _bad(kw, txt_ids=kw["txt_ids"].to(torch.complex64)),
        "txt_ids: expected a real tensor, got torch.complex64",
    ),
    (lambda kw: _bad(kw, img_ids=kw["img_ids"].to("meta")), "img_ids: expected device cpu .* got meta"),
    (lambda kw: _bad(kw, txt_ids=kw["txt_ids"].to("meta")), "txt_ids: expected device cpu .* got meta"),
    (lambda kw: _bad(kw, t=kw["t"].to(torch.complex64)), "t: expected a real floating .* got torch.complex64"),
    (lambda kw: _bad(kw, guidance=kw["guidance"] > 2), "guidance: expected a real floating .* got torch.bool"),
    # the other families' arguments (the common signature, docs/architecture.md): accepted as None, an error otherwise
    (lambda kw: _bad(kw, pooled=torch.ones(2, 8)), "pooled: FLUX.2 takes no pooled; expected None, got Tensor"),
    (lambda kw: _bad(kw, txt_mask=torch.ones(2, 7)), "txt_mask: FLUX.2 takes no txt_mask; expected None"),
    (lambda kw: _bad(kw, img_shapes=[[(1, 3, 4)]] * 2), "img_shapes: FLUX.2 takes no img_shapes; expected None"),
    (lambda kw: _bad(kw, x=kw["x"].double()), "x: expected dtype torch.float32 .* got torch.float64"),
    (lambda kw: _bad(kw, txt=kw["txt"].half()), "txt: expected dtype torch.float32 .* got torch.float16"),
    (lambda kw: _bad(kw, x=kw["x"].to("meta")), "x: expected device cpu .* got meta"),
    (lambda kw: _bad(kw, t=kw["t"].to("meta")), "t: expected device cpu .* got meta"),
    (lambda kw: _bad(kw, x=kw["x"].numpy()), r"x: expected a tensor of shape \(\*, \*, 16\), got ndarray"),
    (lambda kw: _bad(kw, kv_cache="cached"), "kv_cache: expected None, 'extract' or a Flux2KVCache, got 'cached'"),
    (lambda kw: _bad(kw, kv_cache={}), "kv_cache: expected None, 'extract' or a Flux2KVCache, got dict"),
    (lambda kw: _bad(kw, num_ref_tokens=4), "num_ref_tokens: only used with kv_cache='extract'; expected None, got 4"),
    (lambda kw: _bad(kw, ref_fixed_timestep=0.0), "ref_fixed_timestep: only used with kv_cache='extract'"),
    (lambda kw: _bad(kw, kv_cache="extract"), r"num_ref_tokens: expected an int in \[1, 11\] .* got None"),
    (lambda kw: _bad(kw, kv_cache="extract", num_ref_tokens=12), r"num_ref_tokens: .*\[1, 11\] .* got 12"),
    (lambda kw: _bad(kw, kv_cache="extract", num_ref_tokens=0), r"num_ref_tokens: .*\[1, 11\] .* got 0"),
    (lambda kw: _bad(kw, kv_cache="extract", num_ref_tokens=2.0), r"num_ref_tokens: .* got 2.0"),
    (
        lambda kw: _bad(kw, kv_cache="extract", num_ref_tokens=2, ref_fixed_timestep=torch.tensor(0.0)),
        "ref_fixed_timestep: expected a Python number",
    ),
]


@pytest.mark.parametrize("make,message", BAD_INPUTS)
def test_bad_input_raises(make, message):
    params = fd.init(TINY)
    with pytest.raises(ValueError, match=message):
        fd.apply(params, **make(inputs(TINY, batch=2, txt_len=7, h=3, w=4)))


def test_other_families_arguments_as_none_are_accepted(tiny):
    """The one signature for every family (docs/architecture.md): pooled, txt_mask and img_shapes may be None."""
    _, params = tiny
    kw = inputs(TINY, batch=2)
    out = fd.apply(params, **kw, pooled=None, txt_mask=None, img_shapes=None)
    torch.testing.assert_close(out, fd.apply(params, **kw), rtol=0, atol=0)


def test_fp16_clipping_as_diffusers():
    """diffusers clips fp16 activations to +-65504 after the text stream of a double block
    and after a single block, not after the image stream of a double block (an overflow
    there stays inf). Streams at the fp16 maximum, a large MLP gate: the same infs."""
    module, params = diffusers_model(TINY, seed=6, dtype=torch.float16)
    B, S, T, n = 2, 6, 5, TINY.inner_dim
    img, txt = (torch.full((B, L, n), 65504.0, dtype=torch.float16) for L in (S, T))
    raw = torch.zeros(B, 6 * n, dtype=torch.float16)  # (shift, scale, gate) x (attn, mlp)
    raw[:, 3 * n : 4 * n] = 1.0  # MLP input shift: the bias-free MLP sees non-zero input
    raw[:, 5 * n :] = 1000.0  # MLP gate: the residual overflows
    ids = torch.randn(T + S, 4) * 4
    pe = layers.rope(ids, TINY.axes_dims_rope, TINY.rope_theta)
    ref_txt, ref_img = module.transformer_blocks[0](img, txt, raw, raw, module.pos_embed(ids))
    mod = raw.chunk(6, -1)
    p = params["transformer_blocks"]["0"]
    out_img, out_txt, _ = flux2.double_block(p, img, txt, mod, mod, pe, TINY.attention_head_dim, TINY.eps)
    assert ref_img.isinf().any() and not ref_txt.isinf().any()  # the case we mean to test
    torch.testing.assert_close(out_img, ref_img, rtol=0, atol=0)
    torch.testing.assert_close(out_txt, ref_txt, rtol=0, atol=0)
    raw = torch.zeros(B, 3 * n, dtype=torch.float16)  # shift, scale, gate
    raw[:, :n], raw[:, 2 * n :] = 1.0, 1000.0
    x = torch.cat([txt, img], 1)
    ref = module.single_transformer_blocks[0](x, None, raw, module.pos_embed(ids))
    out, _ = flux2.single_block(
        params["single_transformer_blocks"]["0"], x, raw.chunk(3, -1), pe, TINY.attention_head_dim, TINY.eps
    )
    assert ref.abs().max() == 65504 and not ref.isinf().any()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_guidance_given_to_unguided_model():
    params = fd.init(TINY_KLEIN)
    kw = inputs(TINY_KLEIN, batch=2)
    with pytest.raises(ValueError, match="guidance: this model has guidance_embeds=False; expected None"):
        fd.apply(params, **kw, guidance=torch.ones(2))


@pytest.fixture(scope="module")
def extracted():
    params = fd.init(TINY, seed=5)
    kw = inputs(TINY, batch=2, ref_hw=(2, 2))
    return params, kw, fd.apply(params, **kw)[1]


def _cache_with(cache, fn):
    return optree.tree_map(fn, cache)


BAD_CACHES = [  # (change the cached step's kwargs, message); the cache holds (2, 4, 4, 16) tensors
    (lambda kw, c: _bad(kw, x=kw["x"][:1], t=kw["t"][:1], txt=kw["txt"][:1], guidance=kw["guidance"][:1]),
     r"kv_cache\['transformer_blocks.0.k'\]: expected shape \(1, 4, 4, 16\), got \(2, 4, 4, 16\)"),
    (lambda kw, c: _bad(kw, kv_cache=_cache_with(c, lambda t: t.double())),
     r"kv_cache\['transformer_blocks.0.k'\]: expected dtype torch.float32 .* got torch.float64"),
    (lambda kw, c: _bad(kw, kv_cache=_cache_with(c, lambda t: t[:, :, :2])),
     r"kv_cache\['transformer_blocks.0.k'\]: expected shape \(2, 4, 4, 16\), got \(2, 4, 2, 16\)"),
    (lambda kw, c: _bad(kw, kv_cache=fd.Flux2KVCache(c.config, 3, c.tree)),
     r"kv_cache\['transformer_blocks.0.k'\]: expected shape \(2, 3, 4, 16\), got \(2, 4, 4, 16\)"),
    (lambda kw, c: _bad(kw, kv_cache=fd.Flux2KVCache(c.config, 4, {"transformer_blocks": c["transformer_blocks"]})),
     r"kv_cache: expected the keys .* missing: \['single_transformer_blocks.0.k'"),
    (lambda kw, c: _bad(kw, kv_cache=fd.Flux2KVCache(TINY_KLEIN, 4, c.tree)),
     "kv_cache: built for a different model; expected config Flux2Config.*num_attention_heads=4.*got Flux2Config"),
    (lambda kw, c: _bad(kw, num_ref_tokens=5), "num_ref_tokens: the cache holds 4 tokens, got 5"),
    (lambda kw, c: _bad(kw, ref_fixed_timestep=0.5), "ref_fixed_timestep: only used with kv_cache='extract'"),
    (lambda kw, c: _bad(kw, img_ids=torch.zeros(16, 4)), r"img_ids: expected shape \(12, 4\) .* got \(16, 4\)"),
]  # fmt: skip


@pytest.mark.parametrize("make,message", BAD_CACHES)
def test_bad_cache_raises(extracted, make, message):
    params, kw, cache = extracted
    with pytest.raises(ValueError, match=message):
        fd.apply(params, **make(next_step(kw, cache), cache))


def test_cache_from_another_model_with_the_same_shapes_raises(extracted):
    params, kw, cache = extracted
    other = fd.Flux2KVCache(fd.Flux2Config(**{**TINY.__dict__, "rope_theta": 10000}), 4, cache.tree)
    with pytest.raises(ValueError, match="kv_cache: built for a different model"):
        fd.apply(params, **next_step(kw, other))


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
    _close("tiny cast inputs", fd.apply(params, **kw), ref)

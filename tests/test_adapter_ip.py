"""FLUX.1's IP-Adapter: `fd.apply(..., ip_adapter=...)` and `fd.DiffusersTransformer`'s
``_load_ip_adapter_weights`` against the stock ``FluxTransformer2DModel`` with the stock
loader at the same weights, and through ``FluxPipeline.load_ip_adapter`` /
``set_ip_adapter_scale`` / ``unload_ip_adapter`` against the stock pipeline.

The IP-Adapter checkpoints are built here in the layout the stock loader reads
(``{"image_proj": {"proj.*", "norm.*"}, "ip_adapter": {"<i>.to_k_ip.*", "<i>.to_v_ip.*"}}``,
one entry per double block), with random weights: nothing is downloaded.
"""

from __future__ import annotations

import diffusers
import pytest
import torch
from cases_flux1 import diffusers_kwargs as flux1_kwargs
from cases_flux1 import inputs as flux1_inputs
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxIPAdapterAttnProcessor
from test_sample import stock_latents

import functional_dit as fd
from functional_dit import tiny

FLUX1 = fd.PRESETS["flux1-tiny"]
# fp32: the same maths in the same order (bitwise on the CPU this was written on); the
# bound is the plain forward's, for GEMM paths that round differently.
FP32 = dict(rtol=1e-5, atol=1e-5)


def ip_state_dict(config: dict, seed: int, tokens: int = 4) -> dict:
    """A random IP-Adapter checkpoint for a FLUX.1 of diffusers ``config`` (image
    embeddings of pooled_projection_dim; 4 tokens: the stock loader reads 16 only off
    the released 65,536-row projection)."""
    g = torch.Generator().manual_seed(seed)
    cross, inner = config["joint_attention_dim"], config["num_attention_heads"] * config["attention_head_dim"]
    embed = config["pooled_projection_dim"]
    rand = lambda *s: 0.2 * torch.randn(*s, generator=g)  # noqa: E731
    ip = {}
    for i in range(config["num_layers"]):
        for kv in ("to_k_ip", "to_v_ip"):
            ip[f"{i}.{kv}.weight"], ip[f"{i}.{kv}.bias"] = rand(inner, cross), rand(inner)
    proj = {"proj.weight": rand(tokens * cross, embed), "proj.bias": rand(tokens * cross)}
    proj.update({"norm.weight": 1 + rand(cross), "norm.bias": rand(cross)})
    return {"image_proj": proj, "ip_adapter": ip}


def pair(seed: int = 0):
    cfg = fd.config_to_diffusers(FLUX1)
    cfg.pop("_class_name")
    torch.manual_seed(seed)
    stock = diffusers.FluxTransformer2DModel(**cfg).eval()
    return stock, fd.DiffusersTransformer(fd.from_diffusers(stock)), cfg


def embeds(cfg, B: int, seed: int, n_images: int = 1) -> torch.Tensor:
    return torch.randn(B, n_images, cfg["pooled_projection_dim"], generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_adapter_and_fd_apply_equal_stock_with_two_ip_adapters():
    """Two adapters (4 tokens, two images each), scales set per adapter: the
    adapter's forward and fd.apply with its `ip_adapter_input` equal the stock module's;
    the IP weights stay out of ``adapter.params``; the stock processors are reported."""
    stock, ad, cfg = pair()
    plain = ad.params
    kw = flux1_kwargs(flux1_inputs(FLUX1, seed=3))
    base = stock(**kw)[0]
    sds = [ip_state_dict(cfg, 1), ip_state_dict(cfg, 2)]
    for m in (stock, ad):
        m._load_ip_adapter_weights(sds)
        for p in m.attn_processors.values():
            if isinstance(p, FluxIPAdapterAttnProcessor):
                p.scale = [0.7, 1.3]
    kinds = {type(p) for n, p in ad.attn_processors.items() if n.startswith("transformer_blocks")}
    assert kinds == {FluxIPAdapterAttnProcessor}
    assert all(type(p) is FluxAttnProcessor for n, p in ad.attn_processors.items() if n.startswith("single"))
    assert ad.params.flat().keys() == plain.flat().keys()  # the base tree only
    ip = [embeds(cfg, 2, 4, n_images=2), embeds(cfg, 2, 5, n_images=2)]
    want = stock(**kw, joint_attention_kwargs={"ip_adapter_image_embeds": ip})[0]
    torch.testing.assert_close(ad(**kw, joint_attention_kwargs={"ip_adapter_image_embeds": ip})[0], want, **FP32)
    args = dict(pooled=kw["pooled_projections"], guidance=kw["guidance"], img_ids=kw["img_ids"])
    got = fd.apply(plain, kw["hidden_states"], kw["timestep"], kw["encoder_hidden_states"], txt_ids=kw["txt_ids"],
                   ip_adapter=ad.ip_adapter_input(ip), **args)  # fmt: skip
    torch.testing.assert_close(got, want, **FP32)
    assert not torch.allclose(want, base, **FP32)  # the adapters took effect


@torch.no_grad()
def test_pipeline_load_scale_unload_equal_stock():
    """``FluxPipeline.load_ip_adapter`` (a state dict, no image encoder), the pipeline's
    ``ip_adapter_image_embeds`` (and negative ones: the pipeline would encode a black
    image otherwise), ``set_ip_adapter_scale`` and ``unload_ip_adapter``: the stock
    pipeline's latents with the stock transformer, at each stage."""
    stock = tiny.pipeline("flux")
    ours = tiny.pipeline("flux", transformer=fd.DiffusersTransformer(fd.from_diffusers(stock.transformer)))
    cfg = dict(stock.transformer.config)
    sd = ip_state_dict(cfg, 7)
    emb = dict(ip_adapter_image_embeds=[embeds(cfg, 1, 8)], negative_ip_adapter_image_embeds=[embeds(cfg, 1, 9)])
    kw = dict(prompt="a red cube", height=32, width=32, num_inference_steps=3, max_sequence_length=16)
    plain = stock_latents(stock, 0, **kw)
    for pipe in (stock, ours):
        pipe.load_ip_adapter(sd, weight_name="ip.bin", image_encoder_pretrained_model_name_or_path=None)
    with_ip = stock_latents(stock, 0, **emb, **kw)
    torch.testing.assert_close(stock_latents(ours, 0, **emb, **kw), with_ip, **FP32)
    assert not torch.allclose(with_ip, plain, **FP32)  # the adapter took effect
    for pipe in (stock, ours):
        pipe.set_ip_adapter_scale(0.3)
    scaled = stock_latents(stock, 0, **emb, **kw)
    torch.testing.assert_close(stock_latents(ours, 0, **emb, **kw), scaled, **FP32)
    assert not torch.allclose(scaled, with_ip, **FP32)
    for pipe in (stock, ours):
        pipe.unload_ip_adapter()
    torch.testing.assert_close(stock_latents(ours, 0, **kw), plain, **FP32)
    assert ours.transformer.encoder_hid_proj is None
    assert not any(isinstance(p, FluxIPAdapterAttnProcessor) for p in ours.transformer.attn_processors.values())


def test_refusals():
    """Embeddings without an IP-Adapter, an IP-Adapter without embeddings, another family,
    bad inputs to fd.apply: each a ValueError naming it; a step cache takes IP-Adapter inputs."""
    from diffusers.hooks import FirstBlockCacheConfig

    _, ad, cfg = pair()
    kw = flux1_kwargs(flux1_inputs(FLUX1, seed=3))
    ip = [embeds(cfg, 2, 4)]
    with pytest.raises(ValueError, match="ip_adapter_image_embeds: no IP-Adapter is loaded"):
        ad(**kw, joint_attention_kwargs={"ip_adapter_image_embeds": ip})
    ad._load_ip_adapter_weights([ip_state_dict(cfg, 1)])
    with pytest.raises(ValueError, match="ip_adapter_image_embeds: IP-Adapter is loaded"):
        ad(**kw)
    with pytest.raises(ValueError, match=r"expected 1 tensors \(one per loaded IP-Adapter"):
        ad(**kw, joint_attention_kwargs={"ip_adapter_image_embeds": ip * 2})
    inputs = ad.ip_adapter_input(ip)
    args = (ad.params, kw["hidden_states"], kw["timestep"], kw["encoder_hidden_states"])
    extra = dict(pooled=kw["pooled_projections"], guidance=kw["guidance"], img_ids=kw["img_ids"])
    with pytest.raises(ValueError, match=r"ip_adapter: image_embeds\[0\]: expected \(2, num_images, embed_dim\)"):
        fd.apply(*args, ip_adapter=dict(inputs, image_embeds=[ip[0][:1]]), **extra)
    with pytest.raises(ValueError, match="ip_adapter: expected a dict with keys"):
        fd.apply(*args, ip_adapter={"image_proj": []}, **extra)
    # a step cache takes IP-Adapter inputs (the stages carry them): the first call computes
    # (the uncached output, bitwise), the second reuses (block 0 + the last tail residual:
    # the same output to fp32 rounding, the inputs being the same)
    plain = ad(**kw, joint_attention_kwargs={"ip_adapter_image_embeds": ip})[0]
    ad.enable_cache(FirstBlockCacheConfig(1e9))
    with ad.cache_context("cond"):
        outs = [ad(**kw, joint_attention_kwargs={"ip_adapter_image_embeds": ip})[0] for _ in range(2)]
        log = ad.step_cache_hook().state().value.log
    ad.disable_cache()
    assert torch.equal(outs[0], plain) and log == ((True,), (False,))
    torch.testing.assert_close(outs[1], plain, rtol=1e-5, atol=1e-5)
    flux2 = fd.DiffusersTransformer(fd.init(fd.PRESETS["flux2-tiny"], seed=0))
    with pytest.raises(ValueError, match="_load_ip_adapter_weights: .* has no IP-Adapter support"):
        flux2._load_ip_adapter_weights([{}])

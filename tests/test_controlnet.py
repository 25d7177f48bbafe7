"""ControlNet as a pure function (`functional_dit.controlnet`), against diffusers at the same
weights: the FLUX.1 ControlNets (InstantX-style, Union, XLabs) and Qwen-Image's per block
(every residual is one block's output through its ControlNet linear) and per model; the
residuals in `fd.apply` against the stock transformers' ``controlnet_*`` arguments (their
interval and repeat arithmetic); `fd.DiffusersTransformer` in the stock ControlNet
pipelines; `fd.sample(..., controlnet=...)` against them; bad inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

import functional_dit as fd
from functional_dit import controlnet as C
from functional_dit import tiny

# fp32: the same maths in the same order (FLUX.1 measured bitwise, Qwen-Image <= 1e-6 on
# the CPU this was written on); the bound is the project's fp32 parity tolerance.
FP32 = dict(rtol=1e-5, atol=1e-5)
FLUX_PRESETS = ("flux1-controlnet-tiny", "flux1-controlnet-union-tiny", "flux1-controlnet-xlabs-tiny")


def image(seed: int, size: int = 32) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))


def flux_inputs(cfg, B=2, S=4, T=8, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        x=r(B, S, 16),
        t=torch.rand(B, generator=g),
        txt=r(B, T, 32),
        pooled=r(B, 24),
        guidance=torch.full((B,), 3.5),
        img_ids=r(S, 3),
        txt_ids=torch.zeros(T, 3),
    )


def flux_cond(cfg, B: int, S: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if cfg.conditioning_embedding_channels is None:
        return torch.randn(B, S, cfg.in_channels, generator=g)
    side = int(S**0.5) * 8 * cfg.patch_size  # the hint block's H/8, patchified
    return torch.randn(B, 3, side, side, generator=g)


def stock_flux_residuals(module, inp, cond, mode, scale):
    with torch.no_grad():
        return module(
            hidden_states=inp["x"],
            controlnet_cond=cond,
            controlnet_mode=mode,
            conditioning_scale=scale,
            encoder_hidden_states=inp["txt"],
            pooled_projections=inp["pooled"],
            timestep=inp["t"],
            img_ids=inp["img_ids"],
            txt_ids=inp["txt_ids"],
            guidance=inp["guidance"],
            return_dict=False,
        )


def assert_residuals(got, want) -> None:
    if want is None:
        assert got is None
        return
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("preset", FLUX_PRESETS)
def test_flux_controlnet_equals_stock_per_block(preset):
    module = tiny.stock_controlnet(preset, seed=1)
    cn = C.from_diffusers(module)
    assert set(cn.flat()) == set(module.state_dict()) == set(C.to_state_dict(C.init(preset)))
    assert cn.config == C.PRESETS[preset]
    assert C.config_from_diffusers(C.config_to_diffusers(cn.config)) == cn.config
    inp = flux_inputs(cn.config)
    cond = flux_cond(cn.config, 2, 4)
    mode = torch.tensor([[1], [2]]) if cn.config.num_mode else None
    want = stock_flux_residuals(module, inp, cond, mode, 0.7)
    kw = {k: v for k, v in inp.items() if k not in ("x", "t", "txt")}
    got = C.apply(
        cn, inp["x"], inp["t"], inp["txt"], cond, scale=0.7, **kw, **({"mode": mode} if mode is not None else {})
    )
    assert_residuals(got["controlnet_block_samples"], want[0])
    assert_residuals(got["controlnet_single_block_samples"], want[1])
    assert got["controlnet_blocks_repeat"] is (cn.config.conditioning_embedding_channels is not None)


def qwen_inputs(B=2, T=8, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1] * T, [1] * 5 + [0] * (T - 5)])
    return dict(
        x=torch.randn(B, 16, 16, generator=g),
        t=torch.rand(B, generator=g),
        txt=torch.randn(B, T, 32, generator=g),
        txt_mask=mask,
        img_shapes=[[(1, 4, 4)]] * B,
        cond=torch.randn(B, 16, 16, generator=g),
    )


def test_qwen_controlnet_equals_stock_per_block():
    module = tiny.stock_controlnet("qwen-image-controlnet-tiny", seed=1)
    cn = C.from_diffusers(module)
    assert set(cn.flat()) == set(module.state_dict())
    i = qwen_inputs()
    with torch.no_grad():
        want = module(
            hidden_states=i["x"],
            controlnet_cond=i["cond"],
            conditioning_scale=0.6,
            encoder_hidden_states=i["txt"],
            encoder_hidden_states_mask=i["txt_mask"],
            timestep=i["t"],
            img_shapes=i["img_shapes"],
            return_dict=False,
        )
    got = C.apply(
        cn, i["x"], i["t"], i["txt"], i["cond"], scale=0.6, txt_mask=i["txt_mask"], img_shapes=i["img_shapes"]
    )
    assert_residuals(got["controlnet_block_samples"], want)


def _stock(config, seed=2):
    cfg = fd.config_to_diffusers(config)
    module = getattr(diffusers, cfg.pop("_class_name"))(**cfg).eval()
    module.load_state_dict(fd.to_state_dict(fd.init(config, seed=seed)))
    return module, fd.from_diffusers(module)


def _stock_flux(module, inp: dict, **res) -> torch.Tensor:
    names = dict(x="hidden_states", txt="encoder_hidden_states", pooled="pooled_projections", t="timestep")
    with torch.no_grad():
        return module(**{names.get(k, k): v for k, v in inp.items()}, return_dict=False, **res)[0]


# (double-block samples, single-block samples, repeat) for a FLUX.1 of 3 double and 2 single
# blocks: one sample for all, fewer than the blocks (interval ceil(3/2) = 2) and more than
# the blocks, XLabs' cycling, and only one kind.
FLUX_RESIDUALS = [(1, 1, False), (2, 3, False), (2, None, True), (None, 2, False)]


def test_flux_transformer_takes_residuals_as_stock():
    module, params = _stock(dataclasses.replace(fd.PRESETS["flux1-tiny"], num_layers=3))
    inp = flux_inputs(params.config)
    kw = {k: v for k, v in inp.items() if k not in ("x", "t", "txt")}
    g = torch.Generator().manual_seed(5)
    samples = lambda n: None if n is None else [torch.randn(2, 4, 32, generator=g) for _ in range(n)]  # noqa: E731
    plain = _stock_flux(module, inp)
    for n_double, n_single, repeat in FLUX_RESIDUALS:
        res = dict(
            controlnet_block_samples=samples(n_double),
            controlnet_single_block_samples=samples(n_single),
            controlnet_blocks_repeat=repeat,
        )
        want = _stock_flux(module, inp, **res)
        torch.testing.assert_close(fd.apply(params, inp["x"], inp["t"], inp["txt"], **kw, **res), want, **FP32)
        assert (want - plain).abs().max() > 1e-2  # the residuals matter


@pytest.mark.parametrize("n", [1, 2])  # one for all blocks; fewer than the blocks (interval 2)
def test_qwen_transformer_takes_residuals_as_stock(n):
    module, params = _stock(dataclasses.replace(fd.PRESETS["qwen-image-tiny"], num_layers=3))
    i = qwen_inputs()
    g = torch.Generator().manual_seed(5)
    samples = [torch.randn(2, 16, 64, generator=g) for _ in range(n)]
    with torch.no_grad():
        want = module(
            hidden_states=i["x"],
            encoder_hidden_states=i["txt"],
            encoder_hidden_states_mask=i["txt_mask"],
            timestep=i["t"],
            img_shapes=i["img_shapes"],
            controlnet_block_samples=samples,
            return_dict=False,
        )[0]
    got = fd.apply(
        params,
        i["x"],
        i["t"],
        i["txt"],
        txt_mask=i["txt_mask"].bool(),
        img_shapes=i["img_shapes"],
        controlnet_block_samples=samples,
    )
    torch.testing.assert_close(got, want, **FP32)


# ----------------------------------------------------------------------------- pipelines


def _pipe_kwargs(kind: str, n: int = 1) -> tuple[dict, dict]:
    """(stock pipeline kwargs, fd.sample kwargs) for one call of ``n`` prompts; true CFG in
    both families (a negative prompt per prompt: the adapter's broadcast of one negative's
    pooled embedding to a batch is another fix's)."""
    common = dict(height=32, width=32, output_type="latent", max_sequence_length=64)
    pipe_kw = dict(common, num_inference_steps=2, negative_prompt=["blurry"] * n, true_cfg_scale=2.0)
    sample_kw = dict(common, steps=2, negative_prompt=["blurry"] * n, true_cfg=2.0)
    if kind == "flux-controlnet":
        pipe_kw["guidance_scale"], sample_kw["guidance"] = 5.0, 5.0
    return pipe_kw, sample_kw


def _gens(seed: int, n: int):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@pytest.mark.parametrize("kind", ["flux-controlnet", "qwen-image-controlnet"])
def test_adapter_and_sample_equal_stock_controlnet_pipelines(kind):
    pipe = tiny.pipeline(kind)
    pipe_kw, sample_kw = _pipe_kwargs(kind, 2)
    prompts, img = ["a red cube", "a blue ball"], image(0)
    stock = pipe(prompt=prompts, control_image=img, controlnet_conditioning_scale=0.8, generator=_gens(3, 2), **pipe_kw)
    params, cn = fd.from_diffusers(pipe.transformer), C.from_diffusers(pipe.controlnet)
    got = fd.sample(params, pipe, prompts, seed=3, controlnet=(cn, img, 0.8), **sample_kw)
    torch.testing.assert_close(got, stock.images, **FP32)
    one = torch.Generator().manual_seed(4)  # the stock one-generator batch: control draws, then the noise
    want = pipe(prompt=prompts, control_image=img, controlnet_conditioning_scale=0.8, generator=one, **pipe_kw).images
    got = fd.sample(
        params, pipe, prompts, seed=torch.Generator().manual_seed(4), controlnet=(cn, img, 0.8), **sample_kw
    )
    torch.testing.assert_close(got, want, **FP32)
    pipe.transformer = fd.DiffusersTransformer(params)
    adapted = pipe(
        prompt=prompts, control_image=img, controlnet_conditioning_scale=0.8, generator=_gens(3, 2), **pipe_kw
    )
    torch.testing.assert_close(adapted.images, stock.images, **FP32)
    if kind == "qwen-image-controlnet":  # FluxControlNetPipeline opens no cache_context (stock hooks need one)
        pipe.transformer.enable_cache(diffusers.FirstBlockCacheConfig(threshold=0.1))
        with pytest.raises(ValueError, match="controlnet_block_samples: step caching with ControlNet residuals"):
            pipe(prompt=prompts, control_image=img, generator=_gens(3, 2), **pipe_kw)


def test_flux_union_multi_and_xlabs_through_pipeline_and_sample():
    union = tiny.stock_controlnet("flux1-controlnet-union-tiny", seed=1)
    plain = tiny.stock_controlnet("flux1-controlnet-tiny", seed=2)
    multi = diffusers.FluxMultiControlNetModel([union, plain])
    pipe = tiny.pipeline("flux-controlnet", controlnet=multi)
    pipe_kw, sample_kw = _pipe_kwargs("flux-controlnet")
    imgs, scales = [image(0), image(1)], [0.5, 0.8]
    call = dict(prompt="a red cube", control_image=imgs, control_mode=[2, None], controlnet_conditioning_scale=scales)
    stock = pipe(**call, generator=_gens(7, 1), **pipe_kw).images
    params = fd.from_diffusers(pipe.transformer)
    u, p = C.from_diffusers(multi)
    got = fd.sample(
        params, pipe, "a red cube", seed=7, controlnet=[(u, imgs[0], 0.5, 2), (p, imgs[1], 0.8)], **sample_kw
    )
    torch.testing.assert_close(got, stock, **FP32)
    pipe.transformer = fd.DiffusersTransformer(params)
    torch.testing.assert_close(pipe(**call, generator=_gens(7, 1), **pipe_kw).images, stock, **FP32)
    # XLabs: the control image through input_hint_block (no VAE draw), residuals cycled (blocks_repeat)
    xlabs = tiny.stock_controlnet("flux1-controlnet-xlabs-tiny", seed=3)
    pipe = tiny.pipeline("flux-controlnet", controlnet=xlabs)
    stock = pipe(prompt="a red cube", control_image=imgs[0], generator=_gens(7, 1), **pipe_kw).images
    got = fd.sample(params, pipe, "a red cube", seed=7, controlnet=(C.from_diffusers(xlabs), imgs[0], 1.0), **sample_kw)
    torch.testing.assert_close(got, stock, **FP32)
    latents = torch.randn(stock.shape, generator=torch.Generator().manual_seed(9))  # XLabs draws nothing: no seed
    want = pipe(prompt="a red cube", control_image=imgs[0], latents=latents, **pipe_kw).images
    got = fd.sample(params, pipe, "a red cube", latents=latents, controlnet=(C.from_diffusers(xlabs), imgs[0], 1.0),
                    **sample_kw)  # fmt: skip
    torch.testing.assert_close(got, want, **FP32)


def test_combine_equals_stock_multi_module():
    nets = [tiny.stock_controlnet("flux1-controlnet-tiny", seed=s) for s in (1, 2)]
    inp = flux_inputs(None)
    conds = [flux_cond(nets[0].config, 2, 4, seed=s) for s in (1, 2)]
    modes = [torch.tensor([-1, -1])] * 2  # what FluxControlNetPipeline passes for non-Union nets
    with torch.no_grad():
        want = diffusers.FluxMultiControlNetModel(nets)(
            hidden_states=inp["x"],
            controlnet_cond=conds,
            controlnet_mode=modes,
            conditioning_scale=[0.3, 0.9],
            encoder_hidden_states=inp["txt"],
            pooled_projections=inp["pooled"],
            timestep=inp["t"],
            img_ids=inp["img_ids"],
            txt_ids=inp["txt_ids"],
            guidance=inp["guidance"],
            return_dict=False,
        )
    kw = {k: v for k, v in inp.items() if k not in ("x", "t", "txt")}
    got = C.combine(
        [
            C.apply(C.from_diffusers(n), inp["x"], inp["t"], inp["txt"], c, scale=s, **kw)
            for n, c, s in zip(nets, conds, (0.3, 0.9))
        ]
    )
    assert_residuals(got["controlnet_block_samples"], want[0])
    assert_residuals(got["controlnet_single_block_samples"], want[1])


# ----------------------------------------------------------------------------- bad inputs


def test_bad_inputs_name_the_argument():
    cn, union = C.init("flux1-controlnet-tiny"), C.init("flux1-controlnet-union-tiny")
    inp = flux_inputs(None)
    kw = {k: v for k, v in inp.items() if k not in ("x", "t", "txt")}
    x, t, txt, cond = inp["x"], inp["t"], inp["txt"], torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="mode: a Union ControlNet"):
        C.apply(union, x, t, txt, cond, **kw)
    with pytest.raises(ValueError, match="mode: this ControlNet has num_mode=None"):
        C.apply(cn, x, t, txt, cond, mode=torch.tensor([1, 2]), **kw)
    with pytest.raises(ValueError, match=r"cond: expected shape \(2, 4, 16\)"):
        C.apply(cn, x, t, txt, torch.randn(2, 5, 16), **kw)
    with pytest.raises(ValueError, match="scale: expected a real number"):
        C.apply(cn, x, t, txt, cond, scale="1", **kw)
    with pytest.raises(ValueError, match="img_shapes: not an argument of the FLUX.1 ControlNet"):
        C.apply(cn, x, t, txt, cond, img_shapes=[], **kw)
    params = fd.init("flux1-tiny")
    with pytest.raises(ValueError, match=r"controlnet_block_samples\[0\]: expected shape \(2, 4, 32\)"):
        fd.apply(params, x, t, txt, controlnet_block_samples=[torch.randn(2, 4, 31)], **kw)
    with pytest.raises(ValueError, match="controlnet_blocks_repeat: expected True or False"):
        fd.apply(params, x, t, txt, controlnet_block_samples=[torch.randn(2, 4, 32)], controlnet_blocks_repeat=1, **kw)
    with pytest.raises(ValueError, match="controlnet_block_samples: not an argument of FLUX.2"):
        fd.apply(fd.init("flux2-tiny"), x, t, txt, controlnet_block_samples=[])
    pipe = tiny.pipeline("flux")
    with pytest.raises(ValueError, match=r"controlnet\[0\]: expected ControlNet params for a flux1 transformer"):
        fd.sample(
            params,
            pipe,
            "a",
            height=32,
            width=32,
            steps=1,
            controlnet=(C.init("qwen-image-controlnet-tiny"), image(0), 1.0),
        )
    with pytest.raises(ValueError, match=r"controlnet\[0\]: expected an int control mode"):
        fd.sample(params, pipe, "a", height=32, width=32, steps=1, controlnet=(union, image(0), 1.0))
    with pytest.raises(ValueError, match="controlnet: a QwenImageControlNetPipeline runs a ControlNet"):
        fd.sample(fd.init("qwen-image-tiny"), tiny.pipeline("qwen-image-controlnet"), "a", height=32, width=32, steps=1)
    with pytest.raises(ValueError, match="cache: with a ControlNet only the attention-level caches run"):
        fd.sample(
            params, pipe, "a", height=32, width=32, steps=1, controlnet=(cn, image(0), 1.0), cache="fbcache:0.1", seed=0
        )


def test_weights_round_trip_with_stock_folders(tmp_path):
    import weights

    for preset in ("flux1-controlnet-xlabs-tiny", "qwen-image-controlnet-tiny"):
        module = tiny.stock_controlnet(preset, seed=1)
        module.save_pretrained(tmp_path / preset)  # the stock folder
        loaded = weights.load(tmp_path / preset, dtype=torch.bfloat16)
        assert loaded.config == C.PRESETS[preset] and fd.from_diffusers(module).config == loaded.config
        assert all(torch.equal(loaded.flat()[k], v.bfloat16()) for k, v in module.state_dict().items())
        weights.save(C.from_diffusers(module), tmp_path / f"ours-{preset}")
        back = type(module).from_pretrained(tmp_path / f"ours-{preset}")  # stock diffusers reads ours
        assert all(torch.equal(back.state_dict()[k], v) for k, v in module.state_dict().items())


def test_bf16_equals_stock():
    from oracle import assert_bf16_equal

    bf = torch.bfloat16
    union = tiny.stock_controlnet("flux1-controlnet-union-tiny", seed=1, dtype=bf)
    inp = {
        k: v.to(bf) if v.is_floating_point() and k not in ("img_ids", "txt_ids", "guidance") else v
        for k, v in flux_inputs(None).items()
    }
    cond, mode = flux_cond(union.config, 2, 4).to(bf), torch.tensor([[1], [2]])
    want = stock_flux_residuals(union, inp, cond, mode, 0.7)
    kw = {k: v for k, v in inp.items() if k not in ("x", "t", "txt")}
    got = C.apply(C.from_diffusers(union), inp["x"], inp["t"], inp["txt"], cond, scale=0.7, mode=mode, **kw)
    for a, b in zip(got["controlnet_block_samples"] + got["controlnet_single_block_samples"], want[0] + want[1]):
        assert_bf16_equal(a, b)
    qwen = tiny.stock_controlnet("qwen-image-controlnet-tiny", seed=1, dtype=bf)
    i = {k: v.to(bf) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in qwen_inputs().items()}
    with torch.no_grad():
        want = qwen(
            hidden_states=i["x"],
            controlnet_cond=i["cond"],
            encoder_hidden_states=i["txt"],
            encoder_hidden_states_mask=i["txt_mask"],
            timestep=i["t"],
            img_shapes=i["img_shapes"],
            return_dict=False,
        )
    got = C.apply(
        C.from_diffusers(qwen), i["x"], i["t"], i["txt"], i["cond"], txt_mask=i["txt_mask"], img_shapes=i["img_shapes"]
    )
    for a, b in zip(got["controlnet_block_samples"], want):
        assert_bf16_equal(a, b)


def test_qwen_multi_controlnet_through_pipeline_and_sample():
    net = tiny.stock_controlnet("qwen-image-controlnet-tiny", seed=1)
    pipe = tiny.pipeline("qwen-image-controlnet", controlnet=diffusers.QwenImageMultiControlNetModel([net]))
    pipe_kw, sample_kw = _pipe_kwargs("qwen-image-controlnet")
    imgs = [image(0), image(1)]  # one net, two conditions (the stock multi wrapper's only mode)
    stock = pipe(
        prompt="a red cube",
        control_image=imgs,
        controlnet_conditioning_scale=[0.5, 0.8],
        generator=_gens(7, 1),
        **pipe_kw,
    ).images
    cn = C.from_diffusers(net)
    got = fd.sample(
        fd.from_diffusers(pipe.transformer),
        pipe,
        "a red cube",
        seed=7,
        controlnet=[(cn, imgs[0], 0.5), (cn, imgs[1], 0.8)],
        **sample_kw,
    )
    torch.testing.assert_close(got, stock, **FP32)


# ----------------------------------------------------------------------------- schedule, latents, modes


@pytest.mark.parametrize("kind", ["flux-controlnet", "qwen-image-controlnet"])
def test_control_guidance_and_latents_equal_stock(kind):
    """``control_guidance_start`` / ``_end`` (the stock ``controlnet_keep``: 4 steps, [0.25,
    0.75] keeps steps 1 and 2; [0.5, 0.75] step 2 only, the others skipping the ControlNet)
    and ``latents=`` (the control draw still from the generators, the noise given), against
    the stock pipeline called with the same arguments."""
    pipe = tiny.pipeline(kind)
    pipe_kw, sample_kw = _pipe_kwargs(kind)
    pipe_kw["num_inference_steps"] = sample_kw["steps"] = 4
    img, prompt = image(0), ["a red cube"]
    params, cn = fd.from_diffusers(pipe.transformer), C.from_diffusers(pipe.controlnet)
    call = dict(prompt=prompt, control_image=img, controlnet_conditioning_scale=0.8, **pipe_kw)
    full = pipe(**call, generator=_gens(3, 1)).images
    for start, end in ((0.25, 0.75), (0.5, 0.75)):
        want = pipe(**call, control_guidance_start=start, control_guidance_end=end, generator=_gens(3, 1)).images
        got = fd.sample(
            params, pipe, prompt, seed=3, controlnet=(cn, img, 0.8), control_guidance_start=start,
            control_guidance_end=end, **sample_kw,
        )  # fmt: skip
        torch.testing.assert_close(got, want, **FP32)  # fp32, the same maths: the project's bound
        assert (want - full).abs().max() > 1e-2  # the schedule matters
    latents = torch.randn(full.shape, generator=torch.Generator().manual_seed(9))
    for seed, gen in ((3, _gens(3, 1)), (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))):
        want = pipe(**call, latents=latents, generator=gen).images
        got = fd.sample(params, pipe, prompt, seed=seed, latents=latents, controlnet=(cn, img, 0.8), **sample_kw)
        torch.testing.assert_close(got, want, **FP32)
        assert (want - full).abs().max() > 1e-2  # the given latents matter


def test_flux_union_modes_and_per_controlnet_guidance_equal_stock():
    """A Union ControlNet alone (the stock ``control_mode`` int), and a multi-ControlNet with
    one ``control_guidance_start`` / ``_end`` per ControlNet (lists) and one float broadcast."""
    union = tiny.stock_controlnet("flux1-controlnet-union-tiny", seed=1)
    pipe = tiny.pipeline("flux-controlnet", controlnet=union)
    pipe_kw, sample_kw = _pipe_kwargs("flux-controlnet")
    pipe_kw["num_inference_steps"] = sample_kw["steps"] = 4
    img, u = image(0), C.from_diffusers(union)
    params = fd.from_diffusers(pipe.transformer)
    for mode in (0, 2):
        want = pipe(prompt="a red cube", control_image=img, control_mode=mode, generator=_gens(7, 1), **pipe_kw).images
        got = fd.sample(params, pipe, "a red cube", seed=7, controlnet=(u, img, 1.0, mode), **sample_kw)
        torch.testing.assert_close(got, want, **FP32)
    plain = tiny.stock_controlnet("flux1-controlnet-tiny", seed=2)
    pipe = tiny.pipeline("flux-controlnet", controlnet=diffusers.FluxMultiControlNetModel([union, plain]))
    imgs, p = [image(0), image(1)], C.from_diffusers(plain)
    call = dict(
        prompt="a red cube", control_image=imgs, control_mode=[2, None], controlnet_conditioning_scale=[0.5, 0.8]
    )
    nets = [(u, imgs[0], 0.5, 2), (p, imgs[1], 0.8)]
    for start, end in (([0.0, 0.5], [0.5, 1.0]), (0.25, [0.5, 1.0])):
        want = pipe(**call, control_guidance_start=start, control_guidance_end=end, generator=_gens(7, 1), **pipe_kw)
        got = fd.sample(
            params, pipe, "a red cube", seed=7, controlnet=nets, control_guidance_start=start, control_guidance_end=end,
            **sample_kw,
        )  # fmt: skip
        torch.testing.assert_close(got, want.images, **FP32)


def test_qwen_multi_per_condition_guidance_equals_stock():
    net = tiny.stock_controlnet("qwen-image-controlnet-tiny", seed=1)
    pipe = tiny.pipeline("qwen-image-controlnet", controlnet=diffusers.QwenImageMultiControlNetModel([net]))
    pipe_kw, sample_kw = _pipe_kwargs("qwen-image-controlnet")
    pipe_kw["num_inference_steps"] = sample_kw["steps"] = 4
    imgs, cn = [image(0), image(1)], C.from_diffusers(net)
    start, end = [0.0, 0.5], [0.5, 1.0]
    want = pipe(
        prompt="a red cube", control_image=imgs, controlnet_conditioning_scale=[0.5, 0.8],
        control_guidance_start=start, control_guidance_end=end, generator=_gens(7, 1), **pipe_kw,
    ).images  # fmt: skip
    got = fd.sample(
        fd.from_diffusers(pipe.transformer), pipe, "a red cube", seed=7,
        controlnet=[(cn, imgs[0], 0.5), (cn, imgs[1], 0.8)], control_guidance_start=start, control_guidance_end=end,
        **sample_kw,
    )  # fmt: skip
    torch.testing.assert_close(got, want, **FP32)


def test_bad_guidance_modes_and_latents_name_the_argument():
    params, pipe = fd.init("flux1-tiny"), tiny.pipeline("flux")
    cn, union = C.init("flux1-controlnet-tiny"), C.init("flux1-controlnet-union-tiny")
    kw = dict(height=32, width=32, steps=1, seed=0)
    run = lambda **k: fd.sample(params, pipe, "a", **{**kw, **k})  # noqa: E731
    one = (cn, image(0), 1.0)
    below = r"control_guidance_start: expected each below its control_guidance_end, got start 0.8 >= end 0.5"
    with pytest.raises(ValueError, match=below + r" for controlnet\[0\]"):
        run(controlnet=one, control_guidance_start=0.8, control_guidance_end=0.5)
    with pytest.raises(
        ValueError, match=r"control_guidance_end: expected a float or a list of 2 \(one per ControlNet\), got \[1.0\]"
    ):
        run(controlnet=[one, one], control_guidance_end=[1.0])
    with pytest.raises(ValueError, match=r"control_guidance_start: expected a float or a list of 1 .*got \[0.0, 0.1\]"):
        run(controlnet=one, control_guidance_start=[0.0, 0.1])
    with pytest.raises(
        ValueError, match=r"control_guidance_end: expected fractions of the schedule in \[0, 1\], got 1.5"
    ):
        run(controlnet=one, control_guidance_end=1.5)
    with pytest.raises(ValueError, match="control_guidance_start: applies to a ControlNet; expected None"):
        run(control_guidance_start=0.2)
    with pytest.raises(ValueError, match=r"controlnet\[0\]: mode: expected 0 <= mode < 3 .*got 3"):
        run(controlnet=(union, image(0), 1.0, 3))
    with pytest.raises(
        ValueError, match=r"controlnet\[1\]: expected no control mode \(not a Union ControlNet\), got mode=1"
    ):
        run(controlnet=[(union, image(0), 1.0, 1), (cn, image(0), 1.0, 1)])
    with pytest.raises(ValueError, match="seed: with latents= the control images' VAE draws still take a generator"):
        run(controlnet=one, seed=None, latents=torch.randn(1, 16, 64))


def test_request_carries_control_guidance():
    """`functional_dit.sampling.Request` with a ControlNet and its schedule fractions: the
    item's image equals ``fd.sample`` of that request alone (bitwise: the same ops in one
    process, as tests/test_sampling.py's ControlNet items)."""
    from functional_dit import sampling

    pipe = tiny.pipeline("flux")
    params, cn = fd.from_diffusers(pipe.transformer), C.from_diffusers(tiny.stock_controlnet())
    ctl = dict(controlnet=(cn, image(0), 0.8), control_guidance_start=0.25, control_guidance_end=0.75)
    req = sampling.Request("a cat", 32, 32, 4, seed=2, max_sequence_length=64, **ctl)
    state = sampling.init(params, sampling.context(params, pipe), [req])
    while not all(it.done for it in state.items):
        state = sampling.step(params, state)
    (got,) = sampling.decode(state, "np")
    kw = dict(height=32, width=32, steps=4, seed=2, output_type="np", max_sequence_length=64)
    want = fd.sample(params, pipe, "a cat", **kw, **ctl)[0]
    assert np.array_equal(got, want)
    plain = fd.sample(params, pipe, "a cat", **kw, controlnet=ctl["controlnet"])[0]
    assert np.abs(want - plain).max() > 1e-3  # the fractions reach the item
    with pytest.raises(ValueError, match="control_guidance_end: applies to a ControlNet; expected None"):
        sampling.init(
            params, sampling.context(params, pipe), [sampling.Request("a", 32, 32, 2, control_guidance_end=0.5)]
        )


def _faster(pipe):
    """diffusers' FasterCache (one call per step) and ours, as tests/test_cache.py pairs them."""
    from diffusers.hooks import FasterCacheConfig

    stock = FasterCacheConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 950),
        current_timestep_callback=lambda: pipe.current_timestep,
        attention_weight_callback=lambda _: 0.3,
        is_guidance_distilled=True,
        tensor_format="BCHW",
    )
    return stock, fd.FasterCache(2, (-1, 950), weight=0.3)


def test_attention_level_caches_with_controlnet_equal_stock_hooks():
    """Step caching with ControlNet residuals: the attention-level caches run every block and
    its residual add, as the stock hooks leave the stock transformer's adds. Qwen-Image:
    TaylorSeer on the attention modules with true CFG (the pipeline's "cond" / "uncond"
    contexts) and FasterCache without; FLUX.1: TaylorSeer without CFG, the stock call in one
    cache_context (FluxControlNetPipeline opens none). The block-skipping caches are refused."""
    from diffusers.hooks import TaylorSeerCacheConfig

    from functional_dit.pipelines import cache as fd_cache

    kw = dict(cache_interval=2, disable_cache_before_step=2, max_order=2, taylor_factors_dtype=torch.float32)
    taylor = lambda pipe: (TaylorSeerCacheConfig(**kw), fd.TaylorSeer(**kw, modules=fd_cache.ATTENTION))  # noqa: E731
    common = dict(height=32, width=32, output_type="latent", max_sequence_length=64)
    cfg = (dict(negative_prompt=["blurry"], true_cfg_scale=2.0), dict(negative_prompt=["blurry"], true_cfg=2.0))
    runs = [("qwen-image-controlnet", taylor, cfg), ("qwen-image-controlnet", _faster, ({}, {})),
            ("flux-controlnet", taylor, ({}, {}))]  # fmt: skip
    img = image(0)
    for kind, pair, (stock_kw, our_kw) in runs:
        pipe = tiny.pipeline(kind)
        params, cn = fd.from_diffusers(pipe.transformer), C.from_diffusers(pipe.controlnet)
        call = dict(prompt=["a"], control_image=img, controlnet_conditioning_scale=0.8, num_inference_steps=5)
        plain = pipe(**call, generator=_gens(3, 1), **common, **stock_kw).images
        stock, ours = pair(pipe)
        pipe.transformer.enable_cache(stock)
        with pipe.transformer.cache_context("cond") if kind == "flux-controlnet" else contextlib.nullcontext():
            want = pipe(**call, generator=_gens(3, 1), **common, **stock_kw).images
        run = fd.CacheRun(ours)
        got = fd.sample(params, pipe, ["a"], steps=5, seed=3, controlnet=(cn, img, 0.8), cache=run, **common, **our_kw)
        assert run.skipped() > 0 and (want - plain).abs().max() > 1e-3  # the cache acted
        torch.testing.assert_close(got, want, **FP32)  # fp32, the same maths: the project's bound
        if kind == "qwen-image-controlnet":  # the adapter's enable_cache in the stock pipeline, the same
            pipe.transformer = fd.DiffusersTransformer(params)
            pipe.transformer.enable_cache(pair(pipe)[0])
            adapted = pipe(**call, generator=_gens(3, 1), **common, **stock_kw).images
            torch.testing.assert_close(adapted, want, **FP32)
        pipe.transformer.disable_cache()
    for spec in ("fbcache:0.1", "magcache:0.1", fd.TaylorSeer(2, 2)):
        with pytest.raises(ValueError, match="cache: with a ControlNet only the attention-level caches run"):
            fd.sample(params, pipe, "a", steps=2, seed=0, controlnet=(cn, img, 1.0), cache=spec, **common)

"""The stock pipelines' further arguments in `fd.sample` (`functional_dit.pipelines.sampler._stock_args`),
each against the stock diffusers pipeline with the stock transformer at the same seed on the
tiny offline pipelines (`functional_dit.tiny`), and each refusal by name (docs/sampling.md,
"Stock arguments"). Two steps at 32x32 unless a case says otherwise; latents compared.
"""

from __future__ import annotations

import diffusers
import peft  # noqa: F401  (a dev dependency: the stock pipeline's load_lora_weights needs it)
import pytest
import torch
from test_sample import FP32, RAGGED, SIZE, ref_image, stock_latents
from test_sample_flux_image import init_image, mask_image

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import tiny

KW = dict(steps=2, output_type="latent", **SIZE)
MSL = dict(max_sequence_length=64)  # enough for the tiny byte-level FLUX.1 / klein prompts (functional_dit.tiny)


def _params(pipe):
    return fd.from_diffusers(pipe.transformer)


def _differ(a, b) -> None:
    """The argument changed the result (so the equality above it is not vacuous)."""
    assert (a - b).abs().max() > 1e-4


def test_prompt_2_and_negative_prompt_2_equal_stock():
    """FLUX.1: CLIP reads ``prompt``, T5 ``prompt_2``; likewise for the true-CFG negatives."""
    pipe = tiny.pipeline("flux")
    cfg = dict(negative_prompt="blurry", negative_prompt_2=["dark", "flat"])
    stock = dict(prompt=RAGGED, prompt_2=["a blue cone", "two dogs"], num_inference_steps=2, **SIZE, **MSL)
    expected = stock_latents(pipe, 4, 2, **stock, true_cfg_scale=2.0, **cfg)
    ours = dict(seed=4, true_cfg=2.0, **KW, **MSL)
    got = fd.sample(_params(pipe), pipe, RAGGED, prompt_2=["a blue cone", "two dogs"], **cfg, **ours)
    torch.testing.assert_close(got, expected, **FP32)
    with torch.no_grad():  # the second prompts change what T5 reads (so the equality above is not vacuous)
        _differ(
            *(pipe.encode_prompt(RAGGED, p2, max_sequence_length=64)[0] for p2 in (None, ["a blue cone", "two dogs"]))
        )
    with pytest.raises(ValueError, match="prompt_2: expected a string or 2 strings \\(one per prompt\\)"):
        fd.sample(_params(pipe), pipe, RAGGED, prompt_2=["one"], seed=4, **KW)


@pytest.mark.parametrize("kind", ["flux", "qwen-image"])
def test_attention_kwargs_scale_scales_the_lora_as_stock(kind, tmp_path):
    """``joint_attention_kwargs`` (FLUX.1) / ``attention_kwargs`` (the others): their ``scale``
    multiplies the LoRA scales, as the stock pipeline's ``scale_lora_layers`` on a PEFT LoRA."""
    pipe = tiny.pipeline(kind)
    params = _params(pipe)
    ad = lora.init(params, rank=4, targets=lora.linear_modules(params.config), alpha=8.0, seed=1, zero_b=False)
    lora.save(ad, tmp_path / "pytorch_lora_weights.safetensors")
    pipe.load_lora_weights(str(tmp_path))
    name = "joint_attention_kwargs" if kind == "flux" else "attention_kwargs"
    msl = MSL if kind == "flux" else {}  # Qwen-Image's template needs its default length (functional_dit.tiny)
    stock = dict(prompt="a red cube", num_inference_steps=2, **SIZE, **msl)
    expected = stock_latents(pipe, 2, **stock, **{name: {"scale": 0.4}})
    pairs = [(lora.load(tmp_path, params), 1.5)]
    got = fd.sample(params, pipe, "a red cube", seed=2, lora=pairs, **{name: {"scale": 0.4 / 1.5}}, **KW, **msl)
    torch.testing.assert_close(got, expected, **FP32)
    _differ(got, fd.sample(params, pipe, "a red cube", seed=2, lora=pairs, **KW, **msl))
    other = "attention_kwargs" if kind == "flux" else "joint_attention_kwargs"
    with pytest.raises(ValueError, match=f"{other}: a {type(pipe).__name__} takes no {other}"):
        fd.sample(params, pipe, "a red cube", seed=2, **{other: {"scale": 0.5}}, **KW)
    with pytest.raises(ValueError, match=f"{name}: only the LoRA 'scale' has a meaning in fd.sample.*\\['foo'\\]"):
        fd.sample(params, pipe, "a red cube", seed=2, **{name: {"scale": 0.5, "foo": 1}}, **KW)


@pytest.mark.parametrize("kind", ["flux", "qwen-image"])
def test_callback_tensor_inputs_equal_stock(kind):
    """``callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"]`` with true CFG: the
    callback sees the stock conditional prompt embeddings and the latents, and the latents
    it returns replace them."""
    pipe = tiny.pipeline(kind)
    seen = {"stock": [], "ours": []}

    def hook(side):
        def cb(_pipe, i, _t, tensors):
            assert sorted(tensors) == ["latents", "prompt_embeds"]
            seen[side].append({k: v.clone() for k, v in tensors.items()})
            return {"latents": tensors["latents"] * 0.9} if i == 0 else {}

        return cb

    names = ["latents", "prompt_embeds"]
    cfg = dict(negative_prompt="blurry", **(MSL if kind == "flux" else {}))
    stock = dict(prompt=RAGGED, num_inference_steps=2, true_cfg_scale=2.0, callback_on_step_end_tensor_inputs=names)
    expected = stock_latents(pipe, 1, 2, **stock, **cfg, **SIZE, callback_on_step_end=hook("stock"))
    got = fd.sample(_params(pipe), pipe, RAGGED, seed=1, true_cfg=2.0, callback_on_step_end=hook("ours"),
                    callback_on_step_end_tensor_inputs=names, **cfg, **KW)  # fmt: skip
    torch.testing.assert_close(got, expected, **FP32)
    assert len(seen["ours"]) == len(seen["stock"]) == 2
    for a, b in zip(seen["ours"], seen["stock"], strict=True):
        for k in names:
            torch.testing.assert_close(a[k], b[k], **FP32)


def test_callback_tensor_inputs_refused():
    pipe = tiny.pipeline("flux")
    params = _params(pipe)
    new = lambda _p, i, t, d: {"prompt_embeds": d["prompt_embeds"] * 2}  # noqa: E731
    with pytest.raises(ValueError, match="callback_on_step_end: returned new prompt_embeds"):
        fd.sample(params, pipe, "a", seed=0, callback_on_step_end=new,
                  callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"], **KW)  # fmt: skip
    with pytest.raises(ValueError, match="callback_on_step_end_tensor_inputs: expected names from"):
        fd.sample(params, pipe, "a", seed=0, callback_on_step_end=new, callback_on_step_end_tensor_inputs=["x"], **KW)
    with pytest.raises(ValueError, match="callback_on_step_end_tensor_inputs: expected it with a callback_on_step_end"):
        fd.sample(params, pipe, "a", seed=0, callback_on_step_end_tensor_inputs=["latents"], **KW)


def test_masked_image_latents_equal_stock_inpainting():
    """``masked_image_latents`` spare the stock inpainting pipelines a VAE encode; their loop
    never reads them. QwenImageInpaintPipeline given them equals fd.sample given them; FLUX.1
    inpainting given them is bitwise the same as without (FluxInpaintPipeline hard-codes 16
    latent channels, so the tiny 4-channel FLUX.1 cannot take them on the stock side). A
    wrong shape, or a job that is not inpainting, is refused."""
    from test_sample_qwen_image import mask, start_image

    pipe = diffusers.QwenImageInpaintPipeline(
        **tiny.components("qwen-image"), transformer=tiny.stock_transformer("qwen-image")
    )
    z = torch.randn(1, 4, 1, 4, 4, generator=torch.Generator().manual_seed(9))  # the 32 x 32 output's latent grid
    job = dict(image=start_image(), mask_image=mask())
    stock = dict(prompt="a red cube", num_inference_steps=2, true_cfg_scale=1.0, masked_image_latents=z)
    expected = stock_latents(pipe, 3, **stock, **job, **SIZE)
    got = fd.sample(_params(pipe), pipe, "a red cube", masked_image_latents=z, seed=3, **job, **KW)
    torch.testing.assert_close(got, expected, **FP32)
    with pytest.raises(ValueError, match=r"masked_image_latents: expected a tensor \(b, 4, 4, 4\)"):
        fd.sample(_params(pipe), pipe, "a red cube", masked_image_latents=z[:, :2], seed=3, **job, **KW)

    base = tiny.pipeline("flux")
    flux = diffusers.FluxInpaintPipeline.from_pipe(base)
    job = dict(image=init_image(), mask_image=mask_image(), seed=3, **KW, **MSL)
    zf = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(9))  # the 32 x 32 output's latent grid
    plain = fd.sample(_params(flux), flux, "a red cube", **job)
    assert torch.equal(fd.sample(_params(flux), flux, "a red cube", masked_image_latents=zf, **job), plain)
    with pytest.raises(ValueError, match="masked_image_latents: taken for FLUX.1 and Qwen-Image inpainting"):
        fd.sample(_params(base), base, "a red cube", masked_image_latents=zf, seed=3, **KW)


def test_text_encoder_out_layers_equal_stock():
    """FLUX.2 (klein): the hidden layers of the text encoder stacked as the prompt."""
    pipe = tiny.pipeline("flux2-klein")
    layers = (2, 5, 8)  # the tiny encoder has 27 layers (klein reads 9, 18, 27 by default)
    stock = dict(prompt="a red cube", num_inference_steps=2, guidance_scale=1.0, text_encoder_out_layers=layers)
    expected = stock_latents(pipe, 0, **stock, **SIZE, **MSL)
    got = fd.sample(_params(pipe), pipe, "a red cube", seed=0, text_encoder_out_layers=layers, **KW, **MSL)
    torch.testing.assert_close(got, expected, **FP32)
    with torch.no_grad():  # other layers, another prompt (so the equality above is not vacuous)
        _differ(
            *(pipe.encode_prompt("a red cube", text_encoder_out_layers=lay, **MSL)[0] for lay in (layers, (9, 18, 27)))
        )
    flux = tiny.pipeline("flux")
    with pytest.raises(ValueError, match="text_encoder_out_layers: a FluxPipeline takes no text_encoder_out_layers"):
        fd.sample(_params(flux), flux, "a", seed=0, text_encoder_out_layers=layers, **KW)


def test_qwen21_use_kv_cache_and_output_resolution_equal_stock():
    """Qwen-Image 2.1's ``use_kv_cache`` is ``kv_cache``: the same latents (bitwise), the
    stock pipeline's with it off; both given must agree; other pipelines take neither name.
    ``output_resolution`` sizes a missing ``height`` / ``width`` as stock."""
    pipe = tiny.pipeline("qwen-image-2.1")
    params, size = _params(pipe), dict(height=64, width=64)
    kw = dict(steps=2, seed=0, output_type="latent", **size)
    expected = pipe(prompt="a red cube", num_inference_steps=2, use_kv_cache=False, output_type="latent",
                    generator=torch.Generator().manual_seed(0), **size).images  # fmt: skip
    got = fd.sample(params, pipe, "a red cube", use_kv_cache=False, **kw)
    torch.testing.assert_close(got, expected, **FP32)
    assert torch.equal(got, fd.sample(params, pipe, "a red cube", kv_cache=False, use_kv_cache=False, **kw))
    # output_resolution: the missing height / width, as stock
    by_res = pipe(prompt="a red cube", num_inference_steps=2, use_kv_cache=False, output_type="latent",
                  generator=torch.Generator().manual_seed(0), output_resolution=64, width=48).images  # fmt: skip
    ours = dict(steps=2, seed=0, output_type="latent", output_resolution=64, width=48, kv_cache=False)
    torch.testing.assert_close(fd.sample(params, pipe, "a red cube", **ours), by_res, **FP32)
    with pytest.raises(ValueError, match="use_kv_cache: the stock name of kv_cache; expected the same value"):
        fd.sample(params, pipe, "a red cube", kv_cache=True, use_kv_cache=False, **kw)
    flux = tiny.pipeline("flux")
    with pytest.raises(ValueError, match="use_kv_cache: a FluxPipeline takes no use_kv_cache"):
        fd.sample(_params(flux), flux, "a", seed=0, use_kv_cache=True, **KW)


def test_refused_by_name():
    """Arguments with no meaning in fd.sample, each refused by name before any encoding."""
    pipe = tiny.pipeline("flux")
    params = _params(pipe)
    cases = [
        (dict(ip_adapter_image=ref_image()), "ip_adapter_image: not taken by fd.sample: .*CLIP image encoder"),
        (dict(negative_ip_adapter_image=ref_image()), "negative_ip_adapter_image: not taken by fd.sample"),
        (dict(ip_adapter_image_embeds=[torch.zeros(1, 1, 32)]),
         "negative_ip_adapter_image_embeds: expected it with the negative ones too; .*black image"),
        (dict(use_en_prompt=True), "use_en_prompt: not taken by fd.sample: .*never captions"),
        (dict(cfg_normalize=True), "cfg_normalize: a FluxPipeline takes no cfg_normalize"),
        (dict(_auto_resize=False), "_auto_resize: a FluxPipeline takes no _auto_resize"),
        (dict(resolution=640), "resolution: a FluxPipeline takes no resolution"),
        (dict(output_resolution=64), "output_resolution: a FluxPipeline takes no output_resolution"),
        (dict(prompt_embeds=torch.zeros(1, 4, 32), pooled_prompt_embeds=torch.zeros(1, 32), prompt_2="b"),
         "prompt_2: expected None with prompt embeddings"),
    ]  # fmt: skip
    for kw, match in cases:
        prompt = None if "prompt_embeds" in kw else "a"
        with pytest.raises(ValueError, match=match):
            fd.sample(params, pipe, prompt, seed=0, **kw, **KW)
    qwen = tiny.pipeline("qwen-image")
    with pytest.raises(ValueError, match="prompt_2: a QwenImagePipeline takes no prompt_2"):
        fd.sample(_params(qwen), qwen, "a", seed=0, prompt_2="b", **KW)


def test_caption_upsampling_refused_and_upsample_prompt_first_equals_stock(monkeypatch):
    """``caption_upsample_temperature`` (Flux2Pipeline) is refused by name, before any
    encoding: the stock upsampling samples text from torch's global random state, not the
    seed. The route the error names, ``pipe.upsample_prompt(...)`` passed as the prompt, is
    what the stock pipeline encodes: with the upsampler's text fixed (the tiny pipeline's byte
    tokenizer is no Pixtral processor, so the stock ``generate`` cannot run here), the stock
    ``pipe(..., caption_upsample_temperature=0.15)`` equals ``fd.sample`` of its output."""
    pipe = tiny.pipeline("flux2")
    msl = dict(max_sequence_length=256)  # past FLUX.2's ~190-token system prompt: the prompt is read
    params, calls = _params(pipe), []

    def upsample_prompt(prompt, images=None, temperature=0.15, device=None):
        calls.append(temperature)
        return [f"{p}, in soft morning light" for p in ([prompt] if isinstance(prompt, str) else prompt)]

    monkeypatch.setattr(pipe, "upsample_prompt", upsample_prompt)
    monkeypatch.setattr(pipe, "encode_prompt", lambda *a, **k: pytest.fail("encoded before the refusal"), raising=True)
    with pytest.raises(
        ValueError, match="caption_upsample_temperature: not taken by fd.sample: .*pipe.upsample_prompt"
    ):
        fd.sample(params, pipe, "a red cube", seed=0, caption_upsample_temperature=0.15, **KW, **msl)
    monkeypatch.undo()
    monkeypatch.setattr(pipe, "upsample_prompt", upsample_prompt)
    stock = dict(prompt="a red cube", num_inference_steps=2, caption_upsample_temperature=0.15, **SIZE, **msl)
    expected = stock_latents(pipe, 0, **stock)
    assert calls == [0.15]  # the stock pipeline upsampled
    got = fd.sample(params, pipe, pipe.upsample_prompt("a red cube", temperature=0.15), seed=0, **KW, **msl)
    torch.testing.assert_close(got, expected, **FP32)
    _differ(got, fd.sample(params, pipe, "a red cube", seed=0, **KW, **msl))  # the upsampled text mattered


def test_kontext_auto_resize_off_equals_stock():
    """``_auto_resize=False``: the reference keeps its size (floored to multiples of 16)
    instead of the preferred Kontext resolution (which would make it 1024²)."""
    pipe = tiny.pipeline("flux-kontext")
    kw = dict(height=32, width=48, max_area=40 * 40)  # 40² at 3:2 -> 48 x 32
    got = {}

    def grab(_pipe, i, t, tensors):
        got["latents"] = tensors["latents"]
        return {}

    stock = dict(prompt="a red cube", num_inference_steps=2, guidance_scale=2.5, image=init_image(), **kw, **MSL)
    expected = stock_latents(pipe, 3, **stock, _auto_resize=False, callback_on_step_end=grab)  # packed latents
    ours = fd.sample(_params(pipe), pipe, "a red cube", image=init_image(), _auto_resize=False, seed=3, guidance=2.5,
                     steps=2, output_type="latent", **kw, **MSL)  # fmt: skip
    torch.testing.assert_close(ours, expected, **FP32)


def test_layered_cfg_normalize_and_resolution_equal_stock(monkeypatch):
    """Qwen-Image-Layered's ``cfg_normalize=True`` (true CFG rescaled to the conditional
    prediction's norm; stock default False) and ``resolution`` (the output sized from the
    image's aspect ratio by the stock ``calculate_dimensions``, here patched to a small
    area on both sides, as in test_sample_qwen_image)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered as stock_module
    from test_sample_qwen_image import layered_pipeline, start_image

    size = stock_module.calculate_dimensions
    monkeypatch.setattr(stock_module, "calculate_dimensions", lambda area, ratio: size(32 * 32, ratio))
    pipe, img = layered_pipeline(), start_image()
    w, h = stock_module.calculate_dimensions(640 * 640, img.size[0] / img.size[1])
    got = {}

    def grab(_pipe, i, t, tensors):
        got["stock"] = tensors["latents"]
        return {}

    kw = dict(image=img, layers=1, negative_prompt="dark")
    pipe(prompt="a cube", generator=torch.Generator().manual_seed(3), callback_on_step_end=grab, output_type="np",
         true_cfg_scale=2.0, num_inference_steps=2, cfg_normalize=True, **kw)  # fmt: skip
    ours = dict(true_cfg=2.0, steps=2, seed=3, output_type="latent", **kw)
    params = fd.from_diffusers(pipe.transformer)
    got_norm = fd.sample(params, pipe, "a cube", cfg_normalize=True, resolution=640, **ours)  # sized as stock
    torch.testing.assert_close(got_norm, got["stock"], **FP32)
    _differ(got_norm, fd.sample(params, pipe, "a cube", height=h, width=w, **ours))
    with pytest.raises(ValueError, match="height, width: expected None with resolution"):
        fd.sample(params, pipe, "a cube", resolution=640, height=h, width=w, **ours)
    with pytest.raises(ValueError, match=r"resolution: expected one of \[640, 1024\] \(as stock\), got 512"):
        fd.sample(params, pipe, "a cube", resolution=512, **ours)


@torch.no_grad()
def test_ip_adapter_image_embeds_equal_stock():
    """FLUX.1's IP-Adapter loaded on the pipeline (``load_ip_adapter``, a random checkpoint
    in the stock layout), its scale set, true CFG: ``ip_adapter_image_embeds`` and the
    negative ones give the stock latents (the negative in the uncond branch)."""
    from test_adapter_ip import embeds, ip_state_dict

    pipe = tiny.pipeline("flux")
    cfg, params = dict(pipe.transformer.config), _params(pipe)  # the base params, before the IP weights join
    pipe.load_ip_adapter(ip_state_dict(cfg, 7), weight_name="ip.bin", image_encoder_pretrained_model_name_or_path=None)
    pipe.set_ip_adapter_scale(0.7)
    emb = dict(ip_adapter_image_embeds=[embeds(cfg, 1, 8)], negative_ip_adapter_image_embeds=[embeds(cfg, 1, 9)])
    cfg_kw = dict(negative_prompt="blurry")
    stock = dict(prompt=RAGGED, num_inference_steps=2, true_cfg_scale=2.0, **SIZE, **MSL, **cfg_kw, **emb)
    expected = stock_latents(pipe, 5, 2, **stock)
    got = fd.sample(params, pipe, RAGGED, seed=5, true_cfg=2.0, **cfg_kw, **emb, **KW, **MSL)
    torch.testing.assert_close(got, expected, **FP32)  # the same adapter changes the latents: test_adapter_ip
    # a step cache carries the IP-Adapter's inputs through the stages: all blocks computed, the same latents
    run = fd.CacheRun(fd.TaylorSeer(cache_interval=1, disable_cache_before_step=1))
    cached = fd.sample(params, pipe, RAGGED, seed=5, true_cfg=2.0, cache=run, **cfg_kw, **emb, **KW, **MSL)
    assert torch.equal(cached, got) and run.skipped() == 0
    with pytest.raises(ValueError, match=r"ip_adapter_image_embeds: expected a list of \(1, I, E\) tensors"):
        fd.sample(params, pipe, RAGGED, seed=5, **emb | dict(ip_adapter_image_embeds=[embeds(cfg, 2, 8)]), **KW)

"""`fd.sample` img2img and inpainting for Qwen-Image against the stock
``QwenImageImg2ImgPipeline`` / ``QwenImageInpaintPipeline`` (stock transformer, same
seed, tiny offline pipelines): latents in every noise mode, ``output_type`` values,
``padding_mask_crop`` (pil only, as stock), tp=2 and dp=2 on 2 gloo ranks, the bad
arguments, and Qwen-Image's true CFG without a negative prompt (none, as stock).

The stock latents are captured at the last step through ``callback_on_step_end``
(after the inpainting blend, as the pipelines hold them), see `test_sample.stock_latents`.
"""

from __future__ import annotations

import dataclasses
import logging

import diffusers
import numpy as np
import pytest
import torch
from _dist import spawn
from PIL import Image
from test_sample import stock_latents

import functional_dit as fd
import sharding
from functional_dit import tiny

# The bound (fp32, atol/rtol 1e-5); measured ≤ 1.7e-6 for img2img and inpainting
# (1 process, tp=2, dp=2), 1.2e-6 Edit-Plus, 2.2e-6 Layered (docs/sampling.md). Qwen-Image
# is not bitwise: fd.apply and the stock transformer round its attention differently.
FP32 = dict(rtol=1e-5, atol=1e-5)
SIZE = dict(height=32, width=32)
PROMPTS = ["a red cube", "a small green sphere resting on a wooden table"]
CFG = dict(true_cfg_scale=3.0, negative_prompt="blurry"), dict(true_cfg=3.0, negative_prompt="blurry")


def start_image(w=48, h=40, seed=0) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def mask(w=48, h=40, box=(28, 8, 44, 24)) -> Image.Image:
    """White (repaint) inside ``box`` (x0, y0, x1, y1), black elsewhere."""
    a = np.zeros((h, w), dtype="uint8")
    a[box[1] : box[3], box[0] : box[2]] = 255
    return Image.fromarray(a)


def make(cls):
    pipe = getattr(diffusers, cls)(**tiny.components("qwen-image"), transformer=tiny.stock_transformer("qwen-image"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


IMG2IMG, INPAINT = "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"


@pytest.fixture(scope="module")
def pipes():
    return {cls: make(cls) for cls in (IMG2IMG, INPAINT)}


def _ours(pipe, prompt, **kw):
    kw = dict(steps=4, output_type="latent") | SIZE | kw
    return fd.sample(fd.from_diffusers(pipe.transformer), pipe, prompt, **kw)


# (name, pipeline class, stock kwargs, fd.sample kwargs); stock runs 4 steps at 32x32.
CASES = [
    ("img2img-cfg-ragged", IMG2IMG, dict(image=start_image(), **CFG[0]), dict(image=start_image(), **CFG[1])),
    ("img2img-strength-1", IMG2IMG, dict(image=start_image(), strength=1.0), dict(image=start_image(), strength=1.0)),
    (
        "img2img-two-images",
        IMG2IMG,
        dict(image=[start_image(), start_image(seed=1)], strength=0.5),
        dict(image=[start_image(), start_image(seed=1)], strength=0.5),
    ),
    (
        "inpaint-cfg-ragged",
        INPAINT,
        dict(image=start_image(), mask_image=mask(), strength=0.8, **CFG[0]),
        dict(image=start_image(), mask_image=mask(), strength=0.8, **CFG[1]),
    ),
    (
        "inpaint-default-strength",
        INPAINT,
        dict(image=start_image(), mask_image=mask()),
        dict(image=start_image(), mask_image=mask()),
    ),
]


@pytest.mark.parametrize("name, cls, stock_kw, our_kw", CASES, ids=[c[0] for c in CASES])
def test_latents_equal_stock_pipeline(pipes, name, cls, stock_kw, our_kw):
    pipe = pipes[cls]
    stock_kw = dict(true_cfg_scale=1.0) | stock_kw  # stock's default 4.0 is inert without a negative prompt
    expected = stock_latents(pipe, 3, 2, prompt=PROMPTS, num_inference_steps=4, **SIZE, **stock_kw)
    torch.testing.assert_close(_ours(pipe, PROMPTS, seed=3, **our_kw), expected, **FP32)


@pytest.mark.parametrize("cls", [IMG2IMG, INPAINT])
def test_noise_modes_equal_stock(pipes, cls):
    """One batch generator (the VAE samples first, then the whole batch's noise), a list
    of generators, and two images per prompt."""
    pipe, extra = pipes[cls], dict(image=start_image()) | (dict(mask_image=mask()) if cls == INPAINT else {})
    stock = dict(prompt=PROMPTS[0], num_inference_steps=4, true_cfg_scale=1.0, **SIZE, **extra)
    expected = stock_latents(pipe, 0, num_images_per_prompt=2, generator=torch.Generator().manual_seed(7), **stock)
    got = _ours(pipe, PROMPTS[0], seed=torch.Generator().manual_seed(7), num_images_per_prompt=2, **extra)
    torch.testing.assert_close(got, expected, **FP32)
    gens = lambda: [torch.Generator().manual_seed(s) for s in (5, 9)]  # noqa: E731
    expected = stock_latents(pipe, 0, num_images_per_prompt=2, generator=gens(), **stock)
    torch.testing.assert_close(_ours(pipe, PROMPTS[0], seed=gens(), num_images_per_prompt=2, **extra), expected, **FP32)


def test_img2img_given_latents_and_upgraded_text_to_image_pipeline(pipes):
    """latents= is the start as it is (stock img2img skips the image then); a
    QwenImagePipeline given image= (and mask_image=) runs img2img (inpainting)."""
    pipe = pipes[IMG2IMG]
    lat = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(1))
    stock = dict(prompt="a cube", num_inference_steps=4, true_cfg_scale=1.0, image=start_image(), **SIZE)
    expected = stock_latents(pipe, 0, latents=lat, **stock)
    torch.testing.assert_close(_ours(pipe, "a cube", latents=lat, image=start_image()), expected, **FP32)
    t2i = tiny.pipeline("qwen-image")
    for cls, extra in ((IMG2IMG, {}), (INPAINT, dict(mask_image=mask()))):
        expected = stock_latents(pipes[cls], 2, **stock, **extra)
        got = fd.sample(fd.from_diffusers(t2i.transformer), t2i, "a cube", steps=4, seed=2, output_type="latent",
                        image=start_image(), **SIZE, **extra)  # fmt: skip
        torch.testing.assert_close(got, expected, **FP32)


@pytest.mark.parametrize("cls, output_types", [(IMG2IMG, ("latent", "pt")), (INPAINT, ("np", "pil"))])
def test_output_types_return_what_stock_returns(pipes, cls, output_types):
    """Both pipelines decode alike, so each checks two of the four output types."""
    pipe, extra = pipes[cls], dict(image=start_image()) | (dict(mask_image=mask()) if cls == INPAINT else {})
    stock = dict(prompt="a cube", num_inference_steps=4, true_cfg_scale=1.0, **SIZE, **extra)
    for output_type in output_types:
        want = pipe(**stock, output_type=output_type, generator=[torch.Generator().manual_seed(4)]).images
        got = _ours(pipe, "a cube", seed=4, output_type=output_type, **extra)
        assert type(got) is type(want), output_type
        if output_type == "pil":  # uint8 after rounding: decoded values within 1e-5 may round apart by 1
            assert [g.size for g in got] == [w.size for w in want]
            got, want = np.stack([np.asarray(g, dtype=np.int16) for g in got]), np.stack([np.asarray(w) for w in want])
            assert np.abs(got - want).max() <= 1
        else:
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), **FP32)


def test_padding_mask_crop_latents_and_images_equal_stock(pipes):
    """Stock allows padding_mask_crop only with output_type="pil": the latents are compared
    through the step callbacks, the pasted-back images in uint8."""
    pipe, big, m = pipes[INPAINT], start_image(64, 64), mask(64, 64, (40, 8, 56, 24))
    kw = dict(image=big, mask_image=m, padding_mask_crop=4, strength=0.9)
    expected, images = {}, None

    def grab(_pipe, i, t, tensors):
        expected["latents"] = tensors["latents"]
        return {}

    images = pipe("a cube", num_inference_steps=4, true_cfg_scale=1.0, generator=[torch.Generator().manual_seed(6)],
                  callback_on_step_end=grab, **SIZE, **kw).images  # fmt: skip
    got = {}
    ours = _ours(pipe, "a cube", seed=6, output_type="pil", callback=lambda i, x: got.update(latents=x), **kw)
    torch.testing.assert_close(got["latents"], expected["latents"], **FP32)
    assert ours[0].size == images[0].size == (64, 64)  # pasted into the original image, as stock
    diff = np.abs(np.asarray(ours[0], dtype=np.int16) - np.asarray(images[0], dtype=np.int16)).max()
    assert diff <= 1  # uint8 rounding of decoded values within 1e-5


@pytest.mark.parametrize(
    "cls, kw, match",
    [
        (IMG2IMG, dict(image=start_image(), strength=1.5), "strength: expected a number in \\[0, 1\\], got 1.5"),
        (IMG2IMG, dict(image=start_image(), strength=0.0), "strength: expected more than 0 \\(it leaves none of the 4"),
        (IMG2IMG, dict(), "image: a QwenImageImg2ImgPipeline starts from an image"),
        (IMG2IMG, dict(image="x.png"), "image: expected a PIL image or a non-empty list of them, got 'x.png'"),
        (IMG2IMG, dict(image=start_image(), mask_image=mask()), "mask_image: a QwenImageImg2ImgPipeline expects None"),
        (INPAINT, dict(image=start_image()), "mask_image: a QwenImageInpaintPipeline expects a mask image"),
        (
            INPAINT,
            dict(image=start_image(), mask_image=mask(), padding_mask_crop=4),
            "output_type: expected 'pil' with padding_mask_crop",
        ),
        (IMG2IMG, dict(image=start_image(), padding_mask_crop=4), "padding_mask_crop: a QwenImageImg2ImgPipeline"),
        (INPAINT, dict(image=start_image(), mask_image=mask(), latents=torch.zeros(1, 4, 16)), "latents: a Qwen"),
        (IMG2IMG, dict(image=[start_image()] * 3), "image: expected a count that divides the 1 images made, got 3"),
    ],
)
def test_bad_arguments(pipes, cls, kw, match):
    with pytest.raises(ValueError, match=match):
        _ours(pipes[cls], "a cube", seed=0, **kw)


def test_text_to_image_pipeline_refuses_strength_and_mask():
    pipe = tiny.pipeline("qwen-image")
    for kw, match in ((dict(strength=0.5), "strength: a QwenImagePipeline takes no strength"),
                      (dict(mask_image=mask()), "mask_image: a QwenImagePipeline takes no mask_image")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            _ours(pipe, "a cube", seed=0, **kw)


def test_true_cfg_without_negative_prompt_runs_no_cfg_as_stock(caplog):
    """Stock Qwen-Image runs true CFG only with a negative prompt; so does fd.sample (with
    a warning), and with negative_prompt="" it runs CFG against ""."""
    pipe = tiny.pipeline("qwen-image")
    stock = dict(prompt="a cube", num_inference_steps=2, true_cfg_scale=4.0, **SIZE)
    with caplog.at_level(logging.WARNING, logger="functional_dit.pipelines.sampler._requests"):
        got = _ours(pipe, "a cube", steps=2, seed=1, true_cfg=4.0)
    assert "true_cfg=4.0 ignored" in caplog.text
    torch.testing.assert_close(got, stock_latents(pipe, 1, **stock), **FP32)
    torch.testing.assert_close(got, _ours(pipe, "a cube", steps=2, seed=1), rtol=0, atol=0)  # the same calls
    cfg = stock_latents(pipe, 1, negative_prompt="", **stock)
    torch.testing.assert_close(_ours(pipe, "a cube", steps=2, seed=1, true_cfg=4.0, negative_prompt=""), cfg, **FP32)
    assert (cfg - got).abs().max() > 1e-3  # CFG changes the result: the two checks differ


# ----------------------------------------------------------------------------- ranks


def _rank_cases():
    """(name, pipeline class, prompts, fd.sample kwargs) run on 2 ranks."""
    img, inp = dict(image=start_image()), dict(image=start_image(), mask_image=mask(), strength=0.8)
    return [
        ("img2img", IMG2IMG, PROMPTS, img | CFG[1]),
        ("inpaint", INPAINT, PROMPTS, inp | CFG[1]),
        ("img2img-one", IMG2IMG, PROMPTS[:1], img | CFG[1]),  # dp: CFG parallel (one branch per rank)
        ("inpaint-one", INPAINT, PROMPTS[:1], inp | CFG[1]),
    ]


def _sharded(rank, world):
    out, pipes = {}, {cls: make(cls) for cls in (IMG2IMG, INPAINT)}
    for mesh_kw in (dict(tp=2), dict(dp=2)):
        mesh = sharding.make_mesh(**mesh_kw, device_type="cpu")
        params = sharding.shard_params(fd.from_diffusers(pipes[IMG2IMG].transformer), mesh)  # both: the same weights
        for name, cls, prompts, kw in _rank_cases():
            if "tp" in mesh_kw and name.endswith("-one"):
                continue
            pipe = pipes[cls]
            out[f"{name} {mesh_kw}"] = fd.sample(
                params, pipe, prompts, steps=4, seed=3, output_type="latent", **SIZE, **kw
            )
    return out


def test_tp2_and_dp2_equal_stock_pipeline(pipes):
    """img2img and inpainting with ragged prompts and true CFG on tp=2 and dp=2 (two
    prompts: one per dp group; one prompt: [cond; uncond] split over dp)."""
    results = spawn(_sharded, 2, timeout=600)
    for name, cls, prompts, kw in _rank_cases():
        stock_kw = {k: v for k, v in kw.items() if k != "true_cfg"} | dict(true_cfg_scale=3.0)
        expected = stock_latents(pipes[cls], 3, len(prompts), prompt=prompts, num_inference_steps=4, **SIZE, **stock_kw)
        for key in [k for k in results[0] if k.split(" ")[0] == name]:
            for r in results:
                torch.testing.assert_close(r[key], expected, **FP32, msg=lambda m, key=key: f"{key}: {m}")


# ----------------------------------------------------------------------------- Edit-Plus


def test_edit_plus_several_references_equal_stock(monkeypatch):
    """Two references of different shapes, true CFG, two images per prompt. Both sides
    resize references to the same VAE area, set here to 128² for both (at the stock
    1024² the tiny VAE takes about 30 s per reference on 2 CPU cores); the constants
    themselves are checked equal to stock's."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as stock_module

    from functional_dit.pipelines.families.qwenimage import _image as qi

    assert (qi.VAE_AREA, qi.CONDITION_AREA) == (stock_module.VAE_IMAGE_SIZE, stock_module.CONDITION_IMAGE_SIZE)
    monkeypatch.setattr(stock_module, "VAE_IMAGE_SIZE", 128 * 128)
    monkeypatch.setattr(qi, "VAE_AREA", 128 * 128)
    pipe, refs = tiny.pipeline("qwen-image-edit-plus"), [start_image(), start_image(40, 64, 1)]
    stock = dict(image=refs, true_cfg_scale=2.0, negative_prompt="dark", num_images_per_prompt=2, num_inference_steps=2)
    expected = stock_latents(pipe, 3, 2, prompt="a cube", **SIZE, **stock)
    got = _ours(
        pipe, "a cube", seed=3, steps=2, image=refs, true_cfg=2.0, negative_prompt="dark", num_images_per_prompt=2
    )
    torch.testing.assert_close(got, expected, **FP32)
    with pytest.raises(ValueError, match="prompt: a QwenImageEditPlusPipeline takes one prompt \\(as stock\\), got 2"):
        _ours(pipe, PROMPTS, seed=3, steps=1, image=refs)
    with pytest.raises(ValueError, match="image: expected a PIL image or a non-empty list of them, got None"):
        _ours(pipe, "a cube", seed=3, steps=1)


# ----------------------------------------------------------------------------- Layered


def layered_pipeline():
    """QwenImageLayeredPipeline over the tiny Qwen-Image-Edit components with a stock
    transformer that has the Layered flags (additional t cond, layer-3D RoPE)."""
    cfg = dataclasses.replace(tiny.transformer_config("qwen-image"), use_additional_t_cond=True, use_layer3d_rope=True)
    d = fd.config_to_diffusers(cfg)
    module = getattr(diffusers, d.pop("_class_name"))(**{k: v for k, v in d.items() if not k.startswith("_")})
    module.load_state_dict(fd.to_state_dict(fd.init(cfg, seed=0)))
    pipe = diffusers.QwenImageLayeredPipeline(**tiny.components("qwen-image-edit"), transformer=module.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_layered_latents_and_layers_equal_stock(monkeypatch):
    """Two layers, true CFG (plain, not norm-rescaled, as the pipeline's default). Stock
    sizes the output from resolution 640 or 1024 and the image's aspect ratio; fd.sample
    takes height/width, so the stock size is set here to about 64² (both sides then see
    the same sizes; at 640² the tiny VAE takes about 10 s per image on 2 CPU cores).
    Stock output_type="latent" fails in diffusers 0.42.1 (UnboundLocalError): the latents
    are compared through the step callback, the layers as "np"."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered as stock_module

    size = stock_module.calculate_dimensions
    monkeypatch.setattr(stock_module, "calculate_dimensions", lambda area, ratio: size(64 * 64, ratio))
    pipe, img = layered_pipeline(), start_image()
    w, h = stock_module.calculate_dimensions(640 * 640, img.size[0] / img.size[1])
    got, kw = {}, dict(image=img, layers=2, true_cfg_scale=2.0, negative_prompt="dark", num_inference_steps=2)

    def grab(_pipe, i, t, tensors):
        got["stock"] = tensors["latents"]
        return {}

    want = pipe(prompt="a cube", generator=torch.Generator().manual_seed(3), callback_on_step_end=grab,
                output_type="np", **kw).images  # fmt: skip
    ours = dict(image=img, layers=2, true_cfg=2.0, negative_prompt="dark", steps=2, seed=3, height=h, width=w)
    params = fd.from_diffusers(pipe.transformer)
    layers = fd.sample(params, pipe, "a cube", output_type="np", callback=lambda i, x: got.update(ours=x), **ours)
    torch.testing.assert_close(got["ours"], got["stock"], **FP32)
    assert layers.shape == (1, *want[0].shape) == (1, 2, h, w, 3)  # stock: a list of one (layers, H, W, 3) array
    torch.testing.assert_close(torch.as_tensor(layers[0]), torch.as_tensor(want[0]), **FP32)
    with pytest.raises(UnboundLocalError):  # the stock quirk this test works around
        pipe(prompt="a cube", image=img, layers=1, num_inference_steps=1, output_type="latent")
    with pytest.raises(ValueError, match="layers: expected None \\(4, as stock\\) or a positive int, got 0"):
        fd.sample(params, pipe, "a cube", **(ours | dict(layers=0)))

"""`fd.sample` img2img and inpainting for FLUX.1 against the stock ``FluxImg2ImgPipeline``
and ``FluxInpaintPipeline`` (stock transformer, same seed) on the tiny offline pipeline,
on one process and on 2 gloo ranks (tp=2, dp=2), their output types, and bad arguments.

The stock latents are captured at the last step through ``callback_on_step_end``, which
both pipelines call with the packed latents whatever the ``output_type``.
"""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from _dist import spawn
from PIL import Image

import functional_dit as fd
import sharding
from functional_dit import tiny
from functional_dit.pipelines import families as _latents
from functional_dit.pipelines.families.flux1 import _image as _sample_flux_image
from functional_dit.pipelines.families.flux1 import _kontext as _sample_flux_kontext

FP32 = dict(rtol=1e-5, atol=1e-5)  # the bound; measured 0 (bitwise) on one process, ≤ 3.4e-6 on 2 ranks
SIZE = dict(height=64, width=48)  # an 8 x 6 latent grid: 12 tokens, the mask covers some of them
PROMPT = "a red cube on a table"


def init_image(w=56, h=72, seed=0) -> Image.Image:
    """Not the output size, so the stock resize runs too."""
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def mask_image(w=56, h=72) -> Image.Image:
    m = np.zeros((h, w), "uint8")
    m[10:40, 8:30] = 255  # white = repaint
    return Image.fromarray(m)


def pipelines():
    """(FluxImg2ImgPipeline, FluxInpaintPipeline) sharing the tiny FLUX.1 components."""
    base = tiny.pipeline("flux")
    out = tuple(getattr(diffusers, c).from_pipe(base) for c in ("FluxImg2ImgPipeline", "FluxInpaintPipeline"))
    for p in out:
        p.set_progress_bar_config(disable=True)
    return out


def stock_run(pipe, **kw):
    """(the final latents, the pipeline's output)."""
    got = {}

    def grab(_pipe, i, t, tensors):
        got["latents"] = tensors["latents"]
        return {}

    out = pipe(**kw, callback_on_step_end=grab)
    return got["latents"], out


def stock_latents(pipe, **kw) -> torch.Tensor:
    return stock_run(pipe, **kw)[0]


def seeds(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


# (name, which pipeline (0 img2img, 1 inpaint), stock kwargs, fd.sample kwargs); every case
# runs 4 steps at seed 3 unless it says otherwise.
CASES = [
    ("img2img-defaults", 0, dict(), dict()),  # strength 0.6 and guidance 7.0, as stock
    ("img2img-strength-guidance", 0, dict(strength=0.5, guidance_scale=3.0), dict(strength=0.5, guidance=3.0)),
    ("img2img-full-strength", 0, dict(strength=1.0), dict(strength=1.0)),
    (
        "img2img-true-cfg",
        0,
        dict(strength=0.75, true_cfg_scale=2.0, negative_prompt="blurry"),
        dict(strength=0.75, true_cfg=2.0, negative_prompt="blurry"),
    ),
    ("inpaint-defaults", 1, dict(), dict()),
    ("inpaint-strength", 1, dict(strength=0.8, guidance_scale=4.0), dict(strength=0.8, guidance=4.0)),
]


@pytest.fixture(scope="module")
def pipes():
    return pipelines()


@pytest.mark.parametrize("name, which, stock_kw, our_kw", CASES, ids=[c[0] for c in CASES])
def test_latents_equal_stock_pipeline(pipes, name, which, stock_kw, our_kw):
    pipe = pipes[which]
    mask = dict(mask_image=mask_image()) if which else {}
    expected = stock_latents(
        pipe,
        prompt=PROMPT,
        image=init_image(),
        generator=seeds(3, 1),
        num_inference_steps=4,
        **SIZE,
        **mask,
        **stock_kw,
    )
    params = fd.from_diffusers(pipe.transformer)
    got = fd.sample(
        params, pipe, PROMPT, image=init_image(), steps=4, seed=3, output_type="latent", **SIZE, **mask, **our_kw
    )
    torch.testing.assert_close(got, expected, **FP32)


def test_inpainting_keeps_the_image_outside_the_mask(pipes):
    """The last blend leaves the unmasked tokens exactly at the image latents (the
    posterior drawn first from the seed's generator), and the masked ones generated."""
    img2img, inpaint = pipes
    params = fd.from_diffusers(inpaint.transformer)
    kw = dict(image=init_image(), steps=4, seed=3, strength=0.8, output_type="latent", **SIZE)
    got = fd.sample(params, inpaint, PROMPT, mask_image=mask_image(), **kw)
    proc, mask_proc = _sample_flux_image._processors(inpaint)
    pixels = proc.preprocess(init_image(), **SIZE)
    post = inpaint.vae.encode(pixels).latent_dist.sample(torch.Generator().manual_seed(3))
    cfg = inpaint.vae.config
    init = _latents.pack_2x2((post - cfg.shift_factor) * cfg.scaling_factor)
    mask = torch.nn.functional.interpolate(mask_proc.preprocess(mask_image(), **SIZE), size=post.shape[2:])
    keep = _latents.pack_2x2(mask.repeat(1, post.shape[1], 1, 1)) == 0
    assert 0 < int(keep.sum()) < keep.numel()
    assert torch.equal(got[keep], init[keep])
    assert not torch.allclose(got[~keep], init[~keep])
    assert not torch.allclose(got, fd.sample(params, img2img, PROMPT, **kw))


def test_many_images_and_one_generator_equal_stock(pipes):
    """Two prompts x 2 images. Inpainting with one seed each: the stock pipeline given
    ``image=[img] * 4`` and four generators. img2img with one generator for the batch: the
    stock call with one image and one generator (its posterior first, then the whole
    batch's noise). The noise paths are shared by both pipelines."""
    img2img, inpaint = pipes
    params = fd.from_diffusers(img2img.transformer)
    prompts = ["a red cube", "a small green sphere"]
    kw = dict(num_inference_steps=3, num_images_per_prompt=2, **SIZE)
    ours = dict(image=init_image(), steps=3, num_images_per_prompt=2, output_type="latent", **SIZE)
    mask = dict(mask_image=mask_image())
    expected = stock_latents(inpaint, prompt=prompts, image=[init_image()] * 4, generator=seeds(5, 4), **kw, **mask)
    got = fd.sample(params, inpaint, prompts, seed=5, batch_size=3, **ours, **mask)
    torch.testing.assert_close(got, expected, **FP32)
    gen = torch.Generator().manual_seed(7)
    expected = stock_latents(img2img, prompt=prompts, image=init_image(), generator=gen, **kw)
    got = fd.sample(params, img2img, prompts, seed=torch.Generator().manual_seed(7), batch_size=3, **ours)
    torch.testing.assert_close(got, expected, **FP32)


def test_img2img_given_latents_are_the_start_latents(pipes):
    """As FluxImg2ImgPipeline: ``latents=`` (packed) replace the noised image entirely."""
    img2img, _ = pipes
    start = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(1))
    kw = dict(image=init_image(), strength=0.5, **SIZE)
    expected = stock_latents(img2img, prompt=PROMPT, latents=start, num_inference_steps=4, **kw)
    got = fd.sample(
        fd.from_diffusers(img2img.transformer), img2img, PROMPT, steps=4, latents=start, output_type="latent", **kw
    )
    torch.testing.assert_close(got, expected, **FP32)


@pytest.mark.parametrize("output_type", ["pil", "np", "pt"])
def test_output_types_equal_stock(pipes, output_type):
    """The decoded images: the same VAE and image processor on latents within 1e-5 (here
    equal), so equal within 1e-5 in [0, 1]; PIL images may differ by one level where a
    value lies on a rounding edge."""
    _, inpaint = pipes
    kw = dict(image=init_image(), mask_image=mask_image(), strength=0.7, output_type=output_type, **SIZE)
    expected = inpaint(PROMPT, generator=seeds(2, 1), num_inference_steps=3, **kw).images
    got = fd.sample(fd.from_diffusers(inpaint.transformer), inpaint, PROMPT, steps=3, seed=2, **kw)
    assert type(got) is type(expected)
    if output_type == "pil":
        assert len(got) == 1 and got[0].size == expected[0].size == (48, 64)
        diff = np.abs(np.asarray(got[0], dtype=int) - np.asarray(expected[0], dtype=int))
        assert diff.max() <= 1
        return
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(expected), **FP32)


def test_padding_mask_crop_equals_stock(pipes):
    """``padding_mask_crop`` (stock: ``output_type="pil"`` only): the latents of the cropped
    job through ``callback_on_step_end`` on both sides, and the pasted-back images."""
    _, inpaint = pipes
    kw = dict(image=init_image(), mask_image=mask_image(), padding_mask_crop=4, strength=0.9, **SIZE)
    expected = stock_latents(inpaint, prompt=PROMPT, generator=seeds(4, 1), num_inference_steps=3, **kw)
    got_latents = {}

    def grab(_pipe, i, t, tensors):
        got_latents["x"] = tensors["latents"]

    params = fd.from_diffusers(inpaint.transformer)
    got = fd.sample(params, inpaint, PROMPT, steps=3, seed=4, callback_on_step_end=grab, **kw)
    torch.testing.assert_close(got_latents["x"], expected, **FP32)
    stock_image = inpaint(PROMPT, generator=seeds(4, 1), num_inference_steps=3, **kw).images[0]
    assert got[0].size == stock_image.size == init_image().size  # pasted back at the init image's size
    diff = np.abs(np.asarray(got[0], dtype=int) - np.asarray(stock_image, dtype=int))
    assert diff.max() <= 1  # one level where a value lies on a rounding edge (see above)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(strength=1.5), r"strength: expected a number in \[0, 1\], got 1.5"),
        (dict(strength=0), "strength: expected a value > 0 .* got steps=4, strength=0: 0 steps"),
        (dict(image=None, strength=0.5, text_to_image=True), "strength: fd.sample takes it for FLUX.1 img2img and"),
        (dict(image="x.png", strength=0.5), "image: expected one PIL image, got 'x.png'"),
        (dict(mask_image=np.zeros((4, 4))), "mask_image: expected one PIL image"),
        (dict(padding_mask_crop=4), "padding_mask_crop: crops around the mask; expected it with a mask_image"),
        (
            dict(mask_image=mask_image(), padding_mask_crop=4, output_type="latent"),
            "output_type: expected 'pil' with padding_mask_crop",
        ),
        (dict(mask_image=mask_image(), latents=torch.zeros(1, 12, 16)), "latents: inpainting draws its image latents"),
    ],
)
def test_bad_arguments(pipes, kw, match):
    img2img, _ = pipes
    args = dict(image=init_image(), steps=4, seed=0, output_type="latent", **SIZE) | kw
    pipe = diffusers.FluxPipeline.from_pipe(img2img) if args.pop("text_to_image", False) else img2img
    with pytest.raises(ValueError, match=match):
        fd.sample(fd.from_diffusers(img2img.transformer), pipe, PROMPT, **args)


def test_pipelines_that_need_an_image_or_mask_say_so(pipes):
    img2img, inpaint = pipes
    params = fd.from_diffusers(img2img.transformer)
    with pytest.raises(ValueError, match="image: a FluxImg2ImgPipeline needs one"):
        fd.sample(params, img2img, PROMPT, steps=2, seed=0, **SIZE)
    with pytest.raises(ValueError, match="mask_image: a FluxInpaintPipeline needs one"):
        fd.sample(params, inpaint, PROMPT, image=init_image(), steps=2, seed=0, **SIZE)
    flux2 = tiny.pipeline("flux2-klein")
    with pytest.raises(ValueError, match=r"strength: fd.sample takes it for FLUX.1 \(not flux2\)"):
        fd.sample(fd.from_diffusers(flux2.transformer), flux2, PROMPT, strength=0.5, steps=2, seed=0, **SIZE)


# ----------------------------------------------------------------------------- ranks


def _ranked(rank, world):
    """img2img and inpainting under tp=2 and dp=2 (two prompts: one per dp group; one
    prompt with true CFG: the [cond; uncond] batch split over dp), each with its
    single-process result."""
    img2img, inpaint = pipelines()
    params = fd.from_diffusers(img2img.transformer)
    out = {}
    jobs = {
        "img2img": (img2img, dict(strength=0.75)),
        "inpaint": (inpaint, dict(mask_image=mask_image(), strength=0.9)),
        "inpaint-cfg": (inpaint, dict(mask_image=mask_image(), true_cfg=2.0, negative_prompt="blurry")),
    }
    for axes in (dict(tp=2), dict(dp=2)):
        sharded = sharding.shard_params(params, sharding.make_mesh(**axes, device_type="cpu"))
        for name, (pipe, kw) in jobs.items():
            prompts = [PROMPT] if "cfg" in name else ["a red cube", "a small green sphere"]
            kw = dict(image=init_image(), steps=3, seed=6, output_type="latent", **SIZE, **kw)
            out[f"{axes} {name}"] = fd.sample(sharded, pipe, prompts, **kw)
            if axes == dict(tp=2):
                out[f"single {name}"] = fd.sample(params, pipe, prompts, **kw)
    return out


def test_tp2_and_dp2_equal_single_process():
    results = spawn(_ranked, 2, timeout=600)
    for r in results:
        for name in ("img2img", "inpaint", "inpaint-cfg"):
            for axes in ("{'tp': 2}", "{'dp': 2}"):
                torch.testing.assert_close(r[f"{axes} {name}"], r[f"single {name}"], **FP32)
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key  # every rank returns the same latents


# ----------------------------------------------------------------------------- Kontext


def test_kontext_equals_stock_latents_and_images():
    """FluxKontextPipeline: the size rescaled to ``max_area``, the reference resized to its
    preferred resolution (about 1024², so this case is the slow one), encoded, at ids
    ``(1, row, col)``; with and without a reference. Latents through
    ``callback_on_step_end`` on both sides, and the decoded images."""
    pipe = tiny.pipeline("flux-kontext")
    params = fd.from_diffusers(pipe.transformer)
    kw = dict(height=32, width=48, max_area=40 * 40, output_type="np")  # 40² at 3:2 -> 48 x 32
    got = {}

    def grab(_pipe, i, t, tensors):
        got["latents"] = tensors["latents"]

    for ref in (dict(image=init_image()), {}):
        stock = dict(prompt=PROMPT, generator=seeds(3, 1), num_inference_steps=2, guidance_scale=2.5, **kw, **ref)
        expected, stock_out = stock_run(pipe, **stock)
        stock_images = stock_out.images
        images = fd.sample(params, pipe, PROMPT, steps=2, seed=3, guidance=2.5, callback_on_step_end=grab, **kw, **ref)
        torch.testing.assert_close(got["latents"], expected, **FP32)
        torch.testing.assert_close(torch.as_tensor(images), torch.as_tensor(stock_images), **FP32)
        assert images.shape == (1, 32, 48, 3)


def test_kontext_size_and_bad_max_area():
    pipe = tiny.pipeline("flux-kontext")
    size = _sample_flux_kontext.size
    assert size(pipe, 32, 48, None) == (832, 1248)  # the stock default: about 1024² at 3:2
    assert size(pipe, 30, 30, 48 * 48) == (48, 48)  # any size: rescaled to max_area
    params = fd.from_diffusers(pipe.transformer)
    with pytest.raises(ValueError, match="max_area: expected a positive int, got 0"):
        fd.sample(params, pipe, PROMPT, height=32, width=32, steps=1, seed=0, max_area=0)
    with pytest.raises(ValueError, match="max_area: expected room for at least 16x16 pixels at 32:32, got 100"):
        fd.sample(params, pipe, PROMPT, height=32, width=32, steps=1, seed=0, max_area=100)
    with pytest.raises(ValueError, match="strength: fd.sample takes it for FLUX.1 img2img and inpainting"):
        fd.sample(params, pipe, PROMPT, height=32, width=32, steps=1, seed=0, image=init_image(), strength=0.5)
    with pytest.raises(ValueError, match="image: a FluxKontextPipeline takes one PIL reference image"):
        fd.sample(params, pipe, PROMPT, height=32, width=32, steps=1, seed=0, image=[init_image()] * 2, max_area=1024)
    flux = diffusers.FluxPipeline.from_pipe(pipe)
    with pytest.raises(ValueError, match="max_area: only a FluxKontextPipeline takes it; expected None, got 1024"):
        fd.sample(params, flux, PROMPT, height=32, width=32, steps=1, seed=0, max_area=1024)

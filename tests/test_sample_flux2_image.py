"""`fd.sample` FLUX.2-klein inpainting against the stock ``Flux2KleinInpaintPipeline``
(stock transformer, same seed) on the tiny offline klein pipeline, on one process and on
2 gloo ranks (tp=2, dp=2), and bad arguments.

The stock latents are captured at the last step through ``callback_on_step_end`` (packed,
whatever the ``output_type``); ``output_type="latent"`` (klein: the VAE's input) is compared too.
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

FP32 = dict(rtol=1e-5, atol=1e-5)  # the bound; measured 0 here, 1.3e-6 with CFG at 4 steps, ≤ 6e-7 on 2 ranks
PROMPT = "a red cube on a table"
ASKED = dict(height=32, width=32)  # ignored: the output takes the init image's size, as stock
MSL = dict(max_sequence_length=16)  # klein pads prompts to 512 tokens by default: 16 keeps the tests fast


def picture(w=56, h=72, seed=0) -> Image.Image:
    """72 x 56: floored to 64 x 48 (multiples of 16) for the output, as the stock pipeline."""
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def mask_image(w=56, h=72) -> Image.Image:
    m = np.zeros((h, w), "uint8")
    m[10:40, 8:30] = 255  # white = repaint
    return Image.fromarray(m)


def inpaint_pipeline():
    pipe = diffusers.Flux2KleinInpaintPipeline.from_pipe(tiny.pipeline("flux2-klein"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def seeds(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def grabbing():
    """(a callback_on_step_end keeping the latents, what it kept)."""
    got = {}

    def grab(_pipe, i, t, tensors):
        got["latents"] = tensors["latents"]
        return {}

    return grab, got


@pytest.fixture(scope="module")
def pipe():
    return inpaint_pipeline()


@pytest.fixture(scope="module")
def params(pipe):
    return fd.from_diffusers(pipe.transformer)


# (name, stock kwargs, fd.sample kwargs); image and mask as above, 2 steps.
CASES = [
    ("defaults", dict(guidance_scale=1.0), dict()),  # strength 0.8; no CFG (fd.sample's default, see docs)
    (
        "cfg-reference-two-prompts",
        dict(strength=0.5, guidance_scale=3.0, image_reference=picture(40, 24, seed=1), num_images_per_prompt=2),
        dict(strength=0.5, true_cfg=3.0, image_reference=picture(40, 24, seed=1), num_images_per_prompt=2),
    ),
]


@pytest.mark.parametrize("name, stock_kw, our_kw", CASES, ids=[c[0] for c in CASES])
def test_latents_equal_stock_pipeline(pipe, params, name, stock_kw, our_kw):
    prompts = PROMPT if name == "defaults" else ["a red cube", "a small green sphere"]
    n = 1 if name == "defaults" else 4
    kw = dict(image=picture(), mask_image=mask_image(), output_type="latent", **MSL)
    grab, expected = grabbing()
    stock = pipe(prompts, generator=seeds(3, n), num_inference_steps=2, callback_on_step_end=grab, **kw, **stock_kw)
    grab, got = grabbing()
    ours = fd.sample(params, pipe, prompts, steps=2, seed=3, callback_on_step_end=grab, **ASKED, **kw, **our_kw)
    assert ours.shape == stock.images.shape == (n, 4, 8, 6)  # the VAE input of 64 x 48 pixels
    torch.testing.assert_close(got["latents"], expected["latents"], **FP32)
    torch.testing.assert_close(ours, stock.images, **FP32)


def test_inpainting_keeps_the_image_outside_the_mask(pipe, params):
    """After the last blend the tokens where the (bilinear-resized) mask is 0 are exactly
    the argmax-encoded init image's, and the masked ones are generated."""
    grab, got = grabbing()
    fd.sample(params, pipe, PROMPT, image=picture(), mask_image=mask_image(), steps=2, seed=1,
              output_type="latent", **MSL, callback_on_step_end=grab, **ASKED)  # fmt: skip
    pixels = pipe.image_processor.preprocess(picture(), 64, 48)
    init = pipe._pack_latents(pipe._encode_vae_image(pixels, generator=None))
    mask = pipe.prepare_mask_latents(pipe.mask_processor.preprocess(mask_image(), 64, 48), 1, 1, 64, 48, None, "cpu")
    keep = (mask == 0).expand_as(init)
    assert 0 < int(keep.sum()) < keep.numel()
    assert torch.equal(got["latents"][keep], init[keep])
    assert not torch.allclose(got["latents"][~keep], init[~keep])


def test_given_latents_and_padding_mask_crop_equal_stock(pipe, params):
    """``latents=`` (klein's unpacked layout) are the start and the blend's noise, as
    stock; ``padding_mask_crop`` (PIL only): latents through ``callback_on_step_end`` and the
    pasted-back image within one level of 255 (a value on a rounding edge may differ)."""
    start = torch.randn(1, pipe.transformer.config.in_channels, 4, 3, generator=torch.Generator().manual_seed(2))
    kw = dict(image=picture(), mask_image=mask_image(), padding_mask_crop=4, strength=0.9, latents=start, **MSL)
    grab, expected = grabbing()
    stock = pipe(PROMPT, num_inference_steps=2, guidance_scale=1.0, callback_on_step_end=grab, **kw).images[0]
    grab, got = grabbing()
    ours = fd.sample(params, pipe, PROMPT, steps=2, callback_on_step_end=grab, **ASKED, **kw)[0]
    torch.testing.assert_close(got["latents"], expected["latents"], **FP32)
    assert ours.size == stock.size == picture().size  # pasted back into the init image
    assert np.abs(np.asarray(ours, dtype=int) - np.asarray(stock, dtype=int)).max() <= 1


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(mask_image=None), "mask_image: a Flux2KleinInpaintPipeline needs one"),
        (dict(image=None), "image: a Flux2KleinInpaintPipeline needs one"),
        (dict(image="x.png"), "image: expected one PIL image, got 'x.png'"),
        (dict(mask_image=np.zeros((4, 4))), "mask_image: expected one PIL image"),
        (dict(image_reference=[picture()] * 2), "image_reference: expected one PIL image"),
        (dict(strength=1.5), r"strength: expected a number in \[0, 1\], got 1.5"),
        (dict(strength=0), "strength: expected a value > 0 .* got steps=4, strength=0: 0 steps"),
        (dict(padding_mask_crop=-1), "padding_mask_crop: expected None or a non-negative int"),
        (dict(padding_mask_crop=4, output_type="np"), "output_type: expected 'pil' with padding_mask_crop"),
        (dict(kv_cache=True), "kv_cache: a Flux2KleinInpaintPipeline feeds its references every step"),
        (dict(latents=torch.zeros(1, 4, 2, 2)), r"latents: expected shape \(1, 16, 4, 3\)"),
    ],
)
def test_bad_arguments(pipe, params, kw, match):
    args = dict(image=picture(), mask_image=mask_image(), steps=4, seed=0, output_type="latent", **ASKED) | kw
    with pytest.raises(ValueError, match=match):
        fd.sample(params, pipe, PROMPT, **args)


def test_image_reference_is_the_inpainting_pipelines_only():
    klein = tiny.pipeline("flux2-klein")
    with pytest.raises(ValueError, match="image_reference: only a Flux2KleinInpaintPipeline takes it"):
        fd.sample(fd.from_diffusers(klein.transformer), klein, PROMPT, image_reference=picture(), steps=1, **ASKED)


# ----------------------------------------------------------------------------- ranks


def _ranked(rank, world):
    """Inpainting under tp=2 and dp=2 (two prompts: one per dp group), with its
    single-process result."""
    pipe = inpaint_pipeline()
    params = fd.from_diffusers(pipe.transformer)
    kw = dict(image=picture(), mask_image=mask_image(), steps=2, seed=6, output_type="latent", **ASKED, **MSL)
    prompts = ["a red cube", "a small green sphere"]
    out = {"single": fd.sample(params, pipe, prompts, **kw)}
    for axes in (dict(tp=2), dict(dp=2)):
        sharded = sharding.shard_params(params, sharding.make_mesh(**axes, device_type="cpu"))
        out[str(axes)] = fd.sample(sharded, pipe, prompts, **kw)
    return out


def test_tp2_and_dp2_equal_single_process():
    results = spawn(_ranked, 2, timeout=600)
    for r in results:
        for axes in ("{'tp': 2}", "{'dp': 2}"):
            torch.testing.assert_close(r[axes], r["single"], **FP32)
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key  # every rank returns the same latents

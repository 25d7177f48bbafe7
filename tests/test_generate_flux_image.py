"""``generate --image --mask --strength``: FLUX.1 inpainting and Qwen-Image img2img from
tiny pipeline folders saved to disk give the stock ``FluxInpaintPipeline`` /
``QwenImageImg2ImgPipeline`` images, and bad input is one line before anything heavy loads."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image
from test_cli_errors import _pipeline_folder

import weights
from functional_dit import tiny
from functional_dit.__main__ import main

GEN = ["--prompt", "a cube", "--height", "32", "--width", "48", "--steps", "4", "--seed", "3"]


def _files(root):
    img = np.random.default_rng(0).random((40, 56, 3)) * 255
    Image.fromarray(img.astype("uint8")).save(root / "init.png")
    m = np.zeros((40, 56), "uint8")
    m[5:25, 10:40] = 255
    Image.fromarray(m).save(root / "mask.png")
    (root / "not.png").write_bytes(b"no image in here")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen_flux_image")
    _files(root)
    pipe = tiny.pipeline("flux")
    pipe.save_pretrained(str(root / "flux"))
    inpaint = _pipeline_folder(root / "inpaint", "FluxInpaintPipeline", "flux1-tiny")
    img2img = _pipeline_folder(root / "img2img", "FluxImg2ImgPipeline", "flux1-tiny")
    qwen = _pipeline_folder(root / "qwen", "QwenImagePipeline", "qwen-image-tiny")
    tiny.pipeline("qwen-image").save_pretrained(str(root / "qwen-full"))
    return dict(
        root=str(root),
        flux=str(root / "flux"),
        inpaint=inpaint,
        img2img=img2img,
        qwen=qwen,
        pipe=pipe,
        qwen_full=str(root / "qwen-full"),
    )


def test_inpainting_writes_the_stock_image(folders, tmp_path):
    root, out = folders["root"], tmp_path / "inpainted.png"
    argv = ["generate", "--model", folders["flux"], *GEN, "--image", f"{root}/init.png", "--mask", f"{root}/mask.png"]
    assert main([*argv, "--strength", "0.8", "--out", str(out)]) == 0
    stock = diffusers.FluxInpaintPipeline.from_pipe(folders["pipe"])
    expected = stock(
        "a cube", image=Image.open(f"{root}/init.png").convert("RGB"), mask_image=Image.open(f"{root}/mask.png"),
        strength=0.8, height=32, width=48, num_inference_steps=4, generator=torch.Generator().manual_seed(3),
    ).images[0]  # fmt: skip
    diff = np.abs(np.asarray(Image.open(out), dtype=int) - np.asarray(expected, dtype=int))
    assert diff.max() <= 1  # latents within 1e-5 of stock; a pixel on a rounding edge may move one level


def test_qwen_img2img_writes_the_stock_image(folders, tmp_path):
    root, out = folders["root"], tmp_path / "qwen.png"
    argv = ["generate", "--model", folders["qwen_full"], *GEN, "--image", f"{root}/init.png", "--strength", "0.7"]
    assert main([*argv, "--out", str(out)]) == 0
    stock = diffusers.QwenImageImg2ImgPipeline.from_pretrained(folders["qwen_full"])
    expected = stock(
        "a cube", image=Image.open(f"{root}/init.png").convert("RGB"), strength=0.7, height=32, width=48,
        num_inference_steps=4, generator=torch.Generator().manual_seed(3),
    ).images[0]  # fmt: skip
    diff = np.abs(np.asarray(Image.open(out), dtype=int) - np.asarray(expected, dtype=int))
    assert diff.max() <= 1  # latents within 1e-5 of stock; a pixel on a rounding edge may move one level


CASES = [  # (argv with {placeholders}, the line's expected text)
    (
        ["--model", "{flux}", "--strength", "1.5", "--image", "{root}/init.png"],
        "--strength: expected a number in (0, 1]",
    ),
    (["--model", "{flux}", "--strength", "0", "--image", "{root}/init.png"], "--strength: expected a number in (0, 1]"),
    (["--model", "{flux}", "--mask", "{root}/mask.png"], "--image: img2img and inpainting take one init image, got 0"),
    (
        ["--model", "{flux}", "--strength", "0.5", "--image", "{root}/init.png", "{root}/init.png"],
        "--image: img2img and inpainting take one init image, got 2",
    ),
    (
        ["--model", "{flux}", "--image", "{root}/init.png", "--mask", "{root}/not.png"],
        "--mask: {root}/not.png is not an",
    ),
    (["--model", "{flux}", "--image", "{root}/init.png", "--mask", "{root}/no.png"], "--mask: {root}/no.png does not"),
    (["--model", "{qwen}", "--strength", "0.5"], "--image: img2img and inpainting take one init image, got 0"),
    (["--model", "{inpaint}", "--image", "{root}/init.png"], "--mask: a FluxInpaintPipeline inpaints; pass the mask"),
    (["--model", "{flux}", "--image", "{root}/init.png"], "--image: a FluxPipeline takes no reference image"),
    (
        ["--model", "{img2img}", "--image", "{root}/init.png", "--mask", "{root}/mask.png"],
        "--mask: a FluxImg2ImgPipeline takes no mask (img2img); drop --mask or use an inpainting pipeline",
    ),
    (["--model", "{img2img}", "--strength", "0.5"], "--image: img2img and inpainting take one init image, got 0"),
]


@pytest.mark.parametrize("argv, match", CASES, ids=[c[1][:40] for c in CASES])
def test_refuses_before_loading_anything(folders, tmp_path, capsys, monkeypatch, argv, match):
    def heavy(*args, **kw):
        raise AssertionError("the pipeline was loaded before the error")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", heavy)
    monkeypatch.setattr(weights, "load", heavy)
    fill = lambda s: s.format(**folders)  # noqa: E731
    out = tmp_path / "x.png"
    code = main(["generate", *[fill(a) for a in argv], "--prompt", "a cube", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert fill(match) in err, err
    assert not out.exists()


def test_prompts_file_refuses_strength(folders, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cube\n")
    argv = ["generate", "--model", folders["flux"], "--prompts", str(prompts), "--out-dir", str(tmp_path / "o")]
    code = main([*argv, "--image", f"{folders['root']}/init.png", "--strength", "0.5"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--strength: img2img and inpainting run with --prompt (one image), not --prompts" in err, err

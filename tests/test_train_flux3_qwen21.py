"""The trainer on FLUX.3 (the base model) and Qwen-Image 2.1, as users run it
(``--pipeline tiny:<kind>``, in-process ``main``): a few steps give finite losses and a
LoRA that moved from its initialisation; the stock pipeline (the modular
Flux3ModularPipeline, QwenImage21Pipeline) loads the file with ``load_lora_weights`` and
gives what our merged LoRA gives (fp32 1e-5), which differs from the pipeline without it.
FLUX.3's flow map (step-distilled) is refused naming --pipeline."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from _train_data import image_folder, one_thread

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import tiny
from functional_dit.train import main

FP32 = dict(rtol=1e-5, atol=1e-5)  # diffusers' PEFT layers vs our merged weights: fp32 sums in another order
ARGS = ["--resolution", "32", "--max-sequence-length", "64", "--rank", "2", "--alpha", "4", "--batch-size", "2"]
ARGS += ["--lr", "2e-2", "--checkpoint-every", "4", "--steps", "4", "--dtype", "float32", "--no-progress"]
CALLS = {  # the stock pipelines' own calls (the tiny FLUX.3 encoder's stacked layers named, as fd.sample reads them)
    "flux3": dict(height=32, width=32, num_inference_steps=2, text_encoder_out_layers=tiny.FLUX3_LAYERS),
    "qwen-image-2.1": dict(height=64, width=64, num_inference_steps=2),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """Four 40x48 PNGs (cropped to 32x32) with captions of different lengths."""
    folder = image_folder(
        tmp_path_factory.mktemp("images"),
        ("a red square", "a blue circle on grass", "stripes", "a yellow dot"),
        hw=(40, 48),
    )
    return folder


one_thread = pytest.fixture(one_thread)


@pytest.mark.parametrize("kind", ["flux3", "qwen-image-2.1"])
def test_trains_and_the_stock_pipeline_loads_the_file(data, tmp_path, one_thread, kind):
    out = str(tmp_path / kind)
    extra = ["--caption-dropout", "0.5", "--trigger", "sks"]  # the empty caption's row padded to the others'
    got = main(["--pipeline", f"tiny:{kind}", "--data", data, "--output-dir", out, *ARGS, *extra])
    assert len(got["losses"]) == 4 and all(math.isfinite(x) for x in got["losses"]), got
    assert math.isfinite(got["eval_loss_after"]) and got["eval_loss_after"] != got["eval_loss_before"], got
    params = fd.from_diffusers(tiny.stock_transformer(kind, seed=0))
    trained, fresh = lora.load(out, params), lora.init(params, rank=2, alpha=4, seed=0)
    moved = [(trained.flat()[p] - v).abs().max().item() for p, v in fresh.flat().items()]
    assert max(moved) > 1e-3, moved  # the LoRA changed
    _check_stock_loads(out, kind, lora.merge(params, trained))
    if kind == "qwen-image-2.1":
        _check_latents_are_the_pipelines(out, data)


def _check_latents_are_the_pipelines(out: str, data: str) -> None:
    """The cached latent of an image is the packed latent QwenImage21Pipeline makes of it as
    a condition image (RGBA, normalised, flattened)."""
    from safetensors.torch import load_file

    from functional_dit.train._buckets import image_tensor

    key = json.load(open(os.path.join(out, "cache", "key.json")))
    name, hw, file = key["images"][0]
    assert (name, hw) == ("0.png", [32, 32]), key["images"][0]
    cached = load_file(os.path.join(out, "cache", file))["latent"]
    pipe, img = tiny.pipeline("qwen-image-2.1", seed=0), image_tensor(os.path.join(data, "0.png"), (32, 32))[None]
    rgba = torch.cat([img, torch.ones_like(img[:, :1])], 1)[:, :, None]
    _, theirs = pipe.prepare_latents([rgba], 1, pipe.latent_channels, 32, 32, torch.float32, "cpu", None)
    torch.testing.assert_close(cached, theirs[0], rtol=0, atol=0)


def _latents(pipe, kind: str) -> torch.Tensor:
    out = pipe(prompt="a red square", output_type="latent", generator=torch.Generator().manual_seed(3), **CALLS[kind])
    return out.get("latents") if kind == "flux3" else out.images


def _check_stock_loads(folder: str, kind: str, merged) -> None:
    stock = tiny.pipeline(kind, seed=0)
    plain = _latents(stock, kind)
    stock.load_lora_weights(folder)  # the user's call: diffusers + PEFT read our file
    theirs = _latents(stock, kind)
    module = tiny.stock_transformer(kind, seed=0)
    module.load_state_dict(fd.to_state_dict(merged))
    ours = _latents(tiny.pipeline(kind, seed=0, transformer=module), kind)
    torch.testing.assert_close(theirs, ours, **FP32)
    assert (theirs - plain).abs().max() > 1e-3  # the trained LoRA changes the output


def test_the_flow_map_is_refused_naming_the_pipeline(data, tmp_path, capsys):
    """The step-distilled FLUX.3 learns jumps to a target timestep, not the velocity: refused
    before anything loads (a pipeline whose transformer has flow_map=True, too)."""
    from functional_dit.train._data import check_trainable

    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        main(["--pipeline", "tiny:flux3-distilled", "--data", data, "--output-dir", str(out), *ARGS])
    err = capsys.readouterr().err
    assert e.value.code == 2 and not out.exists(), err
    assert "--pipeline: FLUX.3's flow map (step-distilled, flow_map=True) is not trainable here" in err, err
    assert "expected the base model (Flux3ModularPipeline, tiny:flux3), got 'tiny:flux3-distilled'" in err, err
    with pytest.raises(ValueError, match=r"--pipeline: FLUX.3's flow map .* got a Flux3DistilledModularPipeline"):
        check_trainable(tiny.pipeline("flux3-distilled", seed=0))


def test_qwen_image_21_needs_a_resolution_multiple_of_32(data, tmp_path, capsys):
    """Its x16 VAE and 2x2 image slots: 48 is refused before anything loads."""
    out = tmp_path / "o"
    args = ["--pipeline", "tiny:qwen-image-2.1", "--data", data, "--output-dir", str(out), *ARGS, "--resolution", "48"]
    with pytest.raises(SystemExit):
        main(args)
    err = capsys.readouterr().err
    assert "--resolution: expected a multiple of 32 for Qwen-Image 2.1, got 48" in err
    assert not out.exists()


def test_a_saved_flux3_folder_trains(data, tmp_path, one_thread):
    """A FLUX.3 folder is a modular pipeline's (modular_model_index.json, no model_index.json):
    it loads as one and trains to the same first loss as ``tiny:flux3``, the same pipeline."""
    folder = str(tmp_path / "flux3")
    tiny.pipeline("flux3", seed=0).save_pretrained(folder, overwrite_modular_index=True)
    args = ["--data", data, *ARGS, "--steps", "1", "--checkpoint-every", "1"]
    saved = main(["--pipeline", folder, "--output-dir", str(tmp_path / "a"), *args])
    direct = main(["--pipeline", "tiny:flux3", "--output-dir", str(tmp_path / "b"), *args])
    assert math.isfinite(saved["losses"][0]) and saved["losses"] == direct["losses"], (saved, direct)

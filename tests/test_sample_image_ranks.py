"""`fd.sample` with reference images on 2 gloo ranks: ``FluxKontextPipeline``,
``QwenImageEditPlusPipeline`` (two references) and ``QwenImageLayeredPipeline`` under tp=2
and dp=2, against the single-process result and the stock pipeline (stock transformer,
same seed). Each pipeline runs a two-image case (dp splits the images) and a one-image
true-CFG case (dp splits the [cond; uncond] batch).

The reference / output areas are set small on both sides (the tiny VAEs are slow at the
stock 1024²); the single-process tests check the constants equal stock's. The stock
latents are captured at the last step through ``callback_on_step_end``.
"""

from __future__ import annotations

import diffusers.pipelines.flux.pipeline_flux_kontext as kontext_module
import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus_module
import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as layered_module
import torch
from _dist import spawn
from test_sample_flux_image import init_image, seeds, stock_run
from test_sample_qwen_image import layered_pipeline, start_image

import functional_dit as fd
import sharding
from functional_dit import tiny
from functional_dit.pipelines.families.qwenimage import _image as _sample_qwen_image

# The bound (fp32, atol/rtol 1e-5); measured ≤ 1.7e-6 (docs/sampling.md). Not bitwise: one
# thread per rank and the sharded matmuls sum in another order, and Qwen-Image's attention
# rounds differently from the stock transformer's.
FP32 = dict(rtol=1e-5, atol=1e-5)
LAYERED_SIZE = layered_module.calculate_dimensions
CFG = dict(true_cfg=2.0, negative_prompt="blurry")


def small_areas(setattr_):
    """Kontext's preferred reference sizes, Edit-Plus' VAE area and Layered's output area
    made small, on the stock module and (where it keeps its own) on ours alike."""
    setattr_(kontext_module, "PREFERRED_KONTEXT_RESOLUTIONS", [(48, 32), (32, 48), (48, 48)])
    setattr_(edit_plus_module, "VAE_IMAGE_SIZE", 64 * 64)
    setattr_(_sample_qwen_image, "VAE_AREA", 64 * 64)
    setattr_(layered_module, "calculate_dimensions", lambda area, ratio: LAYERED_SIZE(48 * 48, ratio))


def pipelines() -> dict:
    pipes = {
        "kontext": tiny.pipeline("flux-kontext"),
        "edit-plus": tiny.pipeline("qwen-image-edit-plus"),
        "layered": layered_pipeline(),
    }
    for p in pipes.values():
        p.set_progress_bar_config(disable=True)
    return pipes


def layered_size() -> dict:
    w, h = layered_module.calculate_dimensions(640 * 640, start_image().size[0] / start_image().size[1])
    return dict(height=h, width=w)


def cases() -> list:
    """(name, pipeline, prompts, fd.sample kwargs); every case runs 2 steps at seed 3."""
    kontext = dict(image=init_image(), height=32, width=48, max_area=40 * 40, guidance=2.5)
    edit = dict(image=[start_image(), start_image(40, 64, 1)], height=32, width=32)
    layered = dict(image=start_image(), layers=2, **layered_size())
    two = dict(num_images_per_prompt=2)
    return [
        ("kontext-two", "kontext", ["a red cube", "a small green sphere"], kontext),
        ("kontext-cfg", "kontext", "a red cube", kontext | CFG),
        ("edit-plus-two", "edit-plus", "a red cube", edit | two),
        ("edit-plus-cfg", "edit-plus", "a red cube", edit | CFG),
        ("layered-two", "layered", "a red cube", layered | two),
        ("layered-cfg", "layered", "a red cube", layered | CFG),
    ]


def ours(params, pipe, prompts, kw) -> torch.Tensor:
    return fd.sample(params, pipe, prompts, steps=2, seed=3, output_type="latent", **kw)


def stock(pipe, prompts, kw) -> torch.Tensor:
    """The stock pipeline's last latents for the same job (image i seeded by 3 + i)."""
    kw = dict(kw)
    n = (len(prompts) if isinstance(prompts, list) else 1) * kw.get("num_images_per_prompt", 1)
    if "guidance" in kw:
        kw["guidance_scale"] = kw.pop("guidance")
    kw["true_cfg_scale"] = kw.pop("true_cfg", 1.0)  # Qwen's stock 4.0 is inert without a negative prompt
    if type(pipe).__name__ == "QwenImageLayeredPipeline":  # sized by calculate_dimensions; "latent" fails there
        kw = {k: v for k, v in kw.items() if k not in ("height", "width")} | dict(output_type="np")
    else:
        kw["output_type"] = "latent"
    return stock_run(pipe, prompt=prompts, generator=seeds(3, n), num_inference_steps=2, **kw)[0]


def _ranked(rank, world):
    """Every case under tp=2 and dp=2, with the batch of each model call (``fd.apply``
    looked up when called, as the sampler does)."""
    small_areas(setattr)
    pipes, out, calls, apply = pipelines(), {}, [], fd.api.apply

    def spy(p, x, *a, **k):
        calls.append(x.shape[0])
        return apply(p, x, *a, **k)

    fd.api.apply = spy
    for axes in (dict(tp=2), dict(dp=2)):
        mesh = sharding.make_mesh(**axes, device_type="cpu")
        sharded = {k: sharding.shard_params(fd.from_diffusers(p.transformer), mesh) for k, p in pipes.items()}
        for name, which, prompts, kw in cases():
            out[f"{name} {axes}"] = ours(sharded[which], pipes[which], prompts, kw)
            out[f"{name} {axes} calls"], calls[:] = list(calls), []
    return out


def test_tp2_and_dp2_equal_single_process_and_stock(monkeypatch):
    results = spawn(_ranked, 2, timeout=600)
    small_areas(monkeypatch.setattr)
    pipes = pipelines()
    for name, which, prompts, kw in cases():
        pipe = pipes[which]
        single = ours(fd.from_diffusers(pipe.transformer), pipe, prompts, kw)
        expected = stock(pipe, prompts, kw)
        torch.testing.assert_close(single, expected, **FP32)
        for axes in ("{'tp': 2}", "{'dp': 2}"):
            key = f"{name} {axes}"
            # dp splits two images into one per group; one image with CFG is one batch of
            # [cond; uncond] per step, which fd.apply splits over dp (one branch per rank)
            batch = 1 if name.endswith("-two") and "dp" in axes else 2
            assert [r[key + " calls"] for r in results] == [[batch, batch]] * 2, key
            torch.testing.assert_close(results[0][key], single, **FP32, msg=lambda m, key=key: f"{key}: {m}")
            torch.testing.assert_close(results[0][key], expected, **FP32, msg=lambda m, key=key: f"{key}: {m}")
    for key in [k for k in results[0] if not k.endswith(" calls")]:
        assert torch.equal(results[0][key], results[1][key]), key  # every rank returns the same latents

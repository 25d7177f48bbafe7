"""``check --device DEV --sample``: ``fd.sample`` end to end on the device for each
family's tiny pipeline, against the same call on the CPU.

Two images per case, the second with another seed and another step count. Each runs
the fixed-graph loop (`functional_dit.pipelines.sampler_xla`) in its strict mode (any host read
of tensor data inside a step raises). On torch_xla it reports, per image, the XLA
compilations and executions inside the loop and in the whole call, and the
device-to-host transfers inside the loop (``torch_xla.debug.metrics``); image 2 must
compile nothing, the loop must compile once (twice with FLUX.2's reference KV cache or
Qwen-Image 2.1's prefix cache: the extracting first step), transfer nothing, and no ``aten::`` op may fall back.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from .. import api as _api
from ..pipelines import sampler_xla as _sample_xla
from ..pipelines import tiny
from ..pipelines.sampler import sample
from . import _xla_metrics as _metrics

IMAGES = ((0, 3), (1, 4))  # (seed, steps) of image 1 and image 2


def _ref_image(w: int = 80, h: int = 64):
    """A fixed noise picture (FLUX.2's processor needs 64 px a side)."""
    return Image.fromarray((np.random.default_rng(0).random((h, w, 3)) * 255).astype("uint8"))


def _mask(w: int = 80, h: int = 64):
    """White (repaint) in the right half's upper part, black elsewhere."""
    a = np.zeros((h, w), dtype="uint8")
    a[8:40, 40:72] = 255
    return Image.fromarray(a)


def _inpaint() -> dict:
    return dict(image=_ref_image(), mask_image=_mask(), strength=0.6)  # 2 of 3, then 3 of 4 steps


def cases() -> list[tuple[str, str, dict]]:
    """(name, tiny pipeline kind[:pipeline class], fd.sample kwargs): every model path of
    the fixed loop."""
    return [
        ("flux1-dev", "flux", dict(guidance=4.0)),
        ("flux1-inpaint", "flux:FluxInpaintPipeline", _inpaint()),
        ("flux1-true-cfg", "flux", dict(true_cfg=2.0, negative_prompt="blurry")),
        ("flux2-dev-ref", "flux2", dict(image=_ref_image())),
        ("flux2-klein-cfg", "flux2-klein", dict(true_cfg=4.0)),
        ("flux2-klein-kv-ref", "flux2-klein-kv", dict(image=_ref_image())),
        ("flux2-klein-inpaint", "flux2-klein:Flux2KleinInpaintPipeline", _inpaint()),
        ("qwen-image-cfg", "qwen-image", dict(true_cfg=4.0, negative_prompt="blurry, low quality")),
        ("qwen-inpaint", "qwen-image:QwenImageInpaintPipeline", _inpaint()),
        ("flux3-cfg", "flux3", dict(true_cfg=3.5, negative_prompt="")),
        ("flux3-flow-map", "flux3-distilled", {}),
        ("qwen-image-2.1-kv-cfg", "qwen-image-2.1", dict(true_cfg=3.0, negative_prompt="blur")),
        ("qwen-image-2.1", "qwen-image-2.1", dict(kv_cache=False)),
    ]


TWO_GRAPHS = ("flux2-klein-kv", "qwen-image-2.1")  # a KV cache's extracting first step is its own graph


def _counts(met) -> dict:
    if met is None:
        return {}
    # optional: torch_xla, XLA devices only
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()
    data = met.metric_data("CompileTime")
    return {"compiles": 0 if data is None else data[0]}


def _image(pipe, params, dev_params, kw, seed, steps, met, scan=False) -> dict:
    """One image on the CPU and on the device: error, scale and the device counters."""
    args = dict(height=32, width=32, steps=steps, seed=seed, output_type="latent", **kw)
    with torch.no_grad():
        want = sample(params, pipe, "a red cube", **args).float()
        record, before = [], _counts(met)
        with _sample_xla.static(strict=True, record=record, scan=scan):
            got = sample(dev_params, pipe, "a red cube", **args)
        after = _counts(met)
        err = (got.cpu().float() - want).abs().max().item()
    out = dict(err=err, scale=want.abs().max().item(), loop=record[-1] if record else {})
    if met is not None:
        out["call_compiles"] = after["compiles"] - before["compiles"]
    return out


def _pipeline(kind: str):
    """The tiny pipeline of ``kind`` (``kind:Class``: that diffusers pipeline on its components)."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    kind, _, cls = kind.partition(":")
    pipe = tiny.pipeline(kind)
    return (getattr(diffusers, cls).from_pipe(pipe) if cls else pipe), tiny.transformer_config(kind)


def check_case(kind: str, kw: dict, device, dtype, tol: float, met, scan: bool = False) -> dict:
    """Images 1 and 2 of one case; ``ok`` when both agree and compile as required;
    ``scan``: with the block segments scanned (`sampler_xla.static`)."""
    pipe, config = _pipeline(kind)
    params = _api.init(config, seed=0, dtype=dtype)
    dev_params = _api.init(config, seed=0, dtype=dtype, device=device)
    if met is not None:
        met.clear_all()
    images = [_image(pipe, params, dev_params, kw, s, n, met, scan) for s, n in IMAGES]
    fallbacks = [n for n in met.counter_names() if n.startswith("aten::")] if met is not None else []
    ok = all(r["err"] <= tol * max(1.0, r["scale"]) for r in images) and not fallbacks
    if met is not None:
        once = 2 if kind in TWO_GRAPHS and kw.get("kv_cache", True) else 1
        first, second = images
        ok &= first["loop"]["compiles"] <= once and second["call_compiles"] == 0 and second["loop"]["compiles"] == 0
        ok &= all(r["loop"]["transfers"] == 0 for r in images)
    return dict(ok=ok, images=images, fallbacks=fallbacks)


def _line(i: int, r: dict, tol: float) -> str:
    seed, steps = IMAGES[i]
    steps = r["loop"].get("steps", steps)  # img2img / inpainting run the cut schedule's
    text = f"image {i + 1} (seed {seed}, {steps} steps): max|err| {r['err']:.2e} (scale {r['scale']:.2f}, tol {tol:g})"
    loop = r["loop"]
    if "compiles" in loop:
        text += (
            f", compiles {loop['compiles']} in the loop / {r['call_compiles']} in the call, "
            f"executions {loop['executions']}, host transfers in the loop {loop['transfers']}"
        )
    if loop.get("scanned"):
        text += ", blocks scanned"
    return text


def run(device, dtype, tol: float, scan: bool = False, only: str | None = None) -> bool:
    """Every case (``only``: those whose name contains it); prints one block per case and
    returns whether all passed."""
    met = _metrics.xla() if torch.device(device).type == "xla" else None
    picked = [c for c in cases() if only is None or only in c[0]]
    if not picked:
        raise ValueError(f"only: no case name contains {only!r}; expected part of one of {[c[0] for c in cases()]}")
    ok = True
    for name, kind, kw in picked:
        r = check_case(kind, kw, device, dtype, tol, met, scan)
        ok &= r["ok"]
        print(f"{name:<20} {'ok' if r['ok'] else 'FAIL'}")
        for i, image in enumerate(r["images"]):
            print(f"    {_line(i, image, tol)}")
        print(f"    aten:: fallbacks: {r['fallbacks'] or 'none'}")
    return ok

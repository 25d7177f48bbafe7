"""Old tree against new tree: a fixed list of ``fd.sample`` cases on the offline tiny
models (`functional_dit.tiny`), each result saved under its case name, and a compare mode
that says, case by case, whether two runs are bitwise equal.

A refactor that must change no result runs it on the old commit and on the new tree, with
this one script (the new tree's copy) for both::

    git worktree add /tmp/old <commit>
    PYTHONPATH=/tmp/old python examples/sample_equivalence.py --out /tmp/eq-old
    PYTHONPATH=. python examples/sample_equivalence.py --out /tmp/eq-new
    python examples/sample_equivalence.py --compare /tmp/eq-old /tmp/eq-new
    git worktree remove /tmp/old

(run both from the new tree's root with ``OMP_NUM_THREADS=1`` and the same torch on the
same machine: bitwise holds for the same ops in one environment, not across CPUs.)
``--out DIR`` writes ``DIR/<case>.pt``: the result as a float tensor (``output_type="pt"``
images, ``"latent"`` latents, PIL images as (N, H, W, 3) floats), or the error a case
raised. ``--compare A B`` prints each case as ``equal``, its max abs difference, a shape
change, an error or a missing file, and exits 1 unless every case is bitwise equal.
``--only SUBSTRING`` runs the matching cases only, ``--list`` names them.

The cases (2 steps, 32x32 or the smallest size a pipeline takes; 4 steps where a step
cache must skip): every text-to-image family (FLUX.1 dev and schnell, FLUX.2 dev, klein,
Qwen-Image, FLUX.3 and its flow map, Qwen-Image 2.1) with true CFG, a list of prompts,
``batch_size``, one ``torch.Generator``, LoRA per prompt, the four step caches, a step
callback that changes the latents, ``output_type="latent"`` and the fixed-graph loop
(`functional_dit.pipelines.sampler_xla.static`); FLUX.1 img2img and inpainting (CFG,
``padding_mask_crop``, a cache, a generator), Kontext, FLUX.2 and klein references (with
a cache), the klein KV cache, klein inpainting with a reference, Qwen-Image img2img and
inpainting, Qwen-Image-Edit and Edit-Plus (their references are resized to ~1024², the
slow cases), and both ControlNets. tests/test_sample_equivalence.py runs a few of them
twice in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import pathlib
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import diffusers
import numpy as np
import torch
from PIL import Image

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import controlnet as C
from functional_dit import tiny
from functional_dit.pipelines import sampler_xla

PROMPT = "a red cube on a table"
TWO = ["a red cube", "a small green sphere resting on a wooden table"]
THREE = [*TWO, "a blue ball"]
CACHES = {  # 4 steps: each skips some model calls there
    "fbcache": "fbcache:2.0",  # the tiny models' first-block change is large: 2.0 skips
    "taylorseer": "taylorseer:interval=2,warmup=1",
    "fastercache": "fastercache:skip=2,weight=0.3,low=-1,high=950",
    "magcache": "magcache:0.5",
}


class Case(NamedTuple):
    name: str
    kind: str  # a tiny kind, or one of `IMAGE_PIPELINES`' keys
    prompt: object
    kw: Callable[[fd.Params], dict]  # fd.sample's keywords, built afresh each run (generators, adapters)
    static: bool = False  # inside sampler_xla.static(): the fixed-graph loop


def picture(w=56, h=72, seed=0) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def mask(w=56, h=72) -> Image.Image:
    m = np.zeros((h, w), "uint8")
    m[10:40, 8:30] = 255  # white = repaint
    return Image.fromarray(m)


def shrink(pipe, i, t, tensors) -> dict:
    """A ``callback_on_step_end`` that changes the latents."""
    return {"latents": tensors["latents"] * 0.9}


def _adapters(params, n: int) -> list:
    """``n`` LoRA adapters of rank 2 with non-zero B (so each changes the result)."""
    return [lora.init(params.config, rank=2, seed=1 + i, zero_b=False) for i in range(n)]


def _family_cases(kind: str, size: dict, cfg: dict, base: dict) -> list[Case]:
    """A text-to-image family's cases; ``base`` its every call's keywords (guidance, max
    sequence length), ``cfg`` its true-CFG keywords (empty: a family without CFG)."""
    kw = dict(size, steps=2, seed=3, output_type="pt", **base)
    at = lambda **more: lambda params: {**kw, **more}  # noqa: E731
    cases = [
        Case("plain", kind, PROMPT, at()),
        Case("prompts", kind, TWO, at(seed=[3, 9])),
        Case("batch-size", kind, THREE, at(batch_size=2, seed=5)),
        Case("generator", kind, TWO, lambda p: {**kw, "seed": torch.Generator().manual_seed(7)}),
        Case("lora-per-prompt", kind, TWO, lambda p: {**kw, "lora": [[(a, 1.0)] for a in _adapters(p, 2)]}),
        Case("callback", kind, PROMPT, at(callback_on_step_end=shrink)),
        Case("latent", kind, TWO, at(output_type="latent")),
        Case("static", kind, PROMPT, at(output_type="latent"), static=True),
    ]
    cases += [Case(f"cache-{m}", kind, PROMPT, at(steps=4, cache=spec)) for m, spec in CACHES.items()]
    if cfg:
        cases += [
            Case("cfg", kind, TWO, at(**cfg)),
            Case("cfg-lora", kind, PROMPT, lambda p: {**kw, **cfg, "lora": [(_adapters(p, 1)[0], 0.8)]}),
            Case("cfg-cache", kind, PROMPT, at(steps=4, cache=CACHES["fbcache"], **cfg)),
            Case("cfg-static", kind, TWO, at(output_type="latent", **cfg), static=True),
        ]
    return [c._replace(name=f"{kind}-{c.name}") for c in cases]


def text_cases() -> list[Case]:
    s32, s64 = dict(height=32, width=32), dict(height=64, width=64)
    neg = dict(true_cfg=2.0, negative_prompt="blurry")
    msl = dict(max_sequence_length=64)
    schnell = _family_cases("flux-schnell", s32, {}, msl)
    return [
        *_family_cases("flux", s32, neg, dict(guidance=5.0, **msl)),
        *[c for c in schnell if c.name.split("-", 2)[-1] in ("plain", "prompts", "cache-fbcache", "static")],
        *_family_cases("flux2", s32, {}, dict(guidance=3.0)),
        *_family_cases("flux2-klein", s32, dict(true_cfg=4.0), msl),
        *_family_cases("qwen-image", s32, dict(true_cfg=4.0, negative_prompt="blurry, low quality"), {}),
        *_family_cases("flux3", s32, dict(true_cfg=3.5, negative_prompt=""), {}),
        *[c for c in _family_cases("flux3-distilled", s32, {}, {}) if "cache-" not in c.name],
        *_family_cases("qwen-image-2.1", s64, dict(true_cfg=3.0, negative_prompt="blur"), {}),
    ]


def _flux_image_cases() -> list[Case]:
    kw = dict(height=64, width=48, steps=2, output_type="pt", max_sequence_length=64)
    neg = dict(true_cfg=2.0, negative_prompt="blurry")
    gen = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    inp = dict(image=picture(), mask_image=mask())
    return [
        Case("flux-img2img-cfg", "flux-img2img", TWO, lambda p: dict(kw, image=picture(), strength=0.7, seed=3, **neg)),
        Case("flux-img2img-generator-cache", "flux-img2img", PROMPT,
             lambda p: dict(kw, image=picture(), seed=gen(), steps=4, strength=1.0, cache=CACHES["fbcache"])),
        Case("flux-inpaint-cfg", "flux-inpaint", PROMPT, lambda p: dict(kw, **inp, strength=0.8, seed=3, **neg)),
        Case("flux-inpaint-crop", "flux-inpaint", PROMPT,
             lambda p: dict(kw, **inp, seed=3, padding_mask_crop=8, output_type="pil")),
        Case("flux-inpaint-generator-cache", "flux-inpaint", TWO,
             lambda p: dict(kw, **inp, seed=gen(), steps=4, strength=1.0, cache=CACHES["taylorseer"])),
        Case("flux-kontext", "flux-kontext", PROMPT, lambda p: dict(kw, image=picture(), seed=3, max_area=40 * 40)),
        Case("flux-kontext-no-reference", "flux-kontext", PROMPT, lambda p: dict(kw, seed=3, max_area=40 * 40)),
    ]  # fmt: skip


def _flux2_image_cases() -> list[Case]:
    kw = dict(height=32, width=32, steps=2, seed=3, output_type="pt")
    klein = dict(kw, max_sequence_length=64)
    refs = [picture(80, 64), picture(64, 64, 1)]
    inpaint = dict(klein, image=picture(), mask_image=mask(), image_reference=picture(40, 24, seed=1))
    return [
        Case("flux2-reference", "flux2", PROMPT, lambda p: dict(kw, image=refs[0], guidance=3.0)),
        Case("flux2-klein-references-cfg", "flux2-klein", TWO, lambda p: dict(klein, image=refs, true_cfg=4.0)),
        Case("flux2-klein-reference-cache", "flux2-klein", PROMPT,
             lambda p: dict(klein, image=refs[0], steps=4, cache=CACHES["fbcache"])),
        Case("flux2-klein-kv", "flux2-klein-kv", TWO, lambda p: dict(klein, image=refs[0])),
        Case("flux2-klein-kv-cache", "flux2-klein-kv", PROMPT,
             lambda p: dict(klein, image=refs[0], steps=4, cache=CACHES["fbcache"])),
        Case("flux2-klein-inpaint-reference", "flux2-klein-inpaint", PROMPT, lambda p: dict(inpaint, strength=0.5)),
        Case("flux2-klein-inpaint-reference-cfg", "flux2-klein-inpaint", TWO, lambda p: dict(inpaint, true_cfg=3.0)),
    ]  # fmt: skip


def _qwen_image_cases() -> list[Case]:
    kw = dict(height=32, width=32, steps=2, seed=3, output_type="pt")
    neg = dict(true_cfg=3.0, negative_prompt="blurry")
    start, two = picture(48, 40), [picture(48, 40), picture(48, 40, 1)]
    m = Image.fromarray(np.pad(np.full((16, 16), 255, "uint8"), ((8, 16), (28, 4))))
    return [
        Case("qwen-image-img2img-cfg", "qwen-image-img2img", TWO, lambda p: dict(kw, image=start, **neg)),
        Case("qwen-image-img2img-two-images", "qwen-image-img2img", TWO, lambda p: dict(kw, image=two, strength=0.5)),
        Case("qwen-image-inpaint-cfg", "qwen-image-inpaint", TWO,
             lambda p: dict(kw, image=start, mask_image=m, strength=0.8, **neg)),
        Case("qwen-image-inpaint-cache", "qwen-image-inpaint", PROMPT,
             lambda p: dict(kw, image=start, mask_image=m, steps=4, strength=1.0, cache=CACHES["fbcache"])),
        Case("qwen-image-edit", "qwen-image-edit", PROMPT, lambda p: dict(kw, image=start, **neg)),
        Case("qwen-image-edit-plus", "qwen-image-edit-plus", PROMPT,
             lambda p: dict(kw, image=[start], height=32, width=48, **neg)),
    ]  # fmt: skip


def _controlnet_cases() -> list[Case]:
    kw = dict(height=32, width=32, steps=2, seed=3, output_type="pt", max_sequence_length=64)
    neg = dict(true_cfg=2.0, negative_prompt=["blurry"] * 2)
    cn = lambda kind: lambda p: (C.from_diffusers(tiny_pipeline(kind).controlnet), picture(32, 32), 0.8)  # noqa: E731
    return [
        Case("flux-controlnet-cfg", "flux-controlnet", TWO,
             lambda p: dict(kw, guidance=5.0, controlnet=cn("flux-controlnet")(p), **neg)),
        Case("qwen-image-controlnet-cfg", "qwen-image-controlnet", TWO,
             lambda p: dict(kw, controlnet=cn("qwen-image-controlnet")(p), **neg)),
        Case("qwen-image-controlnet-generator", "qwen-image-controlnet", PROMPT,
             lambda p: dict(kw, seed=torch.Generator().manual_seed(4), controlnet=cn("qwen-image-controlnet")(p))),
    ]  # fmt: skip


def cases() -> list[Case]:
    """Every case, in a fixed order, names unique."""
    out = [*text_cases(), *_flux_image_cases(), *_flux2_image_cases(), *_qwen_image_cases(), *_controlnet_cases()]
    assert len({c.name for c in out}) == len(out), "case names must be unique"
    return out


IMAGE_PIPELINES = {  # kind -> (the tiny kind whose components it shares, the diffusers class)
    "flux-img2img": ("flux", "FluxImg2ImgPipeline"),
    "flux-inpaint": ("flux", "FluxInpaintPipeline"),
    "flux2-klein-inpaint": ("flux2-klein", "Flux2KleinInpaintPipeline"),
    "qwen-image-img2img": ("qwen-image", "QwenImageImg2ImgPipeline"),
    "qwen-image-inpaint": ("qwen-image", "QwenImageInpaintPipeline"),
}


@functools.cache
def tiny_pipeline(kind: str):
    """The tiny pipeline of ``kind`` (seed 0), built once per process."""
    if kind == "flux-schnell":  # FLUX.1 without the guidance embedder
        cfg = fd.config_to_diffusers(dataclasses.replace(tiny.transformer_config("flux"), guidance_embeds=False))
        module = diffusers.FluxTransformer2DModel(**{k: v for k, v in cfg.items() if not k.startswith("_")})
        module.load_state_dict(fd.to_state_dict(fd.init(fd.config_from_diffusers(cfg), seed=0)))
        return tiny.pipeline("flux", transformer=module.eval())
    if kind in IMAGE_PIPELINES:
        base, cls = IMAGE_PIPELINES[kind]
        pipe = getattr(diffusers, cls).from_pipe(tiny_pipeline(base))
        pipe.set_progress_bar_config(disable=True)
        return pipe
    return tiny.pipeline(kind)


@functools.cache
def tiny_params(kind: str) -> fd.Params:
    return fd.from_diffusers(tiny_pipeline(kind).transformer)


def as_tensor(out) -> torch.Tensor:
    """A result as a float tensor (PIL images stacked to (N, H, W, 3))."""
    if isinstance(out, list):
        out = np.stack([np.asarray(im) for im in out])
    return torch.as_tensor(out).float()


def run_case(case: Case) -> torch.Tensor:
    """``fd.sample`` of one case on this process's functional_dit."""
    params, pipe = tiny_params(case.kind), tiny_pipeline(case.kind)
    kw = case.kw(params)
    with sampler_xla.static() if case.static else contextlib.nullcontext():
        out = fd.sample(params, pipe, case.prompt, **kw)
    return as_tensor(out)


def write(out_dir: pathlib.Path, only: str | None) -> int:
    """Runs the cases into ``out_dir``; 1 if any raised."""
    out_dir.mkdir(parents=True, exist_ok=True)
    failed, start = 0, time.perf_counter()
    for case in [c for c in cases() if only is None or only in c.name]:
        t0 = time.perf_counter()
        torch.manual_seed(0)  # nothing should draw from the global generator; if it does, the same draws
        try:
            torch.save({"result": run_case(case)}, out_dir / f"{case.name}.pt")
            print(f"{case.name}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 — recorded, so compare reports it
            failed += 1
            torch.save({"error": f"{type(e).__name__}: {e}"}, out_dir / f"{case.name}.pt")
            print(f"{case.name}: ERROR {type(e).__name__}: {e}", flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s, {failed} errors")
    return int(failed > 0)


def verdict(a: dict | None, b: dict | None) -> tuple[bool, str]:
    """(bitwise equal, what to print) for one case's two saved results."""
    if a is None or b is None:
        return False, f"missing in {'A' if a is None else 'B'}"
    if "error" in a or "error" in b:
        return False, f"error: A {a.get('error', 'ok')!r}, B {b.get('error', 'ok')!r}"
    x, y = a["result"], b["result"]
    if x.shape != y.shape:
        return False, f"shape {tuple(x.shape)} != {tuple(y.shape)}"
    if torch.equal(x, y):
        return True, "equal"
    return False, f"max abs difference {(x.double() - y.double()).abs().max().item():.3g}"


def compare(dir_a: pathlib.Path, dir_b: pathlib.Path) -> int:
    """Prints each case's verdict and the counts; 1 unless every case is bitwise equal."""
    names = sorted({p.stem for p in dir_a.glob("*.pt")} | {p.stem for p in dir_b.glob("*.pt")})
    load = lambda d, n: torch.load(d / f"{n}.pt") if (d / f"{n}.pt").exists() else None  # noqa: E731
    equal = 0
    for name in names:
        ok, text = verdict(load(dir_a, name), load(dir_b, name))
        equal += ok
        print(f"{name}: {text}")
    print(f"{equal} of {len(names)} cases bitwise equal, {len(names) - equal} differ")
    return int(equal != len(names) or not names)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=pathlib.Path, metavar="DIR", help="run the cases, one DIR/<case>.pt each")
    mode.add_argument("--compare", type=pathlib.Path, nargs=2, metavar=("DIR_A", "DIR_B"), help="compare two runs")
    mode.add_argument("--list", action="store_true", help="print the case names")
    ap.add_argument("--only", metavar="SUBSTRING", help="with --out: the cases whose name contains it")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(c.name for c in cases()))
        return 0
    if args.compare:
        return compare(*args.compare)
    return write(args.out, args.only)


if __name__ == "__main__":
    sys.exit(main())

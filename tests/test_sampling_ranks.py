"""``functional_dit.sampling`` with image requests on a mesh and with per-item LoRA.

Image requests, each with or without a per-item LoRA: FLUX.1 img2img, FLUX.1 inpainting
(true CFG, a First-Block Cache, two adapters) and a FLUX.1 ControlNet (true CFG); a klein
request with one reference and one with two (true CFG), over klein's pipeline and over
its reference KV cache pipeline (the cache extracted on the first step); Qwen-Image
img2img and inpainting; klein's inpainting pipeline (a context whose every request is an
image job). One request a step ahead of the others, beside a text-to-image item, stepped
by `sampling.step` until done (3 steps at 32x48):

- in one process: each image request's latents bitwise ``fd.sample`` of that request
  alone with that LoRA (an image request takes its own model calls: the same ops);
- on 2 gloo ranks (one spawn): tp=2, fsdp=2 and sp=2 (params, adapters and the ControlNet
  sharded as ``fd.sample`` takes them), each image request's latents bitwise ``fd.sample``
  alone on the same mesh (same ranks, same ops), within the fp32 tolerance of the
  one-process result, and bitwise the same on both ranks; a rank handed another image,
  strength, seed, prompt or LoRA scale raises the same ValueError as its peer, before any
  step.

The text-to-image item shares its calls with the other text-to-image items only; it is
checked within the fp32 tolerance of ``fd.sample`` alone (its batch is not its own).
"""

from __future__ import annotations

import diffusers
import pytest
import torch
from _dist import spawn
from test_sampling import _mask, _picture  # the same test images as the one-process tests

import functional_dit as fd
import functional_dit.lora as lora
import sharding
from functional_dit import controlnet as C
from functional_dit import sampling, tiny

# fp32: one thread per rank and the sharded matmuls / the fsdp batch split sum in another
# order than one process (the bound of docs/numerics.md; measured in docs/sampling.md)
FP32 = dict(rtol=1e-5, atol=1e-5)
MESHES = (dict(tp=2), dict(fsdp=2), dict(sp=2))
KINDS = ("flux", "flux2-klein", "flux2-klein-kv", "qwen-image", "flux2-klein-inpaint")
CFG = dict(true_cfg=2.0, negative_prompt="blurry")


def _setup(kind: str):
    """(pipeline, params, adapter a, adapter b) of the tiny ``kind`` ("flux2-klein-inpaint":
    klein's inpainting pipeline, an image job of its own)."""
    pipe = tiny.pipeline(kind.removesuffix("-inpaint"))
    if kind == "flux2-klein-inpaint":
        pipe = diffusers.Flux2KleinInpaintPipeline.from_pipe(pipe)
        pipe.set_progress_bar_config(disable=True)
    params = fd.from_diffusers(pipe.transformer)
    a = lora.init(params.config, rank=2, alpha=4.0, seed=1, zero_b=False)
    b = lora.init(params.config, rank=4, seed=2, zero_b=False)
    return pipe, params, a, b


def requests(kind: str, a, b, place=lambda tree: tree) -> list:
    """Per family: image requests (some with a LoRA, one with CFG and a cache), a FLUX.1
    ControlNet request and one text-to-image request (but over klein's inpainting pipeline,
    whose every request is an image job); each runs 3 steps at 32x48. The adapters and the
    ControlNet are ``place``d as the params are."""
    msl = None if kind == "qwen-image" else 32
    R = lambda prompt, seed, **kw: sampling.Request(prompt, 32, 48, 3, seed=seed, max_sequence_length=msl, **kw)  # noqa: E731
    a, b = place(a), place(b)
    if kind == "flux2-klein-inpaint":
        return [
            R("a red cube", 5, image=_picture(80, 64), mask_image=_mask(80, 64), strength=0.8, lora=((a, 0.8),)),
            R("a blue cube", 6, image=_picture(80, 64, 1), mask_image=_mask(80, 64), **CFG),
        ]
    if kind in ("flux2-klein", "flux2-klein-kv"):
        return [
            R("a red cube", 5, image=_picture(80, 64), lora=((a, 0.8),)),
            R("a blue cube", 6, image=[_picture(80, 64, 1), _picture(64, 64, 2)], **CFG),
            R("a cat", 8),
        ]
    reqs = [
        R("a red cube", 5, image=_picture(56, 72), strength=0.7, lora=((a, 0.8),)),
        R("a blue cube", 6, image=_picture(56, 72, 1), mask_image=_mask(56, 72), strength=0.9, **CFG,
          cache="fbcache:0.2", lora=((b, 0.5), (a, 0.3))),
        R("a green cube", 7, image=_picture(56, 72, 2), strength=0.8),
        R("a cat", 8, lora=((a, 1.0),)),
    ]  # fmt: skip
    if kind == "flux":
        cn = place(C.from_diffusers(tiny.stock_controlnet()))
        reqs.append(R("a cow", 9, controlnet=(cn, _picture(48, 32, 3), 0.5), lora=((b, 0.7),), **CFG))
    return reqs


def run_ahead(params, pipe, reqs) -> dict:
    """The first request one step ahead, merged with the rest, stepped until every item is
    done: each request's prompt -> its latents (``output_type="latent"``)."""
    ctx = sampling.context(params, pipe)
    state = sampling.step(params, sampling.init(params, ctx, reqs[:1]))
    state = sampling.merge(state, sampling.init(params, ctx, reqs[1:]))
    finished = []
    while state.items:
        done, state = sampling.split(sampling.step(params, state))
        finished += done.items
    latents = sampling.decode(sampling.State(ctx, tuple(finished)), "latent")
    return {it.request.prompt: x for it, x in zip(finished, latents)}


def alone(params, pipe, r: sampling.Request) -> torch.Tensor:
    """``fd.sample`` of the one request."""
    images = {k: getattr(r, k) for k in ("image", "mask_image", "strength", "controlnet") if getattr(r, k) is not None}
    return fd.sample(
        params, pipe, r.prompt, height=r.height, width=r.width, steps=r.steps, seed=r.seed, true_cfg=r.true_cfg,
        negative_prompt=r.negative_prompt, lora=list(r.lora) or None, output_type="latent",
        max_sequence_length=r.max_sequence_length, cache=r.cache, **images,
    )[0]  # fmt: skip


def _each(params, pipe, a, b, kind: str, place) -> dict:
    """Each request of ``kind``: (its latents from the state, ``fd.sample`` alone's), on
    ``params`` and adapters ``place``d alike."""
    reqs = requests(kind, a, b, place)
    got = run_ahead(params, pipe, reqs)
    return {r.prompt: (got[r.prompt], alone(params, pipe, r)) for r in reqs}


def _check_alone(results: dict, reqs) -> None:
    """Image requests bitwise as alone; the text-to-image one within fp32."""
    for r in reqs:
        got, want = results[r.prompt]
        if r.prepared:
            assert torch.equal(got, want), r.prompt
        else:
            torch.testing.assert_close(got, want, **FP32, msg=lambda m, p=r.prompt: f"{p}: {m}")


@pytest.mark.parametrize("kind", KINDS)
def test_image_requests_with_per_item_lora_equal_fd_sample_alone(kind):
    pipe, params, a, b = _setup(kind)
    _check_alone(_each(params, pipe, a, b, kind, lambda t: t), requests(kind, a, b))


def _diverging(rank, params, pipe) -> dict:
    """What `sampling.init` says when rank 1's request has another image, strength, seed,
    prompt or LoRA scale (the last three on a text-to-image request)."""
    out = {}
    image = dict(image=_picture(56, 72), strength=0.7)
    a = sharding.shard_params(_setup("flux")[2], sharding.local_view(params)[1])
    for what, kw in (
        ("image", image | dict(image=_picture(56, 72, rank))),
        ("strength", image | dict(strength=0.7 + 0.1 * rank)),
        ("seed", dict(seed=5 + rank)),
        ("prompt", dict(prompt=f"a red cube {rank}")),
        ("lora", dict(lora=((a, 0.5 + rank),))),
    ):
        r = sampling.Request(
            **(dict(prompt="a red cube", height=32, width=48, steps=3, seed=5, max_sequence_length=32) | kw)
        )
        try:
            sampling.init(params, sampling.context(params, pipe), [r])
            out[what] = "no error"
        except ValueError as e:
            out[what] = str(e)
    return out


def _ranks(rank, world):
    out = {}
    for axes in MESHES:
        mesh = sharding.make_mesh(**axes, device_type="cpu")
        place = lambda tree, mesh=mesh: sharding.shard_params(tree, mesh)  # noqa: E731
        for kind in KINDS:
            pipe, params, a, b = _setup(kind)
            for prompt, pair in _each(place(params), pipe, a, b, kind, place).items():
                out[(str(axes), kind, prompt)] = pair
            if kind == "flux" and "tp" in axes:
                out["diverging"] = _diverging(rank, place(params), pipe)
    return out


@pytest.mark.slow
def test_image_requests_on_tp2_fsdp2_sp2_equal_fd_sample_alone_and_one_process():
    results = spawn(_ranks, 2, timeout=600)
    worst = dict.fromkeys(map(str, MESHES), 0.0)
    for kind in KINDS:
        pipe, params, a, b = _setup(kind)
        reqs = requests(kind, a, b)
        single = {r.prompt: alone(params, pipe, r) for r in reqs}
        for axes in map(str, MESHES):
            for r in results:
                mine = {p: r[(axes, kind, p)] for p in single}
                _check_alone(mine, reqs)
                for p, want in single.items():
                    torch.testing.assert_close(mine[p][0], want, **FP32, msg=lambda m, k=(axes, kind, p): f"{k}: {m}")
            for p in single:
                assert torch.equal(results[0][(axes, kind, p)][0], results[1][(axes, kind, p)][0]), (axes, kind, p)
                worst[axes] = max(worst[axes], (results[0][(axes, kind, p)][0] - single[p]).abs().max().item())
    print(f"image requests on 2 ranks against one process, max |Δ| on the latents: {worst}")
    for r in results:  # another image, strength, seed, prompt or LoRA scale on one tp rank: the same error on both
        same = "expected the same tensor on every rank, got ranks [0]: "
        assert r["diverging"]["image"].startswith("reference latents (image): " + same), r["diverging"]
        assert r["diverging"]["strength"].startswith("strength: expected the same value on every rank"), r["diverging"]
        assert r["diverging"]["seed"].startswith("latents (seed): " + same), r["diverging"]
        assert r["diverging"]["prompt"].startswith("prompt embeddings (prompt): " + same), r["diverging"]
        assert r["diverging"]["lora"].startswith("lora: expected the same value on every rank"), r["diverging"]

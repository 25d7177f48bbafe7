"""`fd.sample` against the stock diffusers pipelines (stock transformer, same seed) on
the offline tiny pipelines of `functional_dit.tiny`, sharded and CFG-parallel sampling
on 2 gloo ranks, the first-step replication check, and `fd.apply(..., rope=)`.

The stock pipelines' latents are their ``output_type="latent"`` results, which
``fd.sample(..., output_type="latent")`` returns in the same layout: the packed latents
(FLUX.1, FLUX.2-dev, Qwen-Image), klein's unpacked VAE input.
"""

from __future__ import annotations

import dataclasses

import diffusers
import numpy as np
import pytest
import torch
from _dist import spawn
from PIL import Image

import functional_dit as fd
import sharding
from functional_dit import api, tiny

FP32 = dict(rtol=1e-5, atol=1e-5)  # the bound; measured ≤ 2.3e-6 (FLUX.1, FLUX.2-dev bitwise)
SIZE = dict(height=32, width=32)
RAGGED = ["a red cube", "a small green sphere resting on a wooden table by the window"]


def ref_image(w=80, h=64, seed=0) -> Image.Image:
    """FLUX.2's image processor refuses references under 64 px a side."""
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def stock_latents(pipe, seed, n=1, **kw) -> torch.Tensor:
    """The stock pipeline's ``output_type="latent"`` result with image i seeded by seed + i
    (what ``fd.sample(..., seed=seed)`` draws), or ``generator=`` as given in ``kw``."""
    kw.setdefault("generator", [torch.Generator().manual_seed(seed + i) for i in range(n)])
    return pipe(**kw, output_type="latent").images


def schnell_pipeline():
    """FluxPipeline with a schnell-style (no guidance embedder) stock transformer."""
    cfg = fd.config_to_diffusers(dataclasses.replace(tiny.transformer_config("flux"), guidance_embeds=False))
    module = diffusers.FluxTransformer2DModel(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    module.load_state_dict(fd.to_state_dict(fd.init(fd.config_from_diffusers(cfg), seed=0)))
    return tiny.pipeline("flux", transformer=module.eval())


# (name, pipeline factory, stock pipeline kwargs, fd.sample kwargs)
CASES = [
    ("flux1-dev", lambda: tiny.pipeline("flux"), dict(guidance_scale=5.0), dict(guidance=5.0)),
    ("flux1-schnell", schnell_pipeline, dict(), dict()),
    (
        "flux1-true-cfg",
        lambda: tiny.pipeline("flux"),
        dict(true_cfg_scale=2.0, negative_prompt="blurry"),
        dict(true_cfg=2.0, negative_prompt="blurry"),
    ),
    ("flux2-dev", lambda: tiny.pipeline("flux2"), dict(guidance_scale=3.0), dict(guidance=3.0)),
    ("flux2-dev-ref", lambda: tiny.pipeline("flux2"), dict(image=ref_image()), dict(image=ref_image())),
    (
        "flux2-klein-cfg-ref",
        lambda: tiny.pipeline("flux2-klein"),
        dict(guidance_scale=4.0, image=[ref_image(), ref_image(64, 64, 1)]),
        dict(true_cfg=4.0, image=[ref_image(), ref_image(64, 64, 1)]),
    ),
    ("flux2-klein-kv", lambda: tiny.pipeline("flux2-klein-kv"), dict(image=ref_image()), dict(image=ref_image())),
    (
        "qwen-image-ragged-cfg",
        lambda: tiny.pipeline("qwen-image"),
        dict(prompt=RAGGED, true_cfg_scale=4.0, negative_prompt="blurry, low quality"),
        dict(prompt=RAGGED, true_cfg=4.0, negative_prompt="blurry, low quality"),
    ),
    (
        "qwen-image-edit",
        lambda: tiny.pipeline("qwen-image-edit"),
        dict(image=ref_image(), true_cfg_scale=2.0, negative_prompt="dark"),
        dict(image=ref_image(), true_cfg=2.0, negative_prompt="dark"),
    ),
]


@pytest.mark.parametrize("name, make, stock_kw, our_kw", CASES, ids=[c[0] for c in CASES])
def test_latents_equal_stock_pipeline(name, make, stock_kw, our_kw):
    pipe = make()
    prompt = stock_kw.pop("prompt", "a red cube on a table")
    our_kw.pop("prompt", None)
    n = len(prompt) if isinstance(prompt, list) else 1
    expected = stock_latents(pipe, 3, n, prompt=prompt, num_inference_steps=2, **SIZE, **stock_kw)
    got = fd.sample(
        fd.from_diffusers(pipe.transformer), pipe, prompt, steps=2, seed=3, output_type="latent", **SIZE, **our_kw
    )
    torch.testing.assert_close(got, expected, **FP32)


def test_images_from_components_mapping_equal_stock_images():
    pipe = tiny.pipeline("flux")
    kw = dict(height=32, width=32)
    expected = pipe("a cube", num_inference_steps=2, generator=torch.Generator().manual_seed(5), **kw).images[0]
    got = fd.sample(fd.from_diffusers(pipe.transformer), tiny.components("flux"), "a cube", steps=2, seed=5, **kw)
    assert isinstance(got[0], Image.Image) and got[0].size == (32, 32)
    assert np.array_equal(np.asarray(got[0]), np.asarray(expected))


def test_pipeline_without_transformer_is_enough():
    comps = tiny.components("qwen-image")
    pipe = diffusers.QwenImagePipeline(**comps, transformer=None)
    params = fd.init(tiny.transformer_config("qwen-image"), seed=0)
    out = fd.sample(params, pipe, "x", steps=1, seed=0, output_type="pt", **SIZE)
    assert out.shape == (1, 3, 32, 32) and 0 <= out.min() and out.max() <= 1


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(height=30), "height: expected a positive multiple of 16"),
        (dict(width=0), "width: expected a positive multiple of 16"),
        (dict(steps=0), "steps: expected a positive int"),
        (dict(seed=1.5), "seed: expected an int"),
        (dict(prompt=""), None),  # an empty prompt is a prompt
        (dict(prompt=[]), "prompt: expected a string or a non-empty list"),
        (dict(output_type="png"), "output_type: expected one of"),
        (dict(image=ref_image()), "image: a FluxPipeline takes no reference image"),
        (dict(kv_cache=True), "kv_cache: the reference KV cache is FLUX.2's"),
        (dict(true_cfg=2.0, negative_prompt=["a", "b"]), "negative_prompt: expected a string or 1 strings"),
    ],
)
def test_bad_arguments(kw, match):
    pipe = tiny.pipeline("flux")
    params = fd.from_diffusers(pipe.transformer)
    args = dict(prompt="a", height=32, width=32, steps=1, seed=0, output_type="latent") | kw
    prompt = args.pop("prompt")
    if match is None:
        fd.sample(params, pipe, prompt, **args)
        return
    with pytest.raises(ValueError, match=match):
        fd.sample(params, pipe, prompt, **args)


def test_encoders_of_another_family_are_refused():
    pipe = tiny.pipeline("flux")
    with pytest.raises(ValueError, match="encoders: a FluxPipeline runs a flux1 transformer, but params are qwen"):
        fd.sample(fd.init(tiny.transformer_config("qwen-image")), pipe, "a", steps=1, seed=0, **SIZE)
    want = "params: expected fd.Params of FLUX.1, FLUX.2, Qwen-Image, FLUX.3 or Qwen-Image 2.1, got dict"
    with pytest.raises(ValueError, match=want):
        fd.sample({}, pipe, "a", steps=1, seed=0, **SIZE)
    with pytest.raises(ValueError, match="encoders: expected a diffusers pipeline or a mapping"):
        fd.sample(fd.from_diffusers(pipe.transformer), "not a pipeline", "a", steps=1, seed=0, **SIZE)


# ----------------------------------------------------------------------------- rope=


def _rope_cases():
    import cases_flux1
    import cases_flux2
    import cases_qwenimage

    return cases_flux1, cases_flux2, cases_qwenimage


def test_apply_with_precomputed_rope_equals_ids():
    c1, c2, _ = _rope_cases()
    p1 = fd.init(c1.TINY, seed=1)
    i1 = c1.inputs(c1.TINY, batch=2, txt_len=5, h=2, w=3, seed=1)
    pe = fd.flux1.rope_table(c1.TINY, i1["img_ids"], i1["txt_ids"])
    no_ids = {k: v for k, v in i1.items() if k not in ("img_ids", "txt_ids")}
    assert torch.equal(fd.apply(p1, **i1), fd.apply(p1, **no_ids, rope=pe))
    with pytest.raises(ValueError, match="rope: replaces img_ids and txt_ids"):
        fd.apply(p1, **i1, rope=pe)
    with pytest.raises(ValueError, match=r"rope\[0\] \(cos\): expected shape \(11, 16\)"):
        fd.apply(p1, **no_ids, rope=tuple(a[1:] for a in pe))

    p2 = fd.init(c2.TINY, seed=2)
    i2 = c2.inputs(c2.TINY, batch=1, txt_len=4, h=2, w=2, seed=2)
    pe2 = fd.flux2.rope_table(c2.TINY, i2["img_ids"], i2["txt_ids"])
    no_ids2 = {k: v for k, v in i2.items() if k not in ("img_ids", "txt_ids")}
    assert torch.equal(fd.apply(p2, **i2), fd.apply(p2, **no_ids2, rope=pe2))
    pk = fd.init(c2.TINY_KLEIN, seed=4)  # KV-cache extract: the table includes the reference rows
    i3 = c2.inputs(c2.TINY_KLEIN, batch=1, txt_len=3, h=2, w=2, seed=3, ref_hw=(2, 3))
    pe3 = fd.flux2.rope_table(c2.TINY_KLEIN, i3["img_ids"], i3["txt_ids"])
    (o1, k1), (o2, k2) = fd.apply(pk, **i3), fd.apply(pk, **{k: v for k, v in i3.items() if "ids" not in k}, rope=pe3)
    assert torch.equal(o1, o2) and all(torch.equal(k1.flat()[n], k2.flat()[n]) for n in k1.flat())


def test_qwen_apply_with_precomputed_rope_equals_shapes():
    pq = fd.init(fd.PRESETS["qwen-image-tiny"], seed=3)
    x, txt = torch.randn(2, 12, 16), torch.randn(2, 5, 32)
    t, shapes = torch.rand(2), [[(1, 2, 4), (1, 2, 2)]] * 2
    pe = fd.qwenimage.pos_embed(shapes[0], 5, pq.config.axes_dims_rope)
    assert torch.equal(fd.apply(pq, x, t, txt, img_shapes=shapes), fd.apply(pq, x, t, txt, img_shapes=shapes, rope=pe))
    with pytest.raises(ValueError, match="rope: expected a"):
        fd.apply(pq, x, t, txt, img_shapes=shapes, rope=pe[0])


# ----------------------------------------------------------------------------- ranks


def _sharded_flux(rank, world):
    """tp=2 and sp=2 give the single-process latents on every rank; a rank with another
    prompt or seed makes every rank raise before the first step."""
    pipe = tiny.pipeline("flux")
    params = fd.from_diffusers(pipe.transformer)
    kw = dict(height=32, width=48, steps=2, seed=11, output_type="latent")
    single = fd.sample(params, pipe, "a red cube", **kw)
    out = {"single": single}
    for axes in (dict(tp=2), dict(sp=2)):
        mesh = sharding.make_mesh(**axes, device_type="cpu")
        out[str(axes)] = fd.sample(sharding.shard_params(params, mesh), pipe, "a red cube", **kw)
    mesh = sharding.make_mesh(tp=2, device_type="cpu")
    sharded = sharding.shard_params(params, mesh)
    for what, change in (("prompt", dict(prompt="a blue cube")), ("seed", dict(seed=12))):
        mine = dict(prompt="a red cube", **kw) | (change if rank == 1 else {})
        try:
            fd.sample(sharded, pipe, mine.pop("prompt"), **mine)
            out[what] = "no error"
        except ValueError as e:
            out[what] = str(e)
    return out


def test_tp2_and_sp2_equal_single_process_and_divergence_raises_everywhere():
    results = spawn(_sharded_flux, 2, timeout=500)
    for r in results:
        for axes in ("{'tp': 2}", "{'sp': 2}"):
            torch.testing.assert_close(r[axes], r["single"], **FP32)
        same = "expected the same tensor on every rank, got ranks [0]: "
        assert r["prompt"].startswith("prompt embeddings (prompt): " + same), r["prompt"]
        assert r["seed"].startswith("latents (seed): " + same), r["seed"]
        assert "; ranks [1]: " in r["prompt"] and "; ranks [1]: " in r["seed"]
    assert torch.equal(results[0]["{'tp': 2}"], results[1]["{'tp': 2}"])


def _cfg_parallel_qwen(rank, world):
    pipe = tiny.pipeline("qwen-image")
    params = fd.from_diffusers(pipe.transformer)
    kw = dict(height=32, width=32, steps=2, seed=4, true_cfg=4.0, negative_prompt="blurry", output_type="latent")
    mesh = sharding.make_mesh(dp=2, device_type="cpu")
    sharded = sharding.shard_params(params, mesh)
    calls = []
    apply = api.apply

    def spy(p, x, *a, **k):  # record the batch each model call gets
        calls.append(x.shape[0])
        return apply(p, x, *a, **k)

    out = {}
    api.apply = spy  # the sampling steps call fd.apply through the api module, looked up per call
    try:
        for name, prompt in (("one", RAGGED[:1]), ("two", RAGGED)):
            out[name] = fd.sample(sharded, pipe, prompt, **kw)
            out[name + " calls"], calls[:] = list(calls), []
    finally:
        api.apply = apply
    out["single one"] = fd.sample(params, pipe, RAGGED[:1], **kw)
    out["single two"] = fd.sample(params, pipe, RAGGED, **kw)
    return out


def test_dp2_cfg_parallel_and_prompt_split_equal_single_process():
    """Qwen-Image true CFG with ragged prompts on dp=2. One prompt: [cond; uncond] is one
    batch of 2 per call, which fd.apply splits over dp (one branch per rank). Two prompts:
    each dp group makes its own prompt, [cond; uncond] batched inside the group."""
    results = spawn(_cfg_parallel_qwen, 2, timeout=500)
    for r in results:
        for name in ("one", "two"):
            torch.testing.assert_close(r[name], r["single " + name], **FP32)
            assert r[name + " calls"] == [2, 2]  # one call per step holding both branches
    assert torch.equal(results[0]["two"], results[1]["two"])

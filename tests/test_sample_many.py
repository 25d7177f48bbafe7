"""`fd.sample` for many images: the stock pipelines' arguments for the job (against the
stock pipelines at the same seeds), per-image seeds that make image i independent of the
batch it is in, distinct prompts over dp groups (dp=2 and dp=2 x tp=2 on gloo ranks), and
ranks that disagree failing together.

Bitwise claims here are made only where every model call has the same shapes
(``batch_size=1``): CPU GEMM kernels pick their blocking by row count, so one image
computed in a batch of 1 and in a batch of 4 differs in the last bits (docs/sampling.md).
"""

from __future__ import annotations

import time

import pytest
import torch
from _dist import spawn
from test_sample import FP32, RAGGED, SIZE, stock_latents

import functional_dit as fd
import sharding
from functional_dit import tiny

PROMPTS = ["a red cube", "a blue sphere", "a green cone on a table", "a dog", "two cats"]
KW = dict(height=32, width=32, steps=2, output_type="latent")


def _params(pipe):
    return fd.from_diffusers(pipe.transformer)


def test_num_images_per_prompt_and_seeds_equal_stock():
    """2 prompts x 2 images: seed=int (image i: seed + i), a list of seeds, a list of
    generators and the one-generator batch noise each equal the stock pipeline's latents."""
    pipe = tiny.pipeline("flux")
    params = _params(pipe)
    stock_kw = dict(prompt=RAGGED, num_images_per_prompt=2, num_inference_steps=2, **SIZE)
    expected = stock_latents(pipe, 7, 4, **stock_kw)
    ours = dict(num_images_per_prompt=2, **KW)
    torch.testing.assert_close(fd.sample(params, pipe, RAGGED, seed=7, **ours), expected, **FP32)
    by_list = fd.sample(params, pipe, RAGGED, seed=[7, 8, 9, 10], **ours)
    gens = fd.sample(params, pipe, RAGGED, seed=[torch.Generator().manual_seed(7 + i) for i in range(4)], **ours)
    assert torch.equal(by_list, gens)
    torch.testing.assert_close(by_list, expected, **FP32)
    batch = stock_latents(pipe, 0, generator=torch.Generator().manual_seed(7), **stock_kw)
    got = fd.sample(params, pipe, RAGGED, seed=torch.Generator().manual_seed(7), **ours)
    torch.testing.assert_close(got, batch, **FP32)
    # the batch noise mode chunked: the same noise rows, so the same images (1e-5: GEMM rows)
    chunked = fd.sample(params, pipe, RAGGED, seed=torch.Generator().manual_seed(7), batch_size=1, **ours)
    torch.testing.assert_close(chunked, batch, **FP32)


def test_image_independent_of_batch_and_chunking():
    """Image i depends on its prompt and seed only: bitwise over chunkings of one image per
    call; within 1e-5 when batched (the GEMMs see another row count)."""
    pipe = tiny.pipeline("qwen-image")
    params = _params(pipe)
    one = [fd.sample(params, pipe, p, seed=20 + i, batch_size=1, **KW) for i, p in enumerate(PROMPTS[:3])]
    chunked = fd.sample(params, pipe, PROMPTS[:3], seed=20, batch_size=1, **KW)
    assert torch.equal(chunked, torch.cat(one))
    later = fd.sample(params, pipe, PROMPTS[1:3], seed=[21, 22], batch_size=1, **KW)
    assert torch.equal(later, chunked[1:])
    batched = fd.sample(params, pipe, PROMPTS[:3], seed=20, **KW)
    torch.testing.assert_close(batched, chunked, **FP32)


def _embeds_case(fam):
    """(pipe, stock kwargs from the pipeline's own encode_prompt, our kwargs) with CFG."""
    pipe = tiny.pipeline(fam)
    if fam == "flux":
        pe, pooled, _ = pipe.encode_prompt(prompt=RAGGED, prompt_2=None)
        npe, npooled, _ = pipe.encode_prompt(prompt=["blurry", "dark"], prompt_2=None)
        kw = dict(prompt_embeds=pe, pooled_prompt_embeds=pooled, negative_prompt_embeds=npe)
        return pipe, kw | dict(negative_pooled_prompt_embeds=npooled), dict(true_cfg_scale=2.0), dict(true_cfg=2.0)
    if fam == "qwen-image":
        pe, mask = pipe.encode_prompt(prompt=RAGGED)
        npe, nmask = pipe.encode_prompt(prompt=["blurry", "dark"])
        kw = dict(prompt_embeds=pe, prompt_embeds_mask=mask, negative_prompt_embeds=npe)
        return pipe, kw | dict(negative_prompt_embeds_mask=nmask), dict(true_cfg_scale=4.0), dict(true_cfg=4.0)
    pe, _ = pipe.encode_prompt(prompt=RAGGED)
    npe, _ = pipe.encode_prompt(prompt=["", ""])
    kw = dict(prompt_embeds=pe, negative_prompt_embeds=npe)
    return pipe, kw, dict(guidance_scale=4.0), dict(true_cfg=4.0)


@pytest.mark.parametrize("fam", ["flux", "flux2-klein", "qwen-image"])
def test_prompt_embeds_without_text_encoders_equal_stock(fam):
    pipe, embeds, stock_cfg, our_cfg = _embeds_case(fam)
    expected = stock_latents(pipe, 5, 2, num_inference_steps=2, **SIZE, **embeds, **stock_cfg)
    comps = {
        k: (None if k.startswith(("text_encoder", "tokenizer", "processor")) else v) for k, v in pipe.components.items()
    }
    got = fd.sample(_params(pipe), comps, None, seed=5, **KW, **embeds, **our_cfg)
    torch.testing.assert_close(got, expected, **FP32)


def test_latents_sigmas_and_step_callback_equal_stock():
    """``latents=`` (FLUX.2 takes them unpacked, Qwen-Image packed), custom ``sigmas`` and a
    ``callback_on_step_end`` that rescales the latents, each against the stock pipeline."""
    sig = [1.0, 0.6, 0.25]

    def shrink(_pipe, i, _t, tensors):
        return {"latents": tensors["latents"] * 0.9} if i == 0 else {}

    for fam, shape in (("flux2", (2, 16, 2, 2)), ("qwen-image", (2, 4, 16))):
        pipe = tiny.pipeline(fam)
        z = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        for our, stock in (
            (dict(latents=z, steps=2), dict(latents=z, num_inference_steps=2)),
            (dict(seed=2, sigmas=sig), dict(sigmas=sig, num_inference_steps=3)),
        ):
            expected = stock_latents(pipe, 2, 2, prompt=RAGGED, **SIZE, **stock)
            got = fd.sample(_params(pipe), pipe, RAGGED, **SIZE, output_type="latent", **our)
            torch.testing.assert_close(got, expected, **FP32)
    expected = stock_latents(pipe, 2, 2, prompt=RAGGED, num_inference_steps=2, **SIZE, callback_on_step_end=shrink)
    got = fd.sample(_params(pipe), pipe, RAGGED, seed=2, callback_on_step_end=shrink, **KW)
    torch.testing.assert_close(got, expected, **FP32)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_sequence_length=513), r"max_sequence_length: expected a positive int ≤ 512 .* got 513"),
        (dict(num_images_per_prompt=0), "num_images_per_prompt: expected a positive int, got 0"),
        (dict(seed=[1, 2]), "seed: expected an int .* 1 ints or 1 torch.Generators"),
        (dict(batch_size=0), "batch_size: expected None or a positive int"),
        (dict(sigmas=[1.0, 0.5], steps=3), r"steps: expected None or len\(sigmas\) = 2, got 3"),
        (dict(latents=torch.zeros(2, 4, 16)), r"latents: expected a tensor with 1 rows \(one per image\)"),
        (
            dict(latents=torch.zeros(1, 4, 64)),
            r"latents: expected shape \(1, 4, 16\) \(FluxPipeline's latents= layout\)",
        ),
        (dict(prompt_embeds=torch.zeros(1, 4, 32), pooled_prompt_embeds=torch.zeros(1, 8)), "prompt: expected None"),
        (dict(prompt=None, prompt_embeds=torch.zeros(1, 4, 32)), "pooled_prompt_embeds: expected with"),
        (dict(prompt=None, prompt_embeds_mask=torch.ones(1, 4)), "prompt_embeds_mask: a flux1 pipeline takes no"),
    ],
)
def test_bad_many_arguments(kw, match):
    pipe = tiny.pipeline("flux")
    args = dict(prompt="a", seed=0, **KW) | kw
    with pytest.raises(ValueError, match=match):
        fd.sample(_params(pipe), pipe, args.pop("prompt"), **args)


def test_qwen_max_sequence_length_as_stock():
    pipe = tiny.pipeline("qwen-image")
    with pytest.raises(ValueError, match="cannot be greater than 1024"):
        pipe("a", max_sequence_length=1025, num_inference_steps=1, **SIZE)
    with pytest.raises(ValueError, match="max_sequence_length: expected a positive int ≤ 1024"):
        fd.sample(_params(pipe), pipe, "a", seed=0, max_sequence_length=1025, **KW)


# ----------------------------------------------------------------------------- ranks


def _many(rank, world, tp):
    """dp=2 (x tp) with 5 prompts (shares 3 and 2), one image per call: every image on
    every rank, the local share, and the rank-dependent checks."""
    pipe = tiny.pipeline("flux")
    params = _params(pipe)
    mesh = sharding.make_mesh(tp=tp, dp=world // tp, device_type="cpu")
    sharded = sharding.shard_params(params, mesh)
    kw = dict(seed=30, batch_size=1, **KW)
    out = {"all": fd.sample(sharded, pipe, PROMPTS, **kw)}
    if tp == 2:  # the local share's indices (dp=2 checks its images too)
        out["local"] = fd.sample(sharded, pipe, PROMPTS, **kw, local=True)
    else:
        out["local"] = fd.sample(sharded, pipe, PROMPTS, **(kw | dict(output_type="pil")), local=True)
        out["local"] = (out["local"][0], [im.tobytes() for im in out["local"][1]])
    if tp == 1:  # a dp group may ask for another guidance: its images follow it
        mine = dict(kw, guidance=5.0 if rank == 1 else 3.5)
        out["per-group guidance"] = fd.sample(sharded, pipe, PROMPTS, **mine)
        return out
    changes = dict(guidance=dict(guidance=4.0), steps=dict(steps=3), height=dict(height=48))
    changes |= dict(true_cfg=dict(true_cfg=2.0), sigmas=dict(sigmas=[1.0, 0.4], steps=None))
    for name, change in changes.items():
        start = time.monotonic()
        try:
            fd.sample(sharded, pipe, PROMPTS, **(kw | (change if rank % 2 else {})))
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
        out[name + " s"] = time.monotonic() - start
    return out


def _tp_reference(rank, world):
    pipe = tiny.pipeline("flux")
    sharded = sharding.shard_params(_params(pipe), sharding.make_mesh(tp=2, device_type="cpu"))
    return fd.sample(sharded, pipe, PROMPTS, seed=30, batch_size=1, **KW)


def _single(output_type="latent"):
    pipe = tiny.pipeline("flux")
    params = _params(pipe)
    return params, pipe, fd.sample(params, pipe, PROMPTS, seed=30, batch_size=1, **(KW | dict(output_type=output_type)))


def test_distinct_prompts_over_dp2_equal_one_process():
    """5 prompts on dp=2 (shares 3 and 2): every image on every rank bitwise equal to one
    process, the local shares, and a dp group asking for another guidance."""
    params, pipe, single = _single()
    five = fd.sample(params, pipe, PROMPTS, seed=30, batch_size=1, **(KW | dict(output_type="pil")))
    dp2 = spawn(_many, 2, 1, timeout=500)
    for r, out in enumerate(dp2):
        assert torch.equal(out["all"], single)  # bitwise: same shapes in every call
        want = [0, 1, 2] if r == 0 else [3, 4]
        assert out["local"] == (want, [five[i].tobytes() for i in want])
    other = fd.sample(params, pipe, PROMPTS[3:], seed=[33, 34], batch_size=1, guidance=5.0, **KW)
    assert torch.equal(dp2[0]["per-group guidance"][:3], single[:3])
    assert torch.equal(dp2[0]["per-group guidance"][3:], other)


def test_dp2_tp2_equals_tp2_and_diverging_ranks_fail_together():
    """dp=2 x tp=2 on 4 ranks: bitwise the tp=2 images (within 1e-5 of one process); a rank
    with another guidance, steps, height, true_cfg or sigmas than its tp partner makes
    every rank raise the same ValueError before the first step."""
    _, _, single = _single()
    tp2 = spawn(_tp_reference, 2, timeout=250)[0]
    torch.testing.assert_close(tp2, single, **FP32)  # tp changes the reduction order
    dp2tp2 = spawn(_many, 4, 2, timeout=450)
    for r, out in enumerate(dp2tp2):
        assert torch.equal(out["all"], tp2)  # dp on top of tp changes nothing
        assert out["local"][0] == ([0, 1, 2] if r < 2 else [3, 4])
        for name in ("guidance", "steps", "height", "true_cfg", "sigmas"):
            assert out[name].startswith(f"{name}: expected the same value on every rank of dp group 0, got"), out[name]
            assert out[name + " s"] < 60  # one check before any step, not a collective timeout
        assert [o["steps"] for o in dp2tp2] == [out["steps"]] * 4  # the same error on every rank

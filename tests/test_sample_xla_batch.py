"""The XLA server's padded, bucketed step (`functional_dit.pipelines.sampler_xla_batch`) on
the CPU, under the lazy-device guard (`sampler_xla.NoHostSync`: any host read of tensor
data inside a step raises).

Items at different steps, with different step counts, seeds, guidance, CFG and adapters,
stepped in buckets 1, 2, 4 as they join and leave: each image within 1 uint8 level of
``fd.sample`` of that request alone (a batch's GEMMs block differently from one image's:
not bitwise); pads change no active row, bitwise (the same bucket, so the same ops); the
refusals name their argument. torch_xla's side (0 compiles after warm-up) is
``check --device xla --serve`` (docs/xla.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import sampling, tiny
from functional_dit.pipelines import sampler_xla
from functional_dit.pipelines import sampler_xla_batch as xb

LEVEL = 1 / 255
BUCKETS = (1, 2, 4)


@pytest.fixture(scope="module")
def flux():
    pipe = tiny.pipeline("flux")
    params = fd.from_diffusers(pipe.transformer)
    a = lora.init(params.config, rank=4, alpha=8.0, seed=1, zero_b=False)
    b = lora.init(params.config, rank=2, seed=2, zero_b=False)
    return params, pipe, [a, b]


def _alone(params, pipe, r: sampling.Request):
    return fd.sample(
        params, pipe, r.prompt, height=r.height, width=r.width, steps=r.steps, seed=r.seed, guidance=r.guidance,
        true_cfg=r.true_cfg, negative_prompt=r.negative_prompt, lora=list(r.lora) or None, output_type="np",
        max_sequence_length=r.max_sequence_length,
    )[0]  # fmt: skip


def _run(params, ctx, first, later, adapters):
    """``first`` stepped once alone (bucket 1), then with ``later`` in the smallest bucket
    until every item is done, all under `NoHostSync`: the finished slots, in order."""
    pad = xb.pads(first[0], max(BUCKETS))
    done, running = [], list(first)
    with sampler_xla._strict():
        running, _ = xb.step(params, ctx, running, xb.Pads(()), adapters)
        running += list(later)
        while running:
            n = xb.bucket(len(running), BUCKETS)
            running, _ = xb.step(params, ctx, running, xb.Pads(pad.slots[: n - len(running)]), adapters)
            done += [s for s in running if s.done]
            running = [s for s in running if not s.done]
    return done


def _slots(params, ctx, reqs, adapters):
    return [xb.slot(ctx, it, adapters) for it in sampling.init(params, ctx, reqs, host_schedule=True).items]


@pytest.mark.parametrize("cfg", [{}, dict(true_cfg=2.0, negative_prompt="blurry")], ids=["guidance", "true-cfg"])
def test_items_at_different_steps_and_adapters_in_buckets_equal_each_alone(flux, cfg):
    params, pipe, (a, b) = flux
    ctx = sampling.context(params, pipe)
    R = lambda *args, **kw: sampling.Request(*args, max_sequence_length=32, **cfg, **kw)  # noqa: E731
    first = _slots(params, ctx, [R("a red cat", 32, 32, 3, seed=1, lora=((a, 0.7),))], [a, b])
    later = [R("a dog", 32, 32, 4, seed=2, guidance=5.0), R("sky", 32, 32, 2, seed=3, lora=((a, 0.3), (b, 0.5)))]
    done = _run(params, ctx, first, _slots(params, ctx, later, [a, b]), [a, b])
    assert [s.request.prompt for s in done] == ["a red cat", "sky", "a dog"]  # 3 steps (one ahead) and 2, then 4
    images = sampling.decode(sampling.State(ctx, tuple(s.item for s in done)), "np")
    for s, img in zip(done, images):
        assert np.abs(img - _alone(params, pipe, s.request)).max() <= LEVEL, s.request.prompt
    no_lora = _alone(params, pipe, sampling.Request("a red cat", 32, 32, 3, seed=1, max_sequence_length=32, **cfg))
    assert np.abs(images[0] - no_lora).max() > 10 * LEVEL  # the adapter changed its item


@pytest.mark.parametrize("kind,cfg", [("flux3-distilled", None), ("qwen-image", 3.0), ("flux2-klein", None)])
def test_other_families_padded_equal_each_alone(kind, cfg):
    """FLUX.3's flow map (its per-step target timestep, per row), Qwen-Image's rescaled CFG
    (its text length from one prompt: the key), FLUX.2-klein."""
    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    ctx = sampling.context(params, pipe)
    kw = {} if cfg is None else dict(true_cfg=cfg, negative_prompt="low quality, blur")
    reqs = [sampling.Request("a red cat", 32, 32, n, seed=s, **kw) for s, n in ((1, 3), (2, 2))]
    first, later = (_slots(params, ctx, [r], []) for r in reqs)
    done = _run(params, ctx, first, later, [])
    images = sampling.decode(sampling.State(ctx, tuple(s.item for s in done)), "np")
    for s, img in zip(done, images):
        assert np.abs(img - _alone(params, pipe, s.request)).max() <= LEVEL, s.request.seed


@pytest.mark.parametrize("cfg", [None, 3.0], ids=["plain", "true-cfg"])
def test_qwen_image_prompts_of_any_length_share_one_padded_key(cfg):
    """Qwen-Image's text is as long as its prompt: padded (masked) to one length, prompts and
    negative prompts of different token counts share one key (one graph), each image still
    within 1 uint8 level of ``fd.sample`` alone (unpadded)."""
    pipe = tiny.pipeline("qwen-image")
    params = fd.from_diffusers(pipe.transformer)
    ctx = sampling.context(params, pipe)
    R = lambda p, n, s, neg: sampling.Request(p, 32, 32, n, seed=s, true_cfg=cfg, negative_prompt=neg)  # noqa: E731
    reqs = [R("a red cat", 3, 1, "blur"), R("a big blue dog on a green hill at noon", 2, 2, "low quality, noise")]
    items = [sampling.init(params, ctx, [r], host_schedule=True).items[0] for r in reqs]
    assert len({it.key for it in items}) == 2  # unpadded: two keys
    first, later = ([xb.slot(ctx, it, [], text=200)] for it in items)
    assert first[0].key == later[0].key and first[0].item.cond.txt.shape[1] == 200
    done = _run(params, ctx, first, later, [])
    images = sampling.decode(sampling.State(ctx, tuple(s.item for s in done)), "np")
    for s, img in zip(done, images):
        assert np.abs(img - _alone(params, pipe, s.request)).max() <= LEVEL, s.request.prompt


def test_pads_and_other_items_change_no_active_row_bitwise(flux):
    params, pipe, (a, b) = flux
    ctx = sampling.context(params, pipe)
    R = lambda p, n, seed, **kw: sampling.Request(p, 32, 32, n, seed=seed, max_sequence_length=32, **kw)  # noqa: E731
    slots = _slots(params, ctx, [R("a red cat", 3, 1, lora=((a, 0.7),)), R("a dog", 4, 2), R("sky", 2, 3)], [a, b])
    with sampler_xla._strict():
        ahead, _ = xb.step(params, ctx, slots[1:2], xb.Pads(()), [a, b])  # "a dog" a step ahead
        pad = xb.pads(slots[0], 3)
        alone, _ = xb.step(params, ctx, slots[:1], pad, [a, b])
        mixed, _ = xb.step(params, ctx, [slots[0], ahead[0], slots[2]], xb.Pads(pad.slots[:1]), [a, b])
    assert torch.equal(alone[0].item.x, mixed[0].item.x)
    assert alone[0].i == mixed[0].i == 1 and mixed[1].i == 2


def test_refusals_name_their_argument(flux):
    params, pipe, (a, b) = flux
    ctx = sampling.context(params, pipe)
    R = lambda **kw: sampling.Request("a cat", 32, 32, 3, max_sequence_length=32, **kw)  # noqa: E731
    (cached,) = sampling.init(params, ctx, [R(cache="fbcache:0.08")], host_schedule=True).items
    with pytest.raises(ValueError, match="^cache: step caches decide on the host"):
        xb.slot(ctx, cached, [a])
    (other,) = sampling.init(params, ctx, [R(lora=((b, 1.0),))], host_schedule=True).items
    with pytest.raises(ValueError, match="^lora: an adapter the server does not hold"):
        xb.slot(ctx, other, [a])
    with pytest.raises(ValueError, match=r"^batch: 5 items exceed the largest bucket 4 \(buckets \[1, 2, 4\]\)"):
        xb.bucket(5, BUCKETS)


def test_contexts_and_adapters_the_graphs_cannot_hold_are_refused(flux):
    params, pipe, (a, _) = flux
    dora = lora.init(params, rank=2, seed=3, use_dora=True)
    with pytest.raises(ValueError, match="^lora: DoRA adapters do not run per row"):
        xb.check_context(sampling.context(params, pipe), [a, dora])
    pipe21 = tiny.pipeline("qwen-image-2.1")
    ctx21 = sampling.context(fd.from_diffusers(pipe21.transformer), pipe21)
    with pytest.raises(
        ValueError, match=r"^encoders: QwenImage21Pipeline \(qwenimage21\) does not run in the fixed-shape"
    ):
        xb.check_context(ctx21)

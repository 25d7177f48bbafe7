"""Mixed resolutions: items of several sizes in one model call (`sampler._packing`).

- ``fd.apply``'s ``img_valid`` with a RoPE table per row: a row padded to a longer image
  predicts what it predicts alone (FLUX.1, Qwen-Image), and a bad mask is refused by name;
- `sampling.step` over items of two sizes (and, for Qwen-Image, two text lengths; one
  item with a LoRA, one with true CFG) makes ONE model call, each item's latents within
  fp32 1e-5 of the item stepped alone and its image within 1 uint8 level of ``fd.sample``
  alone; FLUX.2 (dev, klein KV) and FLUX.3's flow map: two sizes in one call likewise,
  FLUX.2 items with reference images not packed (a call per size, each equal alone);
- no item attends to another: changing item B's latents leaves item A's step bitwise
  unchanged (the same ops in one process);
- Qwen-Image 2.1: items of three sizes / two layouts of one token count (square, wide,
  tall), prompts of three lengths, a LoRA and true CFG: one padded call per CFG branch and
  step, with the prefix KV cache (the first step's extract call, then cached calls) and
  without it, each item within fp32 1e-5 of it alone and its image within 1 level of
  ``fd.sample``; an item joining a running batch extracts its caches in a call apart from
  the running item's cached call, then both share the cached calls; items of one layout
  share a plain call; changing item B's latents leaves item A's step bitwise unchanged;
- items with a step cache are never packed (their states are per call): a call of its own
  beside the other items' shared call (Qwen-Image 2.1) or a call per size (FLUX.1), each
  equal alone;
- slow: the padded call on an sp=2 mesh equals one process;
- the serving engine (in process) packs two sizes into one call while it holds at most
  ``max_batch`` images within ``max_padding``, counts those calls, and with mixed
  resolutions off (or over the padding bound) steps one size per call.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

import functional_dit as fd
import functional_dit.api as api
import functional_dit.lora as lora
from functional_dit import sampling, tiny
from functional_dit.serve import _engine

MSL = 32
LEVEL = 1 / 255


@pytest.fixture(scope="module")
def models():
    out = {}
    for kind in ("flux", "qwen-image"):
        pipe = tiny.pipeline(kind)
        out[kind] = fd.from_diffusers(pipe.transformer), pipe
    return out


def _calls(monkeypatch) -> list:
    """fd.apply's calls from here on: each call's batch and sequence length."""
    seen, plain = [], api.apply

    def counting(params, x, t, txt, **kw):
        seen.append((x.shape[0], x.shape[1], "img_valid" in kw))
        return plain(params, x, t, txt, **kw)

    monkeypatch.setattr(api, "apply", counting)
    return seen


def _req(prompt, w, h, steps=3, **kw):
    return sampling.Request(prompt, h, w, steps, max_sequence_length=kw.pop("msl", MSL), **kw)


def _alone(params, pipe, r: sampling.Request):
    return fd.sample(
        params, pipe, r.prompt, height=r.height, width=r.width, steps=r.steps, seed=r.seed, true_cfg=r.true_cfg,
        negative_prompt=r.negative_prompt, output_type="np", max_sequence_length=r.max_sequence_length,
        lora=list(r.lora) or None,
    )[0]  # fmt: skip


@pytest.mark.parametrize("kind", ["flux", "qwen-image"])
def test_a_padded_row_predicts_what_it_predicts_alone(models, kind):
    params, pipe = models[kind]
    ctx = sampling.context(params, pipe)
    small, big = (sampling.init(params, ctx, [_req("a cat", *wh)]).items[0] for wh in ((32, 32), (64, 48)))
    state = sampling.merge(sampling.State(ctx, (small,)), sampling.State(ctx, (big,)), mixed=True)
    pad = sampling._packing.layout(state.items)
    m = small.tables  # the item's RoPE table and (Qwen-Image) image shapes
    x, cond = pad.latents(state.items), pad.text(state.items)
    t = torch.full((2,), 0.5)
    kw = pad.inputs(state.items, _keywords(kind, m, cond, 2))
    both = fd.apply(params, x, t, cond.txt, **kw)
    one = fd.apply(params, small.x, t[:1], small.cond.txt, **_keywords(kind, m, small.cond, 1))
    torch.testing.assert_close(both[:1, : small.x.shape[1]], one, rtol=1e-5, atol=1e-5)
    bad = dict(kw, img_valid=kw["img_valid"].float())
    with pytest.raises(ValueError, match="img_valid"):
        fd.apply(params, x, t, cond.txt, **bad)


def _keywords(kind, m, cond, B) -> dict:
    if kind == "flux":
        return dict(pooled=cond.pooled, rope=m["rope"], guidance=torch.full((B,), 3.5))
    return dict(txt_mask=cond.mask, img_shapes=[m["shapes"]] * B, rope=m["rope"])


@pytest.mark.parametrize("kind", ["flux", "qwen-image"])
def test_items_of_two_sizes_step_in_one_call_each_equal_alone(models, kind, monkeypatch):
    params, pipe = models[kind]
    ctx = sampling.context(params, pipe)
    adapter = lora.init(params.config, rank=4, alpha=8.0, seed=1, zero_b=False)
    reqs = [
        _req("a red cat", 32, 32, seed=1, lora=((adapter, 0.7),)),
        _req("a blue dog on a mat", 64, 48, seed=2, true_cfg=2.0, negative_prompt="dark"),
        _req("the sun", 32, 32, seed=3, msl=MSL if kind == "flux" else 24),  # Qwen: another text length
    ]
    states = [sampling.init(params, ctx, [r]) for r in reqs]
    assert len({s.items[0].key for s in states}) == 3 if kind != "flux" else 2
    with pytest.raises(ValueError, match="one key"):
        sampling.merge(*states)
    mixed = _stepped_in_one_call(params, states, monkeypatch)
    for it, img in zip(mixed.items, sampling.decode(mixed, "np")):
        assert img.shape[:2] == (it.request.height, it.request.width)
        assert np.abs(img - _alone(params, pipe, it.request)).max() <= LEVEL, it.request.prompt


def _stepped_in_one_call(params, states, monkeypatch):
    """``states`` (one item each, several sizes) merged and stepped to the end: ONE padded
    model call per step, each item's latents within fp32 1e-5 of it stepped alone."""
    mixed, alone = sampling.merge(*states, mixed=True), states
    calls = _calls(monkeypatch)
    while not all(it.done for it in mixed.items):
        n = len(calls)
        mixed = sampling.step(params, mixed)
        assert len(calls) == n + 1 and calls[-1][2], "one padded call over both sizes"
        alone = [sampling.step(params, s) for s in alone]
        for it, s in zip(mixed.items, alone):
            torch.testing.assert_close(it.x, s.items[0].x, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    return mixed


@pytest.fixture(scope="module")
def flux23():
    """Tiny FLUX.2 (dev, klein with the KV cache) and FLUX.3 (the flow map) pipelines."""
    out = {}
    for kind in ("flux2", "flux2-klein-kv", "flux3-distilled"):
        pipe = tiny.pipeline(kind)
        out[kind] = fd.from_diffusers(pipe.transformer), pipe
    return out


@pytest.mark.parametrize("kind", ["flux2", "flux2-klein-kv", "flux3-distilled"])
def test_flux2_flux3_items_of_two_sizes_step_in_one_call_each_equal_alone(flux23, kind, monkeypatch):
    """FLUX.2 (dev: guidance per row; klein KV without references: no cache to extract)
    and FLUX.3 (its flow map's target timestep per row): two sizes in ONE padded call per
    step, each item's latents within fp32 1e-5 of it alone, its image within 1 level of
    ``fd.sample`` alone."""
    params, pipe = flux23[kind]
    ctx = sampling.context(params, pipe)
    reqs = [_req("a red cat", 32, 32, seed=1, guidance=2.5), _req("a blue dog", 64, 48, seed=2)]
    states = [sampling.init(params, ctx, [r]) for r in reqs]
    assert sampling.packs(params, ctx, [s.items[0] for s in states])
    mixed = _stepped_in_one_call(params, states, monkeypatch)
    for it, img in zip(mixed.items, sampling.decode(mixed, "np")):
        r = it.request
        want = fd.sample(params, pipe, r.prompt, height=r.height, width=r.width, steps=r.steps, seed=r.seed,
                         guidance=r.guidance, output_type="np", max_sequence_length=MSL)[0]  # fmt: skip
        assert img.shape[:2] == (r.height, r.width)
        assert np.abs(img - want).max() <= LEVEL, r.prompt


def test_flux2_items_with_reference_images_are_not_packed(flux23, monkeypatch):
    """Reference images (klein's KV cache: an extract call, then cached calls) keep a call
    per size; each image still equals ``fd.sample`` alone."""
    from PIL import Image

    params, pipe = flux23["flux2-klein-kv"]
    ctx = sampling.context(params, pipe)
    ref = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    reqs = [_req("a cat", *wh, seed=j, image=[ref], steps=2) for j, wh in enumerate([(32, 32), (64, 48)])]
    state = sampling.merge(*(sampling.init(params, ctx, [r]) for r in reqs), mixed=True)
    state = _stepped_a_call_each(params, ctx, state, monkeypatch)
    for it, img in zip(state.items, sampling.decode(state, "np")):
        r = it.request
        want = fd.sample(params, pipe, r.prompt, height=r.height, width=r.width, steps=r.steps, seed=r.seed,
                         image=[ref], output_type="np", max_sequence_length=MSL)[0]  # fmt: skip
        assert np.abs(img - want).max() <= LEVEL


def _stepped_a_call_each(params, ctx, state, monkeypatch):
    """``state``'s items (two sizes that must not pack) stepped to the end: two unpadded
    model calls per step."""
    assert not sampling.packs(params, ctx, state.items)
    calls = _calls(monkeypatch)
    state = sampling.step(params, state)
    assert len(calls) == 2 and not any(c[2] for c in calls)
    monkeypatch.undo()
    while not all(it.done for it in state.items):
        state = sampling.step(params, state)
    return state


def test_no_item_attends_to_another(models):
    """Item A's step is bitwise the same whatever item B's latents (one process, the same
    ops); B's own step does change."""
    params, pipe = models["flux"]
    ctx = sampling.context(params, pipe)
    a = sampling.init(params, ctx, [_req("a", 32, 32, seed=1)])
    b = sampling.init(params, ctx, [_req("b", 64, 48, seed=2)])
    b2 = sampling.State(ctx, (b.items[0].__class__(**{**vars(b.items[0]), "x": torch.randn_like(b.items[0].x)}),))
    one = sampling.step(params, sampling.merge(a, b, mixed=True))
    two = sampling.step(params, sampling.merge(a, b2, mixed=True))
    assert torch.equal(one.items[0].x, two.items[0].x)
    assert not torch.equal(one.items[1].x, two.items[1].x)


@pytest.fixture(scope="module")
def qwen21():
    pipe = tiny.pipeline("qwen-image-2.1")
    return fd.from_diffusers(pipe.transformer), pipe


def _q21_context(params, pipe, kv: bool):
    """The sampling context of Qwen-Image 2.1, its prefix KV cache on (the tiny model's
    default: causal_condition) or off."""
    ctx = sampling.context(params, pipe)
    assert ctx.model.kv
    return ctx if kv else dataclasses.replace(ctx, model=type(ctx.model)(params, pipe, False))


def _q21_calls(monkeypatch) -> list:
    """fd.apply's calls from here on: (batch, latent rows, RoPE per row, the KV cache's mode)."""
    seen, plain = [], api.apply

    def counting(params, x, t, txt, **kw):
        kv = kw.get("kv_cache")
        seen.append((x.shape[0], x.shape[1], "rope" in kw, kv if kv is None or isinstance(kv, str) else "read"))
        return plain(params, x, t, txt, **kw)

    monkeypatch.setattr(api, "apply", counting)
    return seen


def _q21_alone(params, pipe, r: sampling.Request, kv: bool):
    return fd.sample(
        params, pipe, r.prompt, height=r.height, width=r.width, steps=r.steps, seed=r.seed, true_cfg=r.true_cfg,
        negative_prompt=r.negative_prompt, output_type="np", lora=list(r.lora) or None, kv_cache=kv,
    )[0]  # fmt: skip


def _q21_step(params, mixed, alone, monkeypatch, want: list):
    """One step of ``mixed`` (its calls ``want``: (batch, kv mode, a RoPE table per row:
    rows of several layouts) each) and of each of ``alone``; each item's latents within
    fp32 1e-5 of it alone."""
    calls = _q21_calls(monkeypatch)
    mixed = sampling.step(params, mixed)
    monkeypatch.undo()
    assert [(b, kv, rope) for b, _, rope, kv in calls] == want, calls
    alone = [sampling.step(params, s) for s in alone]
    for it, s in zip(mixed.items, alone):
        torch.testing.assert_close(it.x, s.items[0].x, rtol=1e-5, atol=1e-5)
    return mixed, alone


@pytest.mark.parametrize("kv", [True, False], ids=["kv-cache", "no-kv-cache"])
def test_qwen_image_21_sizes_and_layouts_share_a_call_per_branch_each_equal_alone(qwen21, kv, monkeypatch):
    """Qwen-Image 2.1: a square 32x32 item (a LoRA), a wide 64x32 and a tall 32x64 one
    (two layouts of one token count; true CFG, each branch its own prompt length), prompts
    of three lengths: ONE padded call per CFG branch and step (branch 0 all three items,
    branch 1 the two with CFG; with the KV cache the first step extracts every item's
    caches, the later ones read them), each item's latents within fp32 1e-5 of it stepped
    alone, its image within 1 uint8 level of ``fd.sample`` alone."""
    params, pipe = qwen21
    ctx = _q21_context(params, pipe, kv)
    adapter = lora.init(params.config, rank=4, alpha=8.0, seed=1, zero_b=False)
    reqs = [
        _req("a red cat", 32, 32, seed=1, msl=None, lora=((adapter, 0.7),)),
        _req("a blue dog on a long mat", 64, 32, seed=2, msl=None, true_cfg=2.0, negative_prompt="dim"),
        _req("sun", 32, 64, seed=3, msl=None, true_cfg=3.0, negative_prompt="a dark and moody night"),
    ]
    alone = [sampling.init(params, ctx, [r]) for r in reqs]
    assert len({s.items[0].key for s in alone}) == 3
    mixed = sampling.merge(*alone, mixed=True)
    assert sampling.packs(params, ctx, mixed.items)
    for i in range(3):
        mode = None if not kv else "extract" if i == 0 else "read"
        mixed, alone = _q21_step(params, mixed, alone, monkeypatch, [(3, mode, True), (2, mode, True)])
    for it, img in zip(mixed.items, sampling.decode(mixed, "np")):
        assert img.shape[:2] == (it.request.height, it.request.width)
        assert np.abs(img - _q21_alone(params, pipe, it.request, kv)).max() <= LEVEL, it.request.prompt


def test_qwen_image_21_a_newcomer_extracts_in_a_call_of_its_own(qwen21, monkeypatch):
    """An item joining a running batch at its first step extracts its KV caches in a call
    of its own while the running item reads its caches in another (per branch: extract
    and cached calls differ in what they compute); from the next step on the two share
    one cached call per branch. Each within 1e-5 of it alone, each image within 1 level
    of ``fd.sample`` alone."""
    params, pipe = qwen21
    ctx = _q21_context(params, pipe, True)
    reqs = [
        _req("a lighthouse at dusk", 64, 32, seed=4, msl=None, true_cfg=2.0, negative_prompt="dim", steps=3),
        _req("a boat", 32, 32, seed=5, msl=None, steps=3),
    ]
    first, late = (sampling.init(params, ctx, [r]) for r in reqs)
    first = sampling.step(params, first)
    mixed = sampling.merge(first, late, mixed=True)
    alone = [first, late]
    one = [(1, "extract", False), (1, "read", False), (1, "read", False)]  # each call one row: its own layout
    mixed, alone = _q21_step(params, mixed, alone, monkeypatch, one)
    mixed, alone = _q21_step(params, mixed, alone, monkeypatch, [(2, "read", True), (1, "read", False)])
    _, rest = sampling.split(mixed)
    assert [it.request.prompt for it in rest.items] == ["a boat"]
    mixed = sampling.merge(sampling.split(mixed)[0], sampling.step(params, rest), mixed=True)
    for it, img in zip(mixed.items, sampling.decode(mixed, "np")):
        assert np.abs(img - _q21_alone(params, pipe, it.request, True)).max() <= LEVEL, it.request.prompt


def test_qwen_image_21_one_layout_shares_a_plain_call_and_no_item_attends_to_another(qwen21, monkeypatch):
    """Two Qwen-Image 2.1 items of one size and prompt length share one call without
    per-row tables (one layout), each within 1e-5 of it alone; in a padded call of two
    sizes, item A's step is bitwise the same whatever item B's latents."""
    params, pipe = qwen21
    ctx = _q21_context(params, pipe, True)
    alone = [sampling.init(params, ctx, [_req(p, 32, 32, seed=j, msl=None)]) for j, p in enumerate(("a cat", "a dog"))]
    assert alone[0].items[0].key == alone[1].items[0].key
    mixed, alone = _q21_step(params, sampling.merge(*alone), alone, monkeypatch, [(2, "extract", False)])
    _q21_step(params, mixed, alone, monkeypatch, [(2, "read", False)])
    a, b = (sampling.init(params, ctx, [_req("a cat", *wh, seed=1, msl=None)]) for wh in ((32, 32), (64, 32)))
    b2 = sampling.State(ctx, (dataclasses.replace(b.items[0], x=torch.randn_like(b.items[0].x)),))
    one, two = (sampling.step(params, sampling.merge(a, s, mixed=True)) for s in (b, b2))
    assert torch.equal(one.items[0].x, two.items[0].x)
    assert not torch.equal(one.items[1].x, two.items[1].x)


def test_qwen_image_21_an_item_with_a_step_cache_keeps_its_own_calls(qwen21):
    """A step cache keeps a state per model call of its item (Qwen-Image 2.1: one per CFG
    branch), so an item with one is not packed (a batch holding one does not join other
    sizes: `sampling.packs`) and takes its own calls, while the batch's other items share
    theirs (`_packing.calls`); each equal to ``fd.sample`` alone (with its cache)."""
    params, pipe = qwen21
    ctx = sampling.context(params, pipe)
    reqs = [
        _req("a red cat", 32, 32, seed=1, msl=None, cache="fbcache:1.5"),
        _req("a dog", 64, 32, seed=2, msl=None),
        _req("a bird in a tree", 32, 32, seed=3, msl=None),
    ]
    state = sampling.merge(*(sampling.init(params, ctx, [r]) for r in reqs), mixed=True)
    cached, *rest = state.items
    assert not sampling.packs(params, ctx, state.items) and sampling.packs(params, ctx, rest)
    assert sampling._packing.calls(params, ctx, state.items) == [rest, [cached]]
    assert sampling._packing.calls(params, ctx, [cached, rest[0]]) == [[cached], [rest[0]]]
    while not all(it.done for it in state.items):
        state = sampling.step(params, state)
    for it, img in zip(state.items, sampling.decode(state, "np")):
        r = it.request
        want = fd.sample(params, pipe, r.prompt, height=r.height, width=r.width, steps=r.steps, seed=r.seed,
                         cache=r.cache, output_type="np")[0]  # fmt: skip
        assert np.abs(img - want).max() <= LEVEL


def test_cached_flux_items_are_not_packed(models):
    params, pipe = models["flux"]
    ctx = sampling.context(params, pipe)
    items = [sampling.init(params, ctx, [_req("a", *wh, cache="fbcache:0.1")]).items[0] for wh in ((32, 32), (64, 48))]
    assert not sampling.packs(params, ctx, items)
    assert sampling.packs(
        params, ctx, [sampling.init(params, ctx, [_req("a", *wh)]).items[0] for wh in ((32, 32), (64, 48))]
    )


def _serve(params, pipe, reqs, **engine_kw):
    """The engine in process making ``reqs`` (one job each, submitted before it starts):
    (images as float arrays, its metrics)."""
    engine = _engine.Engine(params, pipe, max_queue=64, **engine_kw)
    out, done = {}, threading.Semaphore(0)

    def deliver(j):
        return lambda images, error: (out.__setitem__(j, (images, error)), done.release())

    for j, r in enumerate(reqs):
        engine.submit(_engine.Job(str(j), [r], deliver(j)))
    engine.start()
    for _ in reqs:
        assert done.acquire(timeout=300)
    engine.stop()
    assert all(err is None for _, err in out.values()), out
    return [np.asarray(out[j][0][0]).astype(np.float32) / 255 for j in range(len(reqs))], engine.metrics


@pytest.mark.parametrize("kind", ["flux", "qwen-image"])
def test_the_engine_packs_two_sizes_in_one_call_and_counts_it(models, kind):
    params, pipe = models[kind]
    reqs = [_req(f"image {j}", *wh, seed=j) for j, wh in enumerate([(32, 32), (48, 48), (32, 32), (48, 48)])]
    images, m = _serve(params, pipe, reqs, max_batch=4)
    assert m.mixed_calls == m.steps == 3, "every step one call over both sizes"
    for r, img in zip(reqs, images):
        assert np.abs(img - _alone(params, pipe, r)).max() <= LEVEL + 1e-6, r.prompt  # PNG levels
    _, off = _serve(params, pipe, reqs, max_batch=4, mixed=False)
    assert off.mixed_calls == 0 and off.steps == 6, "one call per size and step"
    _, tight = _serve(params, pipe, reqs, max_batch=4, max_padding=1.0)
    assert tight.mixed_calls == 0, "over max_padding: one call per size"
    _, full = _serve(params, pipe, sorted(reqs, key=lambda r: r.width), max_batch=2)  # two 32s, then two 48s
    assert full.mixed_calls == 0 and full.steps == 6, "a call holds at most max_batch images"


def _sp_work(rank, world, config, kw):
    """One rank: the padded call on an sp=2 mesh (Ulysses), and on one process."""
    import sharding

    params = fd.init(config, seed=0)
    mesh = sharding.make_mesh(sp=world)
    out = fd.apply(sharding.shard_params(params, mesh), **kw)
    return torch.as_tensor(out).clone(), fd.apply(params, **kw)


@pytest.mark.slow
def test_padded_rows_under_sequence_parallelism_equal_one_process(models):
    """``img_valid`` and a RoPE table per row split over sp=2 (the key bias and the tables
    cut by `nn.layers.shard_joint`): the real tokens equal one process's within 1e-5."""
    from _dist import spawn

    params, pipe = models["flux"]
    ctx = sampling.context(params, pipe)
    items = [sampling.init(params, ctx, [_req("a cat", *wh)]).items[0] for wh in ((32, 32), (64, 48))]
    pad = sampling._packing.layout(items)
    m = items[0].tables
    cond = pad.text(items)
    kw = pad.inputs(items, dict(pooled=cond.pooled, rope=m["rope"], guidance=torch.full((2,), 3.5)))
    kw.update(x=pad.latents(items), t=torch.full((2,), 0.5), txt=cond.txt)
    (sp, one), _ = spawn(_sp_work, 2, params.config, kw, timeout=300)
    valid = kw["img_valid"].bool()
    torch.testing.assert_close(sp[valid], one[valid], rtol=1e-5, atol=1e-5)

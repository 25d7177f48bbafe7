"""``functional_dit.sampling``: text-to-image sampling as an explicit per-item state.

A `Request` is one image: prompt, seed, size, steps, guidance, true CFG, negative prompt,
LoRA adapters with scales, a step cache. `init` turns requests into `Item`\\ s (encoded
text, the noise drawn from the image's own seed, its shifted schedule, the family's tables),
all of it by ``fd.sample``'s own per-family preparation (`functional_dit.pipelines.sampler`):
nothing here re-implements a family. A `State` is a batch of items that share a latent size
and text length (`Item.key`); each item carries its own latents, step index, scheduler,
guidance, CFG scale, adapters and step cache, so the items of one batch may sit at
different steps. ``step(params, state) -> state`` is the step ``fd.sample`` itself loops
over (`functional_dit.pipelines.sampler._state`, re-exported here): one model call for the
whole batch (one ``t`` per row, per-item LoRA as ``fd.apply``'s ``(adapter, scale, rows)``
form, true CFG as two rows of the item), each item's CFG combination and scheduler step;
it changes nothing it is given. `decode` turns finished items into images. `merge` and
`split` let a server add items to a running batch and take finished ones out between steps
(`functional_dit.serve`); ``merge(..., mixed=True)`` joins items of several keys, which a
step then packs into one padded model call where the family can (FLUX.1, Qwen-Image,
FLUX.2, FLUX.3 text to image; Qwen-Image 2.1 one per CFG branch:
`functional_dit.pipelines.sampler._packing`), else steps one key per call.

Each item's image equals ``fd.sample`` of that request alone (tests/test_sampling.py;
docs/serving.md gives the measured difference). Requests cover the text-to-image pipelines
of FLUX.1, FLUX.2 (dev, klein), Qwen-Image, FLUX.3 (base and step-distilled: each item's
flow-map target is its own next timestep) and Qwen-Image 2.1 (whose plain batch is laid
out by its first item: its steps lay the items into one padded call per CFG branch, each
row its own positions, and each item keeps its CFG branches' prefix KV caches in its
tables), each item with its own step cache (``Request.cache``: every item
deciding alone; one state per model call where a step makes one call per CFG branch,
Qwen-Image 2.1). A request with image inputs (``image``, ``mask_image``, ``strength``: FLUX.1
img2img and inpainting, Qwen-Image's, the FLUX.2 / klein references) is made by
``fd.sample``'s own preparation of that one image (`functional_dit.pipelines.sampler.prepare`):
its item keeps that image job's steps as its own context (`Item.own`) and takes its own
model calls; so does a request with its own ``sigmas`` or with ``embeds`` (the stock
embedding keywords) in place of a prompt. A context over an image job's pipeline of its own (Kontext, the edit
pipelines, Layered, klein inpainting) makes every request so, and so does a request with a
ControlNet (``Request.controlnet``, as ``fd.sample(controlnet=...)``).
"""

from __future__ import annotations

import dataclasses

import torch

import sharding

from ..lora import internal as _lora
from . import sampler as _sampler
from .cache.internal import items as _cache_items
from .families import NO_TABLES
from .families import product as _product
from .sampler.internal import packing as _packing
from .sampler.internal import ranks as _ranks
from .sampler.internal import requests as _requests
from .sampler.internal import state as _state

# The state and its one pure step, shared with fd.sample (`functional_dit.pipelines.sampler._state`).
Context, Item, State, step = _state.Context, _state.Item, _state.State, _state.step

# A request's step cache, for callers outside this package (the server): its config from a
# spec string or config (``cache_config(spec, steps)``, a ValueError naming ``cache`` when
# malformed) and the branch-steps it skipped so far (``cache_skipped(item.cache_state)``).
cache_config = _cache_items.config
cache_skipped = _cache_items.skipped
cache_decisions = _cache_items.decisions

# Mixed resolutions (`functional_dit.pipelines.sampler._packing`): whether items of several
# keys may share one padded model call (``packs(params, ctx, items)``), that call's padded
# over real tokens (``padding(items)``) and its image sizes (``resolutions(items)``).
packs, padding, resolutions = _packing.packs, _packing.padding, _packing.resolutions


@dataclasses.dataclass(frozen=True)
class Request:
    """One image to make: ``fd.sample(params, pipe, prompt, height=, width=, steps=,
    seed=, guidance=, true_cfg=, negative_prompt=, lora=[(adapter, scale), ...],
    cache=, image=, mask_image=, strength=)`` of one prompt and one image (image ``j`` of
    a request for n images is seed + j). The image inputs take ``fd.sample``'s meaning
    for the context's pipeline: FLUX.1's img2img (``strength``) and inpainting
    (``mask_image``), Qwen-Image's (its pipeline upgraded as ``fd.sample`` upgrades it),
    the FLUX.2 / klein reference images."""

    prompt: str
    height: int
    width: int
    steps: int
    seed: int = 0
    guidance: float | None = None
    true_cfg: float | None = None
    negative_prompt: str | None = None
    lora: tuple = ()  # ((adapter, scale), ...)
    max_sequence_length: int | None = None
    cache: object = None  # a step cache: a spec such as "fbcache:0.08" or a config (`cache._items`)
    image: object = None  # a PIL image, or a list of them (references)
    mask_image: object = None
    strength: float | None = None
    sigmas: tuple | None = None  # the schedule's sigmas (``steps`` of them), as fd.sample(sigmas=...)
    # in place of ``prompt`` (None then): fd.sample's stock embedding keywords for this one image
    # (prompt_embeds, pooled_prompt_embeds, prompt_embeds_mask and their negative_ twins), one row each
    embeds: dict | None = None
    controlnet: object = None  # fd.sample's controlnet=: (ControlNet params, control image, scale[, mode]) or a list
    # fd.sample's control_guidance_start / _end (with a controlnet only): a float or one per ControlNet
    control_guidance_start: object = None
    control_guidance_end: object = None
    max_area: int | None = None  # a FluxKontextPipeline's output area (fd.sample(max_area=...); 1024² if None)

    @property
    def has_images(self) -> bool:
        return self.image is not None or self.mask_image is not None or self.strength is not None

    @property
    def prepared(self) -> bool:
        """Made by ``fd.sample``'s whole preparation (`_prepared_item`): image inputs, a
        ControlNet, sigmas or embeddings."""
        prepared = self.has_images or self.controlnet is not None or self.max_area is not None
        return prepared or self.sigmas is not None or self.embeds is not None


def context(params, encoders, text_to_image: bool = False) -> Context:
    """The context of ``params`` with ``encoders`` (a diffusers pipeline of the family or
    its components, as ``fd.sample`` takes them). A pipeline of an image job of its own
    (Kontext, the edit pipelines, Layered, klein inpainting) makes every request's item
    by ``fd.sample``'s preparation (`_prepared_item`); ``text_to_image`` refuses those (the
    server's requests carry no image)."""
    fam = _sampler._family_name(params)
    pipe = _sampler.as_pipeline(encoders, params)
    runs = _product(fam).PER_ITEM_PIPELINES  # the family's text-to-image pipelines
    name = type(pipe).__name__
    if name not in runs and text_to_image:
        raise ValueError(f"encoders: functional_dit.sampling runs text to image ({', '.join(runs)}); got {name}")
    model = _sampler._family_model(fam, params, pipe, None, None) if name in runs else None
    device, dtype = _sampler._param_device_dtype(params)
    return Context(fam, model, pipe, device, dtype)


def check(ctx: Context, params, req: Request) -> None:
    """``req``'s values as ``fd.sample`` checks them (ValueError naming the argument), cheap."""
    if req.embeds is not None:
        if req.prompt is not None or not isinstance(req.embeds, dict):
            raise ValueError(f"embeds: expected a dict of embeddings with prompt None, got prompt={req.prompt!r}")
    elif not isinstance(req.prompt, str):
        raise ValueError(f"prompt: expected a string, got {req.prompt!r}")
    _sampler._check_args(ctx.pipe, req.height, req.width, "pil", None)
    _sampler._check_steps(req.steps, None if req.sigmas is None else list(req.sigmas))
    _sampler.check_max_sequence_length(ctx.fam, req.max_sequence_length)
    if not isinstance(req.seed, int) or isinstance(req.seed, bool):
        raise ValueError(f"seed: expected an int, got {req.seed!r}")
    _lora.check(params, list(req.lora))
    for name in ("control_guidance_start", "control_guidance_end"):
        if req.controlnet is None and getattr(req, name) is not None:
            raise ValueError(
                f"{name}: applies to a ControlNet; expected None without controlnet=, got {getattr(req, name)!r}"
            )
    if _cache_items.config(req.cache, req.steps) is not None and ctx.model is not None and not ctx.model.step_cache:
        raise ValueError(f"cache: step caching is not supported for {ctx.fam} yet; expected None")


def init(params, ctx: Context, requests, tags=None, host_schedule: bool = False) -> State:
    """A state of ``requests`` at step 0 (prompts encoded, noise drawn, schedules set);
    the keys of those that share calls must agree (`Item.key`; a server batches by key).
    ``host_schedule``: each text-to-image item's scheduler set on the CPU, for steps that
    read it on the host (`pipelines.sampler_xla_batch`); `step` needs it on the params' device."""
    tags = [None] * len(requests) if tags is None else list(tags)
    with torch.no_grad():
        items = tuple(_item(params, ctx, r, tag, host_schedule) for r, tag in zip(requests, tags))
    return merge(State(ctx), State(ctx, items))


def _item(params, ctx: Context, req: Request, tag, host_schedule: bool = False) -> Item:
    """The request's item at step 0: its prompt encoded and its noise drawn as one chunk of
    ``fd.sample`` (`sampler._chunk`), made an item as ``fd.sample`` makes its chunks'
    (`sampler._item`; ``host_schedule``: its scheduler on the CPU), with the request's own
    step cache."""
    check(ctx, params, req)
    if req.prepared or ctx.model is None:  # an image job (the pipeline's own, or its inputs), sigmas, embeddings
        return _prepared_item(params, ctx, req, tag)
    cfg = float(req.true_cfg) if req.true_cfg is not None and req.true_cfg > 1 else None
    cfg = _requests.true_cfg(ctx.fam, cfg, req.negative_prompt, None)
    reqs = _sampler.requests(ctx.fam, req.prompt, 1, req.seed, None, req.negative_prompt, cfg is not None, {})
    f = ctx.pipe.vae_scale_factor * 2
    hw = 2 * (req.height // f), 2 * (req.width // f)
    lora = (tuple(req.lora),) if req.lora else None
    job = _sampler._Job(ctx.fam, hw, req.steps, None, req.guidance, cfg, "pil", req.max_sequence_length, None, None,
                        lora=lora)  # fmt: skip
    chunk = _sampler._chunk(ctx.model, NO_TABLES, reqs, (0,), job, ctx.dtype, ctx.device)
    _agree(params, req, ctx.model, chunk, cfg)
    item = _sampler._item(ctx, chunk, job, fixed=host_schedule)
    cache = _cache_items.config(req.cache, len(item.timesteps))
    state = _cache_items.init(cache, ctx.model.cfg_calls if cfg is not None else 1)  # one per model call of a step
    return dataclasses.replace(item, request=req, tag=tag, cache=cache, cache_state=state)


def _agree(params, req: Request, model, chunk, cfg) -> None:
    """On a mesh of every rank, the ranks that run the item must hold the same request:
    ``fd.sample``'s check before the first step (its noise, text and settings; the same
    ValueError on every rank). A mesh of some ranks only (the server's dp groups, each
    with requests of its own) is left to its caller, who hands its ranks the same ones."""
    mesh = sharding.local_view(params)[1] if _sampler._sharded(params) else None
    if mesh is None or mesh.size() != torch.distributed.get_world_size():
        return
    lora, cache = _sampler._lora_items.fingerprint((tuple(req.lora),)), _cache_items.config(req.cache, req.steps)
    settings = dict(height=req.height, width=req.width, steps=req.steps, guidance=req.guidance, true_cfg=cfg,
                    max_sequence_length=req.max_sequence_length, cache=repr(cache), lora=lora)  # fmt: skip
    _sampler._check_ranks(_ranks.layout(mesh, 1), [chunk], model, chunk.tables, settings)


def _prepared_item(params, ctx: Context, req: Request, tag) -> Item:
    """The item of a request with image inputs, a ControlNet, sigmas or embeddings, or over an image
    job's pipeline: ``fd.sample``'s own preparation of that one image (`sampler.prepare`),
    whose steps (the job's) become the item's own context: it takes its own model calls."""
    kw = dict(height=req.height, width=req.width, steps=req.steps, seed=req.seed, guidance=req.guidance,
              true_cfg=req.true_cfg, negative_prompt=req.negative_prompt, image=req.image, mask_image=req.mask_image,
              strength=req.strength, max_sequence_length=req.max_sequence_length, cache=req.cache,
              lora=list(req.lora) or None, sigmas=None if req.sigmas is None else list(req.sigmas),
              controlnet=req.controlnet, control_guidance_start=req.control_guidance_start,
              control_guidance_end=req.control_guidance_end, max_area=req.max_area)  # fmt: skip
    own, (item,) = _sampler.prepare(params, ctx.pipe, req.prompt, **kw, **(req.embeds or {}))
    return dataclasses.replace(item, request=req, tag=tag, own=own)


def merge(*states: State, mixed: bool = False) -> State:
    """One state of every item of ``states`` (same context; the items that share model
    calls, those without a context of their own, one key; ``mixed``: several keys, each
    step then one padded call where the family packs sizes, else one call per key)."""
    ctx = states[0].ctx
    items = tuple(it for s in states for it in s.items)
    if any(s.ctx is not ctx for s in states):
        raise ValueError("states: expected states of one context (one model), got several")
    keys = {it.key for it in items if it.own is None}
    if len(keys) > 1 and not mixed:
        raise ValueError(f"states: a batch needs one key (latent h, w, text length); got {sorted(keys)}")
    return State(ctx, items)


def split(state: State, keep=lambda item: True) -> tuple[State, State]:
    """(finished items, the rest that ``keep`` keeps): a server decodes the first."""
    done = tuple(it for it in state.items if it.done)
    rest = tuple(it for it in state.items if not it.done and keep(it))
    return State(state.ctx, done), State(state.ctx, rest)


def decode(state: State, output_type: str = "pil"):
    """The images of the state's finished items, in order (``fd.sample``'s decode)."""
    items = [it for it in state.items if it.done]
    if not items:
        return []
    if output_type not in ("pil", "np", "pt", "latent"):
        raise ValueError(f"output_type: expected 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
    return _state.decode(state, output_type)


def sample(params, ctx: Context, requests, output_type: str = "pil"):
    """All ``requests`` (one key) to images: `init`, `step` until done, `decode`."""
    state = init(params, ctx, requests)
    while not all(it.done for it in state.items):
        state = step(params, state)
    return decode(state, output_type)


SEEDS = 2**64  # torch.Generator.manual_seed takes a uint64: seeds are the ints in [0, 2**64)


def bad_seed(value, n: int = 1) -> str | None:
    """None if ``value`` seeds ``n`` images (image j gets ``value + j``, as ``fd.sample``),
    each in [0, 2**64); else what was expected. The one seed rule of ``generate --seed``
    and ``serve``'s ``seed`` field."""
    top = f"2**64 - {n}" if n > 1 else "2**64 - 1"
    want = f"an int from 0 to {top}" + (" (image j gets seed + j, each < 2**64)" if n > 1 else "")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEEDS - n:
        return want
    return None

"""``fd.sample``: our own flow-matching denoising loop over ``fd.apply``.

diffusers supplies only the parts around the transformer: the scheduler
(``FlowMatchEulerDiscreteScheduler``), the text encoders (through the pipeline's own
``encode_prompt``, so prompt templates and hidden-state layers are the pipeline's) and
the VAE with its image processor. Everything else is here: the noise, latent packing,
position ids, the timestep shift each pipeline computes, classifier-free guidance as one
batched call, the FLUX.2-klein reference KV cache, and the unpacking for the VAE.

With the same seed the latents equal those of the stock pipeline with the stock
transformer (``FluxPipeline`` and its img2img, inpainting and Kontext pipelines,
``Flux2Pipeline``, ``Flux2KleinPipeline``, ``Flux2KleinKVPipeline``, ``QwenImagePipeline``,
``QwenImageEditPipeline``).

Per-step-invariant work is done once before the loop: prompt embeddings, position ids
and their RoPE tables (passed to ``fd.apply`` as ``rope=``), reference-image latents;
the klein reference KV cache is extracted on the first step and reused after. The loop
itself is `_state`'s: each chunk of images becomes one item (`_state.start`) and
`_state.step`, the one pure step `functional_dit.sampling` also exports, runs until it is
done; ``callback_on_step_end`` runs between steps.

Image ``i`` draws its noise from its own seed (`functional_dit.pipelines.sampler._requests`), so it is the
same image in any batch, chunk or rank. Sharded params work as they are: on a mesh with
``dp`` groups and at least as many images each group makes its own share of the images
with the mesh's tp and sp axes; with fewer images every rank runs the same loop and
``fd.apply`` splits the [cond; uncond] batch over dp (CFG parallelism)
(`functional_dit.pipelines.sampler._ranks`). Fully sharded params (an fsdp axis): the fsdp ranks of a
dp group run the same loop and ``fd.apply`` splits each call's batch over them, so every
rank meets every block's all-gather (docs/sampling.md, "Over fsdp"). Before the first step
one check compares the settings and inputs of the ranks that must agree and raises on
every rank if they differ (nothing is broadcast).

docs/sampling.md lists what is reproduced per pipeline class.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
import numbers
import types
from collections.abc import Callable, Mapping

import numpy as np
import torch

import sharding
from sharding.internal import is_dtensor

from ... import families as _families
from ...params import Params
from .. import cache as _cache
from .. import placement as _placement
from .. import sampler_xla as _sample_xla
from ..families import NO_TABLES, Prompt, tables
from ..families import product as _product
from . import _controlnet, _ranks, _requests, _state
from . import _lora as _lora_items
from . import _stock_args as _stock

# What the per-item sampling module (`functional_dit.pipelines.sampling`) shares with fd.sample.
requests, check_max_sequence_length = _requests.requests, _requests.check_max_sequence_length
_OUTPUT_TYPES = ("pil", "np", "pt", "latent")


# ----------------------------------------------------------------------------- encoders


def _family_name(params) -> str:
    """The family key of ``params`` ("flux1", "flux2", ...: `functional_dit.families`)."""
    if not isinstance(params, Params):
        *most, last = (fam.NAME for fam in _families.FAMILIES)
        raise ValueError(f"params: expected fd.Params of {', '.join(most)} or {last}, got {type(params).__name__}")
    return _families.key(params)


def as_pipeline(encoders, params):
    """A diffusers pipeline whose scheduler, VAE and text encoders we use: ``encoders``
    itself when it is one (its transformer, if any, is never called), or one built from
    a mapping of components (as ``DiffusionPipeline.components`` or
    ``functional_dit.pipelines.tiny.components`` give) with no transformer."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    fam = _family_name(params)
    if isinstance(encoders, (diffusers.DiffusionPipeline, diffusers.ModularPipeline)):
        name = type(encoders).__name__
        if name not in _families.SAMPLED:
            raise ValueError(f"encoders: expected one of the pipelines {sorted(_families.SAMPLED)}, got {name}")
        if name not in _families.pipeline_names(_families.BY_KEY[fam], sample=True):
            runs = _families.of_pipeline(name).KEY
            raise ValueError(f"encoders: a {name} runs a {runs} transformer, but params are {fam}")
        return encoders
    if not isinstance(encoders, Mapping):
        raise ValueError(f"encoders: expected a diffusers pipeline or a mapping of its components, got {encoders!r}")
    comps = {k: v for k, v in encoders.items() if k != "transformer"}
    cls = getattr(diffusers, _product(fam).pipeline_class(comps))
    return cls(**comps, transformer=None)


# ----------------------------------------------------------------------------- checks


def _check_args(pipe, height, width, output_type, batch_size):
    multiple = pipe.vae_scale_factor * 2
    for name, v in (("height", height), ("width", width)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v % multiple:
            raise ValueError(
                f"{name}: expected a positive multiple of {multiple} (VAE scale {pipe.vae_scale_factor} x 2x2 "
                f"packing), got {v!r}"
            )
    if output_type not in _OUTPUT_TYPES:
        raise ValueError(f"output_type: expected one of {list(_OUTPUT_TYPES)}, got {output_type!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"batch_size: expected None or a positive int (images per model call), got {batch_size!r}")


def _check_scales(guidance, true_cfg) -> None:
    """Guidance scales are finite and >= 0. A negative one has no meaning here: the stock
    pipelines treat a ``true_cfg`` <= 1 as "no CFG" (so -2 would be dropped silently), and
    an embedded ``guidance`` is a distilled model's input, trained on positive values."""
    for name, v in (("guidance", guidance), ("true_cfg", true_cfg)):
        if isinstance(v, numbers.Real) and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}: expected None or a finite number >= 0, got {v!r}")


def _check_steps(steps, sigmas) -> tuple[int, list | None]:
    """(steps, sigmas): ``steps`` alone, ``sigmas`` alone (steps = their count) or both agreeing."""
    if sigmas is not None:
        ok = isinstance(sigmas, (list, tuple, np.ndarray)) and len(sigmas) > 0
        if not ok or not all(isinstance(v, (int, float, np.floating)) and not isinstance(v, bool) for v in sigmas):
            raise ValueError(f"sigmas: expected a non-empty list of floats, got {sigmas!r}")
        sigmas = [float(v) for v in sigmas]
        if steps is None:
            return len(sigmas), sigmas
        if steps != len(sigmas):
            raise ValueError(f"steps: expected None or len(sigmas) = {len(sigmas)}, got {steps!r}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    return steps, sigmas


def _sharded(params: Params) -> bool:
    return is_dtensor(next(iter(params.flat().values())))


def _param_device_dtype(params: Params):
    leaf = next(iter(params.flat().values()))
    if is_dtensor(leaf):  # the local shard's device
        leaf = leaf.to_local()
    return leaf.device, leaf.dtype


# ----------------------------------------------------------------------------- schedule


def _scheduler(pipe, fam: str, seq_len: int, steps: int, device, sigmas=None):
    """A copy of the pipeline's scheduler set to ``steps`` sigmas linear from 1 to 1/steps
    (or the given ``sigmas``), shifted by the family's mu, exactly as the pipelines set it."""
    sched = copy.deepcopy(pipe.scheduler)
    sigmas = np.linspace(1.0, 1 / steps, steps) if sigmas is None else np.array(sigmas)
    sigmas = None if sched.config.get("use_flow_sigmas", False) else sigmas
    mu = _product(fam).shift(seq_len, steps, sched.config)  # the family's mu
    sched.set_timesteps(sigmas=sigmas, device=device, mu=mu)
    sched.set_begin_index(0)
    return sched


# ----------------------------------------------------------------------------- latents


@dataclasses.dataclass
class _Chunk:
    """One model batch: its image indices, packed noise (B, S, C) and text (CFG-batched)."""

    images: tuple[int, ...]
    x: torch.Tensor
    cond: Prompt
    prompt_embeds: torch.Tensor | None = None  # the conditional text alone (``callback_on_step_end`` inputs)
    tables: Mapping = dataclasses.field(default_factory=lambda: NO_TABLES)  # the run's and the chunk's (`Steps.draw`)


def _chunks(share, batch_size: int | None) -> list[tuple[int, ...]]:
    """``share`` in runs of ``batch_size`` images (None: all at once)."""
    size = batch_size or max(len(share), 1)
    return [tuple(share[i : i + size]) for i in range(0, len(share), size)]


def _encode(model, run, strings, embeds: dict, rows, msl, prefix: str = "", opts: dict | None = None) -> Prompt:
    """The text of prompt ``rows``: encoded strings (with the stock ``encode_prompt`` options
    ``opts``; a list there holds one value per prompt, e.g. FLUX.1's ``prompt_2``), or rows of
    the given embeddings."""
    if embeds:
        return model.encode_embeds(run, msl, **{k[len(prefix) :]: v[rows] for k, v in embeds.items()})
    opts = {k: [v[r] for r in rows] if isinstance(v, list) else v for k, v in (opts or {}).items()}
    return model.encode(run, [strings[r] for r in rows], msl, **opts)


def _chunk(model, run, req, images, job, dtype, device) -> _Chunk:
    """Encode the chunk's prompts (and negatives with CFG) and draw its noise with the
    steps ``model`` over the run's tables ``run``."""
    rows, msl, stock = req.rows(images), job.max_sequence_length, job.stock
    cond = _encode(model, run, req.prompts, req.embeds, rows, msl, opts=stock.encode_options(stock.prompts_2))
    prompt_embeds = cond.txt.to(device=device, dtype=dtype) if "prompt_embeds" in stock.tensor_inputs else None
    if job.cfg is not None:
        neg = _encode(
            model,
            run,
            req.negatives,
            req.negative_embeds,
            rows,
            msl,
            "negative_",
            stock.encode_options(stock.negatives_2),
        )
        if model.cfg_on_device:  # Qwen-Image 2.1 keeps its branches, on the device
            cond = model.cfg_batch(_to(cond, dtype, device), _to(neg, dtype, device))
        else:  # batched before the move: the default's mask check reads no accelerator
            cond = model.cfg_batch(cond, neg)
    cond = _to(cond, dtype, device)
    shape = lambda B: model.noise_shape(B, *job.hw)  # noqa: E731
    x, drawn = model.draw(run, req.noise, images, shape, dtype, device, _requests.draw)  # img2img: its posterior first
    return _Chunk(images, x, cond, prompt_embeds, tables(run, **drawn))


def _check_ranks(lay, chunks, model, run, settings: dict) -> None:
    """Once, before the first step: the ranks that compute the same images (a dp group's
    tp/sp ranks) must hold the same settings and inputs (fd.apply assumes it and splits
    them itself). Raises the same ValueError on every rank otherwise."""
    tensors = {"latents (seed)": [c.x for c in chunks], "prompt embeddings (prompt)": [c.cond.txt for c in chunks]}
    for name, field in (("pooled (prompt)", "pooled"), ("prompt mask (prompt)", "mask")):
        if any(getattr(c.cond, field) is not None for c in chunks):
            tensors[name] = [getattr(c.cond, field) for c in chunks]
    tensors.update(model.checked(run))  # the references, an image job's start image and mask
    _ranks.check(lay, settings, tensors)


def sample(
    params: Params,
    encoders,
    prompt=None,
    *,
    height: int | None = None,
    width: int | None = None,
    steps: int | None = None,
    seed=None,
    guidance: float | None = None,
    true_cfg: float | None = None,
    negative_prompt=None,
    image=None,
    image_reference=None,
    mask_image=None,
    strength: float | None = None,
    padding_mask_crop: int | None = None,
    layers: int | None = None,
    max_area: int | None = None,
    kv_cache: bool | None = None,
    max_sequence_length: int | None = None,
    output_type: str = "pil",
    callback: Callable[[int, torch.Tensor], None] | None = None,
    num_images_per_prompt: int = 1,
    prompt_embeds: torch.Tensor | None = None,
    pooled_prompt_embeds: torch.Tensor | None = None,
    prompt_embeds_mask: torch.Tensor | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    negative_pooled_prompt_embeds: torch.Tensor | None = None,
    negative_prompt_embeds_mask: torch.Tensor | None = None,
    latents: torch.Tensor | None = None,
    sigmas=None,
    callback_on_step_end: Callable | None = None,
    batch_size: int | None = None,
    local: bool = False,
    cache=None,
    encoder_placement: str = "replicate",
    vae_tiling: bool = False,
    controlnet=None,
    control_guidance_start=None,
    control_guidance_end=None,
    lora=None,
    prompt_2=None,
    negative_prompt_2=None,
    masked_image_latents: torch.Tensor | None = None,
    joint_attention_kwargs: dict | None = None,
    attention_kwargs: dict | None = None,
    callback_on_step_end_tensor_inputs: list[str] | None = None,
    text_encoder_out_layers: tuple[int, ...] | None = None,
    use_kv_cache: bool | None = None,
    _auto_resize: bool | None = None,
    cfg_normalize: bool | None = None,
    use_en_prompt: bool | None = None,
    ip_adapter_image=None,
    negative_ip_adapter_image=None,
    ip_adapter_image_embeds=None,
    negative_ip_adapter_image_embeds=None,
    resolution: int | None = None,
    output_resolution: int | None = None,
    caption_upsample_temperature: float | None = None,
):
    """Generate images with ``params`` (plain or sharded) and our own denoising loop.

    ``encoders``: a diffusers pipeline of a supported class (``FluxPipeline``,
    ``FluxImg2ImgPipeline``, ``FluxInpaintPipeline``, ``FluxKontextPipeline``,
    ``Flux2Pipeline``, ``Flux2KleinPipeline``, ``Flux2KleinKVPipeline``,
    ``Flux2KleinInpaintPipeline``, ``QwenImagePipeline``, ``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``,
    ``QwenImageImg2ImgPipeline``, ``QwenImageInpaintPipeline``, ``QwenImageLayeredPipeline``;
    its transformer is ignored and may be None, e.g. ``from_pretrained(path,
    transformer=None)``) or a mapping of its components.
    ``prompt``: a string or a list, ``num_images_per_prompt`` images each (image ``i`` is
    prompt ``i // num_images_per_prompt``'s); or None with ``prompt_embeds`` (and
    ``pooled_prompt_embeds`` for FLUX.1, ``prompt_embeds_mask`` for Qwen-Image, their
    ``negative_`` twins for CFG: the stock pipelines' arguments; the text encoders may then
    be None). ``height``/``width``: pixels, multiples of the VAE scale x 2 (required but
    for Qwen-Image-Layered and Qwen-Image 2.1, sized from ``resolution`` / ``output_resolution``).

    ``seed``: an int (image ``i`` draws its noise from ``torch.Generator().manual_seed(seed + i)``),
    a list of ints or of ``torch.Generator`` (one per image, as diffusers'
    ``generator=[...]``), or one ``torch.Generator`` (the stock pipelines' batch noise, one
    ``randn`` for all images); or ``latents`` (the stock pipeline's ``latents=`` layout).
    ``steps`` sigmas linear from 1 to 1/steps, or the given ``sigmas`` (then ``steps`` may be
    omitted), shifted as the pipeline shifts them.

    ``guidance``: the embedded guidance of guidance-distilled models (FLUX.1-dev: 3.5 by
    default, FLUX.2-dev: 4.0); ignored by models without it (schnell, klein, Qwen-Image).
    ``true_cfg``: classifier-free guidance scale; > 1 runs the conditional and the
    ``negative_prompt`` (default "") branches as one batch (Qwen-Image's pipelines call it
    ``true_cfg_scale``, klein's ``guidance_scale``; FLUX.1's ``true_cfg_scale``); Qwen-Image
    runs it only with a negative prompt, as its pipelines (a warning otherwise).
    ``image``: reference image(s) (PIL) for FLUX.2 (dev, klein), Qwen-Image-Edit(-Plus) and
    FLUX.1 Kontext (whose output size is rescaled to ``max_area``, 1024² by default, as the
    stock pipeline); the start image of FLUX.1 and Qwen-Image img2img and inpainting (a
    ``QwenImagePipeline`` given one runs img2img), with ``strength`` (0.6 by default),
    ``mask_image`` (white = repaint) and ``padding_mask_crop`` as the stock pipelines take
    them; the image to split for Qwen-Image-Layered, into ``layers`` (4 by default) images.
    ``Flux2KleinInpaintPipeline``: ``image`` and ``mask_image`` required, the output at the
    image's size (``height``/``width`` ignored, as stock), ``strength`` 0.8 by default, and
    ``image_reference``, one more reference image after the encoded init image.
    ``kv_cache``: FLUX.2 with reference images: extract the reference tokens' keys and
    values on the first step and reuse them (``Flux2KleinKVPipeline``); default True for a
    ``Flux2KleinKVPipeline``, else False.
    ``output_type``: "pil" (list of images), "np", "pt" (B, 3, H, W) in [0, 1], or
    "latent" (what the stock pipeline returns for ``output_type="latent"``: packed (B, S, C)
    latents, but klein's unpacked (B, C, H/8, W/8) VAE input).
    ``callback(step, latents)`` runs after every step; ``callback_on_step_end(pipe, step, t,
    {"latents": latents})`` too, and the "latents" of the dict it returns replace them.

    On a mesh with ``dp`` groups and at least as many images, each group makes a contiguous
    share of the images (`functional_dit.pipelines.sampler._ranks`), ``batch_size`` images per model call
    (None: its whole share at once; Qwen-Image 2.1: one, see `_batch_size`). Returns every
    image on every rank, or with ``local`` ``(indices, images)`` of this rank's group only.
    docs/sampling.md says what is bitwise.
    ``cache``: step caching (`functional_dit.pipelines.cache`): ``fd.FirstBlockCache(0.08)``,
    ``fd.TaylorSeer(...)``, ``fd.MagCache(...)``, a spec such as ``"fbcache:0.08"``, or an
    ``fd.CacheRun`` (which then holds the last state and every step's decisions).
    ``encoder_placement``: "replicate", "shard" (over the params' tp group), "cpu" or
    "offload" (`functional_dit.pipelines.placement`); ``vae_tiling``: decode in tiles.
    ``controlnet``: ``(params, image, scale)`` — ControlNet params (`functional_dit.controlnet`),
    its control image (PIL) and conditioning scale; ``(params, image, scale, mode)`` for a
    FLUX.1 Union ControlNet — or a list of them (their residuals summed), as
    ``FluxControlNetPipeline`` / ``QwenImageControlNetPipeline`` run them
    (`functional_dit.pipelines.sampler._controlnet`; text to image only); ``control_guidance_start`` /
    ``control_guidance_end``: the fractions of the schedule each acts in (a float, or one per
    ControlNet; 0.0 and 1.0 by default), as the stock pipelines.
    ``lora``: LoRA adapters applied on the fly (nothing merged): ``[(adapter, scale), ...]``
    for every prompt, or one such list per prompt (``[[(a, 1.0)], [(b, 0.5)], []]``), each
    image computing only its own adapters' updates in the shared batch, both CFG branches
    alike (`functional_dit.pipelines.sampler._lora`); sharded params need the adapters on
    their mesh (``lora.load(path, params)``).

    The stock pipelines' other arguments, with their stock meaning where the pipeline class
    takes them (`functional_dit.pipelines.sampler._stock_args`, docs/sampling.md "Stock
    arguments"): FLUX.1's ``prompt_2`` / ``negative_prompt_2`` (the T5 prompts);
    ``joint_attention_kwargs`` (FLUX.1) / ``attention_kwargs`` (the others), whose LoRA
    ``scale`` multiplies the ``lora`` scales; ``callback_on_step_end_tensor_inputs``
    ("latents", "prompt_embeds": the chunk's conditional text); ``masked_image_latents``
    (inpainting; checked, unused as stock); FLUX.2's ``text_encoder_out_layers``;
    ``use_kv_cache`` (Qwen-Image 2.1's spelling of ``kv_cache``); Kontext's ``_auto_resize``;
    FLUX.1's IP-Adapter ``ip_adapter_image_embeds`` with ``negative_ip_adapter_image_embeds``
    (through the IP-Adapter loaded on the pipeline's transformer, ``pipe.load_ip_adapter``);
    Layered's ``cfg_normalize`` and ``resolution`` (then ``height``/``width`` None: sized as
    stock; 640 when all three are None); Qwen-Image 2.1's ``output_resolution`` (a missing
    ``height``/``width``, 1024 by default). Refused by name: ``use_en_prompt`` (no captioning here),
    the IP-Adapter's images ``ip_adapter_image`` / ``negative_ip_adapter_image`` and FLUX.2's
    ``caption_upsample_temperature`` (pass ``pipe.upsample_prompt(prompt, temperature=t)`` as the prompt).
    """

    plan = _plan(locals())
    with torch.no_grad(), _binding(plan.lay), _placement.tiling(plan.ctx.pipe, plan.vae_tiling):
        parts = [_run(plan.ctx, plan.params, c, plan.job) for c in plan.chunks]
    output_type = plan.job.output_type
    return _ranks.collect(plan.lay, _ranks.concat(parts, output_type), output_type, plan.local)


def prepare(params, encoders, prompt=None, **kwargs) -> tuple:
    """``fd.sample``'s preparation without its loop: (the context, each chunk's item at
    step 0), ``kwargs`` as `sample` takes them. How `functional_dit.sampling.init` makes
    the item of a request with image inputs (or a ControlNet, sigmas, embeddings)."""
    bound = inspect.signature(sample).bind(params, encoders, prompt, **kwargs)
    bound.apply_defaults()
    plan = _plan(bound.arguments)
    with torch.no_grad():
        return plan.ctx, [_item(plan.ctx, c, plan.job) for c in plan.chunks]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A `sample` call prepared: the context, the params its loop runs on (a dp group's
    local view), its chunks encoded, what every chunk shares, the ranks' layout, and the
    output's options."""

    ctx: _state.Context
    params: Params
    chunks: tuple
    job: _Job
    lay: object
    vae_tiling: bool
    local: bool


def _binding(lay):
    """The mesh bound for a dp group's model calls on its local params (else nothing)."""
    return sharding.bind(lay.mesh) if lay.split else contextlib.nullcontext()


def _checked(a: dict) -> types.SimpleNamespace:
    """`sample`'s arguments ``a`` checked before anything heavy, with what the checks
    decide: the family, the pipeline (an image job's), the size, the schedule, the
    ControlNets, the image job, the CFG scale and the requests."""
    n = types.SimpleNamespace(**a)
    n.fam, n.pipe = _family_name(n.params), as_pipeline(n.encoders, n.params)
    n.kv_cache = _stock.kv_cache(n.kv_cache, n.use_kv_cache)
    _stock.size(n.pipe, n.resolution, n.output_resolution)  # refused where the pipeline takes none
    n.height, n.width = _product(n.fam).size(n.pipe, n)  # Layered's, Qwen-Image 2.1's, Kontext's, klein inpainting's
    _check_args(n.pipe, n.height, n.width, n.output_type, n.batch_size)
    _check_scales(n.guidance, n.true_cfg)
    n.batch_size = _product(n.fam).batch_size(n.batch_size)  # Qwen-Image 2.1: one image per call
    _placement.check(n.encoder_placement, n.vae_tiling)
    n.steps, n.sigmas = _check_steps(n.steps, n.sigmas)
    fractions = (n.control_guidance_start, n.control_guidance_end)
    n.controls = _controlnet.check(n.controlnet, n.fam, n.latents, n.pipe, n.seed, fractions, n.cache)
    n.pipe, n.job = _product(n.fam).image_job(n.pipe, n)  # an image job's checks: the family's
    _requests.check_max_sequence_length(n.fam, n.max_sequence_length)
    n.cfg = _cfg(n.fam, n.true_cfg, n.negative_prompt, n.negative_prompt_embeds)
    given = {k: v for k, v in a.items() if "prompt_embeds" in k}  # the six stock embedding arguments
    args = (n.prompt, n.num_images_per_prompt, n.seed, n.latents, n.negative_prompt, n.cfg is not None, given)
    n.req = _requests.requests(n.fam, *args)
    return n


def _plan(a: dict) -> _Plan:
    """`sample`'s preparation of the call ``a`` (its arguments by name): the checks
    (`_checked`), the stock arguments, the ranks' layout, the sampling steps, and the
    chunks encoded (`_prepared`)."""
    n = _checked(a)
    fam, pipe, req = n.fam, n.pipe, n.req
    adapters = _lora_items.per_image(n.params, n.lora, req.n // req.per_prompt, req.per_prompt)
    prompts, sharded = req.n // req.per_prompt, _sharded(n.params)
    stock_kw = {k: v for k, v in a.items() if k in _stock.NAMES}  # the stock pipelines' further arguments
    stock, adapters = _stock.take(pipe, fam, prompts, req, adapters, stock_kw, n.cache, sharded, n.callback_on_step_end)
    device, dtype = _param_device_dtype(n.params)
    local_params, mesh = sharding.local_view(n.params)
    lay = _ranks.layout(mesh, req.n)
    run_params = local_params if lay.split else n.params  # a dp group runs on its local view
    hw = 2 * (n.height // (pipe.vae_scale_factor * 2)), 2 * (n.width // (pipe.vae_scale_factor * 2))
    model = _model(fam, run_params, pipe, (n.job, n.image, n.kv_cache), n.controls, req, hw, n.masked_image_latents)
    on_step = _on_step(pipe, n.callback, n.callback_on_step_end)
    run = _cache_run(n.cache, model, n.image, fam)
    adapters = _lora_items.local(adapters, mesh) if lay.split else adapters  # the model runs on local params
    job = _Job(fam, hw, n.steps, n.sigmas, n.guidance, n.cfg, n.output_type, n.max_sequence_length, n.batch_size,
               on_step, run, adapters, stock)  # fmt: skip
    with torch.no_grad():
        ctx = _state.Context(fam, model, pipe, device, dtype)
        placement = (n.encoder_placement, mesh)
        chunks = _prepared(ctx, req, job, lay, n.image, (n.height, n.width), placement)
    return _Plan(ctx, run_params, tuple(chunks), job, lay, n.vae_tiling, n.local)


def _cfg(fam: str, true_cfg, negative_prompt, negative_prompt_embeds) -> float | None:
    """The true-CFG scale in force, or None (a scale of at most 1, or a family's refusal
    without a negative prompt)."""
    cfg = float(true_cfg) if true_cfg is not None and true_cfg > 1 else None
    return _requests.true_cfg(fam, cfg, negative_prompt, negative_prompt_embeds)


def _model(fam: str, params, pipe, family_inputs: tuple, controls, req, hw: tuple, masked_image_latents):
    """The sampling steps of the call (the family's, an image job's, with a ControlNet),
    with the given latents checked against them. ``family_inputs``: ``(job, image,
    kv_cache)``, ``job`` the family's image job (`image_job`) or None."""
    job, image, kv_cache = family_inputs
    model = _family_model(fam, params, pipe, image, kv_cache, job)
    model = model if controls is None else _controlnet.WithControlNet(model, controls, pipe, job is not None)
    _check_latents(model, pipe, req, *hw)
    _stock.check_masked_latents(masked_image_latents, model, req.n, *hw)
    return model


def _cache_run(cache, model, image, fam: str):
    """The step cache's run (`_cache.CacheRun`), or None; refused for steps without one."""
    run = _cache.CacheRun.of(cache, image is not None and bool(model.kv))
    if run is not None and not model.step_cache:
        raise ValueError(f"cache: step caching is not supported for {fam} yet; expected None")
    return run


def _prepared(ctx: _state.Context, req, job: _Job, lay, image, size: tuple, placement: tuple) -> list:
    """The call's chunks prepared: the reference images and start latents encoded (the
    run's tables, `Steps.images` and `Steps.init_latents`), each chunk's prompts encoded and
    its noise drawn over them (the encoders placed as ``placement = (encoder_placement,
    mesh)`` says), and the ranks' agreement checked."""
    model, pipe, device, dtype = ctx.model, ctx.pipe, ctx.device, ctx.dtype
    run = (
        NO_TABLES if image is None else model.images(image if isinstance(image, (list, tuple)) else [image], 1, device)
    )
    run, req = model.init_latents(run, req, *size, device, dtype)  # img2img, inpainting: the start image
    with _placement.placed(pipe, *placement, device):
        chunks = [_chunk(model, run, req, c, job, dtype, device) for c in _chunks(lay.share, job.batch_size)]
    _check_ranks(lay, chunks, model, run, _settings(job, pipe, req, lay, model, dtype, size))
    return chunks


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every chunk of one `sample` call shares: the family, the latent grid (h, w),
    the schedule, the guidance, the output and the step hook."""

    fam: str
    hw: tuple[int, int]
    steps: int
    sigmas: list | None
    guidance: float | None
    cfg: float | None
    output_type: str
    max_sequence_length: int | None
    batch_size: int | None
    on_step: Callable | None
    cache: object | None = None  # a _cache.CacheRun, or None
    lora: tuple | None = None  # per image, its (adapter, scale) pairs (`sampler._lora.per_image`), or None
    stock: _stock.StockArgs = _stock.StockArgs()  # the stock pipelines' further arguments, checked


def _settings(job: _Job, pipe, req, lay, model, dtype, size) -> dict:
    """Every scalar that shapes the result, for the agreement check across ranks."""
    sigmas = _scheduler(pipe, job.fam, job.hw[0] * job.hw[1] // 4, job.steps, "cpu", job.sigmas).sigmas
    return dict(
        height=size[0], width=size[1], steps=job.steps, sigmas=sigmas, guidance=job.guidance, true_cfg=job.cfg,
        dtype=dtype, output_type=job.output_type, images=req.n, share=lay.share, batch_size=job.batch_size,
        kv_cache=model.kv, max_sequence_length=job.max_sequence_length, noise=req.noise[0],
        cache=None if job.cache is None else repr(job.cache.config), lora=_lora_items.fingerprint(job.lora),
        cfg_normalize=job.stock.cfg_normalize,
        **{"strength": getattr(model, "strength", None), **getattr(model, "settings", {})},
    )  # fmt: skip


def _check_latents(model, pipe, req, h: int, w: int) -> None:
    """Given ``latents`` must have the stock pipeline's ``latents=`` layout (FLUX.2: the
    unpacked (B, C, h/2, w/2) noise; FLUX.1, Qwen-Image: packed (B, S, C))."""
    if req.noise[0] != "latents":
        return
    z = torch.empty(model.noise_shape(req.n, h, w), device="meta")
    want = tuple(model.pack(z).shape if model.packed_latents else z.shape)
    if tuple(req.noise[1].shape) != want:
        raise ValueError(
            f"latents: expected shape {want} ({type(pipe).__name__}'s latents= layout), got {tuple(req.noise[1].shape)}"
        )


def _run(ctx: _state.Context, params, chunk: _Chunk, job: _Job):
    """One chunk from noise to its output: its item (`_item`), `_state.step` until done
    (the step hook between steps), `_state.decode`."""
    fixed = _sample_xla.wanted(ctx.model, job, ctx.pipe, chunk.x.device)  # lazy devices: one fixed graph per step
    item = _item(ctx, chunk, job, fixed)
    hook = job.on_step
    if hook is not None:  # the chunk's tensors for callback_on_step_end
        hook = functools.partial(hook, tensors=_callback_tensors(job.stock.tensor_inputs, chunk))
    state = _state.State(ctx, (item,))
    if fixed:
        state = _fixed(params, state, hook)
    while not state.items[0].done:
        state = _state.step(params, state)
        if hook is not None:
            it = state.items[0]
            state = _state.State(ctx, (dataclasses.replace(it, x=hook(it.i - 1, it.timesteps[it.i - 1], it.x)),))
    if job.cache is not None:
        job.cache.end(state.items[0].cache_state)
    return _state.decode(state, job.output_type)


def _item(ctx: _state.Context, chunk: _Chunk, job: _Job, fixed: bool = False) -> _state.Item:
    """The chunk's item at step 0 (`_state.start`): a copy of the pipeline's scheduler
    (on the host for the fixed-graph loop), its adapters, IP-Adapter inputs and step cache."""
    model = ctx.model
    device = "cpu" if fixed else chunk.x.device
    sched = _scheduler(ctx.pipe, job.fam, chunk.x.shape[1], job.steps, device, job.sigmas)
    lora = None if job.lora is None else tuple(job.lora[i] for i in chunk.images)
    normalise = model.normalise_cfg if job.stock.cfg_normalize is None else job.stock.cfg_normalize
    fields = dict(images=chunk.images, lora=lora if lora and any(lora) else None, ip=job.stock.ip, normalise=normalise)
    item = _state.start(
        ctx, chunk.tables, chunk.x, chunk.cond, sched, job.hw, guidance=job.guidance, cfg=job.cfg, **fields
    )
    if job.cache is None:
        return item
    calls = model.cfg_calls if job.cfg is not None else 1  # model calls per step
    config, cache = job.cache.begin(len(item.timesteps), calls)
    return dataclasses.replace(item, cache=config, cache_state=cache)


def _fixed(params, state: _state.State, hook) -> _state.State:
    """The item's steps as fixed device graphs (`sampler_xla.denoise`: the same step, its
    schedule and inputs computed on the host first), the step hook between steps."""
    (it,) = state.items
    m = _state.bound(params, state.ctx, it)
    x = _sample_xla.denoise(m, copy.copy(it.sched), it.x, it.cond, it.cfg, it.normalise, hook)
    return _state.State(state.ctx, (dataclasses.replace(it, x=x, i=len(it.timesteps)),))


def _callback_tensors(names: tuple, chunk: _Chunk) -> dict:
    """The tensors ``callback_on_step_end`` gets besides the latents (by name)."""
    return {"prompt_embeds": chunk.prompt_embeds} if "prompt_embeds" in names else {}


def _on_step(pipe, callback, callback_on_step_end):
    """The step hook: ``callback(i, x)``, then the stock ``callback_on_step_end`` with the
    chunk's asked-for ``tensors`` ("latents" always first), whose returned "latents" (if
    any) replace x; new prompt embeddings are refused."""
    if callback is None and callback_on_step_end is None:
        return None

    def hook(i, t, x, tensors=None):
        if callback is not None:
            callback(i, x)
        if callback_on_step_end is not None:
            given = {"latents": x, **(tensors or {})}
            out = callback_on_step_end(pipe, i, t, dict(given)) or {}
            if "prompt_embeds" in out and out["prompt_embeds"] is not given.get("prompt_embeds"):
                raise ValueError(
                    "callback_on_step_end: returned new prompt_embeds; fd.sample takes new latents from the callback, "
                    "not new prompt embeddings (its text is encoded once per run)"
                )
            x = out.get("latents", x)
        return x

    return hook


def _family_model(fam: str, params, pipe, image, kv_cache, job=None):
    """The sampling steps after the argument checks: the family's image job's (``job``,
    from its product's ``image_job``), else its text-to-image steps (its product's ``steps``)."""
    return job(params, pipe) if job is not None else _product(fam).steps(params, pipe, image, kv_cache)


def _to(p: Prompt, dtype, device) -> Prompt:
    move = lambda t, dt=dtype: None if t is None else t.to(device=device, dtype=dt)  # noqa: E731
    uncond = None if p.uncond is None else _to(p.uncond, dtype, device)
    return dataclasses.replace(
        p, txt=move(p.txt), pooled=move(p.pooled), mask=move(p.mask, None), txt_ids=move(p.txt_ids, None), uncond=uncond
    )

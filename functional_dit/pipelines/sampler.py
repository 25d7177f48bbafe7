"""``fd.sample``: our own flow-matching denoising loop over ``fd.apply``.

diffusers supplies only the parts around the transformer: the scheduler
(``FlowMatchEulerDiscreteScheduler``), the text encoders (through the pipeline's own
``encode_prompt``, so prompt templates and hidden-state layers are the pipeline's) and
the VAE with its image processor. Everything else is here: the noise, latent packing,
position ids, the timestep shift each pipeline computes, classifier-free guidance as one
batched call, the FLUX.2-klein reference KV cache, and the unpacking for the VAE.

With the same seed the latents equal those of the stock pipeline with the stock
transformer (``FluxPipeline``, ``Flux2Pipeline``, ``Flux2KleinPipeline``,
``Flux2KleinKVPipeline``, ``QwenImagePipeline``, ``QwenImageEditPipeline``).

Per-step-invariant work is done once before the loop: prompt embeddings, position ids
and their RoPE tables (passed to ``fd.apply`` as ``rope=``), reference-image latents;
the klein reference KV cache is extracted on the first step and reused after.

Image ``i`` draws its noise from its own seed (`functional_dit.pipelines._requests`), so it is the
same image in any batch, chunk or rank. Sharded params work as they are: on a mesh with
``dp`` groups and at least as many images each group makes its own share of the images
with the mesh's tp and sp axes; with fewer images every rank runs the same loop and
``fd.apply`` splits the [cond; uncond] batch over dp (CFG parallelism)
(`functional_dit.pipelines._ranks`). Before the first step one check compares the settings and
inputs of the ranks that must agree and raises on every rank if they differ (nothing is
broadcast).

docs/sampling.md lists what is reproduced per pipeline class.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Mapping

import numpy as np
import torch

import sharding

from .. import api as _api
from .. import families as _families
from .. import flux1, flux2
from .. import qwenimage as _qwen
from ..params import Params
from . import _ranks, _requests
from . import cache as _cache
from ._sample_next import Flux3, Qwen21
from ._steps import Prompt, Steps

# The pipeline classes `sample` drives -> the family key of their transformer (the registry's).
PIPELINES = {name: _families.of_pipeline(name).KEY for name in _families.SAMPLED}
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
    import diffusers

    fam = _family_name(params)
    if isinstance(encoders, (diffusers.DiffusionPipeline, diffusers.ModularPipeline)):
        name = type(encoders).__name__
        if name not in PIPELINES:
            raise ValueError(f"encoders: expected one of the pipelines {sorted(PIPELINES)}, got {name}")
        if PIPELINES[name] != fam:
            raise ValueError(f"encoders: a {name} runs a {PIPELINES[name]} transformer, but params are {fam}")
        return encoders
    if not isinstance(encoders, Mapping):
        raise ValueError(f"encoders: expected a diffusers pipeline or a mapping of its components, got {encoders!r}")
    comps = {k: v for k, v in encoders.items() if k != "transformer"}
    cls = getattr(diffusers, _pipeline_class(fam, comps))
    return cls(**comps, transformer=None)


def _pipeline_class(fam: str, comps: Mapping) -> str:
    if fam == "flux1":
        return "FluxPipeline"
    if fam == "qwenimage21":
        return "QwenImage21Pipeline"
    if fam == "flux3":
        raise ValueError("encoders: for FLUX.3 pass the modular pipeline (Flux3ModularPipeline), not its components")
    if fam == "flux2":
        return "Flux2Pipeline" if "Mistral" in type(comps.get("text_encoder")).__name__ else "Flux2KleinPipeline"
    return "QwenImageEditPipeline" if comps.get("processor") is not None else "QwenImagePipeline"


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


def _param_device_dtype(params: Params):
    leaf = next(iter(params.flat().values()))
    if hasattr(leaf, "to_local"):  # a DTensor: the local shard's device
        leaf = leaf.to_local()
    return leaf.device, leaf.dtype


# ----------------------------------------------------------------------------- schedule


def _calculate_shift(seq_len: int, cfg) -> float:
    """FLUX.1 / Qwen-Image: mu linear in the image token count (diffusers' calculate_shift)."""
    base, top = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
    lo, hi = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
    m = (hi - lo) / (top - base)
    return seq_len * m + (lo - m * base)


def _empirical_mu(seq_len: int, steps: int) -> float:
    """FLUX.2: mu fitted to the token count and the number of steps (diffusers' compute_empirical_mu)."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if seq_len > 4300:
        return float(a2 * seq_len + b2)
    m_200, m_10 = a2 * seq_len + b2, a1 * seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + (m_200 - 200.0 * a))


def _scheduler(pipe, fam: str, seq_len: int, steps: int, device, sigmas=None):
    """A copy of the pipeline's scheduler set to ``steps`` sigmas linear from 1 to 1/steps
    (or the given ``sigmas``), shifted by the family's mu, exactly as the pipelines set it."""
    sched = copy.deepcopy(pipe.scheduler)
    sigmas = np.linspace(1.0, 1 / steps, steps) if sigmas is None else np.array(sigmas)
    sigmas = None if sched.config.get("use_flow_sigmas", False) else sigmas
    mu = _empirical_mu(seq_len, steps) if fam == "flux2" else _calculate_shift(seq_len, sched.config)
    sched.set_timesteps(sigmas=sigmas, device=device, mu=mu)
    sched.set_begin_index(0)
    return sched


# ----------------------------------------------------------------------------- latents


def pack_2x2(z: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 · W/2, 4C): 2x2 patches, channels first (FLUX.1, Qwen-Image)."""
    B, C, H, W = z.shape
    return z.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // 2) * (W // 2), C * 4)


def unpack_2x2(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack_2x2` for a latent of h x w (before packing)."""
    B, _, C4 = x.shape
    return x.view(B, h // 2, w // 2, C4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C4 // 4, h, w)


def grid_ids(h: int, w: int, n_axes: int, dtype, device, t: int = 0) -> torch.Tensor:
    """(h·w, n_axes) positions of an h x w token grid: axis 0 = t, 1 = row, 2 = col, rest 0."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.zeros(h * w, n_axes, dtype=torch.int64)
    ids[:, 0], ids[:, 1], ids[:, 2] = t, rows.reshape(-1), cols.reshape(-1)
    return ids.to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- families


class _Flux1(Steps):
    """FluxPipeline: T5 + CLIP pooled text, 2x2-packed 16-channel latents, 3-axis ids."""

    def __init__(self, params, pipe):
        self.params, self.pipe, self.c = params, pipe, params.config

    def encode(self, prompts, msl):
        txt, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, max_sequence_length=msl or 512)
        return Prompt(txt, pooled)

    def encode_embeds(self, msl, prompt_embeds, pooled_prompt_embeds):
        return Prompt(prompt_embeds, pooled_prompt_embeds)

    def noise_shape(self, B, h, w):
        return (B, self.c.in_channels // 4, h, w)

    pack = staticmethod(pack_2x2)
    take = staticmethod(lambda latents: latents)  # the pipeline's latents= are packed

    def prepare(self, cond: Prompt, h, w, guidance, device):
        img_ids = grid_ids(h // 2, w // 2, 3, torch.float32, device)
        txt_ids = torch.zeros(cond.txt.shape[1], 3, device=device)
        self.rope = flux1.rope_table(self.c, img_ids, txt_ids)
        self.guidance = 3.5 if guidance is None else guidance

    def __call__(self, x, t, cond: Prompt):
        g = torch.full((x.shape[0],), float(self.guidance), device=x.device) if self.c.guidance_embeds else None
        return self.apply(self.params, x, t, cond.txt, pooled=cond.pooled, guidance=g, rope=self.rope)

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        return unpack_2x2(x, h, w) / vae.config.scaling_factor + vae.config.shift_factor


class _Flux2(Steps):
    """Flux2Pipeline / Flux2KleinPipeline / Flux2KleinKVPipeline: stacked text-encoder
    layers, patchified 2x2 latents packed as tokens, 4-axis ids, reference images."""

    def __init__(self, params, pipe, kv_cache: bool):
        self.params, self.pipe, self.c, self.kv = params, pipe, params.config, kv_cache
        self.ref = self.ref_ids = self.cache = None

    def encode(self, prompts, msl):
        txt, txt_ids = self.pipe.encode_prompt(prompt=prompts, max_sequence_length=msl or 512)
        return Prompt(txt, txt_ids=txt_ids[0])

    def encode_embeds(self, msl, prompt_embeds):
        return Prompt(prompt_embeds, txt_ids=self.pipe._prepare_text_ids(prompt_embeds)[0].to(prompt_embeds.device))

    def noise_shape(self, B, h, w):
        return (B, self.c.in_channels, h // 2, w // 2)

    @staticmethod
    def pack(z):
        """(B, C, h/2, w/2) -> (B, h/2 · w/2, C): row-major tokens (also the pipeline's latents= layout)."""
        return z.reshape(*z.shape[:2], -1).permute(0, 2, 1)

    take = pack

    def images(self, images, B, device):
        """Reference images -> packed latents (B, R, C) and ids (R, 4), the pipeline's way."""
        pipe, multiple = self.pipe, self.pipe.vae_scale_factor * 2
        processed = []
        for img in images:
            pipe.image_processor.check_image_input(img)
            w, h = img.size
            if w * h > 1024 * 1024:
                img = pipe.image_processor._resize_to_target_area(img, 1024 * 1024)
                w, h = img.size
            w, h = w // multiple * multiple, h // multiple * multiple
            processed.append(pipe.image_processor.preprocess(img, height=h, width=w, resize_mode="crop"))
        ref, ids = pipe.prepare_image_latents(processed, B, None, device, pipe.vae.dtype)
        self.ref, self.ref_ids = ref, ids[0]

    def prepare(self, cond: Prompt, h, w, guidance, device):
        img_ids = grid_ids(h // 2, w // 2, 4, torch.int64, device)
        if self.ref is not None:
            img_ids = torch.cat([self.ref_ids, img_ids] if self.kv else [img_ids, self.ref_ids])
        self.rope = flux2.rope_table(self.c, img_ids, cond.txt_ids)
        if self.kv and self.ref is not None:  # later steps: no reference rows
            n, S = cond.txt_ids.shape[0], img_ids.shape[0] - self.ref.shape[1]
            self.rope_cached = tuple(torch.cat([a[:n], a[a.shape[0] - S :]]) for a in self.rope)
        self.guidance = (4.0 if guidance is None else guidance) if self.c.guidance_embeds else None
        self.cache = None  # a new batch extracts its own reference KV cache

    def __call__(self, x, t, cond: Prompt):
        B, S = x.shape[:2]
        g = None if self.guidance is None else torch.full((B,), float(self.guidance), device=x.device)
        kw = dict(guidance=g)
        if self.ref is None:
            return self.apply(self.params, x, t, cond.txt, rope=self.rope, **kw)
        ref = _batch(self.ref, B).to(x.dtype)
        if not self.kv:
            return self.apply(self.params, torch.cat([x, ref], 1), t, cond.txt, rope=self.rope, **kw)[:, :S]
        if self.cache is None:
            x = torch.cat([ref, x], 1)
            out, self.cache = _api.apply(
                self.params, x, t, cond.txt, rope=self.rope, kv_cache="extract", num_ref_tokens=ref.shape[1], **kw
            )
            return out
        return self.apply(self.params, x, t, cond.txt, rope=self.rope_cached, kv_cache=self.cache, **kw)

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        B, _, C = x.shape
        z = x.permute(0, 2, 1).reshape(B, C, h // 2, w // 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        z = z * std + mean
        return z.reshape(B, C // 4, 2, 2, h // 2, w // 2).permute(0, 1, 4, 2, 5, 3).reshape(B, C // 4, h, w)


class _Qwen(Steps):
    """QwenImagePipeline / QwenImageEditPipeline: Qwen2.5-VL text (ragged, masked),
    2x2-packed latents with a frame axis, RoPE from img_shapes, normalised true CFG."""

    normalise_cfg = True

    def __init__(self, params, pipe):
        self.params, self.pipe, self.c = params, pipe, params.config
        self.ref = self.prompt_image = None
        self.ref_shape = None

    def encode(self, prompts, msl):
        kw = {} if self.prompt_image is None else {"image": self.prompt_image}
        txt, mask = self.pipe.encode_prompt(prompt=prompts, max_sequence_length=msl or 512, **kw)
        return Prompt(txt, mask=mask)

    def encode_embeds(self, msl, prompt_embeds, prompt_embeds_mask=None):
        """As the pipeline's encode_prompt with embeddings: cut to ``msl``, all-real mask -> None."""
        txt, mask = prompt_embeds[:, : msl or 512], prompt_embeds_mask
        mask = None if mask is None or bool(mask[:, : txt.shape[1]].all()) else mask[:, : txt.shape[1]]
        return Prompt(txt, mask=mask)

    def noise_shape(self, B, h, w):
        return (B, 1, self.c.in_channels // 4, h, w)

    pack = staticmethod(lambda z: pack_2x2(z[:, 0]))
    take = staticmethod(lambda latents: latents)  # the pipeline's latents= are packed

    def images(self, images, B, device):
        """The Edit pipeline's reference: resized to about 1024² (multiple of 32), VAE-encoded
        (distribution mode), normalised, packed; also the image its text encoder sees."""
        if len(images) != 1:
            raise ValueError(f"image: QwenImageEditPipeline takes one reference image, got {len(images)}")
        pipe, img = self.pipe, images[0]
        w, h = _qwen_edit_size(img.size)
        self.prompt_image = pipe.image_processor.resize(img, h, w)
        pixels = pipe.image_processor.preprocess(self.prompt_image, h, w).unsqueeze(2)
        z = pipe._encode_vae_image(pixels.to(device=device, dtype=pipe.vae.dtype), generator=None)
        self.ref = _batch(pack_2x2(z[:, :, 0]), B)
        self.ref_shape = (1, z.shape[3] // 2, z.shape[4] // 2)

    def prepare(self, cond: Prompt, h, w, guidance, device):
        self.shapes = [(1, h // 2, w // 2)] + ([self.ref_shape] if self.ref is not None else [])
        self.rope = _qwen.pos_embed(self.shapes, cond.txt.shape[1], self.c.axes_dims_rope, device=device)

    def __call__(self, x, t, cond: Prompt):
        B, S = x.shape[:2]
        if self.ref is not None:
            x = torch.cat([x, _batch(self.ref, B).to(x.dtype)], 1)
        out = self.apply(self.params, x, t, cond.txt, txt_mask=cond.mask, img_shapes=[self.shapes] * B, rope=self.rope)
        return out[:, :S]

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        z = unpack_2x2(x, h, w)[:, :, None].to(vae.dtype)  # (B, C, 1, h, w)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        return z / std + mean


def _qwen_edit_size(size) -> tuple[int, int]:
    """(width, height) of about 1024² pixels with the image's aspect ratio, multiples of 32."""
    ratio = size[0] / size[1]
    w = math.sqrt(1024 * 1024 * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


def _batch(t: torch.Tensor, B: int) -> torch.Tensor:
    """Repeat a batch of b to B rows (B a multiple of b), as the pipelines repeat references."""
    return t if t.shape[0] == B else t.repeat(B // t.shape[0], *([1] * (t.ndim - 1)))


# ----------------------------------------------------------------------------- CFG


def combine(pred: torch.Tensor, scale: float, normalise: bool) -> torch.Tensor:
    """[cond; uncond] predictions -> ``uncond + scale (cond - uncond)``; Qwen-Image rescales
    each token to the conditional prediction's norm (``normalise``)."""
    cond, uncond = pred.chunk(2)
    out = uncond + scale * (cond - uncond)
    if normalise:
        out = out * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(out, dim=-1, keepdim=True))
    return out


# ----------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class _Chunk:
    """One model batch: its image indices, packed noise (B, S, C) and text (CFG-batched)."""

    images: tuple[int, ...]
    x: torch.Tensor
    cond: Prompt


def _chunks(share, batch_size: int | None) -> list[tuple[int, ...]]:
    """``share`` in runs of ``batch_size`` images (None: all at once)."""
    size = batch_size or max(len(share), 1)
    return [tuple(share[i : i + size]) for i in range(0, len(share), size)]


def _encode(model, strings, embeds: dict, rows, msl, prefix: str = "") -> Prompt:
    """The text of prompt ``rows``: encoded strings, or rows of the given embeddings."""
    if embeds:
        return model.encode_embeds(msl, **{k[len(prefix) :]: v[rows] for k, v in embeds.items()})
    return model.encode([strings[r] for r in rows], msl)


def _chunk(model, req, images, job, dtype, device) -> _Chunk:
    """Encode the chunk's prompts (and negatives with CFG) and draw its noise."""
    rows, msl = req.rows(images), job.max_sequence_length
    cond = _to(_encode(model, req.prompts, req.embeds, rows, msl), dtype, device)
    if job.cfg is not None:
        neg = _encode(model, req.negatives, req.negative_embeds, rows, msl, "negative_")
        neg = _to(neg, dtype, device)
        cond = model.cfg_batch(cond, neg)
    shape = lambda B: model.noise_shape(B, *job.hw)  # noqa: E731
    return _Chunk(images, _requests.draw(req.noise, images, shape, model.pack, model.take, dtype, device), cond)


def _check_ranks(lay, chunks, model, settings: dict) -> None:
    """Once, before the first step: the ranks that compute the same images (a dp group's
    tp/sp ranks) must hold the same settings and inputs (fd.apply assumes it and splits
    them itself). Raises the same ValueError on every rank otherwise."""
    tensors = {"latents (seed)": [c.x for c in chunks], "prompt embeddings (prompt)": [c.cond.txt for c in chunks]}
    for name, field in (("pooled (prompt)", "pooled"), ("prompt mask (prompt)", "mask")):
        if any(getattr(c.cond, field) is not None for c in chunks):
            tensors[name] = [getattr(c.cond, field) for c in chunks]
    if model.ref is not None:
        tensors["reference latents (image)"] = model.ref
    _ranks.check(lay, settings, tensors)


def sample(
    params: Params,
    encoders,
    prompt=None,
    *,
    height: int,
    width: int,
    steps: int | None = None,
    seed=None,
    guidance: float | None = None,
    true_cfg: float | None = None,
    negative_prompt=None,
    image=None,
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
):
    """Generate images with ``params`` (plain or sharded) and our own denoising loop.

    ``encoders``: a diffusers pipeline of a supported class (``FluxPipeline``,
    ``Flux2Pipeline``, ``Flux2KleinPipeline``, ``Flux2KleinKVPipeline``,
    ``QwenImagePipeline``, ``QwenImageEditPipeline``; its transformer is ignored and may be
    None, e.g. ``from_pretrained(path, transformer=None)``) or a mapping of its components.
    ``prompt``: a string or a list, ``num_images_per_prompt`` images each (image ``i`` is
    prompt ``i // num_images_per_prompt``'s); or None with ``prompt_embeds`` (and
    ``pooled_prompt_embeds`` for FLUX.1, ``prompt_embeds_mask`` for Qwen-Image, their
    ``negative_`` twins for CFG: the stock pipelines' arguments; the text encoders may then
    be None). ``height``/``width``: pixels, multiples of the VAE scale x 2.

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
    ``true_cfg_scale``, klein's ``guidance_scale``; FLUX.1's ``true_cfg_scale``).
    ``image``: reference image(s) (PIL) for FLUX.2 (dev, klein) and Qwen-Image-Edit.
    ``kv_cache``: FLUX.2 with reference images: extract the reference tokens' keys and
    values on the first step and reuse them (``Flux2KleinKVPipeline``); default True for a
    ``Flux2KleinKVPipeline``, else False.
    ``output_type``: "pil" (list of images), "np", "pt" (B, 3, H, W) in [0, 1], or
    "latent" (the packed latents the pipelines return for ``output_type="latent"``).
    ``callback(step, latents)`` runs after every step; ``callback_on_step_end(pipe, step, t,
    {"latents": latents})`` too, and the "latents" of the dict it returns replace them.

    On a mesh with ``dp`` groups and at least as many images, each group makes a contiguous
    share of the images (`functional_dit.pipelines._ranks`), ``batch_size`` images per model call
    (None: its whole share at once). Returns every image on every rank, or with ``local``
    ``(indices, images)`` of this rank's group only. docs/sampling.md says what is bitwise.
    ``cache``: step caching (`functional_dit.pipelines.cache`): ``fd.FirstBlockCache(0.08)``,
    ``fd.TaylorSeer(...)``, ``fd.MagCache(...)``, a spec such as ``"fbcache:0.08"``, or an
    ``fd.CacheRun`` (which then holds the last state and every step's decisions).
    """
    fam = _family_name(params)
    pipe = as_pipeline(encoders, params)
    _check_args(pipe, height, width, output_type, batch_size)
    steps, sigmas = _check_steps(steps, sigmas)
    _requests.check_max_sequence_length(fam, max_sequence_length)
    cfg = float(true_cfg) if true_cfg is not None and true_cfg > 1 else None
    given = {k: v for k, v in locals().items() if "prompt_embeds" in k}  # the six stock embedding arguments
    req = _requests.requests(fam, prompt, num_images_per_prompt, seed, latents, negative_prompt, cfg is not None, given)
    device, dtype = _param_device_dtype(params)
    local_params, mesh = sharding.local_view(params)
    lay = _ranks.layout(mesh, req.n)
    model = _family_model(fam, local_params if lay.split else params, pipe, image, kv_cache)
    hw = 2 * (height // (pipe.vae_scale_factor * 2)), 2 * (width // (pipe.vae_scale_factor * 2))
    _check_latents(model, pipe, req, *hw)
    on_step = _on_step(pipe, callback, callback_on_step_end)
    run = _cache.CacheRun.of(cache, image is not None and bool(model.kv))
    if run is not None and not model.step_cache:
        raise ValueError(f"cache: step caching is not supported for {fam} yet; expected None")
    job = _Job(fam, hw, steps, sigmas, guidance, cfg, output_type, max_sequence_length, batch_size, on_step, run)
    with torch.no_grad():
        if image is not None:
            model.images(image if isinstance(image, (list, tuple)) else [image], 1, device)
        chunks = [_chunk(model, req, c, job, dtype, device) for c in _chunks(lay.share, batch_size)]
        _check_ranks(lay, chunks, model, _settings(job, pipe, req, lay, model, dtype, (height, width)))
        with sharding.bind(lay.mesh) if lay.split else contextlib.nullcontext():
            parts = [_run(model, pipe, c, job) for c in chunks]
        return _ranks.collect(lay, _ranks.concat(parts, output_type), output_type, local)


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


def _settings(job: _Job, pipe, req, lay, model, dtype, size) -> dict:
    """Every scalar that shapes the result, for the agreement check across ranks."""
    sigmas = _scheduler(pipe, job.fam, job.hw[0] * job.hw[1] // 4, job.steps, "cpu", job.sigmas).sigmas
    return dict(
        height=size[0], width=size[1], steps=job.steps, sigmas=sigmas, guidance=job.guidance, true_cfg=job.cfg,
        dtype=dtype, output_type=job.output_type, images=req.n, share=lay.share, batch_size=job.batch_size,
        kv_cache=model.kv, max_sequence_length=job.max_sequence_length, noise=req.noise[0],
        cache=None if job.cache is None else repr(job.cache.config),
    )  # fmt: skip


def _check_latents(model, pipe, req, h: int, w: int) -> None:
    """Given ``latents`` must have the stock pipeline's ``latents=`` layout (FLUX.2: the
    unpacked (B, C, h/2, w/2) noise; FLUX.1, Qwen-Image: packed (B, S, C))."""
    if req.noise[0] != "latents":
        return
    z = torch.empty(model.noise_shape(req.n, h, w), device="meta")
    want = tuple(z.shape if isinstance(model, _Flux2) else model.pack(z).shape)
    if tuple(req.noise[1].shape) != want:
        raise ValueError(
            f"latents: expected shape {want} ({type(pipe).__name__}'s latents= layout), got {tuple(req.noise[1].shape)}"
        )


def _run(model, pipe, chunk: _Chunk, job: _Job):
    """One chunk from noise to its output: prepare, denoise, decode."""
    device = chunk.x.device
    model.prepare(chunk.cond, *job.hw, job.guidance, device)
    sched = _scheduler(pipe, job.fam, chunk.x.shape[1], job.steps, device, job.sigmas)
    model.schedule(sched)
    x = _denoise(model, sched, chunk.x, chunk.cond, job.cfg, model.normalise_cfg, job.on_step, job.cache)
    return x if job.output_type == "latent" else _decode(model, pipe, x, *job.hw, job.output_type)


def _on_step(pipe, callback, callback_on_step_end):
    """The step hook: ``callback(i, x)``, then the stock ``callback_on_step_end``, whose
    returned "latents" (if any) replace x."""
    if callback is None and callback_on_step_end is None:
        return None

    def hook(i, t, x):
        if callback is not None:
            callback(i, x)
        if callback_on_step_end is not None:
            x = (callback_on_step_end(pipe, i, t, {"latents": x}) or {}).get("latents", x)
        return x

    return hook


def _family_model(fam: str, params, pipe, image, kv_cache):
    """The per-family sampling steps (`_Flux1`, `_Flux2`, `_Qwen`) after the argument checks."""
    import diffusers

    if image is not None and (fam == "flux1" or isinstance(pipe, diffusers.QwenImagePipeline)):
        raise ValueError(f"image: a {type(pipe).__name__} takes no reference image; expected None")
    if image is None and isinstance(pipe, diffusers.QwenImageEditPipeline):
        raise ValueError("image: a QwenImageEditPipeline edits a reference image; expected a PIL image, got None")
    if fam == "qwenimage21":
        return Qwen21(params, pipe, kv_cache)
    if fam == "flux3" and not kv_cache and image is None:
        return Flux3(params, pipe)
    if fam == "flux3":
        raise ValueError("image, kv_cache: fd.sample runs FLUX.3 text to image only; expected None")
    if kv_cache and fam != "flux2":
        raise ValueError(f"kv_cache: the reference KV cache is FLUX.2's; expected None or False for {fam}")
    if fam == "flux1":
        return _Flux1(params, pipe)
    if fam == "flux2":
        return _Flux2(params, pipe, isinstance(pipe, diffusers.Flux2KleinKVPipeline) if kv_cache is None else kv_cache)
    return _Qwen(params, pipe)


def _denoise(model, sched, x, cond: Prompt, cfg: float | None, normalise: bool, callback, run=None):
    """The loop: one model call per step ([cond; uncond] as one batch with CFG), then the
    scheduler's Euler step; ``callback(i, t, x)`` may return new latents; with a
    `_cache.CacheRun`, the calls go through its step cache."""
    if run is not None:
        model.apply = run.start(branches=1 if cfg is None else 2, steps=len(sched.timesteps))
    for i, t in enumerate(sched.timesteps):
        xin = torch.cat([x, x]) if cfg is not None else x
        pred = model(xin, t.expand(xin.shape[0]).to(x.dtype) / 1000, cond)
        if cfg is not None:
            pred = combine(pred, cfg, normalise)
        x = sched.step(pred, t, x, return_dict=False)[0]
        if callback is not None:
            x = callback(i, t, x)
    return x


def _decode(model, pipe, x, h: int, w: int, output_type: str):
    """Packed latents -> the VAE's input (the family's unpacking and de-normalisation) ->
    images through the pipeline's image processor."""
    z = model.decode_latents(x, h, w).to(pipe.vae.device, pipe.vae.dtype)
    img = pipe.vae.decode(z, return_dict=False)[0]
    img = img[:, :, 0] if img.ndim == 5 else img  # Qwen-Image's VAE has a frame axis
    return pipe.image_processor.postprocess(img, output_type=output_type)


def _to(p: Prompt, dtype, device) -> Prompt:
    move = lambda t, dt=dtype: None if t is None else t.to(device=device, dtype=dt)  # noqa: E731
    return Prompt(move(p.txt), move(p.pooled), move(p.mask, None), move(p.txt_ids, None))

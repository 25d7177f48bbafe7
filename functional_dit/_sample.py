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

Sharded params work as they are: every rank runs the same loop on the same inputs and
``fd.apply`` splits the work (tp, sp) and the batch (dp). With classifier-free guidance
the conditional and unconditional branches are one batch of 2B, so on a ``dp=2`` mesh
each rank computes one branch (CFG parallelism). Every rank draws the same noise from
``seed``; before the first step `sharding.check_replicated` compares the inputs across
ranks and raises on every rank if they differ (nothing is broadcast).

docs/sampling.md lists what is reproduced per pipeline class.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping

import numpy as np
import torch

import sharding

from . import _api, flux1, flux2
from . import qwenimage as _qwen
from ._pytree import Params

# The pipeline classes `sample` drives, by transformer family.
PIPELINES = {
    "FluxPipeline": "flux1",
    "Flux2Pipeline": "flux2",
    "Flux2KleinPipeline": "flux2",
    "Flux2KleinKVPipeline": "flux2",
    "QwenImagePipeline": "qwenimage",
    "QwenImageEditPipeline": "qwenimage",
}
_OUTPUT_TYPES = ("pil", "np", "pt", "latent")


@dataclasses.dataclass
class Prompt:
    """Text conditioning for one batch: txt (B, T, C), FLUX.1's pooled (B, C'), Qwen's
    mask (B, T) 1 = real token or None, FLUX.2's txt_ids (T, 4)."""

    txt: torch.Tensor
    pooled: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    txt_ids: torch.Tensor | None = None


# ----------------------------------------------------------------------------- encoders


def _family_name(params) -> str:
    """ "flux1", "flux2" or "qwenimage" from the params' config class."""
    config = getattr(params, "config", None)
    for name, cls in (("flux1", flux1.Flux1Config), ("flux2", flux2.Flux2Config), ("qwenimage", _qwen.QwenImageConfig)):
        if isinstance(config, cls):
            return name
    raise ValueError(f"params: expected fd.Params of FLUX.1, FLUX.2 or Qwen-Image, got {type(params).__name__}")


def as_pipeline(encoders, params):
    """A diffusers pipeline whose scheduler, VAE and text encoders we use: ``encoders``
    itself when it is one (its transformer, if any, is never called), or one built from
    a mapping of components (as ``DiffusionPipeline.components`` or
    ``functional_dit.tiny.components`` give) with no transformer."""
    import diffusers

    fam = _family_name(params)
    if isinstance(encoders, diffusers.DiffusionPipeline):
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
    if fam == "flux2":
        return "Flux2Pipeline" if "Mistral" in type(comps.get("text_encoder")).__name__ else "Flux2KleinPipeline"
    return "QwenImageEditPipeline" if comps.get("processor") is not None else "QwenImagePipeline"


# ----------------------------------------------------------------------------- checks


def _check_args(pipe, prompt, height, width, steps, seed, output_type):
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompt: expected a string or a non-empty list of strings, got {prompt!r}")
    multiple = pipe.vae_scale_factor * 2
    for name, v in (("height", height), ("width", width)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v % multiple:
            raise ValueError(
                f"{name}: expected a positive multiple of {multiple} (VAE scale {pipe.vae_scale_factor} x 2x2 "
                f"packing), got {v!r}"
            )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    if output_type not in _OUTPUT_TYPES:
        raise ValueError(f"output_type: expected one of {list(_OUTPUT_TYPES)}, got {output_type!r}")
    return list(prompts)


def _negatives(negative_prompt, n: int) -> list[str]:
    neg = "" if negative_prompt is None else negative_prompt
    neg = [neg] * n if isinstance(neg, str) else list(neg)
    if len(neg) != n or not all(isinstance(p, str) for p in neg):
        raise ValueError(f"negative_prompt: expected a string or {n} strings (one per prompt), got {negative_prompt!r}")
    return neg


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


def _scheduler(pipe, fam: str, seq_len: int, steps: int, device):
    """A copy of the pipeline's scheduler set to ``steps`` sigmas linear from 1 to 1/steps,
    shifted by the family's mu, exactly as the pipelines set it."""
    sched = copy.deepcopy(pipe.scheduler)
    sigmas = None if sched.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
    mu = _empirical_mu(seq_len, steps) if fam == "flux2" else _calculate_shift(seq_len, sched.config)
    sched.set_timesteps(sigmas=sigmas, device=device, mu=mu)
    sched.set_begin_index(0)
    return sched


# ----------------------------------------------------------------------------- latents


def _noise(shape, seed: int, dtype, device) -> torch.Tensor:
    """Gaussian noise from a CPU generator seeded with ``seed`` (what the pipelines draw
    with ``generator=torch.Generator().manual_seed(seed)``), then moved to ``device``."""
    gen = torch.Generator("cpu").manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=dtype).to(device)


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


class _Flux1:
    """FluxPipeline: T5 + CLIP pooled text, 2x2-packed 16-channel latents, 3-axis ids."""

    def __init__(self, params, pipe):
        self.params, self.pipe, self.c = params, pipe, params.config

    def encode(self, prompts, msl):
        txt, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, max_sequence_length=msl or 512)
        return Prompt(txt, pooled)

    def latents(self, B, h, w, seed, dtype, device):
        return pack_2x2(_noise((B, self.c.in_channels // 4, h, w), seed, dtype, device))

    def prepare(self, cond: Prompt, h, w, guidance, device):
        img_ids = grid_ids(h // 2, w // 2, 3, torch.float32, device)
        txt_ids = torch.zeros(cond.txt.shape[1], 3, device=device)
        self.rope = flux1.rope_table(self.c, img_ids, txt_ids)
        self.guidance = 3.5 if guidance is None else guidance

    def __call__(self, x, t, cond: Prompt):
        g = torch.full((x.shape[0],), float(self.guidance), device=x.device) if self.c.guidance_embeds else None
        return _api.apply(self.params, x, t, cond.txt, pooled=cond.pooled, guidance=g, rope=self.rope)

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        return unpack_2x2(x, h, w) / vae.config.scaling_factor + vae.config.shift_factor


class _Flux2:
    """Flux2Pipeline / Flux2KleinPipeline / Flux2KleinKVPipeline: stacked text-encoder
    layers, patchified 2x2 latents packed as tokens, 4-axis ids, reference images."""

    def __init__(self, params, pipe, kv_cache: bool):
        self.params, self.pipe, self.c, self.kv = params, pipe, params.config, kv_cache
        self.ref = self.ref_ids = self.cache = None

    def encode(self, prompts, msl):
        txt, txt_ids = self.pipe.encode_prompt(prompt=prompts, max_sequence_length=msl or 512)
        return Prompt(txt, txt_ids=txt_ids[0])

    def latents(self, B, h, w, seed, dtype, device):
        z = _noise((B, self.c.in_channels, h // 2, w // 2), seed, dtype, device)
        return z.reshape(B, self.c.in_channels, -1).permute(0, 2, 1)

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

    def __call__(self, x, t, cond: Prompt):
        B, S = x.shape[:2]
        g = None if self.guidance is None else torch.full((B,), float(self.guidance), device=x.device)
        kw = dict(guidance=g)
        if self.ref is None:
            return _api.apply(self.params, x, t, cond.txt, rope=self.rope, **kw)
        ref = _batch(self.ref, B).to(x.dtype)
        if not self.kv:
            return _api.apply(self.params, torch.cat([x, ref], 1), t, cond.txt, rope=self.rope, **kw)[:, :S]
        if self.cache is None:
            x = torch.cat([ref, x], 1)
            out, self.cache = _api.apply(
                self.params, x, t, cond.txt, rope=self.rope, kv_cache="extract", num_ref_tokens=ref.shape[1], **kw
            )
            return out
        return _api.apply(self.params, x, t, cond.txt, rope=self.rope_cached, kv_cache=self.cache, **kw)

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        B, _, C = x.shape
        z = x.permute(0, 2, 1).reshape(B, C, h // 2, w // 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        z = z * std + mean
        return z.reshape(B, C // 4, 2, 2, h // 2, w // 2).permute(0, 1, 4, 2, 5, 3).reshape(B, C // 4, h, w)


class _Qwen:
    """QwenImagePipeline / QwenImageEditPipeline: Qwen2.5-VL text (ragged, masked),
    2x2-packed latents with a frame axis, RoPE from img_shapes, normalised true CFG."""

    def __init__(self, params, pipe):
        self.params, self.pipe, self.c = params, pipe, params.config
        self.ref = self.prompt_image = None
        self.ref_shape = None

    def encode(self, prompts, msl):
        kw = {} if self.prompt_image is None else {"image": self.prompt_image}
        txt, mask = self.pipe.encode_prompt(prompt=prompts, max_sequence_length=msl or 512, **kw)
        return Prompt(txt, mask=mask)

    def latents(self, B, h, w, seed, dtype, device):
        z = _noise((B, 1, self.c.in_channels // 4, h, w), seed, dtype, device)
        return pack_2x2(z[:, 0])

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
        out = _api.apply(self.params, x, t, cond.txt, txt_mask=cond.mask, img_shapes=[self.shapes] * B, rope=self.rope)
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


def _pad_to(p: Prompt, T: int) -> Prompt:
    """Right-pad a prompt batch with masked (zero) tokens to T tokens (Qwen's ragged prompts)."""
    B, n = p.txt.shape[:2]
    mask = torch.ones(B, n, dtype=torch.long, device=p.txt.device) if p.mask is None else p.mask
    if n == T:
        return dataclasses.replace(p, mask=mask)
    txt = torch.cat([p.txt, p.txt.new_zeros(B, T - n, p.txt.shape[2])], 1)
    return dataclasses.replace(p, txt=txt, mask=torch.cat([mask, mask.new_zeros(B, T - n)], 1))


def cfg_batch(cond: Prompt, uncond: Prompt) -> Prompt:
    """[cond; uncond] as one batch of 2B: both branches in one call (on a dp=2 mesh, one
    per rank). Ragged masked prompts are padded to a common length with masked tokens."""
    if cond.mask is not None or uncond.mask is not None or cond.txt.shape[1] != uncond.txt.shape[1]:
        T = max(cond.txt.shape[1], uncond.txt.shape[1])
        cond, uncond = _pad_to(cond, T), _pad_to(uncond, T)
    cat = lambda a, b: None if a is None else torch.cat([a, b])  # noqa: E731
    mask = cat(cond.mask, uncond.mask)
    mask = None if mask is not None and bool(mask.all()) else mask  # as the pipelines: all real -> None
    return Prompt(cat(cond.txt, uncond.txt), cat(cond.pooled, uncond.pooled), mask, cond.txt_ids)


def combine(pred: torch.Tensor, scale: float, normalise: bool) -> torch.Tensor:
    """[cond; uncond] predictions -> ``uncond + scale (cond - uncond)``; Qwen-Image rescales
    each token to the conditional prediction's norm (``normalise``)."""
    cond, uncond = pred.chunk(2)
    out = uncond + scale * (cond - uncond)
    if normalise:
        out = out * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(out, dim=-1, keepdim=True))
    return out


# ----------------------------------------------------------------------------- the loop


def _check_ranks(x: torch.Tensor, cond: Prompt, model) -> None:
    """Once, before the first step: every rank must hold the same inputs (fd.apply
    assumes it and splits them itself). Raises on every rank otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    named = {"latents (seed)": x, "prompt embeddings (prompt)": cond.txt}
    for name, t in (("pooled (prompt)", cond.pooled), ("prompt mask (prompt)", cond.mask)):
        if t is not None:
            named[name] = t
    ref = getattr(model, "ref", None)
    if ref is not None:
        named["reference latents (image)"] = ref
    sharding.check_replicated(*named.values(), names=list(named))


def sample(
    params: Params,
    encoders,
    prompt,
    *,
    height: int,
    width: int,
    steps: int,
    seed: int,
    guidance: float | None = None,
    true_cfg: float | None = None,
    negative_prompt=None,
    image=None,
    kv_cache: bool | None = None,
    max_sequence_length: int | None = None,
    output_type: str = "pil",
    callback: Callable[[int, torch.Tensor], None] | None = None,
):
    """Generate images with ``params`` (plain or sharded) and our own denoising loop.

    ``encoders``: a diffusers pipeline of a supported class (``FluxPipeline``,
    ``Flux2Pipeline``, ``Flux2KleinPipeline``, ``Flux2KleinKVPipeline``,
    ``QwenImagePipeline``, ``QwenImageEditPipeline``; its transformer is ignored and may be
    None, e.g. ``from_pretrained(path, transformer=None)``) or a mapping of its components.
    ``prompt``: a string or a list (one image each). ``height``/``width``: pixels, multiples
    of the VAE scale x 2. ``seed``: the noise is ``torch.randn`` from a CPU generator with
    this seed, as the pipelines draw it with ``generator=torch.Generator().manual_seed(seed)``.

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
    ``callback(step, latents)`` runs after every step.
    """
    fam = _family_name(params)
    pipe = as_pipeline(encoders, params)
    prompts = _check_args(pipe, prompt, height, width, steps, seed, output_type)
    device, dtype = _param_device_dtype(params)
    model = _family_model(fam, params, pipe, image, kv_cache)
    B, h, w = len(prompts), 2 * (height // (pipe.vae_scale_factor * 2)), 2 * (width // (pipe.vae_scale_factor * 2))
    cfg = float(true_cfg) if true_cfg is not None and true_cfg > 1 else None
    with torch.no_grad():
        if image is not None:
            model.images(image if isinstance(image, (list, tuple)) else [image], B, device)
        cond = _to(model.encode(prompts, max_sequence_length), dtype, device)
        if cfg is not None:
            neg = _to(model.encode(_negatives(negative_prompt, B), max_sequence_length), dtype, device)
            cond = cfg_batch(cond, neg)
        x = model.latents(B, h, w, seed, dtype, device)
        model.prepare(cond, h, w, guidance, device)
        sched = _scheduler(pipe, fam, x.shape[1], steps, device)
        _check_ranks(x, cond, model)
        x = _denoise(model, sched, x, cond, cfg, fam == "qwenimage", callback)
        return x if output_type == "latent" else _decode(model, pipe, x, h, w, output_type)


def _family_model(fam: str, params, pipe, image, kv_cache):
    """The per-family sampling steps (`_Flux1`, `_Flux2`, `_Qwen`) after the argument checks."""
    import diffusers

    if image is not None and (fam == "flux1" or isinstance(pipe, diffusers.QwenImagePipeline)):
        raise ValueError(f"image: a {type(pipe).__name__} takes no reference image; expected None")
    if image is None and isinstance(pipe, diffusers.QwenImageEditPipeline):
        raise ValueError("image: a QwenImageEditPipeline edits a reference image; expected a PIL image, got None")
    if kv_cache and fam != "flux2":
        raise ValueError(f"kv_cache: the reference KV cache is FLUX.2's; expected None or False for {fam}")
    if fam == "flux1":
        return _Flux1(params, pipe)
    if fam == "flux2":
        return _Flux2(params, pipe, isinstance(pipe, diffusers.Flux2KleinKVPipeline) if kv_cache is None else kv_cache)
    return _Qwen(params, pipe)


def _denoise(model, sched, x, cond: Prompt, cfg: float | None, normalise: bool, callback):
    """The loop: one model call per step ([cond; uncond] as one batch with CFG), then the
    scheduler's Euler step."""
    for i, t in enumerate(sched.timesteps):
        xin = torch.cat([x, x]) if cfg is not None else x
        pred = model(xin, t.expand(xin.shape[0]).to(x.dtype) / 1000, cond)
        if cfg is not None:
            pred = combine(pred, cfg, normalise)
        x = sched.step(pred, t, x, return_dict=False)[0]
        if callback is not None:
            callback(i, x)
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

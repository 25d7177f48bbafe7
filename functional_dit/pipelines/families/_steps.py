"""The sampler-family protocol: what `fd.sample`'s loop asks of each family's sampling
steps (each family's in its product module, `functional_dit.pipelines.families`), declared
once here with the defaults that only some families override, so the loop calls every
hook unconditionally. The steps are a frozen description; every hook is a pure function
of its arguments, its per-run and per-item values returned as immutable tables. Also the
text conditioning the steps pass around (`Prompt`) and the default classifier-free-guidance
batching (`cfg_batch`).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

import torch

from ... import api as _api


@dataclasses.dataclass
class Prompt:
    """Text conditioning for one batch: txt (B, T, C), FLUX.1's pooled (B, C'), Qwen's
    mask (B, T) 1 = real token or None, FLUX.2's txt_ids (T, 4)."""

    txt: torch.Tensor
    pooled: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    txt_ids: torch.Tensor | None = None
    pad: torch.Tensor | None = None  # Qwen-Image 2.1: the prompt's image-slot pads (its layout)
    uncond: Prompt | None = None  # Qwen-Image 2.1: the CFG branch kept apart (its own layout)


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


def plain_apply(*args, **kwargs):
    """`fd.apply`, looked up when called (a batch's ``apply`` wraps it: adapters, caches)."""
    return _api.apply(*args, **kwargs)


NO_TABLES: Mapping = types.MappingProxyType({})


def tables(base: Mapping = NO_TABLES, **more) -> Mapping:
    """An immutable mapping of ``base`` with ``more`` (a family's tables: tensors and
    small values, never changed after they are made)."""
    return types.MappingProxyType({**base, **more})


class Steps:
    """One family's sampling, as `fd.sample` and `functional_dit.sampling` drive it: a
    frozen description (the pipeline and the config, set once in ``__init__``) whose
    hooks are pure functions of what they are given. Tables are immutable mappings
    (`tables`): the run's (``images``, ``init_latents``: encoded references, start
    images), a chunk's (``draw``: an img2img posterior draw) and an item's (``prepare``,
    ``begin``: RoPE, guidance, the inpainting blend inputs).

    A family implements ``encode(run, prompts, msl, **opts)`` and
    ``encode_embeds(run, msl, **embeds)`` -> `Prompt`, ``noise_shape(B, h, w)``,
    ``pack(z)`` (noise -> tokens), ``take(latents)`` (given ``latents=`` -> tokens),
    ``prepare(run, cond, h, w, guidance, device) -> tables``, ``predict(params, tables,
    x, t, cond, apply, **extra) -> (velocity, updates)`` (``updates``: the tables a call
    changed, e.g. a KV cache extracted on the first step, for the item to keep) and
    ``decode_latents(x, h, w)``; the attributes and hooks below have defaults."""

    kv: bool | None = None  # the family's KV cache in use (None: it has none)
    normalise_cfg = False  # CFG rescaled to the conditional prediction's norm (Qwen-Image)
    cfg_on_device = False  # cfg_batch takes the branches already on the device (Qwen-Image 2.1)
    blends_steps = False  # after_step changes the latents (FLUX.1 inpainting's blend)
    step_cache = True  # `fd.sample(cache=...)` supported
    fixed_graph = False  # each step one fixed device graph (`sampler_xla` may run it on a lazy device)
    packed_latents = True  # `fd.sample(latents=...)` takes packed tokens (B, S, C), as the pipeline's latents=
    # `functional_dit.sampling`: whether items share one model call (False: each item its own
    # call, as Qwen-Image 2.1, whose batch is laid out by its first item)
    cfg_calls = 1  # model calls per step with CFG (Qwen-Image 2.1: one per branch, each its own layout)
    shares_calls = True
    settings: Mapping = NO_TABLES  # the job's settings the ranks must agree on
    CONTROLNET = False  # takes ControlNets (``control_pixels``, ``control_latents``, ``control_kwargs``)
    CONTROL_GUIDANCE: float | None = None  # the stock ControlNet pipeline's guidance default
    strength: float | None = None  # img2img's strength (a setting too)
    # items of several sizes in one padded call (`sampler._packing`): the steps' apply takes
    # fd.apply's img_valid and a RoPE table per row (``rope``, from the item's "rope" table);
    # masks_text: its prompts are masked, so items of several text lengths pad theirs too
    packs_sizes = False
    masks_text = False
    # where items do not share calls (``shares_calls = False``): the steps lay several items'
    # rows into their own calls (`predict_items`; Qwen-Image 2.1: per CFG branch, a padded layout)
    predicts_items = False

    def packs(self, tab: Mapping) -> bool:
        """Whether an item with the tables ``tab`` (``prepare``'s) may share a padded call
        over several sizes, its ``tab["rope"]`` being (cos, sin) of its text then its image
        rows (where ``packs_sizes``; FLUX.2: not with reference images)."""
        return True

    def predict_items(self, params, tabs: list, xs: list, ts: list, conds: list, apply) -> tuple[list, list]:
        """One step of several items (where ``predicts_items``): per item its tables, its
        rows' latents (``[x; x]`` with true CFG), their timesteps and its `Prompt`;
        ``apply(params, x, t, txt, rows=..., **kw)`` is `fd.apply` over the rows ``rows``
        (indices into the items' rows in order: their adapters). Returns per item its rows'
        prediction and the tables it keeps (``predict``'s updates)."""
        raise NotImplementedError(f"{type(self).__name__}: predicts_items without predict_items")

    def cfg_batch(self, cond: Prompt, uncond: Prompt) -> Prompt:
        """Both CFG branches as the loop's one batch ([cond; uncond] by default)."""
        return cfg_batch(cond, uncond)

    def images(self, images, B: int, device) -> Mapping:
        """The run's tables of the reference images; a family without them refuses any."""
        raise ValueError(f"image: {type(self).__name__.lstrip('_')} sampling takes no reference image; expected None")

    def init_latents(self, run: Mapping, req, height: int, width: int, device, dtype) -> tuple:
        """Before the chunks: (the run's tables, the request). img2img / inpainting encode
        their start image here, its draw coming before the noise."""
        return run, req

    def draw(self, run: Mapping, noise: tuple, images, shape_of, dtype, device, draw) -> tuple:
        """(a chunk's packed noise, the chunk's tables): ``draw`` (`sampler._requests.draw`)
        by default; img2img draws its posterior sample first."""
        return draw(noise, images, shape_of, self.pack, self.take, dtype, device), NO_TABLES

    def checked(self, run: Mapping) -> dict:
        """The run's inputs every rank of a group must hold the same (reference latents)."""
        ref = run.get("ref")
        return {} if ref is None else {"reference latents (image)": ref}

    def schedule(self, tables: Mapping, sched):
        """The item's scheduler (set): as it is, or a changed copy (img2img cuts it)."""
        return sched

    def step_inputs(self, sched, batch: int, dtype) -> list[dict]:
        """Per step, the model's extra inputs (``predict`` keywords) computed on the host
        before the loop (FLUX.3's flow-map target timesteps); none by default."""
        return [{} for _ in sched.timesteps]

    def begin(self, tables: Mapping, sched, x: torch.Tensor, images) -> tuple:
        """Before the first step: (start latents, the item's tables). img2img / inpainting
        start from the noised image and keep the blend's inputs."""
        return x, tables

    def after_step(self, tables: Mapping, i: int, sched, x: torch.Tensor) -> torch.Tensor:
        """The latents after step ``i``'s scheduler update (as they are by default)."""
        return x

    def blend_parts(self, tables: Mapping):
        """``after_step``'s inpainting blend as data, (image latents, noise, mask), for the
        fixed-graph loop to blend on the device (`schedule.blend_plan`); None: no blend."""
        return None

    def latent_output(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """What ``output_type="latent"`` returns, as the stock pipeline (the packed latents)."""
        return x

    def overlay(self, tables: Mapping, images):
        """The decoded images as returned (``padding_mask_crop`` pastes them back)."""
        return images

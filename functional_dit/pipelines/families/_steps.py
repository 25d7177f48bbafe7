"""The sampler-family protocol: what `fd.sample`'s loop asks of each family's sampling
steps (each family's in its product module, `functional_dit.pipelines.families`), declared
once here with the defaults that only some families override, so the loop calls every
hook unconditionally. Also the text conditioning the steps pass around (`Prompt`) and
the default classifier-free-guidance batching (`cfg_batch`).
"""

from __future__ import annotations

import copy
import dataclasses

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


def _plain_apply(*args, **kwargs):
    """`fd.apply`, looked up when called."""
    return _api.apply(*args, **kwargs)


class Steps:
    """One family's sampling steps, as `fd.sample` drives them. A family implements
    ``encode(prompts, msl)`` and ``encode_embeds(msl, **embeds)`` -> `Prompt`,
    ``noise_shape(B, h, w)``, ``pack(z)`` (noise -> tokens), ``take(latents)`` (given
    ``latents=`` -> tokens), ``prepare(cond, h, w, guidance, device)`` (per-run tables),
    ``__call__(x, t, cond)`` (the model's prediction) and ``decode_latents(x, h, w)``;
    the attributes and hooks below have defaults."""

    kv: bool | None = None  # the family's KV cache in use (None: it has none)
    ref: torch.Tensor | None = None  # reference latents the ranks must agree on
    normalise_cfg = False  # CFG rescaled to the conditional prediction's norm (Qwen-Image)
    cfg_on_device = False  # cfg_batch takes the branches already on the device (Qwen-Image 2.1)
    blends_steps = False  # after_step changes the latents (FLUX.1 inpainting's blend)
    step_cache = True  # `fd.sample(cache=...)` supported
    fixed_graph = False  # each step one fixed device graph (`sampler_xla` may run it on a lazy device)
    packed_latents = True  # `fd.sample(latents=...)` takes packed tokens (B, S, C), as the pipeline's latents=
    apply = staticmethod(_plain_apply)  # each step's copy takes the item's (`sampler._state.bound`)
    # `functional_dit.sampling`: whether items share one model call (False: each item its own
    # call, as Qwen-Image 2.1, whose batch is laid out by its first item), and the attributes
    # a model call changes (an item keeps them between its steps: Qwen-Image 2.1's KV caches)
    cfg_calls = 1  # model calls per step with CFG (Qwen-Image 2.1: one per branch, each its own layout)
    shares_calls = True
    # items of several sizes in one padded call (`sampler._packing`): the steps' apply takes
    # fd.apply's img_valid and a RoPE table per row (``rope``, from the item's "rope" table);
    # masks_text: its prompts are masked, so items of several text lengths pad theirs too
    packs_sizes = False
    masks_text = False
    call_state: tuple[str, ...] = ()

    def fork(self):
        """A copy for one run or one item (`functional_dit.sampling`): what encoding and
        ``prepare`` set lands on it, not on this object; a family whose steps keep run state
        in containers gives the copy fresh ones."""
        return copy.copy(self)

    def cfg_batch(self, cond: Prompt, uncond: Prompt) -> Prompt:
        """Both CFG branches as the loop's one batch ([cond; uncond] by default)."""
        return cfg_batch(cond, uncond)

    def schedule(self, sched) -> None:
        """Sees the run's scheduler after it is set (FLUX.3's flow map reads the timesteps)."""

    def step_inputs(self, sched, batch: int, dtype) -> list[dict]:
        """Per step, the model's extra inputs (``__call__`` keywords) computed on the host
        before the fixed-graph loop and moved to the device once (FLUX.3's flow-map target
        timesteps); none by default."""
        return [{} for _ in sched.timesteps]

    def begin(self, sched, chunk, on_step):
        """Before the first step: (start latents, the step hook). img2img / inpainting cut
        the schedule here and start from the noised image."""
        return chunk.x, on_step

    def init_latents(self, req, height: int, width: int, device, dtype):
        """Before the chunks: the request (img2img / inpainting encode their start image
        here, its draw coming before the noise)."""
        return req

    def after_step(self, i: int, sched, x: torch.Tensor) -> torch.Tensor:
        """The latents after step ``i``'s scheduler update (as they are by default)."""
        return x

    def blend_parts(self):
        """``after_step``'s inpainting blend as data, (image latents, noise, mask), for the
        fixed-graph loop to blend on the device (`schedule.blend_plan`); None: no blend."""
        return None

    def latent_output(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """What ``output_type="latent"`` returns, as the stock pipeline (the packed latents)."""
        return x

    def overlay(self, images):
        """The decoded images as returned (``padding_mask_crop`` pastes them back)."""
        return images

    def images(self, images, B: int, device) -> None:
        """Encodes the reference images; a family without them refuses any."""
        raise ValueError(f"image: {type(self).__name__.lstrip('_')} sampling takes no reference image; expected None")

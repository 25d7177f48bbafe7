"""The product hooks most families share (`functional_dit.pipelines.families.HOOKS`): the
defaults a family module imports and the helpers two families use alike."""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

from ... import families
from ._jobs import ImageInputs, refuse, refuse_layers, refuse_max_area, refuse_reference


class BenchCache(NamedTuple):
    """A family's run in ``bench --sampling``'s step-cache rows: its row name, the tiny
    pipeline kind it samples with, the stock pipeline's and `fd.sample`'s keywords, and
    whether they run true CFG (two transformer calls per step)."""

    row: str
    kind: str
    stock_kw: dict
    our_kw: dict
    true_cfg: bool = False


BENCH_MSL = dict(max_sequence_length=128)  # FLUX pad prompts to it: the bench's 128 text tokens


def shift(seq_len: int, steps: int, cfg) -> float:
    """FLUX.1 / Qwen-Image: mu linear in the image token count (diffusers' calculate_shift)."""
    base, top = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
    lo, hi = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
    m = (hi - lo) / (top - base)
    return seq_len * m + (lo - m * base)


def batch_size(batch_size: int | None) -> int | None:
    """Images per model call: as asked (None: the whole chunk)."""
    return batch_size


def size(pipe, call) -> tuple:
    """The output size (height, width) as asked (``call``: `fd.sample`'s arguments): a
    family without a job that sets it refuses ``max_area`` (Kontext's)."""
    refuse_max_area(call.max_area)
    return call.height, call.width


IMAGE_INPUTS: dict[str, ImageInputs] = {}  # no pipeline of the family takes images


def image_job(pipe, call) -> tuple:
    """(the pipeline, None): a family without image jobs refuses their arguments (``call``:
    `fd.sample`'s checked arguments)."""
    refuse_layers(pipe, call.layers)
    refuse_reference(call.image_reference)
    refuse(call.fam, call.strength, call.mask_image, call.padding_mask_crop)
    return pipe, None


def refuse_kv_cache(kv_cache, params) -> None:
    """``kv_cache`` refused for a family without one."""
    if kv_cache:
        fam = families.key(params)
        raise ValueError(f"kv_cache: the reference KV cache is FLUX.2's; expected None or False for {fam}")


def adapter_result(out, kwargs):
    """`fd.apply`'s result as it is (a (sample, cache) pair from an extract call)."""
    return out


def output(sample, cache):
    # diffusers: seconds to import, loaded when first used
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)


def broadcast_text(x, t, txt, args):
    """One text for a batch of images, as the stock classes accept (their modulation
    broadcasts it; QwenImagePipeline sends one negative prompt for a batch of prompts):
    expand ``txt`` and its mask to the batch, explicitly. Other mismatches stay errors."""
    B = x.shape[0]
    if txt is None or txt.shape[0] != 1 or B == 1:
        return x, t, txt, args
    mask = args.get("txt_mask")
    if mask is not None and mask.shape[0] == 1:
        args = dict(args, txt_mask=mask.expand(B, *mask.shape[1:]))
    return x, t, txt.expand(B, *txt.shape[1:]), args


def broadcast_layout(x, args):
    """Qwen-Image's ``img_shapes`` / ``img_mask`` with fewer items than the batch, as the
    stock classes read them: ``QwenImageTransformer2DModel`` builds its RoPE from
    ``img_shapes[0]`` alone and ``QwenImage21Transformer2DModel`` reads ``img_shapes[0]``
    and ``img_mask[0]`` ("samples share a layout"), while the pipelines send one entry per
    prompt, not per image (``num_images_per_prompt``). Equal items are repeated to the
    batch; items that differ stay `fd.apply`'s error (the stock class warns, or not even
    that for ``img_mask``, and gives every image the first item's layout). The Layered
    model's batch-1 ``additional_t_cond`` (one per prompt too) is broadcast as stock."""
    B, shapes, mask = x.shape[0], args.get("img_shapes"), args.get("img_mask")
    if isinstance(shapes, (list, tuple)) and 0 < len(shapes) != B and all(s == shapes[0] for s in shapes):
        args = dict(args, img_shapes=[shapes[0]] * B)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] not in (0, B):
        if mask.shape[0] == 1 or all(torch.equal(row, mask[0]) for row in mask):
            args = dict(args, img_mask=mask[:1].expand(B, -1))
    cond = args.get("additional_t_cond")  # Layered's: summed into the time embedding, so broadcast as stock
    if isinstance(cond, torch.Tensor) and cond.dim() > 0 and cond.shape[0] == 1 != B:
        args = dict(args, additional_t_cond=cond.expand(B, *cond.shape[1:]))
    return args


def broadcast_qwen(x, t, txt, args):
    """Qwen-Image's: one text for the batch, and the layout entries per prompt."""
    x, t, txt, args = broadcast_text(x, t, txt, args)
    return x, t, txt, broadcast_layout(x, args)


def stock_module(file: str, name: str, **kwargs):
    """A new object of the diffusers class ``name`` from ``transformer_<file>``."""
    return getattr(importlib.import_module(f"diffusers.models.transformers.transformer_{file}"), name)(**kwargs)


def tiny_assemble(kind: str, parts: dict, transformer):
    """The stock pipeline class of ``kind`` over ``parts``."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    return getattr(diffusers, families.TINY_KINDS[kind][1].name)(**parts, transformer=transformer)


def flux_ids_inputs(config, x, t, txt, h, w, device, n_axes: int):
    """The bench's FLUX-style inputs: (fd.apply kwargs, stock kwargs) with grid ids of
    ``n_axes`` axes and the guidance the config embeds."""
    rows, cols = torch.meshgrid(torch.arange(h) * 1.0, torch.arange(w) * 1.0, indexing="ij")
    guidance = torch.full((1,), 3.5, device=device) if getattr(config, "guidance_embeds", False) else None
    kw = dict(x=x, t=t, txt=txt, guidance=guidance)
    dkw = dict(hidden_states=x, timestep=t, encoder_hidden_states=txt, guidance=guidance, return_dict=False)
    txt_len = txt.shape[1]
    if n_axes == 3:
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3)
        txt_ids = torch.zeros(txt_len, 3)
    else:
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols, torch.zeros_like(rows)], -1).reshape(-1, 4)
        txt_ids = torch.stack([torch.zeros(txt_len)] * 3 + [torch.arange(txt_len) * 1.0], -1)
    kw.update(img_ids=img_ids.to(device), txt_ids=txt_ids.to(device))
    dkw.update(img_ids=kw["img_ids"], txt_ids=kw["txt_ids"])
    return kw, dkw


def qwen_inputs(x, t, txt, h, w):
    """The bench's Qwen-Image-style inputs: (fd.apply kwargs, stock kwargs)."""
    kw = dict(x=x, t=t, txt=txt, img_shapes=[[(1, h, w)]])
    dkw = dict(hidden_states=x, encoder_hidden_states=txt, timestep=t, img_shapes=[[(1, h, w)]], return_dict=False)
    return kw, dkw


# ----------------------------------------------------------------------------- the trainer

TRAIN_PIPELINES = ()  # not trainable unless the family writes its encode steps
TRAIN_LATENT_MULTIPLE = 16  # an 8x VAE and 2x2 packing
TRAIN_TEXTS_TOGETHER = False
TRAIN_SECOND = None


def train_inputs(batch: dict, txt_len: int) -> dict:
    """No further fd.apply inputs for a training batch."""
    return {}


def video_latent(pipe, image: torch.Tensor, rgba: bool, patched: bool) -> tuple[torch.Tensor, dict]:
    """Qwen-Image's (and 2.1's) training latent: the image as a one-frame video (RGBA, opaque,
    for 2.1, as its pipeline converts images), normalised by the VAE's mean and std, packed
    by the pipeline (2x2 patches where ``patched``; 2.1 takes it unpatched) with its
    ``img_shapes``."""
    if rgba:
        image = torch.cat([image, torch.ones_like(image[:, :1])], 1)
    z = pipe.vae.encode(image[:, :, None]).latent_dist.mode()
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(shape)
    z = (z - mean) / torch.tensor(pipe.vae.config.latents_std).view(shape)
    _, c, _, h, w = z.shape
    side = (h // 2, w // 2) if patched else (h, w)
    return pipe._pack_latents(z, 1, c, h, w)[0], {"img_shapes": [(1, *side)]}


def masked_text(embeds: torch.Tensor, mask) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One caption's (L, D) embeddings and its (L,) mask (all ones where the pipeline gave
    none): Qwen-Image's and 2.1's training rows."""
    return embeds[0], (torch.ones(embeds.shape[1], dtype=torch.long) if mask is None else mask[0].long()), {}

"""The product per family: one module per family (``flux1``, ``flux2``, ``qwenimage``,
``flux3``, ``qwenimage21``) holding everything the product does differently for it, found
through `product` (over the registry, `functional_dit.families`), so the sampler, the
adapter, the tiny pipelines, the CLI and the bench ask the family instead of comparing names.

Every product module defines the names in `HOOKS` (docs/adding-a-family.md says what each
one is); the defaults most families share are in `functional_dit.pipelines.families._common`.
"""

from __future__ import annotations

import importlib

from ... import families as _families
from ._jobs import ImageInputs
from ._latents import _batch as repeat_batch
from ._latents import combine, flux2_vae_input, grid_ids, pack_2x2, pad_to, text_mask, unpack_2x2
from ._steps import NO_TABLES, Prompt, Steps, cfg_batch, plain_apply, tables

# What the image jobs, the sampler and the per-item sampling share with the families' steps.
__all__ = [
    "HOOKS",
    "ImageInputs",
    "NO_TABLES",
    "Prompt",
    "Steps",
    "cfg_batch",
    "combine",
    "flux2_vae_input",
    "grid_ids",
    "pack_2x2",
    "pad_to",
    "plain_apply",
    "image_inputs",
    "product",
    "repeat_batch",
    "tables",
    "text_mask",
    "unpack_2x2",
]

HOOKS = (
    # fd.sample (functional_dit.pipelines.sampler, _requests, sampler._stock_args, sampling)
    "steps",  # (params, pipe, image, kv_cache) -> the family's text-to-image `Steps`
    "pipeline_class",  # (components) -> the stock pipeline class name built from components
    "shift",  # (seq_len, steps, scheduler config) -> the schedule's mu
    "batch_size",  # (batch_size) -> images per model call
    "size",  # (pipe, fd.sample's arguments) -> the output size as the pipeline sets it (resolution, max_area)
    "image_job",  # (pipe, fd.sample's checked arguments) -> (the pipeline, a job (params, pipe) -> Steps, or None)
    "IMAGE_INPUTS",  # {stock pipeline name: `ImageInputs`}: its images' role (the CLI's and the server's checks)
    "EMBED_ARGS",  # the stock keywords that replace the text encoders' output
    "EMBEDS_TOGETHER",  # of those, the ones needed together with prompt_embeds
    "MAX_SEQUENCE_LENGTH",  # the stock pipelines' limit, or None
    "ENCODER_LORA_SCALE",  # the pipeline scales its text encoders' LoRA by the attention kwargs' scale
    "CFG_NEEDS_NEGATIVE",  # true CFG runs only with a negative prompt (else ignored, warned)
    "PER_ITEM_PIPELINES",  # the stock pipelines (text to image) whose steps functional_dit.sampling runs
    "CONTROLNET_PIPELINES",  # the stock ControlNet pipelines, refused without fd.sample(controlnet=...)
    # fd.DiffusersTransformer (functional_dit.pipelines.adapter)
    "ADAPTER_ARGS",  # the stock forward's arguments beyond the shared ones
    "adapter_args",  # (adapter, **those) -> fd.apply keywords
    "broadcast",  # (x, t, txt, args) -> the stock class's batch broadcasting, made explicit
    "adapter_result",  # (fd.apply's result, forward kwargs) -> (sample[, cache])
    "output",  # (sample, cache) -> the stock output dataclass
    "PROCESSORS",  # block list -> (accepted stock attention processors, the default's module:Class)
    "pos_embed",  # (stock config) -> the stock parameter-free RoPE module, or None
    "NAMED_FORWARD",  # forward's signature names every argument (the modular pipelines read it)
    "IP_ADAPTER",  # takes the stock IP-Adapter loader
    # the tiny pipelines (functional_dit.pipelines.tiny)
    "tiny_config_changes",  # (kind) -> what the tiny kind changes in the family's tiny preset
    "tiny_components",  # (kind, seed) -> every component but the transformer
    "tiny_assemble",  # (kind, components, transformer) -> the stock pipeline
    # bench and check (functional_dit.cli)
    "MID_CONFIG",  # the bench's mid-size config
    "RELEASED",  # the preset whose depth ``--depth released`` takes
    "bench_inputs",  # (config, x, t, txt, h, w, device, dtype, generator) -> (fd.apply kw, stock kw)
    "BENCH_CACHE",  # the family's step-cache bench run (`_common.BenchCache`), or None
    "CHECK_EAGER_ONLY",  # why `check` runs this family eager only, or None
    # the LoRA trainer (functional_dit.train)
    "TRAIN_PIPELINES",  # the stock pipelines whose encode steps the trainer has (none: not trainable)
    "TRAIN_LATENT_MULTIPLE",  # the pixel multiple the family's latent needs (--resolution, --bucket-step)
    "TRAIN_TEXTS_TOGETHER",  # captions are encoded together, at the longest one's length (a cache key)
    "TRAIN_SECOND",  # the name of a caption's second tensor (a pooled vector, a mask), or None
    "train_latent",  # (pipe, image (1, 3, H, W)) -> (the packed latent (S, C), its position inputs)
    "train_texts",  # (pipe, captions, every caption, max_len) -> [(embeds (L, D), second or None, positions)]
    "train_inputs",  # (a batch's fd.apply inputs, its text length) -> the family's further inputs
)


def image_inputs(name: str):
    """The `ImageInputs` of the stock pipeline class ``name`` (its family's ``IMAGE_INPUTS``),
    or None where it takes no image (or is no family's)."""
    if name not in _families.PIPELINES:
        return None
    return product(_families.of_pipeline(name)).IMAGE_INPUTS.get(name)


def product(fam):
    """The product module of family ``fam`` (a family module, its KEY, a config or `Params`):
    its sampling steps, adapter argument maps, tiny recipes and bench inputs, imported on
    first use (``fam.PRODUCT`` if the family names one, else this package's ``<KEY>``)."""
    if isinstance(fam, str):
        fam = _families.by_key(fam)
    elif not hasattr(fam, "KEY"):
        fam = _families.of(fam)
    return importlib.import_module(getattr(fam, "PRODUCT", f"{__name__}.{fam.KEY}"))

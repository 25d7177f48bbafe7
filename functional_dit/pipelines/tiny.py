"""Complete tiny diffusers pipelines built offline: random weights, tokenizers from
in-memory byte vocabularies, no network.

One call gives a ready stock diffusers pipeline (eval mode) whose every component is
small enough that ``pipe(prompt=...)`` runs in seconds on a CPU::

    import functional_dit as fd
    from functional_dit import tiny

    pipe = tiny.pipeline("flux", seed=0)  # FluxPipeline with the stock transformer
    pipe = tiny.pipeline("flux", transformer=fd.DiffusersTransformer(params))
    latents = pipe(prompt="a red cube", height=32, width=32, num_inference_steps=2, output_type="latent").images

Kinds (`KINDS`): ``flux`` (FluxPipeline), ``flux-kontext`` (FluxKontextPipeline),
``flux2`` (Flux2Pipeline), ``flux2-klein`` (Flux2KleinPipeline), ``flux2-klein-kv``
(Flux2KleinKVPipeline), ``qwen-image`` (QwenImagePipeline), ``qwen-image-edit``
(QwenImageEditPipeline), ``qwen-image-edit-plus`` (QwenImageEditPlusPipeline),
``qwen-image-2.1`` (QwenImage21Pipeline), ``flux-controlnet`` (FluxControlNetPipeline) and
``qwen-image-controlnet`` (QwenImageControlNetPipeline) with a stock ControlNet holding
`functional_dit.controlnet.init` weights (``controlnet=`` passes another: a Union or XLabs one,
a multi-ControlNet wrapper, or an adapter), ``flux3`` / ``flux3-distilled`` (the modular
``Flux3ModularPipeline`` / ``Flux3DistilledModularPipeline``, built from their blocks; the
tiny FLUX.3 text encoder has 2 layers, so call them with
``text_encoder_out_layers=FLUX3_LAYERS``). The kinds and their pipeline classes are the
family files' ``PIPELINES`` (`functional_dit.families`); each kind's transformer config is
its family's tiny preset with the text widths its encoders give.

The tokenizers are byte-level (one token per byte, no merges), so prompts are long in
tokens: at the pipelines' default ``max_sequence_length`` the text encoders see the
whole prompt and different prompts embed differently. Shorter lengths save time but
must still reach past the fixed text before the prompt: 64 is enough for FLUX.1 and
FLUX.2-klein; FLUX.2's Mistral system prompt is ~190 tokens and Qwen-Image keeps the
template's tail after dropping 34 tokens, so use >= 256 there. The text encoders have
as many layers as the pipelines read hidden states from (FLUX.2 stacks layers 10, 20,
30; klein 9, 18, 27), each a few thousand parameters wide. The Edit pipelines resize
their reference image to about 1024x1024 whatever is passed; their ×8 VAE keeps that
at 4,096 reference tokens (a few seconds per call).

Lower-level builders (`tokenizer`, `text_encoder`, `vae`, `scheduler`,
`transformer_config`, `stock_transformer`, `components`) are public for tests that need
one part. Weights are drawn with a fixed seed, so two calls with the same seed give the
same pipeline; the stock transformer gets `fd.init` weights (random, no zero-init).
"""

from __future__ import annotations

import dataclasses

import diffusers
import torch

from .. import config_to_diffusers, families, init, to_state_dict
from .. import controlnet as cn
from .families import product as _product
from .tiny_parts import (  # noqa: F401  (the parts, public here as before)
    FLUX3_LAYERS,
    Qwen3VLProcessorNoVideo,
    QwenVLProcessor,
    clip_text_encoder,
    clip_tokenizer,
    flux2_vae,
    flux_vae,
    mistral3_encoder,
    mistral_tokenizer,
    qwen3_encoder,
    qwen3vl_encoder,
    qwen3vl_processor,
    qwen21_vae,
    qwen25vl_encoder,
    qwen_tokenizer,
    qwen_vae,
    qwen_vl_processor,
    scheduler,
    t5_encoder,
    t5_tokenizer,
)

PIPELINE_CLASSES = {kind: p.name for kind, (_, p) in families.TINY_KINDS.items()}  # kind -> stock pipeline
KINDS = tuple(PIPELINE_CLASSES)


def _check_kind(kind) -> str:
    """``kind``, one of the registry's tiny kinds (`KINDS`, and those of a family registered
    at run time)."""
    if kind not in families.TINY_KINDS:
        raise ValueError(f"kind: expected one of {list(families.TINY_KINDS)}, got {kind!r}")
    return kind


def family(kind: str) -> str:
    """``"flux1"``, ``"flux2"``, ``"qwenimage"``, ``"flux3"`` or ``"qwenimage21"``: the
    transformer family a kind runs (the family registry's key)."""
    return families.TINY_KINDS[_check_kind(kind)][0].KEY


# ---------------------------------------------------------------- transformers


def transformer_config(kind: str):
    """The tiny transformer config a kind's pipeline needs: its family's tiny preset with
    the widths of the kind's encoders (the family product's ``tiny_config_changes``)."""
    fam = families.TINY_KINDS[_check_kind(kind)][0]
    return dataclasses.replace(families.tiny_config(fam), **_product(fam).tiny_config_changes(kind))


def fix_buffers(module, dtype) -> None:
    """``.to(bf16)`` also rounds Qwen-Image 2.1's fp32 frequency buffer, which
    ``from_pretrained(torch_dtype=...)`` keeps: restore it."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TemporalTimesteps

    if isinstance(module, diffusers.QwenImage21Transformer2DModel) and dtype != torch.float32:
        module.time_text_embed.time_proj.freqs = QwenImage21TemporalTimesteps(256).freqs


def stock_transformer(kind: str, *, seed: int = 0, dtype=torch.float32):
    """The stock diffusers transformer for ``kind`` with ``fd.init(config, seed)`` weights."""
    cfg = config_to_diffusers(transformer_config(kind))
    cls = getattr(diffusers, cfg.pop("_class_name"))
    module = cls(**cfg)
    module.load_state_dict(to_state_dict(init(transformer_config(kind), seed=seed)))
    if module.dtype != dtype:  # diffusers' to(dtype) warns about fp32 modules even when it changes nothing
        module = module.to(dtype)
    fix_buffers(module, dtype)
    return module.eval().requires_grad_(False)


# ---------------------------------------------------------------- pipelines


def components(kind: str, *, seed: int = 0) -> dict:
    """Every component but the transformer, as the pipeline's ``__init__`` names them (the
    family product's ``tiny_components``)."""
    return _product(family(kind)).tiny_components(kind, seed)


# The ControlNet kinds -> the tiny ControlNet preset their stock ControlNet is built from.
CONTROLNETS = {"flux-controlnet": "flux1-controlnet-tiny", "qwen-image-controlnet": "qwen-image-controlnet-tiny"}


def stock_controlnet(preset: str = "flux1-controlnet-tiny", *, seed: int = 0, dtype=torch.float32):
    """The stock diffusers ControlNet (``FluxControlNetModel`` / ``QwenImageControlNetModel``)
    for a `functional_dit.controlnet` preset, with ``controlnet.init(preset, seed)`` weights."""
    cfg = cn.config_to_diffusers(preset)
    module = getattr(diffusers, cfg.pop("_class_name"))(**cfg)
    module.load_state_dict(cn.to_state_dict(cn.init(preset, seed=seed)))
    if module.dtype != dtype:  # diffusers' to(dtype) warns about fp32 modules even when it changes nothing
        module = module.to(dtype)
    return module.eval().requires_grad_(False)


def pipeline(kind: str, *, seed: int = 0, dtype=torch.float32, transformer=None, controlnet=None):
    """A ready stock diffusers pipeline for ``kind`` (see `KINDS`), every module in eval
    mode and ``dtype``. ``transformer``: any drop-in transformer module (e.g.
    `fd.DiffusersTransformer`); by default the stock diffusers class with
    ``fd.init(transformer_config(kind), seed)`` weights. ``controlnet`` (the ControlNet
    kinds): the pipeline's ControlNet module; by default `stock_controlnet` of the kind's
    tiny preset (`CONTROLNETS`)."""
    _check_kind(kind)
    if transformer is None:
        transformer = stock_transformer(kind, seed=seed, dtype=dtype)
    parts = components(kind, seed=seed)
    if kind in CONTROLNETS:
        parts["controlnet"] = stock_controlnet(CONTROLNETS[kind], seed=seed) if controlnet is None else controlnet
    elif controlnet is not None:
        raise ValueError(f"controlnet: the {kind!r} pipeline takes none; expected None (kinds: {sorted(CONTROLNETS)})")
    pipe = _assemble(kind, parts, transformer)
    if dtype != torch.float32:
        pipe = pipe.to(dtype)
        fix_buffers(transformer, dtype)
    if hasattr(pipe, "set_progress_bar_config"):  # the modular pipelines have no progress bar
        pipe.set_progress_bar_config(disable=True)
    return pipe


def _assemble(kind: str, parts: dict, transformer):
    """The stock pipeline of ``kind`` over ``parts`` (the family product's ``tiny_assemble``:
    FLUX.3's modular pipelines are built from their blocks)."""
    return _product(family(kind)).tiny_assemble(kind, parts, transformer)

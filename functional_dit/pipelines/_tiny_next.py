"""Tiny offline pipelines for FLUX.3 and Qwen-Image 2.1 (the kinds ``qwen-image-2.1``,
``flux3`` and ``flux3-distilled`` of `functional_dit.pipelines.tiny`): a Qwen3-VL text encoder and
processor from the byte-level Qwen tokenizer, tiny VAEs, and the stock transformers.

``qwen-image-2.1`` is ``QwenImage21Pipeline``; ``flux3`` / ``flux3-distilled`` are the
modular ``Flux3ModularPipeline`` / ``Flux3DistilledModularPipeline`` built from their
blocks with these components (no hub access). The FLUX.3 text encoder has 2 layers, so
call it with ``text_encoder_out_layers=FLUX3_LAYERS``.
"""

from __future__ import annotations

import diffusers
import torch
import transformers

from ..api import config_to_diffusers, init, to_state_dict
from ..flux3 import Flux3Config
from ..qwenimage21 import QwenImage21Config

KINDS = {
    "qwen-image-2.1": "QwenImage21Pipeline",
    "flux3": "Flux3ModularPipeline",
    "flux3-distilled": "Flux3DistilledModularPipeline",
}
_VL_DIM = 24  # the Qwen3-VL text width
FLUX3_LAYERS = (1, 2)  # the hidden states the tiny FLUX.3 encoder stacks (text_encoder_out_layers)


class Qwen3VLProcessorNoVideo(transformers.Qwen3VLProcessor):
    """Qwen3-VL's processor without a video processor (which needs torchvision). Module
    level so a saved pipeline can be reloaded."""

    attributes = ["image_processor", "tokenizer"]

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        transformers.ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        tokens = {"image": "<|image_pad|>", "video": "<|video_pad|>", "vision_start": "<|vision_start|>"}
        tokens["vision_end"] = "<|vision_end|>"
        for name, token in tokens.items():
            setattr(self, f"{name}_token", token)
            setattr(self, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))


def processor():
    from . import tiny

    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=32 * 32, max_pixels=64 * 64, patch_size=16, merge_size=2
    )
    tok = tiny.qwen_tokenizer(tiny._QWEN2VL_CHAT_TEMPLATE)
    return Qwen3VLProcessorNoVideo(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)


def qwen3vl_encoder(tok, seed: int = 0) -> transformers.Qwen3VLForConditionalGeneration:
    from . import tiny

    special = ("image", "video", "vision_start", "vision_end")
    ids = {
        f"{n}_token_id": tok.convert_tokens_to_ids(f"<|{n if n.startswith('vision') else n + '_pad'}|>")
        for n in special
    }
    text = dict(
        vocab_size=len(tok),
        hidden_size=_VL_DIM,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=12,
        max_position_embeddings=4096,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 2], "mrope_interleaved": True},
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=_VL_DIM, patch_size=16)
    vision |= dict(
        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0]
    )
    cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    return tiny._seeded(seed, lambda: transformers.Qwen3VLForConditionalGeneration(cfg))


def qwen21_vae(seed: int = 0) -> diffusers.AutoencoderKLQwenImage21:
    """16x spatial compression (5 levels, as the pipeline assumes), 8 latent channels."""
    from . import tiny

    cfg = dict(base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1)
    cfg |= dict(temperal_downsample=[False] * 4, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    return tiny._seeded(seed, lambda: diffusers.AutoencoderKLQwenImage21(**cfg))


def transformer_config(kind: str):
    if kind == "qwen-image-2.1":
        return QwenImage21Config(
            in_channels=8,
            out_channels=8,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            context_in_dim=_VL_DIM,
            axes_dims_rope=(4, 6, 6),
        )
    return Flux3Config(
        in_channels=16,
        cond_in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=len(FLUX3_LAYERS) * _VL_DIM,
        timestep_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        flow_map=kind == "flux3-distilled",
    )


def fix_buffers(module, dtype) -> None:
    """``.to(bf16)`` also rounds Qwen-Image 2.1's fp32 frequency buffer, which
    ``from_pretrained(torch_dtype=...)`` keeps: restore it."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TemporalTimesteps

    if isinstance(module, diffusers.QwenImage21Transformer2DModel) and dtype != torch.float32:
        module.time_text_embed.time_proj.freqs = QwenImage21TemporalTimesteps(256).freqs


def stock_transformer(kind: str, seed: int = 0, dtype=torch.float32):
    cfg = config_to_diffusers(transformer_config(kind))
    module = getattr(diffusers, cfg.pop("_class_name"))(**cfg)
    module.load_state_dict(to_state_dict(init(transformer_config(kind), seed=seed)))
    module = module.to(dtype).eval().requires_grad_(False)
    fix_buffers(module, dtype)
    return module


def components(kind: str, seed: int = 0) -> dict:
    from . import tiny

    proc = processor()
    parts = {"text_encoder": qwen3vl_encoder(proc.tokenizer, seed)}
    if kind == "qwen-image-2.1":
        return parts | {"scheduler": tiny.scheduler(), "vae": qwen21_vae(seed), "processor": proc}
    # FLUX.3's recipe: a constant shift (6.93) configured on the scheduler (modular_pipelines/flux3/before_denoise.py)
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=6.93)
    return parts | {"scheduler": sched, "vae": tiny.flux2_vae(seed), "tokenizer": proc}


def pipeline(kind: str, seed: int, dtype, transformer):
    if transformer is None:
        transformer = stock_transformer(kind, seed=seed, dtype=dtype)
    parts = components(kind, seed=seed)
    if kind == "qwen-image-2.1":
        pipe = diffusers.QwenImage21Pipeline(**parts, transformer=transformer)
    else:
        blocks = getattr(diffusers, "Flux3DistilledAutoBlocks" if kind == "flux3-distilled" else "Flux3AutoBlocks")()
        blocks.sub_blocks.pop("prompt_upsampler")  # encode the prompt as given (no upsampler model)
        pipe = blocks.init_pipeline()
        pipe.update_components(**parts, transformer=transformer)
    if dtype != torch.float32:
        pipe = pipe.to(dtype)
        fix_buffers(transformer, dtype)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    return pipe

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
import functools

import diffusers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .. import config_to_diffusers, families, init, to_state_dict
from .. import controlnet as cn
from .families import product as _product

PIPELINE_CLASSES = {kind: p.name for kind, (_, p) in families.TINY_KINDS.items()}  # kind -> stock pipeline
KINDS = tuple(PIPELINE_CLASSES)

# Text encoder widths. The transformers' joint_attention_dim follows from them: FLUX.2
# stacks three hidden-state layers (3 x width), Qwen-Image takes the last one, FLUX.3
# stacks the Qwen3-VL layers FLUX3_LAYERS.
_T5_DIM, _CLIP_DIM, _MISTRAL_DIM, _QWEN3_DIM, _QWEN25_DIM, _VL_DIM = 32, 24, 16, 16, 32, 24
_MISTRAL_LAYERS, _QWEN3_LAYERS = 31, 28  # FLUX.2 reads hidden states 10, 20, 30; klein 9, 18, 27
FLUX3_LAYERS = (1, 2)  # the hidden states the tiny FLUX.3 encoder stacks (text_encoder_out_layers)


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


# ---------------------------------------------------------------- tokenizers


@functools.lru_cache(maxsize=1)
def _byte_chars() -> tuple[str, ...]:
    """The printable character standing for each byte in byte-level BPE (GPT-2's
    table): printable Latin-1 bytes stand for themselves, the others are shifted
    past 255 in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shift))
            shift += 1
    return tuple(chars)


def _vocab(specials: list[str], pieces: list[str]) -> dict[str, int]:
    return {p: i for i, p in enumerate([*specials, *pieces])}


_QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
]

# Qwen3's chat template, reduced to what Flux2KleinPipeline uses: user turns and an
# empty think block when thinking is disabled.
_QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

# Qwen2-VL's chat template for list-of-parts content (the Edit pipelines' processor).
_QWEN2VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Mistral's chat template reduced to what Flux2Pipeline sends: a system turn and user
# turns whose content is a list of {"type": "text"} parts.
_MISTRAL_CHAT_TEMPLATE = (
    "<s>{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'text' %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ c['text'] }}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{{ c['text'] }}[/INST]{% endif %}{% endif %}{% endfor %}{% endfor %}"
)


def clip_tokenizer() -> transformers.CLIPTokenizer:
    """CLIP BPE over single bytes, each with and without the end-of-word marker."""
    chars = _byte_chars()
    vocab = _vocab(["<|startoftext|>", "<|endoftext|>"], [*chars, *(c + "</w>" for c in chars)])
    return transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer() -> transformers.T5TokenizerFast:
    """T5's Unigram over printable ASCII characters (others map to ``<unk>``)."""
    pieces = ["▁", *(chr(c) for c in range(33, 127)), *("▁" + chr(c) for c in range(33, 127))]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *((p, -1.0) for p in pieces)]
    return transformers.T5TokenizerFast(vocab=vocab, extra_ids=100, model_max_length=512)


def qwen_tokenizer(chat_template: str = _QWEN3_CHAT_TEMPLATE) -> transformers.Qwen2TokenizerFast:
    """Qwen2 byte-level BPE with the Qwen special tokens."""
    tok = transformers.Qwen2TokenizerFast(
        vocab=_vocab([], list(_byte_chars())), merges=[], model_max_length=4096, chat_template=chat_template
    )
    tok.add_special_tokens({"additional_special_tokens": _QWEN_SPECIALS})
    return tok


def mistral_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with Mistral's special tokens and chat layout."""
    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"]
    raw = Tokenizer(models.BPE(vocab=_vocab(specials, list(_byte_chars())), merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=4096,
        chat_template=_MISTRAL_CHAT_TEMPLATE,
    )
    tok.add_special_tokens({"additional_special_tokens": specials[4:]})
    return tok


class QwenVLProcessor(transformers.Qwen2VLProcessor):
    """Qwen2-VL's processor without a video processor (which needs torchvision), for
    the Edit pipelines. Module level so a saved pipeline can be reloaded."""

    attributes = ["image_processor", "tokenizer"]

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        transformers.ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.image_token = tokenizer.image_token if hasattr(tokenizer, "image_token") else "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)


def qwen_vl_processor() -> QwenVLProcessor:
    """Image processor (PIL backend, small ``max_pixels``) and Qwen tokenizer."""
    image_processor = transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56)
    tok = qwen_tokenizer(_QWEN2VL_CHAT_TEMPLATE)
    return QwenVLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=_QWEN2VL_CHAT_TEMPLATE)


# ---------------------------------------------------------------- text encoders


def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def clip_text_encoder(tok, seed: int = 0) -> transformers.CLIPTextModel:
    cfg = transformers.CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=_CLIP_DIM,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        projection_dim=_CLIP_DIM,
    )
    return _seeded(seed, lambda: transformers.CLIPTextModel(cfg))


def t5_encoder(tok, seed: int = 0) -> transformers.T5EncoderModel:
    cfg = transformers.T5Config(
        vocab_size=len(tok),
        d_model=_T5_DIM,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    return _seeded(seed, lambda: transformers.T5EncoderModel(cfg))


def mistral3_encoder(tok, seed: int = 0) -> transformers.Mistral3ForConditionalGeneration:
    text = transformers.MistralConfig(
        vocab_size=len(tok),
        hidden_size=_MISTRAL_DIM,
        intermediate_size=32,
        num_hidden_layers=_MISTRAL_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = transformers.PixtralVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    cfg = transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("[IMG]")
    )
    return _seeded(seed, lambda: transformers.Mistral3ForConditionalGeneration(cfg))


def qwen3_encoder(tok, seed: int = 0) -> transformers.Qwen3ForCausalLM:
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=_QWEN3_DIM,
        intermediate_size=32,
        num_hidden_layers=_QWEN3_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return _seeded(seed, lambda: transformers.Qwen3ForCausalLM(cfg))


def qwen25vl_encoder(tok, seed: int = 0) -> transformers.Qwen2_5_VLForConditionalGeneration:
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in _QWEN_VL_TOKENS.items()}
    text = {
        "vocab_size": len(tok),
        "hidden_size": _QWEN25_DIM,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4], "rope_type": "default"},
        "rope_theta": 1000000.0,
        "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tok.pad_token_id,
    }
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": _QWEN25_DIM,
        "fullatt_block_indexes": [0],
        "window_size": 112,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        **ids,
    )
    return _seeded(seed, lambda: transformers.Qwen2_5_VLForConditionalGeneration(cfg))


_QWEN_VL_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}


# ---------------------------------------------------------------- VAEs, scheduler


def flux_vae(seed: int = 0) -> diffusers.AutoencoderKL:
    """×8 VAE with 4 latent channels (FluxPipeline packs 2×2 → 16 = in_channels)."""
    return _seeded(
        seed,
        lambda: diffusers.AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        ),
    )


def flux2_vae(seed: int = 0) -> diffusers.AutoencoderKLFlux2:
    """×8 FLUX.2 VAE with 4 latent channels (patchified 2×2 → 16 = in_channels)."""
    return _seeded(
        seed,
        lambda: diffusers.AutoencoderKLFlux2(
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
    )


def qwen_vae(seed: int = 0) -> diffusers.AutoencoderKLQwenImage:
    """×8 Qwen-Image VAE with z_dim 4 (packed 2×2 → 16 = in_channels)."""
    return _seeded(
        seed,
        lambda: diffusers.AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        ),
    )


def scheduler() -> diffusers.FlowMatchEulerDiscreteScheduler:
    """The FLUX / Qwen-Image flow-matching Euler scheduler with dynamic shifting."""
    return diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


# ---------------------------------------------------------------- Qwen3-VL (FLUX.3, Qwen-Image 2.1)


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


def qwen3vl_processor() -> Qwen3VLProcessorNoVideo:
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=32 * 32, max_pixels=64 * 64, patch_size=16, merge_size=2
    )
    tok = qwen_tokenizer(_QWEN2VL_CHAT_TEMPLATE)
    return Qwen3VLProcessorNoVideo(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)


def _qwen3vl_text(tok) -> dict:
    return dict(
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


def qwen3vl_encoder(tok, seed: int = 0) -> transformers.Qwen3VLForConditionalGeneration:
    special = ("image", "video", "vision_start", "vision_end")
    ids = {
        f"{n}_token_id": tok.convert_tokens_to_ids(f"<|{n if n.startswith('vision') else n + '_pad'}|>")
        for n in special
    }
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=_VL_DIM, patch_size=16)
    vision |= dict(
        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0]
    )
    cfg = transformers.Qwen3VLConfig(text_config=_qwen3vl_text(tok), vision_config=vision, **ids)
    return _seeded(seed, lambda: transformers.Qwen3VLForConditionalGeneration(cfg))


def qwen21_vae(seed: int = 0) -> diffusers.AutoencoderKLQwenImage21:
    """16x spatial compression (5 levels, as the pipeline assumes), 8 latent channels."""
    cfg = dict(base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1)
    cfg |= dict(temperal_downsample=[False] * 4, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    return _seeded(seed, lambda: diffusers.AutoencoderKLQwenImage21(**cfg))


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

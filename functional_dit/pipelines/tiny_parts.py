"""The tiny pipelines' parts, built offline: byte-level tokenizers from in-memory
vocabularies, text encoders, VAEs and the scheduler, each a few thousand parameters with
seeded random weights. The families' product modules assemble them (their
``tiny_components``); `functional_dit.pipelines.tiny` builds whole pipelines from those and
re-exports the builders. This module imports no family, so a product module can import it."""

from __future__ import annotations

import functools

import diffusers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

# Text encoder widths. The transformers' joint_attention_dim follows from them: FLUX.2
# stacks three hidden-state layers (3 x width), Qwen-Image takes the last one, FLUX.3
# stacks the Qwen3-VL layers FLUX3_LAYERS.
T5_DIM, CLIP_DIM, MISTRAL_DIM, QWEN3_DIM, QWEN25_DIM, VL_DIM = 32, 24, 16, 16, 32, 24
_MISTRAL_LAYERS, _QWEN3_LAYERS = 31, 28  # FLUX.2 reads hidden states 10, 20, 30; klein 9, 18, 27
FLUX3_LAYERS = (1, 2)  # the hidden states the tiny FLUX.3 encoder stacks (text_encoder_out_layers)


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
QWEN2VL_CHAT_TEMPLATE = (
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
    tok = qwen_tokenizer(QWEN2VL_CHAT_TEMPLATE)
    return QwenVLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=QWEN2VL_CHAT_TEMPLATE)


# ---------------------------------------------------------------- text encoders


def seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def clip_text_encoder(tok, seed: int = 0) -> transformers.CLIPTextModel:
    cfg = transformers.CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=CLIP_DIM,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        projection_dim=CLIP_DIM,
    )
    return seeded(seed, lambda: transformers.CLIPTextModel(cfg))


def t5_encoder(tok, seed: int = 0) -> transformers.T5EncoderModel:
    cfg = transformers.T5Config(
        vocab_size=len(tok),
        d_model=T5_DIM,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    return seeded(seed, lambda: transformers.T5EncoderModel(cfg))


def mistral3_encoder(tok, seed: int = 0) -> transformers.Mistral3ForConditionalGeneration:
    text = transformers.MistralConfig(
        vocab_size=len(tok),
        hidden_size=MISTRAL_DIM,
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
    return seeded(seed, lambda: transformers.Mistral3ForConditionalGeneration(cfg))


def qwen3_encoder(tok, seed: int = 0) -> transformers.Qwen3ForCausalLM:
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=QWEN3_DIM,
        intermediate_size=32,
        num_hidden_layers=_QWEN3_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return seeded(seed, lambda: transformers.Qwen3ForCausalLM(cfg))


def qwen25vl_encoder(tok, seed: int = 0) -> transformers.Qwen2_5_VLForConditionalGeneration:
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in _QWEN_VL_TOKENS.items()}
    text = {
        "vocab_size": len(tok),
        "hidden_size": QWEN25_DIM,
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
        "out_hidden_size": QWEN25_DIM,
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
    return seeded(seed, lambda: transformers.Qwen2_5_VLForConditionalGeneration(cfg))


_QWEN_VL_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}


# ---------------------------------------------------------------- VAEs, scheduler


def flux_vae(seed: int = 0) -> diffusers.AutoencoderKL:
    """×8 VAE with 4 latent channels (FluxPipeline packs 2×2 → 16 = in_channels)."""
    return seeded(
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
    return seeded(
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
    return seeded(
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
    tok = qwen_tokenizer(QWEN2VL_CHAT_TEMPLATE)
    return Qwen3VLProcessorNoVideo(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)


def _qwen3vl_text(tok) -> dict:
    return dict(
        vocab_size=len(tok),
        hidden_size=VL_DIM,
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
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=VL_DIM, patch_size=16)
    vision |= dict(
        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0]
    )
    cfg = transformers.Qwen3VLConfig(text_config=_qwen3vl_text(tok), vision_config=vision, **ids)
    return seeded(seed, lambda: transformers.Qwen3VLForConditionalGeneration(cfg))


def qwen21_vae(seed: int = 0) -> diffusers.AutoencoderKLQwenImage21:
    """16x spatial compression (5 levels, as the pipeline assumes), 8 latent channels."""
    cfg = dict(base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1)
    cfg |= dict(temperal_downsample=[False] * 4, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    return seeded(seed, lambda: diffusers.AutoencoderKLQwenImage21(**cfg))

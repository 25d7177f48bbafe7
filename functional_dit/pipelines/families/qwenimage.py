"""Qwen-Image's product (and its Edit, Edit-Plus, Layered, img2img and inpainting
pipelines): its sampling steps for `fd.sample`, the diffusers adapter's argument map for
``QwenImageTransformer2DModel``, its tiny pipelines' recipes and the bench's inputs
(`functional_dit.pipelines.families.HOOKS`)."""

from __future__ import annotations

import math

import torch

from ... import qwenimage as _qwen
from ...qwenimage import QwenImageConfig
from . import _common
from ._common import refuse_kv_cache, stock_module
from ._latents import _batch, pack_2x2, unpack_2x2
from ._steps import Prompt, Steps

# the shared hooks Qwen-Image takes as they are (`_common`)
shift, batch_size, adapter_result, output, tiny_assemble = (
    _common.shift,
    _common.batch_size,
    _common.adapter_result,
    _common.output,
    _common.tiny_assemble,
)

# ----------------------------------------------------------------------------- fd.sample

EMBED_ARGS = ("prompt_embeds", "prompt_embeds_mask")
EMBEDS_TOGETHER = ()
MAX_SEQUENCE_LENGTH = 1024
ENCODER_LORA_SCALE = False
CFG_NEEDS_NEGATIVE = True  # true CFG only with a negative prompt (`sampler._qwen_image.true_cfg`)
PER_ITEM_PIPELINES = ("QwenImagePipeline",)


class _Qwen(Steps):
    """QwenImagePipeline / QwenImageEditPipeline: Qwen2.5-VL text (ragged, masked),
    2x2-packed latents with a frame axis, RoPE from img_shapes, normalised true CFG."""

    fixed_graph = True  # one fixed device graph per step (`sampler_xla`)

    normalise_cfg = True
    packs_sizes = masks_text = True  # items of several sizes and text lengths in one call (`sampler._packing`)

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


def steps(params, pipe, image, kv_cache) -> Steps:
    """Text to image or the Edit pipeline (the other image jobs build on it: `sampler._qwen_image`)."""
    import diffusers

    if image is not None and isinstance(pipe, diffusers.QwenImagePipeline):
        raise ValueError(
            f"image: a {type(pipe).__name__} takes no reference image; expected None (img2img: add strength=, "
            "inpainting: mask_image=)"
        )
    if image is None and isinstance(pipe, diffusers.QwenImageEditPipeline):
        raise ValueError("image: a QwenImageEditPipeline edits a reference image; expected a PIL image, got None")
    refuse_kv_cache(kv_cache, params)
    return _Qwen(params, pipe)


def pipeline_class(components) -> str:
    """The Edit pipeline when the components hold its processor."""
    return "QwenImageEditPipeline" if components.get("processor") is not None else "QwenImagePipeline"


IMAGE_JOBS = "pipeline"  # its pipelines make the image jobs (`sampler._qwen_image.pipeline`)


# ----------------------------------------------------------------------------- the adapter

ADAPTER_ARGS = {
    "encoder_hidden_states_mask",
    "img_shapes",
    "attention_kwargs",
    "additional_t_cond",
    "controlnet_block_samples",
}
PROCESSORS = {
    "transformer_blocks": (
        {"QwenDoubleStreamAttnProcessor2_0"},
        "transformer_qwenimage:QwenDoubleStreamAttnProcessor2_0",
    ),
}
NAMED_FORWARD = False
IP_ADAPTER = False
broadcast = _common.broadcast_qwen


def adapter_args(
    adapter,
    encoder_hidden_states_mask=None,
    img_shapes=None,
    attention_kwargs=None,
    additional_t_cond=None,
    controlnet_block_samples=None,
):
    adapter._lora_scale("attention_kwargs", attention_kwargs)
    mask = encoder_hidden_states_mask
    if isinstance(mask, torch.Tensor) and (mask.is_floating_point() or mask.is_complex()):
        mask = mask != 0  # the stock class casts to bool: any non-zero keeps the token
    return dict(
        txt_mask=mask,
        img_shapes=img_shapes,
        additional_t_cond=additional_t_cond,
        controlnet_block_samples=controlnet_block_samples,
    )


def pos_embed(c):
    name = "QwenEmbedLayer3DRope" if c.get("use_layer3d_rope", False) else "QwenEmbedRope"
    return stock_module("qwenimage", name, theta=10000, axes_dim=list(c["axes_dims_rope"]), scale_rope=True)


# ----------------------------------------------------------------------------- tiny pipelines


def tiny_config_changes(kind: str) -> dict:
    """Qwen2.5-VL's width."""
    from .. import tiny

    return dict(joint_attention_dim=tiny._QWEN25_DIM)


def tiny_components(kind: str, seed: int) -> dict:
    from .. import tiny

    tok = tiny.qwen_tokenizer(tiny._QWEN2VL_CHAT_TEMPLATE)
    parts = {
        "scheduler": tiny.scheduler(),
        "vae": tiny.qwen_vae(seed),
        "text_encoder": tiny.qwen25vl_encoder(tok, seed),
        "tokenizer": tok,
    }
    if kind not in ("qwen-image", "qwen-image-controlnet"):
        parts["processor"] = tiny.qwen_vl_processor()
    return parts


# ----------------------------------------------------------------------------- bench, check

MID_CONFIG = QwenImageConfig(
    in_channels=64,
    num_layers=4,
    attention_head_dim=64,
    num_attention_heads=8,
    joint_attention_dim=512,
    axes_dims_rope=(8, 28, 28),
)
RELEASED = "qwen-image"
BENCH_CACHE = _common.BenchCache(
    "qwenimage",
    "qwen-image",
    dict(true_cfg_scale=4.0, negative_prompt="blurry"),
    dict(true_cfg=4.0, negative_prompt="blurry"),
    true_cfg=True,
)
CHECK_EAGER_ONLY = None


def bench_inputs(config, x, t, txt, h, w, device, dtype, g):
    return _common.qwen_inputs(x, t, txt, h, w)

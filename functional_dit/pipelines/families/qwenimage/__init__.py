"""Qwen-Image's product (and its Edit, Edit-Plus, Layered, img2img and inpainting
pipelines): its sampling steps for `fd.sample`, the diffusers adapter's argument map for
``QwenImageTransformer2DModel``, its tiny pipelines' recipes and the bench's inputs
(`functional_dit.pipelines.families.HOOKS`)."""

from __future__ import annotations

import torch

from ....qwenimage import QwenImageConfig
from ... import tiny_parts
from ..internal import ImageInputs, Steps, refuse_kv_cache, refuse_max_area, refuse_reference, stock_module
from ..internal import common as _common
from . import _image
from ._base import _Qwen

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
CFG_NEEDS_NEGATIVE = True  # true CFG only with a negative prompt (`sampler._requests.true_cfg`)
PER_ITEM_PIPELINES = ("QwenImagePipeline",)
CONTROLNET_PIPELINES = ("QwenImageControlNetPipeline",)  # refused without fd.sample(controlnet=...)


def steps(params, pipe, image, kv_cache) -> Steps:
    """Text to image or the Edit pipeline (the other image jobs build on it: `JOBS`)."""
    # diffusers: seconds to import, loaded when first used
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


def size(pipe, call) -> tuple:
    """The output size: Layered's from ``resolution`` (`_image.size`)."""
    size = _image.size(pipe, call.height, call.width, call.resolution, call.image)
    refuse_max_area(call.max_area)
    return size


def _job(pipe, call):
    """img2img, inpainting, Edit-Plus, Layered: their steps (`_image.model`)."""
    args = (call.image, call.mask_image, call.strength, call.padding_mask_crop, call.layers)
    return lambda params, pipe: _image.model(params, pipe, *args)


# The image jobs by stock pipeline class name (the others: text to image, the Edit pipeline).
JOBS = dict.fromkeys(_image.PIPELINES, _job)
_IMG2IMG = "Qwen-Image img2img, with a mask inpainting (QwenImageImg2Img/Inpaint)"
IMAGE_INPUTS = {  # what each pipeline does with images (the CLI's and the server's checks)
    "QwenImagePipeline": ImageInputs(_IMG2IMG, 1, "init", mask="optional"),
    "QwenImageImg2ImgPipeline": ImageInputs("Qwen-Image img2img", 1, "init", needs=True),
    "QwenImageInpaintPipeline": ImageInputs("Qwen-Image inpainting", 1, "init", needs=True, mask="required"),
    "QwenImageEditPipeline": ImageInputs("Qwen-Image-Edit", 1, "edit", needs=True),
    "QwenImageEditPlusPipeline": ImageInputs("Qwen-Image-Edit-Plus", 3, "edit", needs=True),  # 3: Qwen's advice
}  # fmt: skip


def image_job(pipe, call) -> tuple:
    """(the pipeline, its image job or None): a QwenImagePipeline given an image becomes
    the img2img (inpainting) pipeline over the same components (`_image.pipeline`);
    ``call`` is `fd.sample`'s checked arguments."""
    args = (call.image, call.mask_image, call.strength, call.padding_mask_crop, call.layers)
    pipe = _image.pipeline(pipe, call.steps, call.output_type, *args)
    refuse_reference(call.image_reference)
    job = JOBS.get(type(pipe).__name__)
    return pipe, None if job is None else job(pipe, call)


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
    return dict(joint_attention_dim=tiny_parts.QWEN25_DIM)


def tiny_components(kind: str, seed: int) -> dict:
    tok = tiny_parts.qwen_tokenizer(tiny_parts.QWEN2VL_CHAT_TEMPLATE)
    parts = {
        "scheduler": tiny_parts.scheduler(),
        "vae": tiny_parts.qwen_vae(seed),
        "text_encoder": tiny_parts.qwen25vl_encoder(tok, seed),
        "tokenizer": tok,
    }
    if kind not in ("qwen-image", "qwen-image-controlnet"):
        parts["processor"] = tiny_parts.qwen_vl_processor()
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


# ----------------------------------------------------------------------------- the trainer

TRAIN_PIPELINES = ("QwenImagePipeline",)
TRAIN_LATENT_MULTIPLE, TRAIN_TEXTS_TOGETHER, train_inputs = (
    _common.TRAIN_LATENT_MULTIPLE,
    _common.TRAIN_TEXTS_TOGETHER,
    _common.train_inputs,
)
TRAIN_SECOND = "txt_mask"  # captions padded to the batch's longest, masked


def train_latent(pipe, image):
    """A one-frame video latent, normalised, packed 2x2 (`_common.video_latent`)."""
    return _common.video_latent(pipe, image, rgba=False, patched=True)


def train_texts(pipe, captions: list, every: list, max_len: int) -> list:
    """Each caption's embeddings and mask."""
    return [_common.masked_text(*pipe.encode_prompt(c, max_sequence_length=max_len)) for c in captions]

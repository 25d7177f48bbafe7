"""FLUX.1's product: its sampling steps for `fd.sample` (``FluxPipeline``; the image jobs
build on them), the diffusers adapter's argument map for ``FluxTransformer2DModel``, its
tiny pipelines' recipes and the bench's inputs (`functional_dit.pipelines.families.HOOKS`)."""

from __future__ import annotations

import torch

from ....flux1 import Flux1Config
from ... import tiny_parts
from ..internal import (
    ImageInputs,
    Steps,
    flux_ids_inputs,
    refuse_kv_cache,
    refuse_layers,
    refuse_reference,
    stock_module,
)
from ..internal import common as _common
from . import _image, _kontext
from ._base import _Flux1

TextToImage = _Flux1  # the text-to-image steps, public for a family that builds on FLUX.1's (tests' toy)

# the shared hooks FLUX.1 takes as they are (`_common`)
shift, batch_size, adapter_result, output, tiny_assemble = (
    _common.shift,
    _common.batch_size,
    _common.adapter_result,
    _common.output,
    _common.tiny_assemble,
)

# ----------------------------------------------------------------------------- fd.sample

EMBED_ARGS = ("prompt_embeds", "pooled_prompt_embeds")
EMBEDS_TOGETHER = ("pooled_prompt_embeds",)
MAX_SEQUENCE_LENGTH = 512
ENCODER_LORA_SCALE = True  # FluxPipeline scales its text encoders' LoRA by the attention kwargs' scale
CFG_NEEDS_NEGATIVE = False
PER_ITEM_PIPELINES = ("FluxPipeline",)
CONTROLNET_PIPELINES = ("FluxControlNetPipeline",)  # refused without fd.sample(controlnet=...)


def steps(params, pipe, image, kv_cache) -> Steps:
    """Text to image (img2img, inpainting and Kontext build on it: `JOBS`)."""
    if image is not None:
        raise ValueError(
            f"image: a {type(pipe).__name__} takes no reference image; expected None (img2img: add strength=, "
            "inpainting: mask_image=)"
        )
    refuse_kv_cache(kv_cache, params)
    return _Flux1(params, pipe)


def pipeline_class(components) -> str:
    return "FluxPipeline"


def size(pipe, call) -> tuple:
    """The output size: Kontext's rescale to ``max_area`` (refused elsewhere)."""
    return _kontext.size(pipe, call.height, call.width, call.max_area)


def _kontext_job(pipe, call):
    """Kontext: the reference image after the latents."""
    _image.check(pipe, call.steps, call.image, call.strength, call.mask_image, call.padding_mask_crop,
                 call.output_type, call.latents, (call.height, call.width))  # fmt: skip
    auto_resize = call._auto_resize is not False
    return lambda params, pipe: _kontext.Flux1Kontext(params, pipe, auto_resize)


def _img2img_job(pipe, call):
    """img2img and inpainting (``strength``, ``mask_image``) over any other FLUX.1 pipeline;
    None (text to image) without an image."""
    size = (call.height, call.width)
    edit = _image.check(pipe, call.steps, call.image, call.strength, call.mask_image, call.padding_mask_crop,
                        call.output_type, call.latents, size)  # fmt: skip
    return None if edit is None else lambda params, pipe: _image.Flux1Image(params, pipe, edit)


# The image jobs by stock pipeline class name (every other FLUX.1 pipeline: `_img2img_job`).
JOBS = {"FluxKontextPipeline": _kontext_job}
_IMG2IMG = "FLUX.1 img2img, with a mask inpainting (FluxImg2Img/InpaintPipeline)"
IMAGE_INPUTS = {  # what each pipeline does with images (the CLI's and the server's checks)
    "FluxPipeline": ImageInputs(_IMG2IMG, 1, "init", mask="optional"),
    "FluxImg2ImgPipeline": ImageInputs("FLUX.1 img2img", 1, "init", needs=True),
    "FluxInpaintPipeline": ImageInputs("FLUX.1 inpainting", 1, "init", needs=True, mask="required"),
    "FluxKontextPipeline": ImageInputs("FLUX.1 Kontext (max_area: the requested size's area)", 1, "edit", area=True),
}  # fmt: skip


def image_job(pipe, call) -> tuple:
    """(the pipeline, its image job or None): ``call`` is `fd.sample`'s checked arguments;
    the job makes the steps (``job(params, pipe)``)."""
    refuse_layers(pipe, call.layers)
    refuse_reference(call.image_reference)
    return pipe, JOBS.get(type(pipe).__name__, _img2img_job)(pipe, call)


# ----------------------------------------------------------------------------- the adapter

ADAPTER_ARGS = {
    "pooled_projections",
    "img_ids",
    "txt_ids",
    "joint_attention_kwargs",
    "controlnet_block_samples",
    "controlnet_single_block_samples",
    "controlnet_blocks_repeat",
}
PROCESSORS = {
    "transformer_blocks": ({"FluxAttnProcessor", "FluxIPAdapterAttnProcessor"}, "transformer_flux:FluxAttnProcessor"),
    "single_transformer_blocks": ({"FluxAttnProcessor"}, "transformer_flux:FluxAttnProcessor"),
}
NAMED_FORWARD = False
IP_ADAPTER = True


def adapter_args(
    adapter,
    pooled_projections=None,
    img_ids=None,
    txt_ids=None,
    joint_attention_kwargs=None,
    controlnet_block_samples=None,
    controlnet_single_block_samples=None,
    controlnet_blocks_repeat=False,
):
    kwargs = dict(joint_attention_kwargs or {})
    ip = adapter.ip_adapter_input(kwargs.pop("ip_adapter_image_embeds", None))
    adapter._lora_scale("joint_attention_kwargs", kwargs)
    if pooled_projections is None:
        raise ValueError(
            f"pooled_projections: {type(adapter).__name__} (FLUX.1 params) needs the CLIP pooled embedding, got None, "
            "as the FLUX.2 and Qwen-Image pipelines call their transformers; is this adapter in the wrong "
            f"pipeline? It belongs in {adapter.pipelines_served()}"
        )
    control = dict(
        controlnet_block_samples=controlnet_block_samples,
        controlnet_single_block_samples=controlnet_single_block_samples,
        controlnet_blocks_repeat=controlnet_blocks_repeat,
    )
    return dict(pooled=pooled_projections, img_ids=img_ids, txt_ids=txt_ids, ip_adapter=ip, **control)


def _batch(v) -> int | None:
    return v.shape[0] if isinstance(v, torch.Tensor) and v.dim() > 0 else None


def broadcast(x, t, txt, args):
    """FLUX.1's batch-1 inputs broadcast as ``FluxTransformer2DModel`` broadcasts them: its
    time, guidance and pooled embeddings are summed into one ``temb`` (any of them with
    batch 1 serves the others' batch), and each stream is modulated by ``temb``, so the
    image stream takes the batch of ``hidden_states`` and ``temb``, the text stream that of
    ``encoder_hidden_states`` and ``temb``; the two must then agree (FluxPipeline sends one
    negative prompt's embeddings for several prompts under true CFG: text and pooled of
    batch 1, timestep and guidance of the batch). Expanded explicitly here; what the stock
    module cannot broadcast (e.g. every conditioning input of batch 1 for a batch of
    images) stays an error (`fd.apply`'s)."""
    named = dict(x=x, t=t, txt=txt, guidance=args.get("guidance"), pooled=args.get("pooled"))
    temb = {_batch(named[k]) for k in ("t", "guidance", "pooled")} - {None}
    if len(temb - {1}) > 1:
        return x, t, txt, args
    tb = max(temb, default=1)
    streams = {max(_batch(x), tb), max(_batch(txt), tb)} if None not in (_batch(x), _batch(txt)) else set()
    if len(streams) != 1 or any(_batch(v) not in (None, 1, *streams) for v in named.values()):
        return x, t, txt, args
    B = streams.pop()
    out = {k: v.expand(B, *v.shape[1:]) if _batch(v) == 1 else v for k, v in named.items()}
    return out["x"], out["t"], out["txt"], dict(args, guidance=out["guidance"], pooled=out["pooled"])


def pos_embed(c):
    return stock_module("flux", "FluxPosEmbed", theta=10000, axes_dim=c["axes_dims_rope"])


# ----------------------------------------------------------------------------- tiny pipelines


def tiny_config_changes(kind: str) -> dict:
    """The CLIP and T5 widths; dev-style guidance, Kontext without it."""
    widths = dict(joint_attention_dim=tiny_parts.T5_DIM, pooled_projection_dim=tiny_parts.CLIP_DIM)
    return dict(widths, guidance_embeds=kind != "flux-kontext")


def tiny_components(kind: str, seed: int) -> dict:
    tok, tok2 = tiny_parts.clip_tokenizer(), tiny_parts.t5_tokenizer()
    return {
        "scheduler": tiny_parts.scheduler(),
        "vae": tiny_parts.flux_vae(seed),
        "text_encoder": tiny_parts.clip_text_encoder(tok, seed),
        "tokenizer": tok,
        "text_encoder_2": tiny_parts.t5_encoder(tok2, seed),
        "tokenizer_2": tok2,
        "image_encoder": None,
        "feature_extractor": None,
    }


# ----------------------------------------------------------------------------- bench, check

# The mid-size config (8 heads x 64 = 512 wide), ~37-44 M params.
MID_CONFIG = Flux1Config(
    in_channels=64,
    num_layers=2,
    num_single_layers=4,
    attention_head_dim=64,
    num_attention_heads=8,
    joint_attention_dim=512,
    pooled_projection_dim=256,
    guidance_embeds=True,
    axes_dims_rope=(8, 28, 28),
)
RELEASED = "flux1-dev"
BENCH_CACHE = _common.BenchCache(
    "flux1", "flux", dict(guidance_scale=3.5, **_common.BENCH_MSL), dict(guidance=3.5, **_common.BENCH_MSL)
)
CHECK_EAGER_ONLY = None


def bench_inputs(config, x, t, txt, h, w, device, dtype, g):
    kw, dkw = flux_ids_inputs(config, x, t, txt, h, w, device, 3)
    kw["pooled"] = dkw["pooled_projections"] = torch.randn(1, config.pooled_projection_dim, generator=g).to(
        device, dtype
    )
    return kw, dkw


# ----------------------------------------------------------------------------- the trainer

TRAIN_PIPELINES = ("FluxPipeline",)
TRAIN_LATENT_MULTIPLE, TRAIN_TEXTS_TOGETHER, train_inputs = (
    _common.TRAIN_LATENT_MULTIPLE,
    _common.TRAIN_TEXTS_TOGETHER,
    _common.train_inputs,
)
TRAIN_SECOND = "pooled"  # CLIP's pooled vector


def train_latent(pipe, image: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The VAE latent shifted and scaled, packed 2x2, with its ``img_ids``."""
    z = pipe.vae.encode(image).latent_dist.mode()
    z = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    _, c, h, w = z.shape
    ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    return pipe._pack_latents(z, 1, c, h, w)[0], {"img_ids": ids}


def train_texts(pipe, captions: list, every: list, max_len: int) -> list:
    """Each caption's T5 embeddings, CLIP pooled vector and ``txt_ids``."""
    out = []
    for caption in captions:
        e, pooled, txt_ids = pipe.encode_prompt(caption, prompt_2=None, max_sequence_length=max_len)
        out.append((e[0], pooled[0], {"txt_ids": txt_ids}))
    return out

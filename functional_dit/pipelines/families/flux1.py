"""FLUX.1's product: its sampling steps for `fd.sample` (``FluxPipeline``; the image jobs
build on them), the diffusers adapter's argument map for ``FluxTransformer2DModel``, its
tiny pipelines' recipes and the bench's inputs (`functional_dit.pipelines.families.HOOKS`)."""

from __future__ import annotations

import torch

from ... import flux1
from ...flux1 import Flux1Config
from . import _common
from ._common import refuse_kv_cache, stock_module
from ._latents import grid_ids, pack_2x2, unpack_2x2
from ._steps import Prompt, Steps

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


class _Flux1(Steps):
    """FluxPipeline: T5 + CLIP pooled text, 2x2-packed 16-channel latents, 3-axis ids."""

    fixed_graph = True  # one fixed device graph per step (`sampler_xla`)
    packs_sizes = True  # items of several sizes in one call (`sampler._packing`)

    def __init__(self, params, pipe):
        self.params, self.pipe, self.c = params, pipe, params.config

    def encode(self, prompts, msl, prompt_2=None, lora_scale=None):
        """CLIP's pooled vector of ``prompts``, T5's text of ``prompt_2`` (None: ``prompts``),
        with the text encoders' LoRA at ``lora_scale``: the pipeline's ``encode_prompt``."""
        kw = dict(prompt_2=prompt_2, max_sequence_length=msl or 512, lora_scale=lora_scale)
        txt, pooled, _ = self.pipe.encode_prompt(prompt=prompts, **kw)
        return Prompt(txt, pooled)

    def encode_embeds(self, msl, prompt_embeds, pooled_prompt_embeds):
        return Prompt(prompt_embeds, pooled_prompt_embeds)

    def noise_shape(self, B, h, w):
        return (B, self.c.in_channels // 4, h, w)

    pack = staticmethod(pack_2x2)
    take = staticmethod(lambda latents: latents)  # the pipeline's latents= are packed

    def prepare(self, cond: Prompt, h, w, guidance, device):
        img_ids = grid_ids(h // 2, w // 2, 3, torch.float32, device)
        txt_ids = torch.zeros(cond.txt.shape[1], 3, device=device)
        self.rope = flux1.rope_table(self.c, img_ids, txt_ids)
        self.guidance = 3.5 if guidance is None else guidance

    def __call__(self, x, t, cond: Prompt):
        g = torch.full((x.shape[0],), float(self.guidance), device=x.device) if self.c.guidance_embeds else None
        return self.apply(self.params, x, t, cond.txt, pooled=cond.pooled, guidance=g, rope=self.rope)

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        return unpack_2x2(x, h, w) / vae.config.scaling_factor + vae.config.shift_factor


def steps(params, pipe, image, kv_cache) -> Steps:
    """Text to image (img2img, inpainting and Kontext build on it: `sampler._flux_image`,
    `sampler._flux_kontext`)."""
    if image is not None:
        raise ValueError(
            f"image: a {type(pipe).__name__} takes no reference image; expected None (img2img: add strength=, "
            "inpainting: mask_image=)"
        )
    refuse_kv_cache(kv_cache, params)
    return _Flux1(params, pipe)


def pipeline_class(components) -> str:
    return "FluxPipeline"


IMAGE_JOBS = "img2img"  # fd.sample's img2img and inpainting over these steps (`sampler._flux_image`)


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
    from .. import tiny

    widths = dict(joint_attention_dim=tiny._T5_DIM, pooled_projection_dim=tiny._CLIP_DIM)
    return dict(widths, guidance_embeds=kind != "flux-kontext")


def tiny_components(kind: str, seed: int) -> dict:
    from .. import tiny

    tok, tok2 = tiny.clip_tokenizer(), tiny.t5_tokenizer()
    return {
        "scheduler": tiny.scheduler(),
        "vae": tiny.flux_vae(seed),
        "text_encoder": tiny.clip_text_encoder(tok, seed),
        "tokenizer": tok,
        "text_encoder_2": tiny.t5_encoder(tok2, seed),
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
    from ._common import flux_ids_inputs

    kw, dkw = flux_ids_inputs(config, x, t, txt, h, w, device, 3)
    kw["pooled"] = dkw["pooled_projections"] = torch.randn(1, config.pooled_projection_dim, generator=g).to(
        device, dtype
    )
    return kw, dkw

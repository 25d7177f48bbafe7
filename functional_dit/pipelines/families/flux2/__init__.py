"""FLUX.2's product (dev, klein, klein with its reference KV cache): its sampling steps for
`fd.sample`, the diffusers adapter's argument map for ``Flux2Transformer2DModel``, its tiny
pipelines' recipes and the bench's inputs (`functional_dit.pipelines.families.HOOKS`)."""

from __future__ import annotations

from ....flux2 import Flux2Config
from ... import tiny_parts
from ..internal import ImageInputs, Steps, refuse, refuse_layers, refuse_max_area, refuse_reference, stock_module
from ..internal import common as _common
from . import _inpaint
from ._base import _Flux2

# the shared hooks FLUX.2 takes as they are (`_common`)
batch_size, tiny_assemble = _common.batch_size, _common.tiny_assemble

# ----------------------------------------------------------------------------- fd.sample

EMBED_ARGS = ("prompt_embeds",)
EMBEDS_TOGETHER = ()
MAX_SEQUENCE_LENGTH = None  # the stock pipelines set no limit
ENCODER_LORA_SCALE = False
CFG_NEEDS_NEGATIVE = False
PER_ITEM_PIPELINES = ("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinKVPipeline")
CONTROLNET_PIPELINES = ()  # refused without fd.sample(controlnet=...)


def steps(params, pipe, image, kv_cache) -> Steps:
    """Text to image with reference images (klein inpainting builds on it: `JOBS`)."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    return _Flux2(params, pipe, isinstance(pipe, diffusers.Flux2KleinKVPipeline) if kv_cache is None else kv_cache)


def size(pipe, call) -> tuple:
    """The output size: klein inpainting's is its image's."""
    refuse_max_area(call.max_area)
    return _inpaint.size(pipe, call.height, call.width, call.image)


def _klein_inpaint_job(pipe, call):
    """klein inpainting (its image, mask and optional ``image_reference``)."""
    args = (call.steps, call.image, call.mask_image, call.image_reference, call.strength, call.padding_mask_crop)
    job = _inpaint.check(pipe, *args, call.output_type, call.kv_cache)
    return lambda params, pipe: _inpaint.Flux2Inpaint(params, pipe, job)


# The image jobs by stock pipeline class name (the others: text to image with references).
JOBS = {_inpaint.NAME: _klein_inpaint_job}
_REFERENCES = ImageInputs("FLUX.2 reference images", 10, "reference")  # 10: BFL's limit for FLUX.2 references
IMAGE_INPUTS = dict.fromkeys(("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinKVPipeline"), _REFERENCES)


def image_job(pipe, call) -> tuple:
    """(the pipeline, its image job or None): ``call`` is `fd.sample`'s checked arguments."""
    refuse_layers(pipe, call.layers)
    job = JOBS.get(type(pipe).__name__)
    if job is not None:
        return pipe, job(pipe, call)
    refuse_reference(call.image_reference)
    refuse(call.fam, call.strength, call.mask_image, call.padding_mask_crop)
    return pipe, None


def pipeline_class(components) -> str:
    """FLUX.2-dev's pipeline with its Mistral encoder, klein's otherwise."""
    return "Flux2Pipeline" if "Mistral" in type(components.get("text_encoder")).__name__ else "Flux2KleinPipeline"


def shift(seq_len: int, steps: int, cfg) -> float:
    """FLUX.2: mu fitted to the token count and the number of steps (diffusers' compute_empirical_mu)."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if seq_len > 4300:
        return float(a2 * seq_len + b2)
    m_200, m_10 = a2 * seq_len + b2, a1 * seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + (m_200 - 200.0 * a))


# ----------------------------------------------------------------------------- the adapter

ADAPTER_ARGS = {"img_ids", "txt_ids", "joint_attention_kwargs", "kv_cache", "kv_cache_mode", "num_ref_tokens"}
ADAPTER_ARGS |= {"ref_fixed_timestep"}
PROCESSORS = {
    "transformer_blocks": ({"Flux2AttnProcessor", "Flux2KVAttnProcessor"}, "transformer_flux2:Flux2AttnProcessor"),
    "single_transformer_blocks": (
        {"Flux2ParallelSelfAttnProcessor", "Flux2KVParallelSelfAttnProcessor"},
        "transformer_flux2:Flux2ParallelSelfAttnProcessor",
    ),
}
NAMED_FORWARD = False
IP_ADAPTER = False
broadcast = _common.broadcast_text


def adapter_args(
    adapter,
    img_ids=None,
    txt_ids=None,
    joint_attention_kwargs=None,
    kv_cache=None,
    kv_cache_mode=None,
    num_ref_tokens=0,
    ref_fixed_timestep=0.0,
):
    # FLUX.2's KV cache module loads diffusers' cache classes: imported on first use
    from ..internal import flux2_kv as kv

    adapter._lora_scale("joint_attention_kwargs", joint_attention_kwargs)
    args = dict(img_ids=img_ids, txt_ids=txt_ids)
    if kv_cache_mode is None:
        if kv_cache is not None or num_ref_tokens or ref_fixed_timestep:
            raise ValueError(
                f"kv_cache_mode: None runs without a KV cache, but got kv_cache={kv_cache!r}, "
                f"num_ref_tokens={num_ref_tokens!r}, ref_fixed_timestep={ref_fixed_timestep!r}"
            )
        return args
    if kv_cache_mode == "extract":
        if kv_cache is not None:
            raise ValueError(f"kv_cache: expected None with kv_cache_mode='extract', got {kv_cache!r}")
        return dict(args, kv_cache="extract", num_ref_tokens=num_ref_tokens, ref_fixed_timestep=ref_fixed_timestep)
    if kv_cache_mode == "cached":
        if kv_cache is None:
            raise ValueError("kv_cache: expected the cache an extract call returned with kv_cache_mode='cached'")
        return dict(args, kv_cache=kv.to_fd(kv_cache, adapter._fd_config))
    raise ValueError(f"kv_cache_mode: expected None, 'extract' or 'cached', got {kv_cache_mode!r}")


def adapter_result(out, kwargs):
    """An extract call's cache as diffusers' ``Flux2KVCache`` (`_flux2_kv.KVCache`)."""
    # FLUX.2's KV cache module loads diffusers' cache classes: imported on first use
    from ..internal import flux2_kv as _flux2_kv

    return (out[0], _flux2_kv.KVCache(out[1])) if isinstance(out, tuple) else out


def output(sample, cache):
    # diffusers: seconds to import, loaded when first used
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput

    return Flux2Transformer2DModelOutput(sample=sample, kv_cache=cache)


def pos_embed(c):
    return stock_module("flux2", "Flux2PosEmbed", theta=c["rope_theta"], axes_dim=c["axes_dims_rope"])


# ----------------------------------------------------------------------------- tiny pipelines


def tiny_config_changes(kind: str) -> dict:
    """Three stacked encoder layers' width; FLUX.2-dev is guidance-distilled, klein is not."""
    width = tiny_parts.MISTRAL_DIM if kind == "flux2" else tiny_parts.QWEN3_DIM
    return dict(joint_attention_dim=3 * width, guidance_embeds=kind == "flux2")


def tiny_components(kind: str, seed: int) -> dict:
    """FLUX.2-dev's Mistral3 encoder; klein's Qwen3."""
    tok = tiny_parts.mistral_tokenizer() if kind == "flux2" else tiny_parts.qwen_tokenizer()
    parts = {
        "scheduler": tiny_parts.scheduler(),
        "vae": tiny_parts.flux2_vae(seed),
    }  # built in the order they always were
    parts["text_encoder"] = (
        tiny_parts.mistral3_encoder(tok, seed) if kind == "flux2" else tiny_parts.qwen3_encoder(tok, seed)
    )
    return {**parts, "tokenizer": tok}


# ----------------------------------------------------------------------------- bench, check

MID_CONFIG = Flux2Config(
    in_channels=128,
    num_layers=2,
    num_single_layers=6,
    attention_head_dim=64,
    num_attention_heads=8,
    joint_attention_dim=512,
    axes_dims_rope=(16, 16, 16, 16),
)
RELEASED = "flux2-dev"
BENCH_CACHE = _common.BenchCache(  # klein, with true CFG
    "flux2-klein",
    "flux2-klein",
    dict(guidance_scale=4.0, **_common.BENCH_MSL),
    dict(true_cfg=4.0, **_common.BENCH_MSL),
    true_cfg=True,
)
CHECK_EAGER_ONLY = None


def bench_inputs(config, x, t, txt, h, w, device, dtype, g):
    return _common.flux_ids_inputs(config, x, t, txt, h, w, device, 4)


# ----------------------------------------------------------------------------- the trainer

TRAIN_PIPELINES = ("Flux2Pipeline", "Flux2KleinPipeline")
TRAIN_LATENT_MULTIPLE, TRAIN_TEXTS_TOGETHER, TRAIN_SECOND, train_inputs = (
    _common.TRAIN_LATENT_MULTIPLE,
    _common.TRAIN_TEXTS_TOGETHER,
    _common.TRAIN_SECOND,
    _common.train_inputs,
)


def train_latent(pipe, image):
    """The pipeline's reference encoding (patchified 2x2, batch-normed), packed, with its ids."""
    z = pipe._encode_vae_image(image, generator=None)
    return pipe._pack_latents(z)[0], {"img_ids": pipe._prepare_latent_ids(z)[0]}


def train_texts(pipe, captions: list, every: list, max_len: int) -> list:
    """Each caption's embeddings (the text encoder's stacked layers) and ``txt_ids``."""
    out = []
    for caption in captions:
        e, txt_ids = pipe.encode_prompt(caption, max_sequence_length=max_len)
        out.append((e[0], None, {"txt_ids": txt_ids[0]}))
    return out

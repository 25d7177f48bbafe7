"""FLUX.2's product (dev, klein, klein with its reference KV cache): its sampling steps for
`fd.sample`, the diffusers adapter's argument map for ``Flux2Transformer2DModel``, its tiny
pipelines' recipes and the bench's inputs (`functional_dit.pipelines.families.HOOKS`)."""

from __future__ import annotations

import torch

from ... import flux2
from ...flux2 import Flux2Config
from . import _common
from ._common import stock_module
from ._latents import _batch, flux2_vae_input, grid_ids
from ._steps import NO_TABLES, Prompt, Steps, tables

# the shared hooks FLUX.2 takes as they are (`_common`)
batch_size, tiny_assemble = _common.batch_size, _common.tiny_assemble

# ----------------------------------------------------------------------------- fd.sample

EMBED_ARGS = ("prompt_embeds",)
EMBEDS_TOGETHER = ()
MAX_SEQUENCE_LENGTH = None  # the stock pipelines set no limit
IMAGE_JOBS = None  # klein inpainting is its pipeline's (`sampler._flux2_image`)
ENCODER_LORA_SCALE = False
CFG_NEEDS_NEGATIVE = False
PER_ITEM_PIPELINES = ("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinKVPipeline")


class _Flux2(Steps):
    """Flux2Pipeline / Flux2KleinPipeline / Flux2KleinKVPipeline: stacked text-encoder
    layers, patchified 2x2 latents packed as tokens, 4-axis ids, reference images."""

    fixed_graph = True  # one fixed device graph per step (`sampler_xla`)
    packed_latents = False  # latents= given as the unpacked (B, C, h/2, w/2) noise

    def __init__(self, params, pipe, kv_cache: bool):
        self.pipe, self.c, self.kv = pipe, params.config, kv_cache

    def encode(self, run, prompts, msl, **layers):
        """The pipeline's ``encode_prompt`` (``text_encoder_out_layers`` in ``layers`` if given)."""
        txt, txt_ids = self.pipe.encode_prompt(prompt=prompts, max_sequence_length=msl or 512, **layers)
        return Prompt(txt, txt_ids=txt_ids[0])

    def encode_embeds(self, run, msl, prompt_embeds):
        return Prompt(prompt_embeds, txt_ids=self.pipe._prepare_text_ids(prompt_embeds)[0].to(prompt_embeds.device))

    def noise_shape(self, B, h, w):
        return (B, self.c.in_channels, h // 2, w // 2)

    @staticmethod
    def pack(z):
        """(B, C, h/2, w/2) -> (B, h/2 · w/2, C): row-major tokens (also the pipeline's latents= layout)."""
        return z.reshape(*z.shape[:2], -1).permute(0, 2, 1)

    take = pack

    def images(self, images, B, device):
        """Reference images -> the run's packed latents (B, R, C) and ids (R, 4), the pipeline's way."""
        pipe, multiple = self.pipe, self.pipe.vae_scale_factor * 2
        processed = []
        for img in images:
            pipe.image_processor.check_image_input(img)
            w, h = img.size
            if w * h > 1024 * 1024:
                img = pipe.image_processor._resize_to_target_area(img, 1024 * 1024)
                w, h = img.size
            w, h = w // multiple * multiple, h // multiple * multiple
            processed.append(pipe.image_processor.preprocess(img, height=h, width=w, resize_mode="crop"))
        ref, ids = pipe.prepare_image_latents(processed, B, None, device, pipe.vae.dtype)
        return tables(ref=ref, ref_ids=ids[0])

    def prepare(self, run, cond: Prompt, h, w, guidance, device):
        """RoPE (with the references' rows), guidance; klein KV: the later steps' RoPE
        without the reference rows, and no cache yet (the first step extracts it)."""
        ref = run.get("ref")
        img_ids = grid_ids(h // 2, w // 2, 4, torch.int64, device)
        if ref is not None:
            img_ids = torch.cat([run["ref_ids"], img_ids] if self.kv else [img_ids, run["ref_ids"]])
        rope = flux2.rope_table(self.c, img_ids, cond.txt_ids)
        out = dict(rope=rope, cache=None)
        if self.kv and ref is not None:  # later steps: no reference rows
            n, S = cond.txt_ids.shape[0], img_ids.shape[0] - ref.shape[1]
            out["rope_cached"] = tuple(torch.cat([a[:n], a[a.shape[0] - S :]]) for a in rope)
        out["guidance"] = (4.0 if guidance is None else guidance) if self.c.guidance_embeds else None
        return tables(**out)

    def predict(self, params, tab, x, t, cond: Prompt, apply, **extra):
        """The prediction (and with the klein KV cache, the cache the first step extracts)."""
        B, S = x.shape[:2]
        g = None if tab["guidance"] is None else torch.full((B,), float(tab["guidance"]), device=x.device)
        kw, ref = dict(guidance=g), tab.get("ref")
        if ref is None:
            return apply(params, x, t, cond.txt, rope=tab["rope"], **kw), NO_TABLES
        ref = _batch(ref, B).to(x.dtype)
        if not self.kv:
            return apply(params, torch.cat([x, ref], 1), t, cond.txt, rope=tab["rope"], **kw)[:, :S], NO_TABLES
        if tab["cache"] is None:
            x = torch.cat([ref, x], 1)
            extract = dict(kv_cache="extract", num_ref_tokens=ref.shape[1])
            out, cache = apply(params, x, t, cond.txt, rope=tab["rope"], **extract, **kw)
            return out, tables(cache=cache)
        return apply(params, x, t, cond.txt, rope=tab["rope_cached"], kv_cache=tab["cache"], **kw), NO_TABLES

    def latent_output(self, x, h, w):
        """``output_type="latent"`` as the stock pipeline returns it: FLUX.2-dev the packed
        tokens, klein (every klein pipeline) the VAE's input (unpacked, de-normalised)."""
        return x if type(self.pipe).__name__ == "Flux2Pipeline" else self.decode_latents(x, h, w)

    def decode_latents(self, x, h, w):
        return flux2_vae_input(self.pipe.vae, x, h, w)


def steps(params, pipe, image, kv_cache) -> Steps:
    """Text to image with reference images (klein inpainting builds on it: `sampler._flux2_image`)."""
    import diffusers

    return _Flux2(params, pipe, isinstance(pipe, diffusers.Flux2KleinKVPipeline) if kv_cache is None else kv_cache)


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
    from . import _flux2_kv as kv

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
    from . import _flux2_kv

    return (out[0], _flux2_kv.KVCache(out[1])) if isinstance(out, tuple) else out


def output(sample, cache):
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput

    return Flux2Transformer2DModelOutput(sample=sample, kv_cache=cache)


def pos_embed(c):
    return stock_module("flux2", "Flux2PosEmbed", theta=c["rope_theta"], axes_dim=c["axes_dims_rope"])


# ----------------------------------------------------------------------------- tiny pipelines


def tiny_config_changes(kind: str) -> dict:
    """Three stacked encoder layers' width; FLUX.2-dev is guidance-distilled, klein is not."""
    from .. import tiny

    width = tiny._MISTRAL_DIM if kind == "flux2" else tiny._QWEN3_DIM
    return dict(joint_attention_dim=3 * width, guidance_embeds=kind == "flux2")


def tiny_components(kind: str, seed: int) -> dict:
    """FLUX.2-dev's Mistral3 encoder; klein's Qwen3."""
    from .. import tiny

    tok = tiny.mistral_tokenizer() if kind == "flux2" else tiny.qwen_tokenizer()
    parts = {"scheduler": tiny.scheduler(), "vae": tiny.flux2_vae(seed)}  # built in the order they always were
    parts["text_encoder"] = tiny.mistral3_encoder(tok, seed) if kind == "flux2" else tiny.qwen3_encoder(tok, seed)
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

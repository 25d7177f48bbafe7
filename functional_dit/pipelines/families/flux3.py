"""FLUX.3's product (base and step-distilled, the modular pipelines): its text-to-image
sampling steps for `fd.sample`, the diffusers adapter's argument map for
``Flux3Transformer2DModel`` (its forward signature names every argument: the modular
pipelines pass a field to the transformer only when ``forward`` names it), its tiny
pipelines' recipes and the bench's inputs (`functional_dit.pipelines.families.HOOKS`)."""

from __future__ import annotations

import types

import torch

from ... import flux3
from ...flux3 import Flux3Config
from .. import tiny_parts
from . import _common
from ._common import stock_module
from ._latents import flux2_vae_input
from ._steps import NO_TABLES, Prompt, Steps, tables

# the shared hooks FLUX.3 takes as they are (`_common`)
IMAGE_INPUTS = _common.IMAGE_INPUTS  # none of its pipelines takes images yet
shift, batch_size, adapter_result, output, size, image_job = (
    _common.shift,
    _common.batch_size,
    _common.adapter_result,
    _common.output,
    _common.size,
    _common.image_job,
)

# ----------------------------------------------------------------------------- fd.sample

EMBED_ARGS = ()  # embeddings not taken yet: these pipelines encode their own prompts
EMBEDS_TOGETHER = ()
MAX_SEQUENCE_LENGTH = None
ENCODER_LORA_SCALE = False
CFG_NEEDS_NEGATIVE = False
PER_ITEM_PIPELINES = ("Flux3ModularPipeline", "Flux3DistilledModularPipeline")
CONTROLNET_PIPELINES = ()  # refused without fd.sample(controlnet=...)


class Flux3(Steps):
    """The modular Flux3 pipelines, text to image: stacked Qwen3-VL hidden states (one
    prompt per encoder call, right-padded to a multiple of 80 tokens), 2x2-patchified
    128-channel latents as tokens, 4-axis ids with the image H/W scaled by 0.5, a
    constant-shift schedule, CFG (the base model's guider) as one batch, and for a flow
    map the target timestep (the next scheduler timestep, 0 after the last)."""

    fixed_graph = True  # one fixed device graph per step (`sampler_xla`)
    packs_sizes = True  # items of several sizes (one padded prompt length) in one call (`sampler._packing`)
    PAD_MULTIPLE, ROPE_SCALE = 80, 0.5  # modular_pipelines/flux3: Flux3TextEncoderStep, Flux3PrepareLatentsStep

    def __init__(self, params, pipe):
        self.pipe, self.c = pipe, params.config

    def _layers(self) -> tuple:
        """The encoder layers stacked: diffusers' default (4, 8, ..., 32), or as many evenly
        spaced layers as joint_attention_dim holds for a shallower encoder."""
        te = self.pipe.text_encoder
        n = self.c.joint_attention_dim // te.config.text_config.hidden_size
        L_ = te.config.text_config.num_hidden_layers
        return tuple(range(4, 33, 4)) if L_ >= 32 and n == 8 else tuple(round((k + 1) * L_ / n) for k in range(n))

    def encode(self, run, prompts, msl):
        # diffusers: seconds to import, loaded when first used
        from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

        embed = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds
        pipe, kw = self.pipe, dict(max_sequence_length=msl or 8192, pad_multiple=self.PAD_MULTIPLE)
        txts = [embed(pipe.text_encoder, pipe.tokenizer, p, hidden_states_layers=self._layers(), **kw) for p in prompts]
        if len({t.shape[1] for t in txts}) != 1:
            raise ValueError(f"prompt: FLUX.3 prompts of different padded lengths {[t.shape[1] for t in txts]}")
        txt = torch.cat(txts)
        T = txt.shape[1]
        ids = torch.stack([torch.zeros(T), torch.zeros(T), torch.zeros(T), torch.arange(T) * 1.0], -1)
        return Prompt(txt, txt_ids=ids)

    def noise_shape(self, B, h, w):
        return (B, self.c.in_channels, h // 2, w // 2)

    @staticmethod
    def pack(z):
        """(B, C, h/2, w/2) -> (B, h/2·w/2, C): the patchified latents as tokens."""
        return z.flatten(2).transpose(1, 2)

    take = staticmethod(lambda latents: latents)  # latents= given packed

    def prepare(self, run, cond, h, w, guidance, device):
        rows, cols = torch.meshgrid(torch.arange(h // 2) * 1.0, torch.arange(w // 2) * 1.0, indexing="ij")
        zeros = torch.zeros(rows.numel())
        img_ids = torch.stack(
            [zeros, rows.reshape(-1) * self.ROPE_SCALE, cols.reshape(-1) * self.ROPE_SCALE, zeros], -1
        )
        return tables(rope=flux3.rope_table(self.c, img_ids.to(device), cond.txt_ids.to(device)))

    @staticmethod
    def _target(ts, i: int, batch: int, dtype) -> torch.Tensor:
        """Step i's flow-map target: the next timestep / 1000, 0 after the last."""
        nxt = ts[i + 1] if i + 1 < len(ts) else torch.zeros_like(ts[i])
        return (nxt / 1000).expand(batch).to(dtype)

    def step_inputs(self, sched, batch, dtype):
        """The flow map's target timestep per step (every loop passes it to `predict`)."""
        if not self.c.flow_map:
            return super().step_inputs(sched, batch, dtype)
        return [{"target": self._target(sched.timesteps, i, batch, dtype)} for i in range(len(sched.timesteps))]

    def predict(self, params, tab, x, t, cond, apply, target=None):
        if target is None and self.c.flow_map:
            raise ValueError("target: a FLUX.3 flow map needs each step's target timestep (`step_inputs`), got None")
        return apply(params, x, t, cond.txt, rope=tab["rope"], target_timestep=target), NO_TABLES

    def decode_latents(self, x, h, w):
        return flux2_vae_input(self.pipe.vae, x, h, w)


def steps(params, pipe, image, kv_cache) -> Steps:
    if kv_cache or image is not None:
        raise ValueError("image, kv_cache: fd.sample runs FLUX.3 text to image only; expected None")
    return Flux3(params, pipe)


def pipeline_class(components) -> str:
    raise ValueError("encoders: for FLUX.3 pass the modular pipeline (Flux3ModularPipeline), not its components")


# ----------------------------------------------------------------------------- the adapter

ADAPTER_ARGS = {"img_ids", "txt_ids", "image_cond_hidden_states", "image_cond_ids", "target_timestep"}
ADAPTER_ARGS |= {"attention_kwargs"}
PROCESSORS = {
    "txt_mode_blocks": ({"Flux3AttnProcessor"}, "transformer_flux3:Flux3AttnProcessor"),
    "single_transformer_blocks": ({"Flux3AttnProcessor"}, "transformer_flux3:Flux3AttnProcessor"),
}
NAMED_FORWARD = True
IP_ADAPTER = False
broadcast = _common.broadcast_text


def adapter_args(
    adapter,
    img_ids=None,
    txt_ids=None,
    image_cond_hidden_states=None,
    image_cond_ids=None,
    target_timestep=None,
    attention_kwargs=None,
) -> dict:
    adapter._lora_scale("attention_kwargs", attention_kwargs)
    return dict(
        img_ids=img_ids,
        txt_ids=txt_ids,
        image_cond=image_cond_hidden_states,
        image_cond_ids=image_cond_ids,
        target_timestep=target_timestep,
    )


def pos_embed(c):
    return stock_module("flux3", "Flux3PosEmbed", theta=c["rope_theta"], axes_dim=list(c["axes_dims_rope"]))


# ----------------------------------------------------------------------------- tiny pipelines


def tiny_config_changes(kind: str) -> dict:
    """One block; the stacked encoder layers' width; image_cond tokens are VAE latents, as x;
    the base model or the flow map."""
    width = len(tiny_parts.FLUX3_LAYERS) * tiny_parts.VL_DIM
    return dict(cond_in_channels=16, num_layers=1, joint_attention_dim=width, flow_map=kind == "flux3-distilled")


def tiny_components(kind: str, seed: int) -> dict:
    """A Qwen3-VL encoder and processor; FLUX.3's recipe: a constant shift (6.93) configured
    on the scheduler (modular_pipelines/flux3/before_denoise.py)."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    proc = tiny_parts.qwen3vl_processor()
    parts = {"text_encoder": tiny_parts.qwen3vl_encoder(proc.tokenizer, seed)}
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=6.93)
    return parts | {"scheduler": sched, "vae": tiny_parts.flux2_vae(seed), "tokenizer": proc}


def tiny_assemble(kind: str, parts: dict, transformer):
    """The modular pipeline built from its blocks, without the prompt upsampler (the prompt
    is encoded as given)."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    blocks = getattr(diffusers, "Flux3DistilledAutoBlocks" if kind == "flux3-distilled" else "Flux3AutoBlocks")()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline()
    pipe.update_components(**parts, transformer=transformer)
    return pipe


# ----------------------------------------------------------------------------- bench, check

MID_CONFIG = Flux3Config(  # the released klein's channels and RoPE split, mid width
    in_channels=128,
    cond_in_channels=128,
    num_layers=2,
    num_single_layers=5,
    attention_head_dim=64,
    num_attention_heads=8,
    joint_attention_dim=512,
    axes_dims_rope=(16, 16, 16, 16),
    flow_map=True,
)
RELEASED = "flux3-klein"
BENCH_CACHE = None  # no step cache yet
CHECK_EAGER_ONLY = None


def bench_inputs(config, x, t, txt, h, w, device, dtype, g):
    """No guidance embedding; the step-distilled model's target timestep instead."""
    kw, dkw = _common.flux_ids_inputs(config, x, t, txt, h, w, device, 4)
    del kw["guidance"], dkw["guidance"]
    dkw["target_timestep"] = t * 0.5 if config.flow_map else None
    if config.flow_map:
        kw["target_timestep"] = dkw["target_timestep"]
    return kw, dkw


# ----------------------------------------------------------------------------- the trainer

TRAIN_PIPELINES = ("Flux3ModularPipeline",)  # the base model (its flow map learns jumps, not velocities)
TRAIN_LATENT_MULTIPLE, TRAIN_SECOND, train_inputs = (
    _common.TRAIN_LATENT_MULTIPLE,
    _common.TRAIN_SECOND,
    _common.train_inputs,
)
TRAIN_TEXTS_TOGETHER = True  # no mask to stack captions with: all at the longest one's padded length


def train_latent(pipe, image: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The latent as the VAE encoder step makes a reference's (patchified 2x2,
    batch-normed) packed as the sampler packs (one token per patch), and its 4-axis ids
    (image H/W scaled by 0.5, as Flux3PrepareLatentsStep)."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep

    vae = pipe.vae
    z = Flux3VaeEncoderStep._patchify_latents(vae.encode(image).latent_dist.mode())
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    z = (z - mean) / torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    _, _, h, w = z.shape
    rows, cols = torch.meshgrid(torch.arange(h) * 1.0, torch.arange(w) * 1.0, indexing="ij")
    zeros = torch.zeros(rows.numel())
    ids = torch.stack([zeros, rows.reshape(-1) * Flux3.ROPE_SCALE, cols.reshape(-1) * Flux3.ROPE_SCALE, zeros], -1)
    return Flux3.pack(z)[0], {"img_ids": ids}


def train_texts(pipe, captions: list, every: list, max_len: int) -> list:
    """The captions' embeddings through the pipeline's encoder (stacked Qwen3-VL layers,
    right-padded to a multiple of 80 tokens, as `fd.sample` encodes), ``every`` caption of
    the run at one length: a caption whose padded length is shorter than the longest's is
    padded to it with the same pad tokens (FLUX.3 attends to them)."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    layers = Flux3(types.SimpleNamespace(config=pipe.transformer.config), pipe)._layers()
    embed = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds

    def run(caption: str, multiple: int) -> torch.Tensor:
        kw = dict(max_sequence_length=max_len, pad_multiple=multiple, hidden_states_layers=layers)
        return embed(pipe.text_encoder, pipe.tokenizer, caption, **kw)[0]

    embeds = {c: run(c, Flux3.PAD_MULTIPLE) for c in every}
    T = max(len(e) for e in embeds.values())
    ids = torch.stack([torch.zeros(T), torch.zeros(T), torch.zeros(T), torch.arange(T) * 1.0], -1)
    rows = {c: (e if len(e) == T else run(c, T), None, {"txt_ids": ids}) for c, e in embeds.items()}
    return [rows[c] for c in captions]

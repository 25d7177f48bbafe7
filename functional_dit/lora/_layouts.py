"""LoRA key layouts as data: how each adapted diffusers module is found in a LoRA file.

A LoRA file names *modules* (``transformer_blocks.0.attn.to_q``) and stores two
factors per module — ``lora_A`` / ``lora_B`` in the diffusers/PEFT layout,
``lora_down`` / ``lora_up`` in Kohya's (sd-scripts) — plus an optional ``alpha``.
The tables below map the Black Forest Labs module names that the FLUX checkpoints,
their trainers (Kohya ``lora_unet_double_blocks_0_img_attn_qkv``) and ComfyUI
(``diffusion_model.double_blocks.0.img_attn.qkv``) use to the diffusers modules, as
the checkpoint tables in ``weights/_layouts.py`` do for the weights themselves:

- ``rename``: the module is stored under another name;
- ``split``: a fused projection (BFL ``qkv``, FLUX.1 ``linear1``) whose output rows
  are the targets' rows one after another: the down factor ``A`` (r, in) is shared by
  every target and the up factor ``B`` (out, r) is split by rows, exactly
  (``B @ A`` restricted to a target's rows is that target's update);
- ``swap_scale_shift``: the two halves of the output rows are stored in the other
  order (BFL's final AdaLN), so ``B``'s row halves swap.

The mapping mirrors diffusers' ``_convert_kohya_flux_lora_to_diffusers`` and
``_convert_non_diffusers_flux2_lora_to_diffusers`` (``loaders/lora_conversion_utils.py``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Rule:
    src: str  # source module template, "{}" = block index
    dst: tuple[str, ...]  # diffusers module templates
    transform: str = "rename"  # "rename" | "split" | "swap_scale_shift"


def _r(src: str, dst: str) -> Rule:
    return Rule(src, (dst,))


def _split(src: str, *dst: str) -> Rule:
    return Rule(src, dst, "split")


_QKV = tuple(f"transformer_blocks.{{}}.attn.to_{x}" for x in "qkv")
_ADD_QKV = tuple(f"transformer_blocks.{{}}.attn.add_{x}_proj" for x in "qkv")

FLUX1 = (
    _r("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
    _r("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
    _r("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
    _r("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
    _r("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
    _r("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
    _r("txt_in", "context_embedder"),
    _r("img_in", "x_embedder"),
    _r("double_blocks.{}.img_mod.lin", "transformer_blocks.{}.norm1.linear"),
    _r("double_blocks.{}.txt_mod.lin", "transformer_blocks.{}.norm1_context.linear"),
    _split("double_blocks.{}.img_attn.qkv", *_QKV),
    _split("double_blocks.{}.txt_attn.qkv", *_ADD_QKV),
    _r("double_blocks.{}.img_attn.proj", "transformer_blocks.{}.attn.to_out.0"),
    _r("double_blocks.{}.txt_attn.proj", "transformer_blocks.{}.attn.to_add_out"),
    _r("double_blocks.{}.img_mlp.0", "transformer_blocks.{}.ff.net.0.proj"),
    _r("double_blocks.{}.img_mlp.2", "transformer_blocks.{}.ff.net.2"),
    _r("double_blocks.{}.txt_mlp.0", "transformer_blocks.{}.ff_context.net.0.proj"),
    _r("double_blocks.{}.txt_mlp.2", "transformer_blocks.{}.ff_context.net.2"),
    _r("single_blocks.{}.modulation.lin", "single_transformer_blocks.{}.norm.linear"),
    _split(
        "single_blocks.{}.linear1",
        *(f"single_transformer_blocks.{{}}.attn.to_{x}" for x in "qkv"),
        "single_transformer_blocks.{}.proj_mlp",
    ),
    _r("single_blocks.{}.linear2", "single_transformer_blocks.{}.proj_out"),
    Rule("final_layer.adaLN_modulation.1", ("norm_out.linear",), "swap_scale_shift"),
    _r("final_layer.linear", "proj_out"),
)

FLUX2 = (
    _r("time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_1"),
    _r("time_in.out_layer", "time_guidance_embed.timestep_embedder.linear_2"),
    _r("guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_1"),
    _r("guidance_in.out_layer", "time_guidance_embed.guidance_embedder.linear_2"),
    _r("double_stream_modulation_img.lin", "double_stream_modulation_img.linear"),
    _r("double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear"),
    _r("single_stream_modulation.lin", "single_stream_modulation.linear"),
    _r("img_in", "x_embedder"),
    _r("txt_in", "context_embedder"),
    _split("double_blocks.{}.img_attn.qkv", *_QKV),
    _split("double_blocks.{}.txt_attn.qkv", *_ADD_QKV),
    _r("double_blocks.{}.img_attn.proj", "transformer_blocks.{}.attn.to_out.0"),
    _r("double_blocks.{}.txt_attn.proj", "transformer_blocks.{}.attn.to_add_out"),
    _r("double_blocks.{}.img_mlp.0", "transformer_blocks.{}.ff.linear_in"),
    _r("double_blocks.{}.img_mlp.2", "transformer_blocks.{}.ff.linear_out"),
    _r("double_blocks.{}.txt_mlp.0", "transformer_blocks.{}.ff_context.linear_in"),
    _r("double_blocks.{}.txt_mlp.2", "transformer_blocks.{}.ff_context.linear_out"),
    _r("single_blocks.{}.linear1", "single_transformer_blocks.{}.attn.to_qkv_mlp_proj"),
    _r("single_blocks.{}.linear2", "single_transformer_blocks.{}.attn.to_out"),
    Rule("final_layer.adaLN_modulation.1", ("norm_out.linear",), "swap_scale_shift"),
    _r("final_layer.linear", "proj_out"),
)

# diffusers class -> its BFL module table (Qwen-Image LoRAs use the diffusers names)
BFL_TABLES = {"FluxTransformer2DModel": FLUX1, "Flux2Transformer2DModel": FLUX2}

# Prefixes stripped from module names, longest first: diffusers pipelines save
# ``transformer.``; a raw PEFT model ``base_model.model.``; ComfyUI and BFL
# ``diffusion_model.``; Kohya (sd-scripts) ``lora_unet_`` with dots turned into "_".
PREFIXES = ("transformer.", "base_model.model.", "model.diffusion_model.", "diffusion_model.")
KOHYA_PREFIX = "lora_unet_"
# LoRA for other pipeline components (text encoders): not ours, skipped with a warning.
OTHER_COMPONENTS = ("text_encoder.", "text_encoder_2.", "lora_te_", "lora_te1_", "lora_te2_", "lora_te3_")

# factor suffix -> (which factor, layout)
FACTORS = {
    "lora_A.weight": ("A", "peft"),
    "lora_B.weight": ("B", "peft"),
    "lora_down.weight": ("A", "kohya"),
    "lora_up.weight": ("B", "kohya"),
}
DORA_MARKERS = ("lora_magnitude_vector", "dora_scale")


@dataclasses.dataclass(frozen=True)
class Target:
    """One diffusers module fed by a source module: rows ``[start, stop)`` of the source's
    up factor, with the halves swapped when ``swap``."""

    module: str
    start: int
    stop: int
    swap: bool = False


def _fill(template: str, i: int | None) -> str:
    return template if i is None else template.replace("{}", str(i))


def source_index(table, shapes: dict[str, tuple[int, int]], blocks: dict[str, int]) -> dict[str, list[Target]]:
    """``{source module: [Target, ...]}`` for a model whose linear modules have weight
    ``shapes`` (diffusers module -> (out, in)); ``blocks`` gives the block count per
    template prefix. Every diffusers module maps to itself; the table adds the BFL names."""
    index = {m: [Target(m, 0, s[0])] for m, s in shapes.items()}
    for rule in table:
        counts = [None] if "{}" not in rule.src else range(blocks.get(rule.src.split(".")[0], 0))
        for i in counts:
            dst = [_fill(d, i) for d in rule.dst]
            if not all(d in shapes for d in dst):
                continue  # e.g. guidance_in on a model without guidance embeds
            targets, row = [], 0
            for d in dst:
                n = shapes[d][0]
                targets.append(Target(d, row, row + n, rule.transform == "swap_scale_shift"))
                row += n
            index[_fill(rule.src, i)] = targets
    return index


def kohya_name(module: str) -> str:
    return KOHYA_PREFIX + module.replace(".", "_")

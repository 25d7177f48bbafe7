"""LoRA key layouts as data: how each adapted diffusers module is found in a LoRA file.

A LoRA file names *modules* (``transformer_blocks.0.attn.to_q``) and stores two
factors per module — ``lora_A`` / ``lora_B`` in the diffusers/PEFT layout,
``lora_down`` / ``lora_up`` in Kohya's (sd-scripts) — plus an optional ``alpha``.
Black Forest Labs module names (the FLUX checkpoints, their trainers' Kohya
``lora_unet_double_blocks_0_img_attn_qkv``, ComfyUI's
``diffusion_model.double_blocks.0.img_attn.qkv``) are read through the checkpoint
tables of `weights` (``weights.BFL_TABLES``), the one home of the BFL names; a rule's
transform means for the factors:

- ``rename``: the module is stored under another name;
- ``split``: a fused projection (BFL ``qkv``, FLUX.1 ``linear1``) whose output rows
  are the targets' rows one after another: the down factor ``A`` (r, in) is shared by
  every target and the up factor ``B`` (out, r) is split by rows, exactly
  (``B @ A`` restricted to a target's rows is that target's update);
- ``swap_scale_shift``: the two halves of the output rows are stored in the other
  order (BFL's final AdaLN), so ``B``'s row halves swap.

Rules for non-linear modules (the QK norms) name no linear layer and are skipped. The
mapping mirrors diffusers' ``_convert_kohya_flux_lora_to_diffusers``,
``_convert_non_diffusers_flux2_lora_to_diffusers`` and
``_convert_non_diffusers_flux3_lora_to_diffusers`` (``loaders/lora_conversion_utils.py``).
"""

from __future__ import annotations

import dataclasses
import re

from weights import BFL_TABLES, Rule

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
    "lora_B.bias": ("bias", "peft"),  # PEFT's lora_bias=True
    "lora_magnitude_vector": ("magnitude", "peft"),  # PEFT's DoRA (use_dora=True)
}
# per-output-row leaves (out,), cut by rows like the up factor
ROW_LEAVES = {"bias": "lora_B.bias", "magnitude": "lora_magnitude_vector"}
KOHYA_DORA = "dora_scale"  # LyCORIS/Kohya DoRA: another layout and norm axis, refused


@dataclasses.dataclass(frozen=True)
class Target:
    """One diffusers module fed by a source module: rows ``[start, stop)`` of the source's
    up factor, with the halves swapped when ``swap``."""

    module: str
    start: int
    stop: int
    swap: bool = False


def bfl_table(diffusers_class: str) -> tuple[Rule, ...]:
    """The BFL module table of a diffusers class (none: its LoRAs use diffusers' names)."""
    return BFL_TABLES.get(diffusers_class, ())


def _fill(template: str, i: str | None) -> str:
    return template if i is None else template.replace("{}", i)


def _block_indices(template: str, modules) -> list[str | None]:
    """The block indices ``{}`` takes among ``modules`` ([None] for a template without one)."""
    if "{}" not in template:
        return [None]
    pattern = re.compile(re.escape(template).replace(r"\{\}", r"(\d+)") + r"\Z")
    return sorted({m.group(1) for name in modules if (m := pattern.match(name))}, key=int)


def _targets(rule: Rule, dst: list[str], shapes: dict) -> list[Target]:
    targets, row = [], 0
    for d in dst:
        n = shapes[d][0]
        targets.append(Target(d, row, row + n, rule.transform == "swap_scale_shift"))
        row += n
    return targets


def source_index(table, shapes: dict[str, tuple[int, int]]) -> dict[str, list[Target]]:
    """``{source module: [Target, ...]}`` for a model whose linear modules have weight
    ``shapes`` (diffusers module -> (out, in)). Every diffusers module maps to itself;
    the ``table`` (`weights.Rule` s) adds the BFL names of the blocks the model has."""
    index = {m: [Target(m, 0, s[0])] for m, s in shapes.items()}
    for rule in table:
        for i in _block_indices(rule.dst[0], shapes):
            dst = [_fill(d, i) for d in rule.dst]
            if all(d in shapes for d in dst):  # else e.g. guidance_in without guidance embeds, or a norm
                index[_fill(rule.src, i)] = _targets(rule, dst, shapes)
    return index


def kohya_name(module: str) -> str:
    return KOHYA_PREFIX + module.replace(".", "_")

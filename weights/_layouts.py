"""Checkpoint key layouts as data: how each diffusers parameter is found in a file.

A layout is a table of rules: a source key template, one or more diffusers key templates
(``{}`` a block index) and a named transform (``rename``, ``split`` of a fused tensor,
``swap_scale_shift``). `resolve` turns a table into row ranges of source tensors per
diffusers key; every transform permutes dim-0 rows, so a rank reads only the rows it
holds. The Black Forest Labs tables follow black-forest-labs/flux and flux2
(docs/weights.md, "Key layouts as data").
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from functional_dit import families

LINEAR = (("weight", "weight"), ("bias", "bias"))  # (source leaf, diffusers leaf)
NORM = (("scale", "weight"),)  # BFL RMSNorm stores its gain as `scale`


@dataclasses.dataclass(frozen=True)
class Rule:
    src: str  # source module template, "{}" = block index
    dst: tuple[str, ...]  # diffusers module templates
    transform: str  # "rename" | "split" | "swap_scale_shift"
    leaves: tuple[tuple[str, str], ...] = LINEAR


def rename(src: str, dst: str, leaves=LINEAR) -> Rule:
    return Rule(src, (dst,), "rename", leaves)


def norm(src: str, dst: str) -> Rule:
    return Rule(src, (dst,), "rename", NORM)


def split(src: str, *dst: str) -> Rule:
    return Rule(src, dst, "split")


def swap_scale_shift(src: str, dst: str) -> Rule:
    return Rule(src, (dst,), "swap_scale_shift")


# ----------------------------------------------------------------------------- FLUX.1, BFL layout

_FLUX1_EMBED = "time_text_embed"
FLUX1_BFL = (
    rename("time_in.in_layer", f"{_FLUX1_EMBED}.timestep_embedder.linear_1"),
    rename("time_in.out_layer", f"{_FLUX1_EMBED}.timestep_embedder.linear_2"),
    rename("guidance_in.in_layer", f"{_FLUX1_EMBED}.guidance_embedder.linear_1"),
    rename("guidance_in.out_layer", f"{_FLUX1_EMBED}.guidance_embedder.linear_2"),
    rename("vector_in.in_layer", f"{_FLUX1_EMBED}.text_embedder.linear_1"),
    rename("vector_in.out_layer", f"{_FLUX1_EMBED}.text_embedder.linear_2"),
    rename("txt_in", "context_embedder"),
    rename("img_in", "x_embedder"),
    # double-stream blocks
    rename("double_blocks.{}.img_mod.lin", "transformer_blocks.{}.norm1.linear"),
    rename("double_blocks.{}.txt_mod.lin", "transformer_blocks.{}.norm1_context.linear"),
    split("double_blocks.{}.img_attn.qkv", *(f"transformer_blocks.{{}}.attn.to_{x}" for x in "qkv")),
    split("double_blocks.{}.txt_attn.qkv", *(f"transformer_blocks.{{}}.attn.add_{x}_proj" for x in "qkv")),
    norm("double_blocks.{}.img_attn.norm.query_norm", "transformer_blocks.{}.attn.norm_q"),
    norm("double_blocks.{}.img_attn.norm.key_norm", "transformer_blocks.{}.attn.norm_k"),
    norm("double_blocks.{}.txt_attn.norm.query_norm", "transformer_blocks.{}.attn.norm_added_q"),
    norm("double_blocks.{}.txt_attn.norm.key_norm", "transformer_blocks.{}.attn.norm_added_k"),
    rename("double_blocks.{}.img_attn.proj", "transformer_blocks.{}.attn.to_out.0"),
    rename("double_blocks.{}.txt_attn.proj", "transformer_blocks.{}.attn.to_add_out"),
    rename("double_blocks.{}.img_mlp.0", "transformer_blocks.{}.ff.net.0.proj"),
    rename("double_blocks.{}.img_mlp.2", "transformer_blocks.{}.ff.net.2"),
    rename("double_blocks.{}.txt_mlp.0", "transformer_blocks.{}.ff_context.net.0.proj"),
    rename("double_blocks.{}.txt_mlp.2", "transformer_blocks.{}.ff_context.net.2"),
    # single-stream blocks: linear1 = [q, k, v, mlp] rows, linear2 = proj_out
    rename("single_blocks.{}.modulation.lin", "single_transformer_blocks.{}.norm.linear"),
    split(
        "single_blocks.{}.linear1",
        *(f"single_transformer_blocks.{{}}.attn.to_{x}" for x in "qkv"),
        "single_transformer_blocks.{}.proj_mlp",
    ),
    norm("single_blocks.{}.norm.query_norm", "single_transformer_blocks.{}.attn.norm_q"),
    norm("single_blocks.{}.norm.key_norm", "single_transformer_blocks.{}.attn.norm_k"),
    rename("single_blocks.{}.linear2", "single_transformer_blocks.{}.proj_out"),
    swap_scale_shift("final_layer.adaLN_modulation.1", "norm_out.linear"),
    rename("final_layer.linear", "proj_out"),
)

# ----------------------------------------------------------------------------- FLUX.2, BFL layout

_FLUX2_EMBED = "time_guidance_embed"
FLUX2_BFL = (
    rename("time_in.in_layer", f"{_FLUX2_EMBED}.timestep_embedder.linear_1"),
    rename("time_in.out_layer", f"{_FLUX2_EMBED}.timestep_embedder.linear_2"),
    rename("guidance_in.in_layer", f"{_FLUX2_EMBED}.guidance_embedder.linear_1"),
    rename("guidance_in.out_layer", f"{_FLUX2_EMBED}.guidance_embedder.linear_2"),
    rename("double_stream_modulation_img.lin", "double_stream_modulation_img.linear"),
    rename("double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear"),
    rename("single_stream_modulation.lin", "single_stream_modulation.linear"),
    rename("img_in", "x_embedder"),
    rename("txt_in", "context_embedder"),
    # double-stream blocks (modulation is shared across blocks in FLUX.2)
    split("double_blocks.{}.img_attn.qkv", *(f"transformer_blocks.{{}}.attn.to_{x}" for x in "qkv")),
    split("double_blocks.{}.txt_attn.qkv", *(f"transformer_blocks.{{}}.attn.add_{x}_proj" for x in "qkv")),
    norm("double_blocks.{}.img_attn.norm.query_norm", "transformer_blocks.{}.attn.norm_q"),
    norm("double_blocks.{}.img_attn.norm.key_norm", "transformer_blocks.{}.attn.norm_k"),
    norm("double_blocks.{}.txt_attn.norm.query_norm", "transformer_blocks.{}.attn.norm_added_q"),
    norm("double_blocks.{}.txt_attn.norm.key_norm", "transformer_blocks.{}.attn.norm_added_k"),
    rename("double_blocks.{}.img_attn.proj", "transformer_blocks.{}.attn.to_out.0"),
    rename("double_blocks.{}.txt_attn.proj", "transformer_blocks.{}.attn.to_add_out"),
    rename("double_blocks.{}.img_mlp.0", "transformer_blocks.{}.ff.linear_in"),
    rename("double_blocks.{}.img_mlp.2", "transformer_blocks.{}.ff.linear_out"),
    rename("double_blocks.{}.txt_mlp.0", "transformer_blocks.{}.ff_context.linear_in"),
    rename("double_blocks.{}.txt_mlp.2", "transformer_blocks.{}.ff_context.linear_out"),
    # single-stream blocks: linear1 is already diffusers' fused to_qkv_mlp_proj
    rename("single_blocks.{}.linear1", "single_transformer_blocks.{}.attn.to_qkv_mlp_proj"),
    rename("single_blocks.{}.linear2", "single_transformer_blocks.{}.attn.to_out"),
    norm("single_blocks.{}.norm.query_norm", "single_transformer_blocks.{}.attn.norm_q"),
    norm("single_blocks.{}.norm.key_norm", "single_transformer_blocks.{}.attn.norm_k"),
    swap_scale_shift("final_layer.adaLN_modulation.1", "norm_out.linear"),
    rename("final_layer.linear", "proj_out"),
)

# ----------------------------------------------------------------------------- FLUX.3, BFL layout
# diffusers' convert_flux3_transformer_checkpoint_to_diffusers (loaders/single_file_utils.py).


def _flux3_block(src: str, dst: str) -> tuple[Rule, ...]:
    """One per-mode or single block: separate q/k/v, attn_out, QK norms, the SwiGLU MLP."""
    rules = [rename(f"{src}.{x}_proj", f"{dst}.attn.to_{x}") for x in "qkv"]
    rules += [norm(f"{src}.norm.query_norm", f"{dst}.attn.norm_q"), norm(f"{src}.norm.key_norm", f"{dst}.attn.norm_k")]
    return (*rules, rename(f"{src}.attn_out", f"{dst}.attn.to_out.0"), rename(f"{src}.mlp_in", f"{dst}.ff.linear_in"),
            rename(f"{src}.mlp_out", f"{dst}.ff.linear_out"))  # fmt: skip


_FLUX3_MODES = ("image", "image_cond", "txt")
FLUX3_BFL = (
    rename("time_in.in_layer", "timestep_embedder.linear_1"),
    rename("time_in.out_layer", "timestep_embedder.linear_2"),
    rename("ref_time_in.in_layer", "target_timestep_embedder.linear_1"),  # flow map (step-distilled)
    rename("ref_time_in.out_layer", "target_timestep_embedder.linear_2"),
    *(
        rename(f"{k}_stream_modulations.{m}.lin", f"{k}_stream_modulations.{m}.linear")
        for k in ("early", "single")
        for m in _FLUX3_MODES
    ),
    rename("emb_in.image", "x_embedders.image"),
    rename("emb_in.image_cond", "x_embedders.image_cond"),
    rename("txt_in", "context_embedder"),
    *_flux3_block("content_mode_blocks.image.{}", "mode_blocks.image.{}"),
    *_flux3_block("content_mode_blocks.image_cond.{}", "mode_blocks.image_cond.{}"),
    *_flux3_block("txt_mode_blocks.{}", "txt_mode_blocks.{}"),
    *_flux3_block("single_blocks.{}", "single_transformer_blocks.{}"),
    swap_scale_shift("final_layer.image.adaLN_modulation.1", "norm_out.linear"),
    rename("final_layer.image.linear", "proj_out"),
)

# ----------------------------------------------------------------------------- Qwen-Image 2.1, original layout
# diffusers' convert_qwen_image21_transformer_checkpoint_to_diffusers: diffusers' names, but
# ComfyUI fuses the SwiGLU gate and up projections into one gate_up (gate rows first).

_QWEN21_SAME = ("time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
                "txt_in.text_norm", "txt_in.in_layer", "txt_in.out_layer", "img_in", "modulation.1", "norm_out.linear",
                "proj_out")  # fmt: skip
_QWEN21_BLOCK = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.norm_q", "attn.norm_k", "img_mlp.out")
QWEN21_ORIGINAL = (
    *(rename(k, k) for k in _QWEN21_SAME),
    *(rename(f"transformer_blocks.{{}}.{k}", f"transformer_blocks.{{}}.{k}") for k in _QWEN21_BLOCK),
    split(
        "transformer_blocks.{}.img_mlp.gate_up",
        "transformer_blocks.{}.img_mlp.gate_layer",
        "transformer_blocks.{}.img_mlp.proj",
    ),
)

# diffusers class -> its Black Forest Labs (original) table
BFL_TABLES = {
    "FluxTransformer2DModel": FLUX1_BFL,
    "Flux2Transformer2DModel": FLUX2_BFL,
    "Flux3Transformer2DModel": FLUX3_BFL,
    "QwenImage21Transformer2DModel": QWEN21_ORIGINAL,
}
# diffusers class -> source key prefixes its converter drops (training-only heads)
DROPPED = {"Flux3Transformer2DModel": ("repa_projectors.",)}

# (diffusers class, layout) -> a key only that family's layout has
SIGNATURES = (
    ("FluxTransformer2DModel", "diffusers", "time_text_embed.text_embedder.linear_1.weight"),
    ("Flux2Transformer2DModel", "diffusers", "time_guidance_embed.timestep_embedder.linear_1.weight"),
    ("QwenImageTransformer2DModel", "diffusers", "txt_norm.weight"),
    ("FluxTransformer2DModel", "bfl", "vector_in.in_layer.weight"),
    ("Flux2Transformer2DModel", "bfl", "double_stream_modulation_img.lin.weight"),
    ("Flux3Transformer2DModel", "diffusers", "early_stream_modulations.image.linear.weight"),
    ("Flux3Transformer2DModel", "bfl", "early_stream_modulations.image.lin.weight"),
    ("QwenImage21Transformer2DModel", "bfl", "transformer_blocks.0.img_mlp.gate_up.weight"),  # before diffusers'
    ("QwenImage21Transformer2DModel", "diffusers", "txt_in.text_norm.weight"),
)
FAMILY_NAMES = {fam.DIFFUSERS_CLASS: fam.NAME for fam in families.FAMILIES}  # the family registry's
STRIP_PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # ComfyUI / Kohya wrappers around a BFL state dict


def detect(keys: Iterable[str]) -> tuple[str, str] | None:
    """(diffusers class, "diffusers" | "bfl") recognised from a checkpoint's keys, or None."""
    keys = set(keys)
    for cls, layout, key in SIGNATURES:
        if key in keys:
            return cls, layout
    return None


# ----------------------------------------------------------------------------- resolution


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[dst, dst + rows)`` of a diffusers tensor are rows ``[src_row, src_row + rows)``
    of the source tensor ``src``."""

    src: str
    src_row: int
    dst: int
    rows: int


@dataclasses.dataclass
class Resolved:
    pieces: dict[str, list[Piece]]  # diffusers key -> its pieces
    source_shapes: dict[str, tuple[int, ...]]  # source key -> the shape the targets imply
    unmatched: list[str]  # diffusers keys no rule produces


def identity(shapes: Mapping[str, tuple[int, ...]]) -> Resolved:
    """The diffusers layout: every key is stored under its own name."""
    return Resolved({k: [Piece(k, 0, 0, s[0] if s else 1)] for k, s in shapes.items()}, dict(shapes), [])


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{\}", r"(\d+)") + r"\Z")


def resolve(table: tuple[Rule, ...], shapes: Mapping[str, tuple[int, ...]]) -> Resolved:
    """Apply ``table`` to the diffusers keys and shapes of a model (``shapes``)."""
    compiled = [
        (rule, j, dl, sl, _pattern(f"{d}.{dl}"))
        for rule in table
        for j, d in enumerate(rule.dst)
        for sl, dl in rule.leaves
    ]
    pieces, source_shapes, unmatched = {}, {}, []
    for key in shapes:
        hit = next(((r, j, dl, sl, m) for r, j, dl, sl, p in compiled if (m := p.match(key))), None)
        if hit is None:
            unmatched.append(key)
            continue
        rule, j, dl, sl, m = hit
        block = m.group(1) if m.groups() else None
        src = f"{_fill(rule.src, block)}.{sl}"
        siblings = [shapes.get(f"{_fill(d, block)}.{dl}") for d in rule.dst]
        pieces[key], source_shapes[src] = _pieces(rule, j, src, siblings, key)
    return Resolved(pieces, source_shapes, unmatched)


def _fill(template: str, block: str | None) -> str:
    return template if block is None else template.replace("{}", block)


def _pieces(rule: Rule, j: int, src: str, siblings: list, key: str):
    shape = siblings[j]
    if rule.transform == "rename":
        return [Piece(src, 0, 0, shape[0] if shape else 1)], shape
    if rule.transform == "swap_scale_shift":
        half = shape[0] // 2
        return [Piece(src, half, 0, half), Piece(src, 0, half, half)], shape
    if rule.transform == "split":
        if any(s is None or s[1:] != shape[1:] for s in siblings):
            raise AssertionError(f"split {rule.src}: targets {rule.dst} have shapes {siblings}")
        start = sum(s[0] for s in siblings[:j])
        return [Piece(src, start, 0, shape[0])], (sum(s[0] for s in siblings), *shape[1:])
    raise AssertionError(f"unknown transform {rule.transform!r} for {key}")

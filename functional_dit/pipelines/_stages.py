"""Each family's forward as stages: the streams entering the first block, the blocks in
order, and the final layer, built from the family's own block functions. A step cache
(`functional_dit.pipelines.cache`) runs the first block(s), decides, then runs the rest (on all
batch items, on some, or on none) or reuses a residual; with every block run the result
is bitwise the family's ``forward``.

Streams are a tuple of (B, S, C) tensors in the local view: ``(img, txt)`` through the
double blocks, ``(x,)`` = (txt; img) through FLUX's single blocks; `image` takes the
image rows of either. ``ctx`` holds what the blocks read besides the streams (RoPE
table, key bias, per-block modulations); `Stages.take` cuts its batch-first tensors to a
subset of batch items, so the rest of the network can run for some items only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import sharding
from sharding.internal import gathered_blocks

from .. import flux1, flux2
from .. import qwenimage as qwen
from ..nn import compile as _compile
from ..nn import layers as L
from ..params import ordered_blocks


@dataclasses.dataclass
class Stages:
    """``streams`` before block 0; ``blocks[i](streams, ctx) -> streams``; ``final(img,
    ctx) -> out``; ``txt_len`` the local text rows; ``seq`` the full image length;
    ``batched`` the ctx keys whose tensors (or lists/tuples of tensors) are batch-first;
    ``attention`` the stock names of the attention modules whose blocks take a hook: a
    ctx entry ``"attn"``, {name: hook}, passes each block its hook."""

    streams: tuple
    blocks: list[Block]
    ctx: dict
    final: Callable
    txt_len: int
    seq: int
    batched: tuple[str, ...]
    attention: tuple[str, ...] = ()

    def image(self, streams: tuple) -> torch.Tensor:
        """The image rows (B, S_img_local, C) of ``streams``."""
        return streams[0] if len(streams) == 2 else streams[0][:, self.txt_len :]

    def run(self, streams: tuple, blocks, ctx: dict | None = None) -> tuple:
        """``blocks`` (`Block`s, in order) on ``streams``. Fully sharded params: each
        block's weights all-gathered at once before it computes, the next block's gather
        issued first (`sharding.internal.gathered_blocks`, as ``fd.apply``'s block loop)."""
        ctx = self.ctx if ctx is None else ctx
        blocks = list(blocks)
        for block, p in zip(blocks, gathered_blocks([b.p for b in blocks])):
            streams = block.fn(p, block.i, streams, ctx)
        return streams

    def gather_only(self, blocks) -> None:
        """Take part in ``blocks``' all-gathers over "fsdp" without computing: a fully
        sharded rank whose batch items all reuse a cached value while its peers' compute
        (their gathers need every fsdp rank). Nothing without an fsdp axis."""
        if sharding.axis_size("fsdp") > 1:
            for _ in gathered_blocks([b.p for b in blocks]):
                pass

    def take(self, idx: torch.Tensor) -> dict:
        """ctx for the batch items ``idx`` (a long tensor of local indices)."""
        return {k: _take(v, idx) if k in self.batched else v for k, v in self.ctx.items()}


def _take(v, idx):
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        return type(v)(_take(a, idx) for a in v)
    return v.index_select(0, idx)


def take_streams(streams: tuple, idx: torch.Tensor) -> tuple:
    return tuple(s.index_select(0, idx) for s in streams)


def _joint(streams: tuple) -> torch.Tensor:
    return streams[0] if len(streams) == 1 else torch.cat([streams[1], streams[0]], 1)


# ----------------------------------------------------------------------------- FLUX.1


def _flux1_double(p, i, streams, ctx):
    img, txt = streams
    args = (p, img, txt, ctx["img_mods"][i], ctx["txt_mods"][i], ctx["pe"], ctx["D"], ctx["bias"])
    return _block(flux1, "double_block", ctx, f"transformer_blocks.{i}.attn", args)


def _flux1_single(p, i, streams, ctx):
    args = (p, _joint(streams), ctx["single_mods"][i], ctx["pe"], ctx["D"], ctx["bias"])
    return (_block(flux1, "single_block", ctx, f"single_transformer_blocks.{i}.attn", args),)


def _hook(ctx: dict, attn_name: str):
    """The attention hook ctx holds for the module ``attn_name``, or None."""
    return ctx.get("attn", {}).get(attn_name)


def _attention_names(doubles: int, singles: int) -> tuple[str, ...]:
    """The stock names of the attention modules of ``doubles`` double and ``singles`` single blocks."""
    names = [f"transformer_blocks.{i}.attn" for i in range(doubles)]
    return tuple(names + [f"single_transformer_blocks.{i}.attn" for i in range(singles)])


def _block(fam, name: str, ctx: dict, attn_name: str, args: tuple):
    """The family's block function ``name`` on ``args``: as its compile region, or, where
    ctx holds an attention hook for ``attn_name``, the plain function with that hook."""
    hook = _hook(ctx, attn_name)
    if hook is None:
        return getattr(_compile.regions(fam), name)(*args)
    return getattr(fam, name)(*args, attn=hook)


def flux1_stages(params, x, t, txt, *, pooled, guidance, pe, ip=None, controlnet=None) -> Stages:
    """`flux1.forward` up to its first block, as `Stages` (no IP-Adapter, no ControlNet)."""
    if ip is not None:
        raise ValueError("ip_adapter: step caching with IP-Adapter is not supported; expected ip_adapter=None")
    _no_controlnet(controlnet)
    img = L.linear(params["x_embedder"], x)
    t = t.to(img.dtype) * 1000
    guidance = None if guidance is None else guidance.to(img.dtype) * 1000
    vec = flux1.time_text_embed(params["time_text_embed"], t, guidance, pooled)
    txt = L.linear(params["context_embedder"], txt)
    txt, img, pe, bias = L.shard_joint(txt, img, pe)
    img_mods, txt_mods, single_mods, out_mod = flux1.modulations(params, vec)
    ctx = dict(img_mods=img_mods, txt_mods=txt_mods, single_mods=single_mods, out_mod=out_mod, pe=pe, bias=bias)
    ctx["D"] = params.config.attention_head_dim
    doubles = ordered_blocks(params, "transformer_blocks")
    blocks = [_bind(_flux1_double, p, i) for i, p in enumerate(doubles)]
    blocks += [_bind(_flux1_single, p, i) for i, p in enumerate(ordered_blocks(params, "single_transformer_blocks"))]
    final = lambda img, c: flux1.final_layer(params, img, c["out_mod"])  # noqa: E731
    batched = ("img_mods", "txt_mods", "single_mods", "out_mod", "bias")
    names = _attention_names(len(doubles), len(blocks) - len(doubles))
    return Stages((img, txt), blocks, ctx, final, txt.shape[1], x.shape[1], batched, names)


# ----------------------------------------------------------------------------- FLUX.2


def _flux2_double(p, i, streams, ctx):
    img, txt = streams
    mod_img, mod_txt, _ = ctx["mods"]
    hook = _hook(ctx, f"transformer_blocks.{i}.attn")
    args = (p, img, txt, mod_img, mod_txt, ctx["pe"], ctx["D"], ctx["eps"], ctx["bias"])
    img, txt, _ = flux2.double_block(*args, attn=hook)
    return img, txt


def _flux2_single(p, i, streams, ctx):
    T = streams[1].shape[1] if len(streams) == 2 else ctx["T"]
    hook = _hook(ctx, f"single_transformer_blocks.{i}.attn")
    args = (p, _joint(streams), ctx["mods"][2], ctx["pe"], ctx["D"], ctx["eps"], ctx["bias"], T)
    x, _ = flux2.single_block(*args, attn=hook)
    return (x,)


def flux2_stages(params, x, t, txt, *, guidance, pe_img, pe_txt, num_ref_tokens, ref_fixed_timestep, cache, batch):
    """`flux2.forward` up to its first block, as `Stages` (no reference KV cache)."""
    c = params.config
    t, guidance = t.to(x.dtype) * 1000, None if guidance is None else guidance.to(x.dtype) * 1000
    temb = flux2.time_guidance_embed(params["time_guidance_embed"], t, guidance, c.timestep_guidance_channels)
    img, txt = L.linear(params["x_embedder"], x), L.linear(params["context_embedder"], txt)
    pe = tuple(torch.cat([a, b]) for a, b in zip(pe_txt, pe_img))
    txt, img, pe, bias = L.shard_joint(txt, img, pe)
    ctx = dict(mods=flux2.modulations(params, temb), temb=temb, pe=pe, bias=bias, D=c.attention_head_dim, eps=c.eps)
    ctx["T"] = txt.shape[1]
    doubles, singles = ordered_blocks(params, "transformer_blocks"), ordered_blocks(params, "single_transformer_blocks")
    blocks = [_bind(_flux2_double, p, i) for i, p in enumerate(doubles)]
    blocks += [_bind(_flux2_single, p, i) for i, p in enumerate(singles)]
    final = lambda img, k: flux2.final_layer(params, img, k["temb"], c.eps)  # noqa: E731
    names = _attention_names(len(doubles), len(singles))
    return Stages((img, txt), blocks, ctx, final, txt.shape[1], x.shape[1], ("mods", "temb", "bias"), names)


# ----------------------------------------------------------------------------- Qwen-Image


def _qwen_block(p, i, streams, ctx):
    img, txt = streams
    mod_i, mod_t = ctx["img_mods"][i], ctx["txt_mods"][i]
    args = (p, img, txt, mod_i, mod_t, ctx["pe"], ctx["D"], ctx["bias"], ctx["cond_rows"])
    return _block(qwen, "block", ctx, f"transformer_blocks.{i}.attn", args)


def _no_controlnet(controlnet) -> None:
    if controlnet is not None:
        raise ValueError(
            "controlnet_block_samples: step caching with ControlNet residuals is not supported; disable the cache"
        )


def qwen_stages(params, x, t, txt, *, pe, cond_rows, bias, t_cond, controlnet=None) -> Stages:
    """`qwenimage.forward` up to its first block, as `Stages` (no ControlNet)."""
    _no_controlnet(controlnet)
    c = params.config
    img = L.linear(params["img_in"], x)
    temb = qwen.time_embed(params["time_text_embed"], t.to(img.dtype), t_cond, c.zero_cond_t)
    txt = L.linear(params["txt_in"], L.rms_norm_fp32(params["txt_norm"], txt))
    txt, img, pe, bias = L.shard_joint(txt, img, pe, bias)
    img_mods, txt_mods, out_mod = qwen.modulations(params, temb, img.shape[0])
    if c.zero_cond_t:  # (2B, 6C) = [mod(t); mod(0)]: as (B, 2, 6C), batch-first
        img_mods = [m.unflatten(0, (2, -1)).transpose(0, 1) for m in img_mods]
    ctx = dict(img_mods=img_mods, txt_mods=txt_mods, out_mod=out_mod, pe=pe, bias=bias, cond_rows=cond_rows)
    ctx.update(D=c.attention_head_dim, zero_cond_t=c.zero_cond_t)
    blocks = [_bind(_qwen_block_mods, p, i) for i, p in enumerate(ordered_blocks(params, "transformer_blocks"))]
    final = lambda img, k: qwen.final_layer(params, img, k["out_mod"])  # noqa: E731
    batched = ("img_mods", "txt_mods", "out_mod", "bias")
    return Stages((img, txt), blocks, ctx, final, txt.shape[1], x.shape[1], batched, _attention_names(len(blocks), 0))


def _qwen_block_mods(p, i, streams, ctx):
    """`_qwen_block` with ``zero_cond_t``'s (B, 2, 6C) modulations back as (2B, 6C)."""
    if ctx["zero_cond_t"]:
        ctx = dict(ctx, img_mods={i: ctx["img_mods"][i].transpose(0, 1).flatten(0, 1)})
    return _qwen_block(p, i, streams, ctx)


@dataclasses.dataclass(frozen=True)
class Block:
    """Block ``i`` of the stack: ``fn(p, i, streams, ctx) -> streams`` over its params ``p``
    (under fsdp a `sharding` ``GatheredBlock`` of its local shards, gathered by `Stages.run`)."""

    fn: Callable
    p: object
    i: int

    def __call__(self, streams: tuple, ctx: dict) -> tuple:
        (p,) = gathered_blocks([self.p])
        return self.fn(p, self.i, streams, ctx)


def _bind(fn, p, i) -> Block:
    return Block(fn, p, i)


STAGES = {flux1: flux1_stages, flux2: flux2_stages, qwen: qwen_stages}

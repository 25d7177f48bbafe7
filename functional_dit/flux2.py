"""FLUX.2 (dev, klein 4B, klein 9B) as pure functions over a parameter tree.

Mirrors diffusers' ``Flux2Transformer2DModel`` (``transformer_flux2.py``) and Black
Forest Labs' ``flux2/model.py``: double-stream (MMDiT) blocks and parallel single-stream
blocks whose AdaLN modulation is computed once from the timestep (and guidance) and
shared by every block, SwiGLU MLPs, fused ``to_qkv_mlp_proj`` / ``to_out`` projections in
the single blocks, 4-axis RoPE over (txt; img) ids, and no biases anywhere.

FLUX.2-klein image editing can cache the reference image tokens' keys and values: the
first step runs with ``kv_cache="extract"`` on (ref; img) tokens and returns the cache,
later steps pass ``kv_cache=cache`` with the img tokens only (diffusers' ``kv_cache_mode``
"extract" / "cached", ``Flux2KleinKVPipeline``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import NamedTuple

import optree
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree

import sharding

from . import _layers as L
from ._checks import (
    check_guidance,
    check_ids,
    check_streams,
    check_tensor,
    check_unused,
    reference_leaf,
)
from ._config import (
    require,
    require_bool,
    require_non_negative,
    require_positive,
    require_positive_number,
    require_positive_or_none,
    require_rope_axes,
)
from ._pytree import PACKED, Block, flatten, linear_spec, nest, norm_spec, ordered_blocks

DIFFUSERS_CLASS = "Flux2Transformer2DModel"


@dataclasses.dataclass(frozen=True)
class Flux2Config:
    """diffusers ``Flux2Transformer2DModel`` config; defaults are FLUX.2-dev's."""

    patch_size: int = 1
    in_channels: int = 128  # 32 VAE channels x 2x2 packed patches
    out_channels: int | None = None  # None: same as in_channels
    num_layers: int = 8  # double-stream blocks
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360  # 3 stacked text-encoder layers x hidden size
    timestep_guidance_channels: int = 256  # sinusoidal embedding width
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)  # (t, h, w, l) share of head_dim
    rope_theta: int = 2000
    eps: float = 1e-6
    guidance_embeds: bool = True  # True for the guidance-distilled dev model

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        require_positive(
            self,
            "patch_size",
            "in_channels",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "timestep_guidance_channels",
        )
        require(
            self.timestep_guidance_channels % 2 == 0,
            f"Flux2Config.timestep_guidance_channels: expected an even int, got {self.timestep_guidance_channels}",
        )
        require_positive_or_none(self, "out_channels")
        require_non_negative(self, "num_layers", "num_single_layers")
        require_positive_number(self, "mlp_ratio", "rope_theta", "eps")
        require(
            self.mlp_hidden_dim > 0, f"Flux2Config: int(inner_dim * mlp_ratio) = {self.mlp_hidden_dim}, expected > 0"
        )
        require_bool(self, "guidance_embeds")
        require_rope_axes(self)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.inner_dim * self.mlp_ratio)  # as diffusers: int(dim * mlp_ratio)

    @property
    def out_dim(self) -> int:
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)


# Every released transformer: patch_size 1, in_channels 128 (32-channel AutoencoderKLFlux2
# latents packed 2x2), head_dim 128, mlp_ratio 3, 4-axis RoPE (32, 32, 32, 32) with theta
# 2000, eps 1e-6 - BFL flux2 src/flux2/model.py (Flux2Params, Klein9BParams, Klein4BParams)
# and the diffusers defaults. joint_attention_dim = 3 stacked hidden states of the text
# encoder (diffusers pipelines/flux2: Mistral-Small-3 layers (10, 20, 30) x 5120 for dev,
# Qwen3 layers (9, 18, 27) x hidden size for klein).
PRESETS = {
    # black-forest-labs/FLUX.2-dev: 8 double + 48 single blocks, 48 heads (6144 wide),
    # Mistral-Small-3.1 text (3 x 5120). Guidance-distilled: Flux2Pipeline passes
    # guidance=guidance_scale to the transformer, BFL use_guidance_embed=True. 32.2B params.
    "flux2-dev": Flux2Config(),
    # black-forest-labs/FLUX.2-klein-4B (and -base-4B): 5 double + 20 single blocks, 24 heads
    # (3072 wide), Qwen3-4B text (3 x 2560 = 7680). Flux2KleinPipeline always passes
    # guidance=None (CFG or step distillation, no embedded guidance): BFL use_guidance_embed=False.
    "flux2-klein-4b": Flux2Config(
        num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680, guidance_embeds=False
    ),
    # black-forest-labs/FLUX.2-klein-9B (and -base-9B, -9b-kv): 8 double + 24 single blocks,
    # 32 heads (4096 wide), Qwen3-8B text (3 x 4096 = 12288); guidance=None as above.
    "flux2-klein-9b": Flux2Config(
        num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288, guidance_embeds=False
    ),
    # A tiny guidance-distilled model for tests and the offline demo: 4 heads so TP up to 4.
    "flux2-tiny": Flux2Config(
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=40,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,
    ),
}


# ----------------------------------------------------------------------------- specs

_lin = functools.partial(linear_spec, bias=False)  # FLUX.2 has no biases anywhere


def _swiglu_specs(c) -> dict:
    n, m = c.inner_dim, c.mlp_hidden_dim
    gate_up = (Block("gate", m, "mlp"), Block("up", m, "mlp"))
    return {
        "linear_in": _lin(2 * m, n, PACKED, "embed", blocks=gate_up),
        "linear_out": _lin(n, m, "embed", "mlp"),
    }


def _double_block_specs(c) -> dict:
    D, n = c.attention_head_dim, c.inner_dim
    col, row = _lin(n, n, "heads", "embed"), _lin(n, n, "embed", "heads")
    attn = {"to_q": col, "to_k": col, "to_v": col, "norm_q": norm_spec(D), "norm_k": norm_spec(D), "to_out": {"0": row}}
    attn |= {"norm_added_q": norm_spec(D), "norm_added_k": norm_spec(D)}
    attn |= {"add_q_proj": col, "add_k_proj": col, "add_v_proj": col, "to_add_out": row}
    return {"attn": attn, "ff": _swiglu_specs(c), "ff_context": _swiglu_specs(c)}


def _single_block_specs(c) -> dict:
    D, n, m = c.attention_head_dim, c.inner_dim, c.mlp_hidden_dim
    qkv_mlp = tuple(Block(b, n, "heads") for b in "qkv") + (Block("mlp_gate", m, "mlp"), Block("mlp_up", m, "mlp"))
    attn_mlp = (Block("attn", n, "heads"), Block("mlp", m, "mlp"))  # to_out consumes cat([attn, mlp])
    return {
        "attn": {
            "to_qkv_mlp_proj": _lin(3 * n + 2 * m, n, PACKED, "embed", blocks=qkv_mlp),
            "norm_q": norm_spec(D),
            "norm_k": norm_spec(D),
            "to_out": _lin(n, n + m, "embed", PACKED, blocks=attn_mlp),
        }
    }


def param_specs(c: Flux2Config) -> dict:
    """Nested dict of `ParamSpec` in diffusers ``state_dict`` order; allocates nothing."""
    n, f = c.inner_dim, c.timestep_guidance_channels
    emb = {
        "linear_1": _lin(n, f, "embed", "freq"),
        "linear_2": _lin(n, n, "embed", "embed"),
    }
    time = {"timestep_embedder": emb, **({"guidance_embedder": emb} if c.guidance_embeds else {})}
    return {
        "time_guidance_embed": time,
        "double_stream_modulation_img": {"linear": _lin(6 * n, n, "mod", "embed")},
        "double_stream_modulation_txt": {"linear": _lin(6 * n, n, "mod", "embed")},
        "single_stream_modulation": {"linear": _lin(3 * n, n, "mod", "embed")},
        "x_embedder": _lin(n, c.in_channels, "embed", "channels"),
        "context_embedder": _lin(n, c.joint_attention_dim, "embed", "txt_embed"),
        "transformer_blocks": {str(i): _double_block_specs(c) for i in range(c.num_layers)},
        "single_transformer_blocks": {str(i): _single_block_specs(c) for i in range(c.num_single_layers)},
        "norm_out": {"linear": _lin(2 * n, n, "mod", "embed")},
        "proj_out": _lin(c.out_dim, n, "out_channels", "embed"),
    }


# ----------------------------------------------------------------------------- KV cache


class Flux2KVCache:
    """The reference tokens' keys and values in every block, after QK norm and RoPE.

    ``tree`` is ``{"transformer_blocks": {"0": {"k": t, "v": t}, ...},
    "single_transformer_blocks": {...}}`` with t (B, num_ref_tokens, heads, head_dim),
    full (unsharded) on every rank; ``config`` and ``num_ref_tokens`` are static metadata.
    A pytree node for optree and ``torch.utils._pytree``, like `Params`. Treat as immutable.
    """

    __slots__ = ("config", "num_ref_tokens", "tree")

    def __init__(self, config, num_ref_tokens: int, tree):
        self.config, self.num_ref_tokens, self.tree = config, num_ref_tokens, dict(tree)

    def __getitem__(self, key: str):
        return self.tree[key]

    def flat(self) -> dict:
        return flatten(self.tree)

    def __repr__(self) -> str:
        return f"Flux2KVCache({self.num_ref_tokens} reference tokens, {len(self.flat())} tensors)"


def _cache_context(c: Flux2KVCache) -> tuple:
    """Static metadata as plain constants (the config's field values): ``torch.export``
    cannot rebuild a frozen dataclass held in an output's tree spec."""
    return (c.num_ref_tokens, *(getattr(c.config, f.name) for f in dataclasses.fields(c.config)))


def _cache_unflatten(children, context) -> Flux2KVCache:
    return Flux2KVCache(Flux2Config(*context[1:]), context[0], children[0])


def _cache_context_from_json(text: str) -> tuple:
    """`torch.export.load`: JSON gives lists; the context must equal `_cache_context`'s
    tuple again, or the loaded program refuses the cache as an input."""
    return tuple(tuple(v) if isinstance(v, list) else v for v in json.loads(text))


torch_pytree.register_pytree_node(
    Flux2KVCache,
    lambda c: ([c.tree], _cache_context(c)),
    _cache_unflatten,
    serialized_type_name="functional_dit.Flux2KVCache",
    to_dumpable_context=json.dumps,
    from_dumpable_context=_cache_context_from_json,
    flatten_with_keys_fn=lambda c: ([(torch_pytree.GetAttrKey("tree"), c.tree)], _cache_context(c)),
)
optree.register_pytree_node(
    Flux2KVCache,
    lambda c: ((c.tree,), _cache_context(c), ("tree",)),
    lambda context, children: _cache_unflatten(children, context),
    namespace=optree.registry.__GLOBAL_NAMESPACE,
)


def cache_shapes(c: Flux2Config, batch: int, num_ref_tokens: int) -> dict:
    """``{dotted path: shape}`` of the cache `apply(..., kv_cache="extract")` returns."""
    shape = (batch, num_ref_tokens, c.num_attention_heads, c.attention_head_dim)
    kinds = (("transformer_blocks", c.num_layers), ("single_transformer_blocks", c.num_single_layers))
    return {f"{kind}.{i}.{kv}": shape for kind, n in kinds for i in range(n) for kv in "kv"}


class Ref(NamedTuple):
    """The reference tokens as the blocks see them, in the local view.

    Extract: ``x`` (B, R, C) their hidden states, ``mod`` their modulation (from the fixed
    timestep), ``pe`` their RoPE rows; a block returns it with this layer's ``k``/``v``.
    Cached: ``x`` None and ``k``/``v`` (B, R, H, D) this layer's cached keys and values.
    ``bias`` (B, R) is the additive key bias of sequence-parallel padding, or None.
    """

    x: torch.Tensor | None = None
    mod: tuple | None = None
    pe: tuple | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    bias: torch.Tensor | None = None


# ----------------------------------------------------------------------------- forward


def time_guidance_embed(p, t, guidance, channels: int) -> torch.Tensor:
    """temb (B, C) = MLP(sin(t)) [+ MLP(sin(guidance))]; t and guidance already x 1000."""
    temb = L.mlp_embed(p["timestep_embedder"], L.timestep_embedding(t, channels).to(t.dtype))
    if guidance is None:
        return temb
    return temb + L.mlp_embed(p["guidance_embedder"], L.timestep_embedding(guidance, channels).to(guidance.dtype))


def modulations(params, temb):
    """The shared modulation vectors (B, C): 6 for the img and 6 for the txt stream of the
    double blocks, (shift, scale, gate) x (attn, mlp); 3 for the single blocks."""
    return (
        L.adaln(params["double_stream_modulation_img"]["linear"], temb, 6),
        L.adaln(params["double_stream_modulation_txt"]["linear"], temb, 6),
        L.adaln(params["single_stream_modulation"]["linear"], temb, 3),
    )


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over the [gate, up] halves (each rank holds its slice of both)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def feed_forward(p, x: torch.Tensor) -> torch.Tensor:
    """diffusers ``Flux2FeedForward``: ``linear_out(swiglu(linear_in(x)))``."""
    return L.row_linear(p["linear_out"], swiglu(L.col_linear(p["linear_in"], x)))


_IMG = (("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
_TXT = (("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"))


def _stream_qkv(a, x, mod, head_dim, eps, names):
    """One stream of a double block: AdaLN, then q, k, v (B, S, H, D) with q, k RMS-normalised."""
    (proj, norms), (shift, scale) = names, mod[:2]
    h = L.modulate(L.layer_norm(x, eps), shift, scale)
    q, k, v = (L.split_heads(L.col_linear(a[n], h), head_dim) for n in proj)
    return L.rms_norm(L.per_head(a[norms[0]]), q, eps), L.rms_norm(L.per_head(a[norms[1]]), k, eps), v


def _stream_out(x, attn, mod, p_out, p_ff, eps):
    """Gated residual attention output, then the gated residual SwiGLU MLP."""
    _, _, gate, shift2, scale2, gate2 = mod
    x = x + gate[:, None] * L.row_linear(p_out, attn)
    return x + gate2[:, None] * feed_forward(p_ff, L.modulate(L.layer_norm(x, eps), shift2, scale2))


def _attend(q, k, v, T: int, key_bias, ref: Ref | None):
    """Joint attention of the (txt; img) queries whose first T rows are text; with ``ref``
    their keys/values sit between txt and img, diffusers' (txt; ref; img) layout."""
    if ref is None:
        return L.attention(q, k, v, key_bias)
    k, v = (torch.cat([a[:, :T], r, a[:, T:]], 1) for a, r in ((k, ref.k), (v, ref.v)))
    if key_bias is not None or ref.bias is not None:
        B, S, R = q.shape[0], q.shape[1], ref.k.shape[1]
        main = torch.zeros(B, S, device=q.device) if key_bias is None else key_bias
        rb = torch.zeros(B, R, device=q.device) if ref.bias is None else ref.bias
        key_bias = torch.cat([main[:, :T], rb, main[:, T:]], 1)
    return L.attention(q, k, v, key_bias)


def _rope_qk(q, k, pe):
    return L.apply_rope(q, *pe), L.apply_rope(k, *pe)


def double_block(p, img, txt, mod_img, mod_txt, pe, head_dim, eps=1e-6, key_bias=None, ref: Ref | None = None):
    """MMDiT block with shared modulation: separate weights per stream, one joint attention
    over (txt; img). Reference tokens (extract) go through the img weights with their own
    modulation and attend only to themselves. Returns img, txt and ref (with its k, v)."""
    a, T = p["attn"], txt.shape[1]
    tq, tk, tv = _stream_qkv(a, txt, mod_txt, head_dim, eps, _TXT)
    iq, ik, iv = _stream_qkv(a, img, mod_img, head_dim, eps, _IMG)
    q, k = _rope_qk(torch.cat([tq, iq], 1), torch.cat([tk, ik], 1), pe)
    ref_out = None
    if ref is not None and ref.x is not None:
        rq, rk, rv = _stream_qkv(a, ref.x, ref.mod, head_dim, eps, _IMG)
        rq, rk = _rope_qk(rq, rk, ref.pe)
        ref, ref_out = ref._replace(k=rk, v=rv), L.attention(rq, rk, rv, ref.bias)
    out = _attend(q, k, torch.cat([tv, iv], 1), T, key_bias, ref)
    img = _stream_out(img, out[:, T:], mod_img, a["to_out"]["0"], p["ff"], eps)
    txt = L.clip_fp16(_stream_out(txt, out[:, :T], mod_txt, a["to_add_out"], p["ff_context"], eps))
    if ref_out is not None:
        ref = ref._replace(x=_stream_out(ref.x, ref_out, ref.mod, a["to_out"]["0"], p["ff"], eps))
    return img, txt, ref


def _single_in(a, x, mod, head_dim, eps):
    """AdaLN, then the fused projection to q, k, v (B, S, H, D) and the MLP input.

    The local rows are [q, k, v, gate, up] = 3n + 2m and ``to_out``'s local columns
    n + m, so this rank's width n of q is read off the two shapes (TP-agnostic).
    """
    shift, scale, _ = mod
    h = L.col_linear(a["to_qkv_mlp_proj"], L.modulate(L.layer_norm(x, eps), shift, scale))
    n = a["to_qkv_mlp_proj"]["weight"].shape[0] - 2 * a["to_out"]["weight"].shape[1]
    qkv, mlp = h.split([3 * n, h.shape[-1] - 3 * n], dim=-1)
    q, k, v = (L.split_heads(t, head_dim) for t in qkv.chunk(3, dim=-1))
    return L.rms_norm(L.per_head(a["norm_q"]), q, eps), L.rms_norm(L.per_head(a["norm_k"]), k, eps), v, mlp


def _single_out(a, x, attn, mlp, mod):
    gate = mod[2]
    return L.clip_fp16(x + gate[:, None] * L.row_linear(a["to_out"], torch.cat([attn, swiglu(mlp)], -1)))


def single_block(p, x, mod, pe, head_dim, eps=1e-6, key_bias=None, txt_len=0, ref: Ref | None = None):
    """Parallel attention + SwiGLU MLP over the joint (txt; img) sequence x (B, S, C).
    ``txt_len`` (the local text rows) places reference keys between txt and img."""
    a = p["attn"]
    q, k, v, mlp = _single_in(a, x, mod, head_dim, eps)
    q, k = _rope_qk(q, k, pe)
    ref_out = None
    if ref is not None and ref.x is not None:
        rq, rk, rv, rmlp = _single_in(a, ref.x, ref.mod, head_dim, eps)
        rq, rk = _rope_qk(rq, rk, ref.pe)
        ref, ref_out = ref._replace(k=rk, v=rv), L.attention(rq, rk, rv, ref.bias)
    out = _single_out(a, x, _attend(q, k, v, txt_len, key_bias, ref), mlp, mod)
    if ref_out is not None:
        ref = ref._replace(x=_single_out(a, ref.x, ref_out, rmlp, ref.mod))
    return out, ref


def final_layer(p, x, temb, eps=1e-6):
    scale, shift = L.adaln(p["norm_out"]["linear"], temb, 2)  # note: (scale, shift) order
    return L.linear(p["proj_out"], L.modulate(L.layer_norm(x, eps), shift, scale))


# ----------------------------------------------------------------------------- validation


def _validate_mode(c, x, kv_cache, num_ref_tokens, ref_fixed_timestep, ref):
    """Returns "extract", "cached" or None, after checking the KV-cache arguments."""
    B, S = x.shape[:2]
    if kv_cache is None:
        for name, v in (("num_ref_tokens", num_ref_tokens), ("ref_fixed_timestep", ref_fixed_timestep)):
            if v is not None:
                raise ValueError(f"{name}: only used with kv_cache='extract'; expected None, got {v!r}")
        return None
    if isinstance(kv_cache, str):
        if kv_cache != "extract":
            raise ValueError(f"kv_cache: expected None, 'extract' or a Flux2KVCache, got {kv_cache!r}")
        R = num_ref_tokens
        if not isinstance(R, int) or isinstance(R, bool) or not 0 < R < S:
            raise ValueError(f"num_ref_tokens: expected an int in [1, {S - 1}] (x has {S} tokens), got {R!r}")
        t_ref = ref_fixed_timestep
        if t_ref is not None and (not isinstance(t_ref, (int, float)) or isinstance(t_ref, bool)):
            raise ValueError(f"ref_fixed_timestep: expected a Python number (0.0 by default), got {t_ref!r}")
        return "extract"
    if not isinstance(kv_cache, Flux2KVCache):
        raise ValueError(f"kv_cache: expected None, 'extract' or a Flux2KVCache, got {type(kv_cache).__name__}")
    _validate_cache(c, kv_cache, B, ref)
    if num_ref_tokens is not None and num_ref_tokens != kv_cache.num_ref_tokens:
        raise ValueError(f"num_ref_tokens: the cache holds {kv_cache.num_ref_tokens} tokens, got {num_ref_tokens!r}")
    if ref_fixed_timestep is not None:
        raise ValueError(f"ref_fixed_timestep: only used with kv_cache='extract'; got {ref_fixed_timestep!r}")
    return "cached"


def _validate_cache(c, cache, B, ref):
    if cache.config != c:
        raise ValueError(f"kv_cache: built for a different model; expected config {c}, got {cache.config}")
    expected, flat = cache_shapes(c, B, cache.num_ref_tokens), cache.flat()
    if set(flat) != set(expected):  # any key order: blocks are looked up by name
        missing = [k for k in expected if k not in flat]
        extra = [k for k in flat if k not in expected]
        raise ValueError(f"kv_cache: expected the keys {list(expected)[:4]}...; missing {missing}, unexpected {extra}")
    for key, shape in expected.items():
        check_tensor(f"kv_cache[{key!r}]", flat[key], shape, ref.dtype, ref.device)


def _validate(params, x, t, txt, guidance, img_ids, txt_ids):
    c = params.config
    ref = reference_leaf(params, "x_embedder.weight")
    B, S = check_streams(c, ref, x, t, txt)
    check_guidance(c, guidance, B, ref.device)
    n_axes = len(c.axes_dims_rope)
    for name, ids, n in (("img_ids", img_ids, S), ("txt_ids", txt_ids, txt.shape[1])):
        if ids is None:
            raise ValueError(f"{name}: FLUX.2 needs position ids of shape ({n}, {n_axes}) or ({B}, {n}, {n_axes})")
    img_ids = check_ids("img_ids", img_ids, S, n_axes, B, ref.device)
    return img_ids, check_ids("txt_ids", txt_ids, txt.shape[1], n_axes, B, ref.device), ref


# ----------------------------------------------------------------------------- apply


def _local_cache(cache: Flux2KVCache, kind: str, i: int, device) -> Ref:
    """Block i's cached k, v in the local view (batch over dp, tokens over sp, heads over tp)."""
    kv = cache[kind][str(i)]
    k, v = (sharding.shard(sharding.shard(_heads(kv[n]), "dp", 0), "sp", 1) for n in "kv")
    bias = sharding.pad_bias(cache.num_ref_tokens, "sp", device)
    return Ref(k=k, v=v, bias=None if bias is None else bias.expand(k.shape[0], -1))


def _heads(t: torch.Tensor) -> torch.Tensor:
    """This rank's heads (dim 2) of a cached k or v every rank holds whole; its gradient
    is a per-rank share, summed over tp."""
    return sharding.shard(sharding.pvary(t, "tp"), "tp", 2)


def _full(t: torch.Tensor, B: int, R: int, H: int) -> torch.Tensor:
    """Inverse of `_local_cache`'s slicing: the full (B, R, H, D) tensor on every rank."""
    return sharding.gather(sharding.gather(sharding.gather(t, "tp", 2, H), "sp", 1, R), "dp", 0, B)


def _ref_stream(params, x, pe, t, guidance, ref_fixed_timestep):
    """Extract mode: the reference tokens x (B, R, in_channels) as a `Ref` in the local view,
    modulated at the fixed timestep (diffusers: t = ref_fixed_timestep, same guidance);
    also returns their single-block modulation."""
    temb = time_guidance_embed(
        params["time_guidance_embed"],
        torch.full_like(t, ref_fixed_timestep * 1000),
        guidance,
        params.config.timestep_guidance_channels,
    )
    mod_img, _, mod_single = modulations(params, temb)
    bias = sharding.pad_bias(x.shape[1], "sp", x.device)
    x = sharding.shard(L.linear(params["x_embedder"], x), "sp", 1)
    pe = tuple(sharding.shard(a, "sp", 0) for a in pe)
    return Ref(x=x, mod=mod_img, pe=pe, bias=None if bias is None else bias.expand(x.shape[0], -1)), mod_single


def _blocks(params, img, txt, mods, pe, key_bias, ref, ref_mod_single, cache):
    """All blocks in the local view. Returns the img stream and, per block, its `Ref`."""
    c, (mod_img, mod_txt, mod_single), T, refs = params.config, mods, txt.shape[1], {}
    D, eps = c.attention_head_dim, c.eps
    for i, p in enumerate(ordered_blocks(params["transformer_blocks"])):
        ref = ref if cache is None else _local_cache(cache, "transformer_blocks", i, img.device)
        img, txt, ref = double_block(p, img, txt, mod_img, mod_txt, pe, D, eps, key_bias, ref)
        refs[f"transformer_blocks.{i}"] = ref
    x = torch.cat([txt, img], 1)
    ref = ref._replace(mod=ref_mod_single) if ref is not None and ref.x is not None else None
    for i, p in enumerate(ordered_blocks(params["single_transformer_blocks"])):
        ref = ref if cache is None else _local_cache(cache, "single_transformer_blocks", i, x.device)
        x, ref = single_block(p, x, mod_single, pe, D, eps, key_bias, T, ref)
        refs[f"single_transformer_blocks.{i}"] = ref
    return x[:, T:], refs


def apply(
    params,
    x,
    t,
    txt,
    *,
    img_ids=None,
    txt_ids=None,
    guidance=None,
    kv_cache=None,
    num_ref_tokens=None,
    ref_fixed_timestep=None,
    pooled=None,
    txt_mask=None,
    img_shapes=None,
):
    """FLUX.2 forward: x (B, S_img, in_channels), t (B,) in [0, 1], txt (B, S_txt,
    joint_attention_dim), guidance (B,) when the model is guidance-distilled, img_ids
    (S_img, 4) / txt_ids (S_txt, 4) or their 3-D forms (B or 1, S, 4), of which, like
    diffusers, only the first item is used. Returns (B, S_img, patch_size² · out_channels)
    as ``Flux2Transformer2DModel(...)[0]``.

    Reference-token KV cache (FLUX.2-klein editing, diffusers' ``kv_cache_mode``):
    ``kv_cache="extract", num_ref_tokens=R, ref_fixed_timestep=0.0``: the first R tokens of
    x (and rows of img_ids) are reference tokens, modulated at the fixed timestep and
    attending only to themselves; returns ``(out, cache)`` with out over the other tokens
    and cache a `Flux2KVCache`. ``kv_cache=cache``: x holds no reference tokens; every
    block's txt and img queries also attend to the cached reference keys and values.

    ``pooled`` (FLUX.1's), ``txt_mask`` and ``img_shapes`` (Qwen-Image's) must be None.
    """
    check_unused("FLUX.2", pooled=pooled, txt_mask=txt_mask, img_shapes=img_shapes)
    img_ids, txt_ids, leaf = _validate(params, x, t, txt, guidance, img_ids, txt_ids)
    c = params.config
    mode = _validate_mode(c, x, kv_cache, num_ref_tokens, ref_fixed_timestep, leaf)
    R = num_ref_tokens if mode == "extract" else 0
    B, S = x.shape[0], x.shape[1] - R
    pe_img, pe_txt = (L.rope(ids, c.axes_dims_rope, theta=c.rope_theta) for ids in (img_ids, txt_ids))
    x, t, txt, guidance = (None if a is None else sharding.shard(a, "dp", 0) for a in (x, t, txt, guidance))
    t, guidance = t.to(x.dtype) * 1000, None if guidance is None else guidance.to(x.dtype) * 1000
    temb = time_guidance_embed(params["time_guidance_embed"], t, guidance, c.timestep_guidance_channels)
    ref = ref_mod_single = None
    if mode == "extract":
        ref_pe = tuple(a[:R] for a in pe_img)
        ref, ref_mod_single = _ref_stream(params, x[:, :R], ref_pe, t, guidance, ref_fixed_timestep or 0.0)
        x, pe_img = x[:, R:], tuple(a[R:] for a in pe_img)
    img, txt = L.linear(params["x_embedder"], x), L.linear(params["context_embedder"], txt)
    pe = tuple(torch.cat([a, b]) for a, b in zip(pe_txt, pe_img))
    txt, img, pe, key_bias = L.shard_joint(txt, img, pe)
    cache = kv_cache if mode == "cached" else None
    img, refs = _blocks(params, img, txt, modulations(params, temb), pe, key_bias, ref, ref_mod_single, cache)
    out = sharding.gather(sharding.gather(final_layer(params, img, temb, c.eps), "sp", 1, S), "dp", 0, B)
    if mode != "extract":
        return out
    H = c.num_attention_heads
    flat = {f"{key}.{n}": _full(getattr(r, n), B, R, H) for key, r in refs.items() for n in "kv"}
    return out, Flux2KVCache(c, R, nest(flat))

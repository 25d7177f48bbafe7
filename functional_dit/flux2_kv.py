"""FLUX.2-klein's reference-token KV cache: the cache type, its checks, and its
movement between the full view (what callers hold) and the local view (what blocks see).

Image editing with FLUX.2-klein can cache the reference image tokens' keys and values:
the first step runs with ``kv_cache="extract"`` on (ref; img) tokens and returns the
cache, later steps pass ``kv_cache=cache`` with the img tokens only (diffusers'
``kv_cache_mode`` "extract" / "cached", ``Flux2KleinKVPipeline``). The block maths that
use a `Ref` live in `flux2`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple

import torch

import sharding
from sharding.tree import flatten, mismatch_report, nest

from .nn.checks import check_tensor
from .params import register_tree_node


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


def _cache_context_from_json(text: str) -> tuple:
    """`torch.export.load`: JSON gives lists; the context must equal `_cache_context`'s
    tuple again, or the loaded program refuses the cache as an input."""
    return tuple(tuple(v) if isinstance(v, list) else v for v in json.loads(text))


def register_pytree(config_cls) -> None:
    """Make `Flux2KVCache` a pytree node (`_pytree.register_tree_node`); its config is
    rebuilt as ``config_cls(*fields)``. Called once, by `flux2`, which owns the config
    class (this module does not import it)."""
    register_tree_node(
        Flux2KVCache,
        _cache_context,
        lambda context, tree: Flux2KVCache(config_cls(*context[1:]), context[0], tree),
        name="functional_dit.Flux2KVCache",
        to_json=json.dumps,
        from_json=_cache_context_from_json,
    )


def cache_shapes(c, batch: int, num_ref_tokens: int) -> dict:
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


def check_mode(c, x, kv_cache, num_ref_tokens, ref_fixed_timestep, leaf):
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
    check_cache(c, kv_cache, B, leaf)
    if num_ref_tokens is not None and num_ref_tokens != kv_cache.num_ref_tokens:
        raise ValueError(f"num_ref_tokens: the cache holds {kv_cache.num_ref_tokens} tokens, got {num_ref_tokens!r}")
    if ref_fixed_timestep is not None:
        raise ValueError(f"ref_fixed_timestep: only used with kv_cache='extract'; got {ref_fixed_timestep!r}")
    return "cached"


def check_cache(c, cache, B, leaf):
    if cache.config != c:
        raise ValueError(f"kv_cache: built for a different model; expected config {c}, got {cache.config}")
    expected, flat = cache_shapes(c, B, cache.num_ref_tokens), cache.flat()
    if set(flat) != set(expected):  # any key order: blocks are looked up by name
        missing, extra = [k for k in expected if k not in flat], [k for k in flat if k not in expected]
        raise ValueError(mismatch_report("kv_cache: expected the keys of the model's blocks", missing, extra))
    for key, shape in expected.items():
        check_tensor(f"kv_cache[{key!r}]", flat[key], shape, leaf.dtype, leaf.device)


def local_cache(cache: Flux2KVCache, kind: str, i: int, device) -> Ref:
    """Block i's cached k, v in the local view (batch over dp, tokens over sp, heads over tp)."""
    kv = cache[kind][str(i)]
    k, v = (sharding.shard(sharding.shard(_heads(kv[n]), "dp", 0), "sp", 1) for n in "kv")
    bias = sharding.pad_bias(cache.num_ref_tokens, "sp", device)
    return Ref(k=k, v=v, bias=None if bias is None else bias.expand(k.shape[0], -1))


def _heads(t: torch.Tensor) -> torch.Tensor:
    """This rank's heads (dim 2) of a cached k or v every rank holds whole; its gradient
    is a per-rank share, summed over tp."""
    return sharding.shard(sharding.pvary(t, "tp"), "tp", 2)


def full(t: torch.Tensor, B: int, R: int, H: int) -> torch.Tensor:
    """Inverse of `local_cache`'s slicing: the full (B, R, H, D) tensor on every rank."""
    return sharding.gather(sharding.gather(sharding.gather(t, "tp", 2, H), "sp", 1, R), "dp", 0, B)


def from_refs(config, refs: dict, B: int, R: int) -> Flux2KVCache:
    """The cache of an extract pass: every block's `Ref` k, v made full on every rank."""
    H = config.num_attention_heads
    flat = {f"{key}.{n}": full(getattr(r, n), B, R, H) for key, r in refs.items() for n in "kv"}
    return Flux2KVCache(config, R, nest(flat))

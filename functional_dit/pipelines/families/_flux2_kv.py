"""The FLUX.2 reference-token KV cache of `DiffusersTransformer`, as diffusers' own type.

A FLUX.2 adapter's ``kv_cache_mode="extract"`` call returns a `KVCache`: an instance of
diffusers' ``Flux2KVCache`` (``transformer_flux2.Flux2KVCache``) whose per-layer
``Flux2KVLayerCache`` entries hold the keys and values `fd.apply` extracted, so code that
checks ``isinstance(cache, Flux2KVCache)``, reads ``get_double(i).get()`` or calls
``clear()`` works as with the stock class. Either kind, ours or one the stock class
filled, goes back in with ``kv_cache_mode="cached"``; `to_fd` reads it into the
`fd.Flux2KVCache` pytree that `fd.apply` takes.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_flux2 import Flux2KVCache as StockKVCache

from sharding.tree import nest

from ...flux2_kv import Flux2KVCache

_KINDS = (("transformer_blocks", "double_block_caches"), ("single_transformer_blocks", "single_block_caches"))


class KVCache(StockKVCache):
    """diffusers' ``Flux2KVCache`` filled from an `fd.Flux2KVCache` (tensors shared, each
    (B, num_ref_tokens, heads, head_dim) as the stock layer caches hold them). ``cache``:
    the `fd.Flux2KVCache` it holds now (None once cleared)."""

    def __init__(self, cache: Flux2KVCache):
        c = cache.config
        super().__init__(c.num_layers, c.num_single_layers)
        self.config = c
        self.num_ref_tokens = cache.num_ref_tokens
        for kind, attr in _KINDS:
            for i, layer in enumerate(getattr(self, attr)):
                kv = cache[kind][str(i)]
                layer.store(kv["k"], kv["v"])

    @property
    def cache(self) -> Flux2KVCache | None:
        return to_fd(self, self.config, "kv_cache", missing_ok=True)

    def __repr__(self) -> str:
        return f"KVCache({self.num_ref_tokens} reference tokens, {self.config.num_layers} + "
        f"{self.config.num_single_layers} layers)"


def to_fd(cache, config, name: str = "kv_cache", missing_ok: bool = False) -> Flux2KVCache | None:
    """``cache`` (a diffusers ``Flux2KVCache``, ours or the stock class's) as the
    `fd.Flux2KVCache` for ``config``; None for an empty (cleared) one when ``missing_ok``,
    else a ValueError naming ``name``."""
    if isinstance(cache, Flux2KVCache):
        return cache
    if not isinstance(cache, StockKVCache):
        raise ValueError(f"{name}: expected the Flux2KVCache an extract call returned, got {type(cache).__name__}")
    want = (config.num_layers, config.num_single_layers)
    got = (len(cache.double_block_caches), len(cache.single_block_caches))
    if got != want:
        raise ValueError(f"{name}: expected a cache of {want} (double, single) layers for this model, got {got}")
    layers = [(kind, i, layer) for kind, attr in _KINDS for i, layer in enumerate(getattr(cache, attr))]
    empty = [f"{kind}.{i}" for kind, i, layer in layers if layer.k_ref is None or layer.v_ref is None]
    if empty:
        if missing_ok and len(empty) == len(layers):
            return None
        raise ValueError(
            f"{name}: expected the cache an extract call returned, filled; layers {empty[:4]} hold no keys / values "
            "(a cleared or unfilled cache)"
        )
    flat = {f"{kind}.{i}.{n}": getattr(layer, f"{n}_ref") for kind, i, layer in layers for n in "kv"}
    return Flux2KVCache(config, int(cache.num_ref_tokens), nest(flat))

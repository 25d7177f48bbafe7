"""`DiffusersTransformer` for FLUX.3 and Qwen-Image 2.1: their forward arguments mapped to
`fd.apply`'s, and forward signatures that name every argument (the modular pipelines
pass a field to the transformer only when its ``forward`` signature names it).

Qwen-Image 2.1's KV cache: the pipelines hand the transformer diffusers'
``QwenImage21KVCache`` object to fill ("extract") and read ("cached"); the adapter fills
it with the `fd.QwenImage21KVCache` tensors and reads them back.
"""

from __future__ import annotations

import inspect

from ..qwenimage21 import QwenImage21KVCache


class Flux3:
    @staticmethod
    def args(
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

    @staticmethod
    def result(out, kwargs):
        return out


def _layers(kv_cache) -> list:
    layers = getattr(kv_cache, "layer_caches", None)
    if layers is None:
        raise ValueError(
            "kv_cache: expected diffusers' QwenImage21KVCache (or fd.QwenImage21KVCache), "
            f"got {type(kv_cache).__name__}"
        )
    return layers


def _from_diffusers_cache(config, kv_cache) -> QwenImage21KVCache:
    """The tensors an extract call stored in diffusers' cache object, as our cache."""
    if isinstance(kv_cache, QwenImage21KVCache):
        return kv_cache
    layers = _layers(kv_cache)
    if any(layer.k is None for layer in layers):
        raise ValueError("kv_cache: kv_cache_mode='cached' needs a cache an 'extract' call filled; this one is empty")
    tree = {str(i): {"k": layer.k, "v": layer.v} for i, layer in enumerate(layers)}
    return QwenImage21KVCache(config, layers[0].k.shape[1] if layers else 0, {"transformer_blocks": tree})


class QwenImage21:
    @staticmethod
    def args(
        adapter,
        encoder_hidden_states_mask=None,
        img_shapes=None,
        img_mask=None,
        attention_kwargs=None,
        kv_cache=None,
        kv_cache_mode=None,
    ) -> dict:
        adapter._lora_scale("attention_kwargs", attention_kwargs)
        args = dict(txt_mask=encoder_hidden_states_mask, img_shapes=img_shapes, img_mask=img_mask)
        if kv_cache is None and kv_cache_mode is not None:
            raise ValueError(f"kv_cache_mode: {kv_cache_mode!r}, but no kv_cache was passed to hold the prefix")
        if kv_cache is None:
            return args
        if kv_cache_mode == "extract":
            _layers(kv_cache)
            return dict(args, kv_cache="extract")
        if kv_cache_mode == "cached":
            return dict(args, kv_cache=_from_diffusers_cache(adapter.params.config, kv_cache))
        raise ValueError(f"kv_cache_mode: expected 'extract' or 'cached' with a kv_cache, got {kv_cache_mode!r}")

    @staticmethod
    def result(out, kwargs):
        """An extract call: store the cache in the pipeline's object, return the output."""
        if not isinstance(out, tuple):
            return out
        out, cache = out
        target = kwargs["kv_cache"]
        if not isinstance(target, QwenImage21KVCache):
            for i, layer in enumerate(_layers(target)):
                kv = cache["transformer_blocks"][str(i)]
                layer.store(kv["k"], kv["v"])
        return out


FAMILIES = {"flux3": Flux3, "qwenimage21": QwenImage21}


def _forward_with(names: list):
    """A ``forward`` whose signature names ``names`` (after the shared ones)."""

    def forward(self, hidden_states, encoder_hidden_states=None, timestep=None, return_dict=True, **kwargs):
        return (
            type(self)
            .__mro__[1]
            .forward(self, hidden_states, encoder_hidden_states, timestep=timestep, return_dict=return_dict, **kwargs)
        )

    kw = inspect.Parameter.KEYWORD_ONLY
    shared = list(inspect.signature(forward).parameters.values())[
        :4
    ]  # self, hidden_states, encoder_hidden_states, timestep
    extra = [inspect.Parameter(n, kw, default=None) for n in names] + [
        inspect.Parameter("return_dict", kw, default=True)
    ]
    forward.__signature__ = inspect.Signature(shared + extra)
    return forward


def add_signatures(subclasses: dict) -> None:
    """Give the FLUX.3 and Qwen-Image 2.1 adapter classes forwards naming their arguments."""
    for fam, cls in FAMILIES.items():
        names = [n for n in inspect.signature(cls.args).parameters if n != "adapter"]
        subclasses[fam].forward = _forward_with(names)

"""`DiffusersTransformer`: `fd.apply` behind the stock diffusers transformer interface,
a drop-in ``transformer`` for the diffusers FLUX.1, FLUX.2 and Qwen-Image pipelines.

It takes the stock forward arguments (``FluxTransformer2DModel``,
``Flux2Transformer2DModel``, ``QwenImageTransformer2DModel``), runs `fd.apply` on its
params (plain or sharded) and returns what the stock class returns. Everything a
pipeline touches besides ``forward`` is here: ``config`` with the diffusers keys,
``dtype`` / ``device`` / ``to``, ``cache_context`` and ``enable_cache`` (diffusers' First-Block
Cache, TaylorSeer, MagCache, FasterCache and PAB configs, with or without an on-the-fly LoRA:
`functional_dit.pipelines.cache._hooks`), the stock
``pos_embed`` RoPE module (the family product's ``pos_embed``), the block lists whose attention
processors the FLUX.2-klein KV pipeline sets, ``save_pretrained`` and
``from_pretrained`` (the stock keywords: `adapter._io`). The parameter leaves are
registered as ``nn.Parameter`` s under the diffusers names (``state_dict()`` keys equal
the stock class's; they require grad, as a stock module's do), so ``to()``, accelerate's
CPU offload, ``train()`` + ``backward()`` and ``fd.from_diffusers(adapter)`` work as on
the stock module; each forward reads them back into `Params`. The rest of the stock
surface (fused projections, gradient checkpointing, the refusals) is in
`adapter._surface`, the PEFT methods in `adapter._peft`, FLUX.2's KV cache (diffusers'
``Flux2KVCache``) in `families._flux2_kv`, ``enable_layerwise_casting`` (fp8 storage over
`fd.layerwise_cast`) in `adapter._layerwise`. Arguments it cannot honour (custom attention
processors) raise a ``ValueError``; FLUX.1's IP-Adapter is in `adapter._ip`. ControlNet residuals
(``controlnet_block_samples``, FLUX.1's ``controlnet_single_block_samples`` and
``controlnet_blocks_repeat``) go to `fd.apply` as they are (docs/controlnet.md).

LoRA: ``adapter.set_lora([(lora_adapter, scale), ...])`` applies `functional_dit.lora`
adapters on the fly in every forward (plain or sharded, several at separate scales,
nothing merged); ``pipe.load_lora_weights(path)`` reaches ``load_lora_adapter``, which
reads the file with `functional_dit.lora` and adds it at weight 1 (``set_adapters``
changes weights). The LoRA ``scale``
the pipelines pass in ``joint_attention_kwargs`` / ``attention_kwargs`` multiplies
every adapter's scale for that call, as diffusers' ``scale_lora_layers`` does.

Calling ``DiffusersTransformer(params)`` gives an instance of the family's subclass,
named after the stock class it stands in for. A pipeline holding it records it in
``model_index.json`` as ``["diffusers", "<stock class>"]``, and ``save_pretrained``
writes a stock checkpoint folder (`weights.save`), so a saved pipeline reloads with
stock diffusers and the stock transformer.
"""

from __future__ import annotations

import importlib
import inspect
import os

import diffusers
import torch

import weights
from sharding.internal import is_dtensor
from sharding.tree import nest

from ... import families as _families
from ...api import config_to_diffusers, family
from ...lora import internal as lora_apply
from ...params import Params
from .. import CacheHooks
from ..families import product as _product
from . import _io as io
from ._ip import IPAdapterMixin, is_ip_weight
from ._ip import ip_adapter_input as ip_adapter_input  # the sampler's IP-Adapter inputs
from ._layerwise import LayerwiseMixin
from ._peft import PeftMixin, read_lora
from ._peft_layers import base_key as layers_base_key
from ._surface import SurfaceMixin

# The adapter stands in for the stock module, so its PEFT messages go where diffusers' do.
_PEFT_LOG = diffusers.utils.logging.get_logger("diffusers.loaders.peft")

# Stock forward arguments of the families that do not take them, with their defaults (accepted).
_UNSUPPORTED = {
    "controlnet_block_samples": None,
    "controlnet_single_block_samples": None,
    "controlnet_blocks_repeat": False,
}
# Per family, in its product module (`functional_dit.pipelines.families.product`): ``ADAPTER_ARGS``, the
# forward arguments beyond the shared ones (hidden_states, timestep, encoder_hidden_states,
# guidance, return_dict), mapped to `fd.apply`'s by ``adapter_args``; ``PROCESSORS``, the stock
# attention processors whose maths fd.apply computes per block list, and the stock default.


def _stock_class(key: str) -> str:
    """The stock class the family ``key``'s adapter stands in for."""
    return _families.BY_KEY[key].DIFFUSERS_CLASS


def _served(key: str) -> str:
    """The stock pipelines the family ``key``'s adapter serves, for messages."""
    return " / ".join(_families.pipeline_names(_families.BY_KEY[key]))


def _family(params) -> str:
    if not isinstance(params, Params):
        raise ValueError(f"params: expected functional_dit.Params, got {type(params).__name__}")
    return _families.key(params)


class _Node(torch.nn.Module):
    """One level of the parameter tree, named as in the stock module (so the adapter's
    ``state_dict`` keys are the diffusers keys)."""

    def forward(self, *args, **kwargs):
        raise ValueError(f"{type(self).__name__}: a parameter container of DiffusersTransformer, not callable")

    def __getitem__(self, index):
        """``node[0]`` as on the stock ``nn.Sequential`` containers (``ff.net``), which
        diffusers' LoRA loading indexes (``get_submodule_by_name``)."""
        return self.get_submodule(str(index))


class _Attention(_Node):
    """A block's ``attn``: holds the attention processor a pipeline sets (the FLUX.2-klein
    KV pipeline sets its own at construction; IP-Adapter's hold its weights, registered as
    a child module as on the stock module), accepting only the stock processors whose
    maths `fd.apply` computes; without one, ``get_processor`` gives the stock default."""

    def __init__(self, owner: str, accepted: set[str], default: str):
        super().__init__()
        self.__dict__.update(_owner=owner, _accepted=accepted, _default=default, processor=None)

    def check_processor(self, processor) -> None:
        name = type(processor).__name__
        if name not in self._accepted:
            raise ValueError(
                f"processor: {self._owner} computes attention as one of {sorted(self._accepted)}; got {name}, "
                "which it cannot honour"
            )

    def set_processor(self, processor) -> None:
        self.check_processor(processor)
        self._modules.pop("processor", None)
        self.__dict__.pop("processor", None)
        if isinstance(processor, torch.nn.Module):
            self.add_module("processor", processor)
        else:
            self.__dict__["processor"] = processor

    def get_processor(self, return_deprecated_lora: bool = False):
        if self.processor is None:
            self.__dict__["processor"] = _stock_processor(self._default)
        return self.processor


def _stock_processor(path: str):
    """A new stock processor from its ``module:Class`` path in diffusers' transformers."""
    module, name = path.split(":")
    return getattr(importlib.import_module(f"diffusers.models.transformers.{module}"), name)()


def _tree_module(node: torch.nn.Module, subtree: dict, path: tuple, owner: str, fam: str) -> None:
    """Register ``subtree``'s tensors on ``node`` as parameters (requiring grad, as a stock
    module's do), its dicts as child modules (`nn.ModuleList` for block lists,
    `_Attention` for a block's ``attn``)."""
    for name, value in subtree.items():
        if isinstance(value, torch.Tensor):
            node.register_parameter(name, torch.nn.Parameter(value, requires_grad=True))
            continue
        if len(path) == 2 and name == "attn":
            child = _Attention(owner, *_product(fam).PROCESSORS[path[0]])
        else:
            child = _Node()
        _tree_module(child, value, (*path, name), owner, fam)
        if value and sorted(value, key=int if all(k.isdigit() for k in value) else str) == [
            str(i) for i in range(len(value))
        ]:
            child = torch.nn.ModuleList([child.get_submodule(str(i)) for i in range(len(value))])
        node.add_module(name, child)


class DiffusersTransformer(
    CacheHooks, PeftMixin, LayerwiseMixin, IPAdapterMixin, SurfaceMixin, diffusers.ModelMixin, diffusers.ConfigMixin
):
    """A drop-in ``transformer`` for diffusers pipelines computing with `fd.apply`.

    ``DiffusersTransformer(params)`` with `Params` from `fd.init`, `fd.from_diffusers`,
    `weights.load` or sharded by `sharding.shard_params` (then every rank runs the same
    pipeline call). ``adapter.params`` is the current pytree; ``to(...)`` moves and
    casts it.
    """

    config_name = "config.json"
    _family_name: str = ""

    def __new__(cls, params=None, *args, **kwargs):
        if cls is DiffusersTransformer:
            cls = _subclass(_family(params))
        return super().__new__(cls)

    def __init__(self, params: Params):
        fam = _family(params)
        if fam != self._family_name:
            raise ValueError(
                f"params: {type(self).__name__} wraps {_stock_class(self._family_name)} params, "
                f"got {type(params.config).__name__}"
            )
        super().__init__()
        cfg = config_to_diffusers(params.config)
        cfg.pop("_class_name")
        self.register_to_config(**cfg)
        self.__dict__["_fd_config"] = params.config
        _tree_module(self, params.tree, (), type(self).__name__, fam)
        pos_embed = _product(fam).pos_embed(self.config)  # the stock RoPE module (unused by forward)
        if pos_embed is not None:
            self.pos_embed = pos_embed
        self.gradient_checkpointing = False  # what the stock classes hold (enable_gradient_checkpointing)
        # What diffusers records in a pipeline's model_index.json: the stock class, whose
        # checkpoint folder save_pretrained writes (see the module docstring).
        self.__dict__["__module__"] = "diffusers"

    # ---------------------------------------------------------------- state

    @property
    def params(self) -> Params:
        """The current parameters as `Params` (sharing storage with this module; leaves that
        require grad stay attached, so a loss over `fd.apply` fills their ``.grad``)."""
        return self._base_params(detached=False)

    def _base_params(self, detached: bool) -> Params:
        """The base model's parameters (the PEFT factors left out) as `Params`."""
        layers, flat = self._peft_layers(), {}
        for k, p in self.named_parameters(remove_duplicate=False):
            if is_ip_weight(k):
                continue
            key = layers_base_key(k, layers) if layers else k
            if key is not None:
                flat[key] = p.detach() if detached or not p.requires_grad else p
        return Params(self._fd_config, nest(flat))

    def _family_module(self):
        return family(self._fd_config)

    def _leaf(self) -> torch.Tensor:
        return next(self.parameters())

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype; under layerwise casting the compute dtype, as stock."""
        hook = self.layerwise_hook()
        return hook.compute_dtype if hook is not None else self._leaf().dtype

    @property
    def device(self) -> torch.device:
        return self._leaf().device

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fd.apply over {type(self.params.config).__name__}, dtype={self.dtype})"

    # ---------------------------------------------------------------- forward

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        *,
        timestep: torch.Tensor = None,
        guidance: torch.Tensor = None,
        return_dict: bool = True,
        **kwargs,
    ):
        """The stock class's forward (see its docstring); returns ``(sample,)`` with
        ``return_dict=False`` (``(sample, cache)`` for FLUX.2 ``kv_cache_mode="extract"``),
        else the stock output dataclass."""
        product = _product(self._family_name)  # the family's argument map
        kwargs = self._check_args(kwargs)
        args = dict(guidance=guidance, **product.adapter_args(self, **kwargs))
        cache = None
        hidden_states, timestep, encoder_hidden_states, args = product.broadcast(
            hidden_states, timestep, encoder_hidden_states, args
        )
        scale = self.__dict__.pop("_call_scale", 1.0)
        pairs = [(ad, s * scale) for ad, s in self.get_lora()]
        out = self.cached_apply(
            self.params,
            hidden_states,
            timestep,
            encoder_hidden_states,
            pairs or None,
            checkpoint=bool(self.gradient_checkpointing),
            **args,
        )
        out = product.adapter_result(out, kwargs)  # (sample, cache) for an extract call that returns one
        if isinstance(out, tuple):
            out, cache = out
        if not return_dict:
            return (out,) if cache is None else (out, cache)
        return product.output(out, cache)

    def _check_args(self, kwargs) -> dict:
        """``kwargs`` less the unsupported stock options left at their defaults; any other
        argument this family does not take is a ValueError."""
        fam, name = self._family_name, type(self).__name__
        takes = _product(fam).ADAPTER_ARGS
        for key, value in kwargs.items():
            if key in takes:
                continue
            if key in _UNSUPPORTED and value is _UNSUPPORTED[key]:  # a stock option left at its default
                continue
            others = [f.KEY for f in _families.FAMILIES if key in _product(f).ADAPTER_ARGS]
            if others:
                raise ValueError(
                    f"{key}: this {name} adapter runs {type(self.params.config).__name__} params "
                    f"({_served(fam)}), but {key} is an argument of "
                    f"{' / '.join(_stock_class(f) for f in others)} ({' or '.join(_served(f) for f in others)}); "
                    "is this adapter in the wrong pipeline?"
                )
            raise ValueError(f"{key}: not supported by functional_dit's {name} adapter, got {type(value).__name__}")
        return {k: v for k, v in kwargs.items() if k in takes}

    def pipelines_served(self) -> str:
        """The stock pipelines this adapter's family serves (for messages)."""
        return _served(self._family_name)

    def _lora_scale(self, argname: str, attention_kwargs) -> None:
        """The LoRA ``scale`` the pipelines pass in ``joint_attention_kwargs`` /
        ``attention_kwargs``: kept for this call (1.0 when absent); any other key is an error."""
        extra = sorted(set(attention_kwargs or {}) - {"scale"})
        if extra:
            raise ValueError(
                f"{argname}: expected None, {{}} or {{'scale': float}}, got keys {sorted(attention_kwargs)}; "
                f"{type(self).__name__} supports a LoRA scale (and FLUX.1 IP-Adapter's ip_adapter_image_embeds) but no "
                "other attention arguments"
            )
        scale = (attention_kwargs or {}).get("scale", 1.0)
        if scale is None:
            scale = 1.0
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise ValueError(f"{argname}: 'scale' must be a real number, got {scale!r}")
        self.__dict__["_call_scale"] = float(scale)

    # ---------------------------------------------------------------- LoRA

    def set_lora(self, lora) -> None:
        """Apply ``lora`` — a list of ``(adapter, scale)`` pairs of `functional_dit.lora`
        adapters made for these params, or None / [] for none — on the fly in every
        forward from now on. Sharded params need the adapters on the same mesh."""
        pairs = [] if not lora else lora_apply.check(self.params, lora)
        self.__dict__["_lora"] = list(pairs)

    def get_lora(self) -> list:
        """The ``(adapter, scale)`` pairs every forward applies: those `set_lora` set, then
        the active PEFT adapters (``load_lora_adapter``, ``add_adapter``) at their weights."""
        return list(self.__dict__.get("_lora", [])) + self._peft_pairs()

    def load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix="transformer", metadata=None, **kwargs):
        """What ``pipe.load_lora_weights(...)`` calls: read the LoRA (a state dict, a
        safetensors file or a folder holding ``pytorch_lora_weights.safetensors``) with
        `functional_dit.lora` and add it at weight 1 under ``adapter_name`` (default
        ``default_<n>``) as the one active adapter, as the stock loader does (``set_adapters``
        combines several). Its ``peft_config`` is the stock loader's (the file's metadata, or
        inferred); missing or unexpected LoRA keys are warned about as the stock loader warns.
        ``network_alphas`` are honoured; hub downloads, hotswapping and pickles are not supported."""
        alphas = kwargs.pop("network_alphas", None) or {}
        name = kwargs.pop("adapter_name", None)
        if kwargs.pop("hotswap", False):
            raise ValueError("hotswap: not supported by functional_dit's adapter; use set_lora to swap adapters")
        for ignored in ("_pipeline", "low_cpu_mem_usage"):  # nothing is initialised before the factors are read
            kwargs.pop(ignored, None)
        if kwargs.pop("use_safetensors", None) is False:
            raise ValueError("use_safetensors: only safetensors are read (pickle is refused), got False")
        weight_name = kwargs.pop("weight_name", None)
        if kwargs:
            raise ValueError(f"load_lora_adapter: unsupported arguments {sorted(kwargs)}")
        state, metadata = read_lora(pretrained_model_name_or_path_or_dict, prefix, metadata, weight_name)
        if not state:  # as the stock method: e.g. a LoRA for the text encoder only
            _PEFT_LOG.warning(
                f"No LoRA keys associated to {type(self).__name__} found with the prefix={prefix!r}; "
                "nothing loaded into the transformer"
            )
            return
        if prefix is not None:
            alphas = {k.removeprefix(f"{prefix}."): v for k, v in alphas.items() if k.startswith(f"{prefix}.")}
        self._peft_load(state, metadata, alphas, name)

    # ---------------------------------------------------------------- save / load

    def save_pretrained(
        self,
        save_directory,
        is_main_process: bool = True,
        save_function=None,
        safe_serialization: bool = True,
        variant=None,
        max_shard_size="5GB",
        push_to_hub: bool = False,
        **kwargs,
    ) -> None:
        """Write a stock diffusers checkpoint folder (``config.json`` + safetensors) with
        `weights.save`; the stock class's ``from_pretrained`` loads it. ``variant`` names
        the files as diffusers does (``diffusion_pytorch_model.<variant>.safetensors``);
        ``safe_serialization=False`` writes the stock pickled ``.bin`` files (``torch.save``
        of each shard's state dict, as diffusers writes them; `from_pretrained` reads them
        back with ``torch.load(weights_only=True)`` only). With sharded params every rank
        must call it (rank 0 writes); a variant or pickles need plain params. The adapter's
        PEFT factors are not part of the checkpoint (``save_lora_adapter``)."""
        bad = {k: v for k, v in dict(kwargs, save_function=save_function, push_to_hub=push_to_hub).items() if v}
        if bad or is_main_process is not True:
            raise ValueError(f"save_pretrained: unsupported arguments {sorted(bad) or ['is_main_process']}")
        # layerwise-cast leaves are written in the dtype they are stored in (weights.save), as stock
        params, size = self._base_params(detached=True), max_shard_size or "5GB"
        if variant is None and safe_serialization:
            weights.save(params, os.fspath(save_directory), max_shard_size=size)
            return
        if any(is_dtensor(t) for t in params.leaves()):
            what = f"a variant ({variant!r})" if variant is not None else "pickled weights (safe_serialization=False)"
            raise ValueError(f"save_pretrained: saving {what} needs plain (unsharded) params, got sharded ones")
        io.save_renamed(params, os.fspath(save_directory), variant, size, pickle=not safe_serialization)

    @classmethod
    def from_pretrained(
        cls, path, *, subfolder: str | None = None, mesh=None, plan=None, device=None, **kwargs
    ) -> DiffusersTransformer:
        """An adapter over `weights.load` of a diffusers model or pipeline folder (or a
        single safetensors file): ``mesh`` / ``plan`` stream each rank's own slices
        (sharded params), ``device`` as in `weights.load`; the stock keywords
        (``torch_dtype`` / ``dtype``, ``variant``, ``subfolder``, ``device_map``,
        ``low_cpu_mem_usage``, ``output_loading_info``, ``use_safetensors``, ...) with the
        stock meanings (`functional_dit.pipelines.adapter._io`). A folder of pickled
        ``.bin`` weights (``save_pretrained(safe_serialization=False)``) is read with
        ``torch.load(weights_only=True)``, never a full unpickling."""
        opts = io.load_options(kwargs, device)
        path = os.fspath(path)
        if subfolder:
            path = os.path.join(path, subfolder)
        pickled = io.pickled(path, opts["variant"], opts["use_safetensors"])
        if pickled is not None:
            params = io.load_pickled(path, pickled, opts["dtype"], opts["device"], mesh, plan)
        else:
            io.check_weights(path, opts["variant"])
            params = weights.load(
                path, mesh=mesh, plan=plan, dtype=opts["dtype"], device=opts["device"], variant=opts["variant"]
            )
        if cls is not DiffusersTransformer and _family(params) != cls._family_name:
            raise ValueError(
                f"path: {cls.__name__} expects a {_stock_class(cls._family_name)} checkpoint, "
                f"got {type(params.config).__name__} params from {path}"
            )
        model = DiffusersTransformer(params)
        return (model, io.loading_info()) if opts["output_loading_info"] else model


_SUBCLASSES: dict = {}  # family key -> its adapter class, made on first use


def _subclass(family: str) -> type:
    """The adapter class of ``family``, named after the stock class it stands in for (made
    once per family and stock class); its ``forward`` names every argument where the family's
    pipelines read the signature (``NAMED_FORWARD``)."""
    name, product = _stock_class(family), _product(family)
    if (family, name) in _SUBCLASSES:
        return _SUBCLASSES[family, name]
    doc = f"`DiffusersTransformer` for {name} params (made by ``DiffusersTransformer(params)``)."
    attrs = {"_family_name": family, "__doc__": doc, "__module__": __name__}
    stock = getattr(diffusers, name, None)  # the stock class's layerwise-casting patterns (None: not installed)
    for attr in ("_skip_layerwise_casting_patterns", "_keep_in_fp32_modules"):
        attrs[attr] = getattr(stock, attr, None)
    if product.NAMED_FORWARD:
        attrs["forward"] = _forward_with([n for n in inspect.signature(product.adapter_args).parameters][1:])
    _SUBCLASSES[family, name] = type(name, (DiffusersTransformer,), attrs)
    return _SUBCLASSES[family, name]


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

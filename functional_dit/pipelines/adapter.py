"""`DiffusersTransformer`: `fd.apply` behind the stock diffusers transformer interface,
a drop-in ``transformer`` for the diffusers FLUX.1, FLUX.2 and Qwen-Image pipelines.

It takes the stock forward arguments (``FluxTransformer2DModel``,
``Flux2Transformer2DModel``, ``QwenImageTransformer2DModel``), runs `fd.apply` on its
params (plain or sharded) and returns what the stock class returns. Everything a
pipeline touches besides ``forward`` is here: ``config`` with the diffusers keys,
``dtype`` / ``device`` / ``to``, ``cache_context`` and ``enable_cache`` (diffusers' First-Block
Cache, TaylorSeer lite and MagCache configs, `functional_dit.pipelines._cache_hooks`), the stock
``pos_embed`` RoPE module (`_adapter_rope`), the block lists whose attention
processors the FLUX.2-klein KV pipeline sets, ``save_pretrained`` and
``from_pretrained`` (the stock keywords: `_adapter_io`). The parameter leaves are
registered as ``nn.Parameter`` s under the diffusers names (``state_dict()`` keys equal
the stock class's; they require grad, as a stock module's do), so ``to()``, accelerate's
CPU offload, ``train()`` + ``backward()`` and ``fd.from_diffusers(adapter)`` work as on
the stock module; each forward reads them back into `Params`. The rest of the stock
surface (fused projections, gradient checkpointing, the refusals) is in
`_adapter_surface`, the PEFT methods in `_adapter_peft`, FLUX.2's KV cache (diffusers'
``Flux2KVCache``) in `_adapter_kv`, ``enable_layerwise_casting`` (fp8 storage over
`fd.layerwise_cast`) in `_adapter_layerwise`. Arguments it cannot honour (custom attention
processors) raise a ``ValueError``; FLUX.1's IP-Adapter is in `_adapter_ip`. ControlNet residuals
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
import os

import diffusers
import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput

from sharding.internal import is_dtensor
from sharding.tree import nest

from .. import families as _families
from ..api import config_to_diffusers, family
from ..params import Params
from . import _adapter_io as io
from . import _adapter_kv as kv
from ._adapter_ip import IPAdapterMixin, is_ip_weight
from ._adapter_layerwise import LayerwiseMixin
from ._adapter_peft import PeftMixin
from ._adapter_peft_layers import base_key as layers_base_key
from ._adapter_rope import stock_pos_embed
from ._adapter_surface import SurfaceMixin
from ._cache_hooks import CacheHooks

# The adapter stands in for the stock module, so its PEFT messages go where diffusers' do.
_PEFT_LOG = diffusers.utils.logging.get_logger("diffusers.loaders.peft")
KVCache = kv.KVCache  # the cache a FLUX.2 extract call returns: a diffusers Flux2KVCache

# Per family key: the stock class it stands in for and the pipelines it serves (the registry's).
_STOCK_CLASS = {fam.KEY: fam.DIFFUSERS_CLASS for fam in _families.FAMILIES}
_PIPELINES = {fam.KEY: " / ".join(_families.pipeline_names(fam)) for fam in _families.FAMILIES}
# Forward arguments beyond the shared ones (hidden_states, timestep,
# encoder_hidden_states, guidance, return_dict), per family.
_FAMILY_ARGS = {
    "flux1": {
        "pooled_projections",
        "img_ids",
        "txt_ids",
        "joint_attention_kwargs",
        "controlnet_block_samples",
        "controlnet_single_block_samples",
        "controlnet_blocks_repeat",
    },
    "flux2": {
        "img_ids",
        "txt_ids",
        "joint_attention_kwargs",
        "kv_cache",
        "kv_cache_mode",
        "num_ref_tokens",
        "ref_fixed_timestep",
    },
    "qwenimage": {
        "encoder_hidden_states_mask",
        "img_shapes",
        "attention_kwargs",
        "additional_t_cond",
        "controlnet_block_samples",
    },
    "flux3": {
        "img_ids",
        "txt_ids",
        "image_cond_hidden_states",
        "image_cond_ids",
        "target_timestep",
        "attention_kwargs",
    },
    "qwenimage21": {
        "encoder_hidden_states_mask",
        "img_shapes",
        "img_mask",
        "attention_kwargs",
        "kv_cache",
        "kv_cache_mode",
    },
}
# Stock forward arguments of the families that do not take them, with their defaults (accepted).
_UNSUPPORTED = {
    "controlnet_block_samples": None,
    "controlnet_single_block_samples": None,
    "controlnet_blocks_repeat": False,
}
# The stock attention processors whose maths fd.apply computes, per block list.
_PROCESSORS = {
    ("flux1", "transformer_blocks"): {"FluxAttnProcessor", "FluxIPAdapterAttnProcessor"},
    ("flux1", "single_transformer_blocks"): {"FluxAttnProcessor"},
    ("flux2", "transformer_blocks"): {"Flux2AttnProcessor", "Flux2KVAttnProcessor"},
    ("flux2", "single_transformer_blocks"): {"Flux2ParallelSelfAttnProcessor", "Flux2KVParallelSelfAttnProcessor"},
    ("qwenimage", "transformer_blocks"): {"QwenDoubleStreamAttnProcessor2_0"},
    ("flux3", "txt_mode_blocks"): {"Flux3AttnProcessor"},
    ("flux3", "single_transformer_blocks"): {"Flux3AttnProcessor"},
    ("qwenimage21", "transformer_blocks"): {"QwenImage21AttnProcessor", "QwenImage21FlexAttnProcessor"},
}
# The stock default processor of each block list's attention (what ``attn_processors`` reports unset).
_DEFAULT_PROCESSOR = {
    ("flux1", "transformer_blocks"): "transformer_flux:FluxAttnProcessor",
    ("flux1", "single_transformer_blocks"): "transformer_flux:FluxAttnProcessor",
    ("flux2", "transformer_blocks"): "transformer_flux2:Flux2AttnProcessor",
    ("flux2", "single_transformer_blocks"): "transformer_flux2:Flux2ParallelSelfAttnProcessor",
    ("qwenimage", "transformer_blocks"): "transformer_qwenimage:QwenDoubleStreamAttnProcessor2_0",
    ("flux3", "txt_mode_blocks"): "transformer_flux3:Flux3AttnProcessor",
    ("flux3", "single_transformer_blocks"): "transformer_flux3:Flux3AttnProcessor",
    ("qwenimage21", "transformer_blocks"): "transformer_qwenimage21:QwenImage21AttnProcessor",
}


def _broadcast_text(x, txt, args):
    """One text for a batch of images, as the stock classes accept (their modulation
    broadcasts it; QwenImagePipeline sends one negative prompt for a batch of prompts):
    expand ``txt`` and its mask to the batch, explicitly. Other mismatches stay errors."""
    B = x.shape[0]
    if txt is None or txt.shape[0] != 1 or B == 1:
        return x, txt, args
    mask = args.get("txt_mask")
    if mask is not None and mask.shape[0] == 1:
        args = dict(args, txt_mask=mask.expand(B, *mask.shape[1:]))
    return x, txt.expand(B, *txt.shape[1:]), args


def _batch(v) -> int | None:
    return v.shape[0] if isinstance(v, torch.Tensor) and v.dim() > 0 else None


def _broadcast_flux1(x, t, txt, args):
    """FLUX.1's batch-1 inputs broadcast as ``FluxTransformer2DModel`` broadcasts them: its
    time, guidance and pooled embeddings are summed into one ``temb`` (any of them with
    batch 1 serves the others' batch), and each stream is modulated by ``temb``, so the
    image stream takes the batch of ``hidden_states`` and ``temb``, the text stream that of
    ``encoder_hidden_states`` and ``temb``; the two must then agree (FluxPipeline sends one
    negative prompt's embeddings for several prompts under true CFG: text and pooled of
    batch 1, timestep and guidance of the batch). Expanded explicitly here; what the stock
    module cannot broadcast (e.g. every conditioning input of batch 1 for a batch of
    images) stays an error (`fd.apply`'s)."""
    named = dict(x=x, t=t, txt=txt, guidance=args.get("guidance"), pooled=args.get("pooled"))
    temb = {_batch(named[k]) for k in ("t", "guidance", "pooled")} - {None}
    if len(temb - {1}) > 1:
        return x, t, txt, args
    tb = max(temb, default=1)
    streams = {max(_batch(x), tb), max(_batch(txt), tb)} if None not in (_batch(x), _batch(txt)) else set()
    if len(streams) != 1 or any(_batch(v) not in (None, 1, *streams) for v in named.values()):
        return x, t, txt, args
    B = streams.pop()
    out = {k: v.expand(B, *v.shape[1:]) if _batch(v) == 1 else v for k, v in named.items()}
    return out["x"], out["t"], out["txt"], dict(args, guidance=out["guidance"], pooled=out["pooled"])


def _broadcast_layout(x, args):
    """Qwen-Image's ``img_shapes`` / ``img_mask`` with fewer items than the batch, as the
    stock classes read them: ``QwenImageTransformer2DModel`` builds its RoPE from
    ``img_shapes[0]`` alone and ``QwenImage21Transformer2DModel`` reads ``img_shapes[0]``
    and ``img_mask[0]`` ("samples share a layout"), while the pipelines send one entry per
    prompt, not per image (``num_images_per_prompt``). Equal items are repeated to the
    batch; items that differ stay `fd.apply`'s error (the stock class warns, or not even
    that for ``img_mask``, and gives every image the first item's layout). The Layered
    model's batch-1 ``additional_t_cond`` (one per prompt too) is broadcast as stock."""
    B, shapes, mask = x.shape[0], args.get("img_shapes"), args.get("img_mask")
    if isinstance(shapes, (list, tuple)) and 0 < len(shapes) != B and all(s == shapes[0] for s in shapes):
        args = dict(args, img_shapes=[shapes[0]] * B)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] not in (0, B):
        if mask.shape[0] == 1 or all(torch.equal(row, mask[0]) for row in mask):
            args = dict(args, img_mask=mask[:1].expand(B, -1))
    cond = args.get("additional_t_cond")  # Layered's: summed into the time embedding, so broadcast as stock
    if isinstance(cond, torch.Tensor) and cond.dim() > 0 and cond.shape[0] == 1 != B:
        args = dict(args, additional_t_cond=cond.expand(B, *cond.shape[1:]))
    return args


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
            child = _Attention(owner, _PROCESSORS[(fam, path[0])], _DEFAULT_PROCESSOR[(fam, path[0])])
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
            cls = _SUBCLASSES[_family(params)]
        return super().__new__(cls)

    def __init__(self, params: Params):
        fam = _family(params)
        if fam != self._family_name:
            raise ValueError(
                f"params: {type(self).__name__} wraps {_STOCK_CLASS[self._family_name]} params, "
                f"got {type(params.config).__name__}"
            )
        super().__init__()
        cfg = config_to_diffusers(params.config)
        cfg.pop("_class_name")
        self.register_to_config(**cfg)
        self.__dict__["_fd_config"] = params.config
        _tree_module(self, params.tree, (), type(self).__name__, fam)
        pos_embed = stock_pos_embed(fam, self.config)  # the stock RoPE module (unused by forward)
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
        fam = self._family_name
        kwargs = self._check_args(kwargs)
        args = dict(guidance=guidance)
        cache = None
        if fam == "flux1":
            args.update(self._flux1_args(**kwargs))
        elif fam == "flux2":
            args.update(self._flux2_args(**kwargs))
        elif fam in _NEW_FAMILIES:
            args.update(_NEW_FAMILIES[fam].args(self, **kwargs))
        else:
            args.update(self._qwen_args(**kwargs))
        if fam == "flux1":
            hidden_states, timestep, encoder_hidden_states, args = _broadcast_flux1(
                hidden_states, timestep, encoder_hidden_states, args
            )
        else:
            hidden_states, encoder_hidden_states, args = _broadcast_text(hidden_states, encoder_hidden_states, args)
        if fam in ("qwenimage", "qwenimage21"):
            args = _broadcast_layout(hidden_states, args)
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
        if fam in _NEW_FAMILIES:
            out = _NEW_FAMILIES[fam].result(out, kwargs)
        if isinstance(out, tuple):
            out, cache = out[0], KVCache(out[1])
        if not return_dict:
            return (out,) if cache is None else (out, cache)
        if fam == "flux2":
            return Flux2Transformer2DModelOutput(sample=out, kv_cache=cache)
        return Transformer2DModelOutput(sample=out)

    def _check_args(self, kwargs) -> dict:
        """``kwargs`` less the unsupported stock options left at their defaults; any other
        argument this family does not take is a ValueError."""
        fam, name = self._family_name, type(self).__name__
        for key, value in kwargs.items():
            if key in _FAMILY_ARGS[fam]:
                continue
            if key in _UNSUPPORTED and value is _UNSUPPORTED[key]:  # a stock option left at its default
                continue
            others = [f for f, keys in _FAMILY_ARGS.items() if key in keys]
            if others:
                raise ValueError(
                    f"{key}: this {name} adapter runs {type(self.params.config).__name__} params "
                    f"({_PIPELINES[fam]}), but {key} is an argument of "
                    f"{' / '.join(_STOCK_CLASS[f] for f in others)} ({' or '.join(_PIPELINES[f] for f in others)}); "
                    "is this adapter in the wrong pipeline?"
                )
            raise ValueError(f"{key}: not supported by functional_dit's {name} adapter, got {type(value).__name__}")
        return {k: v for k, v in kwargs.items() if k in _FAMILY_ARGS[fam]}

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
        from ..lora import internal as lora_apply

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
        from ._adapter_peft import read_lora

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

    def _flux1_args(
        self,
        pooled_projections=None,
        img_ids=None,
        txt_ids=None,
        joint_attention_kwargs=None,
        controlnet_block_samples=None,
        controlnet_single_block_samples=None,
        controlnet_blocks_repeat=False,
    ):
        kwargs = dict(joint_attention_kwargs or {})
        ip = self.ip_adapter_input(kwargs.pop("ip_adapter_image_embeds", None))
        self._lora_scale("joint_attention_kwargs", kwargs)
        if pooled_projections is None:
            raise ValueError(
                f"pooled_projections: {type(self).__name__} (FLUX.1 params) needs the CLIP pooled embedding, got None, "
                "as the FLUX.2 and Qwen-Image pipelines call their transformers; is this adapter in the wrong "
                f"pipeline? It belongs in {_PIPELINES['flux1']}"
            )
        control = dict(
            controlnet_block_samples=controlnet_block_samples,
            controlnet_single_block_samples=controlnet_single_block_samples,
            controlnet_blocks_repeat=controlnet_blocks_repeat,
        )
        return dict(pooled=pooled_projections, img_ids=img_ids, txt_ids=txt_ids, ip_adapter=ip, **control)

    def _flux2_args(
        self,
        img_ids=None,
        txt_ids=None,
        joint_attention_kwargs=None,
        kv_cache=None,
        kv_cache_mode=None,
        num_ref_tokens=0,
        ref_fixed_timestep=0.0,
    ):
        self._lora_scale("joint_attention_kwargs", joint_attention_kwargs)
        args = dict(img_ids=img_ids, txt_ids=txt_ids)
        if kv_cache_mode is None:
            if kv_cache is not None or num_ref_tokens or ref_fixed_timestep:
                raise ValueError(
                    f"kv_cache_mode: None runs without a KV cache, but got kv_cache={kv_cache!r}, "
                    f"num_ref_tokens={num_ref_tokens!r}, ref_fixed_timestep={ref_fixed_timestep!r}"
                )
            return args
        if kv_cache_mode == "extract":
            if kv_cache is not None:
                raise ValueError(f"kv_cache: expected None with kv_cache_mode='extract', got {kv_cache!r}")
            return dict(args, kv_cache="extract", num_ref_tokens=num_ref_tokens, ref_fixed_timestep=ref_fixed_timestep)
        if kv_cache_mode == "cached":
            if kv_cache is None:
                raise ValueError("kv_cache: expected the cache an extract call returned with kv_cache_mode='cached'")
            return dict(args, kv_cache=kv.to_fd(kv_cache, self._fd_config))
        raise ValueError(f"kv_cache_mode: expected None, 'extract' or 'cached', got {kv_cache_mode!r}")

    def _qwen_args(
        self,
        encoder_hidden_states_mask=None,
        img_shapes=None,
        attention_kwargs=None,
        additional_t_cond=None,
        controlnet_block_samples=None,
    ):
        self._lora_scale("attention_kwargs", attention_kwargs)
        mask = encoder_hidden_states_mask
        if isinstance(mask, torch.Tensor) and (mask.is_floating_point() or mask.is_complex()):
            mask = mask != 0  # the stock class casts to bool: any non-zero keeps the token
        return dict(
            txt_mask=mask,
            img_shapes=img_shapes,
            additional_t_cond=additional_t_cond,
            controlnet_block_samples=controlnet_block_samples,
        )

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
        import weights

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
        stock meanings (`functional_dit.pipelines._adapter_io`). A folder of pickled
        ``.bin`` weights (``save_pretrained(safe_serialization=False)``) is read with
        ``torch.load(weights_only=True)``, never a full unpickling."""
        import weights

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
                f"path: {cls.__name__} expects a {_STOCK_CLASS[cls._family_name]} checkpoint, "
                f"got {type(params.config).__name__} params from {path}"
            )
        model = DiffusersTransformer(params)
        return (model, io.loading_info()) if opts["output_loading_info"] else model


def _subclass(family: str) -> type:
    name = _STOCK_CLASS[family]
    doc = f"`DiffusersTransformer` for {name} params (made by ``DiffusersTransformer(params)``)."
    attrs = {"_family_name": family, "__doc__": doc, "__module__": __name__}
    stock = getattr(diffusers, name, None)  # the stock class's layerwise-casting patterns (None: not installed)
    for attr in ("_skip_layerwise_casting_patterns", "_keep_in_fp32_modules"):
        attrs[attr] = getattr(stock, attr, None)
    return type(name, (DiffusersTransformer,), attrs)


_SUBCLASSES = {fam: _subclass(fam) for fam in _STOCK_CLASS}

from . import _adapter_families as _new  # noqa: E402  (FLUX.3, Qwen-Image 2.1)

_NEW_FAMILIES = _new.FAMILIES
_new.add_signatures(_SUBCLASSES)

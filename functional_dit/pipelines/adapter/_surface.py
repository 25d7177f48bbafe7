"""The stock module methods of `DiffusersTransformer` beyond forward and IO, each backed
by the functional core, and the refusals of those it cannot honour.

- ``fuse_qkv_projections`` / ``unfuse_qkv_projections``: the parameters laid out as
  `fd.prepare` lays them (each q/k/v group row views of one buffer, which `fd.apply`
  runs as one matmul in eager inference) / back to one buffer per leaf. The keys, shapes
  and values stay; no ``to_qkv`` module appears.
- ``enable_gradient_checkpointing`` / ``disable_gradient_checkpointing``: per-block
  recomputation in backward, ``fd.apply(..., checkpoint=True)``.
- ``set_default_attn_processor``: accepted, a no-op (the default maths is `fd.apply`'s).
- Attention backends, group offloading, xformers / NPU attention: these
  hook the stock attention modules, which the adapter does not have; each raises a
  ValueError naming itself rather than silently doing nothing. (Layerwise casting is
  honoured: `adapter._layerwise`.)
"""

from __future__ import annotations

import torch

from ...nn import fused as _fuse


def relayout(module: torch.nn.Module, leaves: dict) -> None:
    """Re-register ``leaves`` ({dotted name: tensor}) as ``module``'s parameters of those
    names, keeping each one's ``requires_grad``."""
    for name, t in leaves.items():
        parent, _, leaf = name.rpartition(".")
        node = module.get_submodule(parent)
        old = node._parameters[leaf]
        node._parameters[leaf] = torch.nn.Parameter(t, requires_grad=old.requires_grad)


def _refuse(name: str, why: str):
    def method(self, *args, **kwargs):
        raise ValueError(f"{name}: {type(self).__name__} (functional_dit) {why}")

    method.__name__ = name
    method.__doc__ = f"Raises a ValueError: the adapter {why}."
    return method


_NO_ATTENTION_MODULES = (
    "computes attention inside fd.apply (scaled_dot_product_attention): its attention modules hold parameters, "
    "not processors, and it cannot run another processor's maths"
)


class SurfaceMixin:
    """See the module docstring."""

    _supports_gradient_checkpointing = True

    def fuse_qkv_projections(self) -> None:
        """Lay the projections out as `fd.prepare` does (eager inference runs each group as
        one matmul; the outputs are unchanged within float rounding)."""
        if self.layerwise_hook() is not None:
            raise ValueError(
                "fuse_qkv_projections: layerwise casting is enabled; its weights are stored in another dtype than they "
                "compute in, so there is no one buffer to lay them out in (fuse before enabling layerwise casting)"
            )
        fam = self._family_module()
        with torch.no_grad():
            fused = _fuse.prepare(self._base_params(detached=True), fam.FUSED)
        relayout(self, fused.flat())
        self.__dict__["fused_projections"] = True

    def unfuse_qkv_projections(self) -> None:
        """Give every projection its own buffer again (the layout `fd.init` makes)."""
        with torch.no_grad():
            relayout(self, {k: v.clone() for k, v in self._base_params(detached=True).flat().items()})
        self.__dict__["fused_projections"] = False

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        """Recompute each block's activations in backward (``fd.apply(..., checkpoint=True)``)."""
        if gradient_checkpointing_func is not None:
            raise ValueError(
                "gradient_checkpointing_func: the adapter checkpoints fd.apply's blocks itself "
                "(torch.utils.checkpoint, non-reentrant); a custom function over block modules cannot be honoured"
            )
        self.gradient_checkpointing = True

    def disable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = False

    @property
    def attn_processors(self) -> dict:
        """Per attention module (``<name>.processor``) the stock processor it holds."""
        return {f"{n}.processor": m.get_processor() for n, m in self._attention_modules()}

    def set_attn_processor(self, processor) -> None:
        """diffusers' method: one processor for every attention module, or a dict of one per
        module; only the stock processors whose maths `fd.apply` computes are accepted, and
        a refused one changes none (each is checked first)."""
        modules = self._attention_modules()
        if isinstance(processor, dict) and len(processor) != len(modules):
            raise ValueError(
                f"A dict of processors was passed, but the number of processors {len(processor)} does not match the"
                f" number of attention layers: {len(modules)}. Please make sure to pass {len(modules)} processor "
                "classes."
            )
        if isinstance(processor, dict):
            missing = [n for n, _ in modules if f"{n}.processor" not in processor]
            if missing:
                raise ValueError(f"processor: no entry for {missing[0]}.processor")
        chosen = [(m, processor[f"{n}.processor"] if isinstance(processor, dict) else processor) for n, m in modules]
        for m, p in chosen:
            m.check_processor(p)
        for m, p in chosen:
            m.set_processor(p)

    def _attention_modules(self) -> list:
        return [(n, m) for n, m in self.named_modules() if hasattr(m, "check_processor")]

    def set_default_attn_processor(self) -> None:
        """Accepted, and changes nothing: the default attention processor computes exactly
        the maths `fd.apply` computes (diffusers' pipeline tests call this on every component
        that has it, to compare against the default maths). The stock FLUX.1 / FLUX.2 /
        Qwen-Image classes do not define the method; custom processors stay refused
        (`set_attn_processor`). Processors a pipeline set (IP-Adapter's, FLUX.2-klein's KV
        ones) are kept: they are how the stock classes hold those features' state."""

    set_attention_backend = _refuse("set_attention_backend", _NO_ATTENTION_MODULES)
    reset_attention_backend = _refuse("reset_attention_backend", _NO_ATTENTION_MODULES)
    enable_xformers_memory_efficient_attention = _refuse(
        "enable_xformers_memory_efficient_attention", _NO_ATTENTION_MODULES
    )
    enable_npu_flash_attention = _refuse("enable_npu_flash_attention", _NO_ATTENTION_MODULES)
    set_use_npu_flash_attention = _refuse("set_use_npu_flash_attention", _NO_ATTENTION_MODULES)
    enable_group_offload = _refuse(
        "enable_group_offload",
        "runs fd.apply on its parameters directly, with no submodule forward to hook; use enable_model_cpu_offload "
        "on the pipeline",
    )

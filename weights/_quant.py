"""fp8 weights (`fd.quantize`) in a checkpoint folder: each quantized linear is written as
``<module>.weight`` (float8 e4m3, the weight divided by its scale) and
``<module>.weight_scale`` (float32, (out, 1) per output channel or (1, 1) per tensor), the
layout of vLLM's / compressed-tensors' fp8 checkpoints, and config.json gains
``"quantization_config": {"quant_method": "functional_dit-fp8", "scheme": ...}``. diffusers'
own loader does not know that method and refuses the folder (docs/quantization.md);
`weights.load` rebuilds the `QuantTensor` leaves, with a mesh reading each rank's rows of
the weights and of their scales."""

from __future__ import annotations

import dataclasses

import torch

from functional_dit.nn import quant
from sharding.internal import is_dtensor, local_tensor

from . import _format as F

SUFFIX = "_scale"  # <module>.weight -> <module>.weight_scale
METHOD = "functional_dit-fp8"


def expand(flat: dict) -> dict:
    """``{key: tensor}`` to write: a `QuantTensor` leaf becomes its fp8 values and its scales."""
    out = {}
    for k, t in flat.items():
        if is_dtensor(t) and quant.is_quant(local_tensor(t)):
            raise ValueError(
                f"params: {k!r} is a sharded fp8 leaf; weights.save of sharded quantized params is not supported: save "
                "the quantized params before sharding them (or load them with mesh=, which shards them)"
            )
        if quant.is_quant(t):
            out[k], out[k + SUFFIX] = t.qdata, t.scale
        else:
            out[k] = t
    return out


def config_entry(flat: dict) -> dict:
    """The config.json entry for quantized params (empty for none)."""
    schemes = {t.scheme for t in flat.values() if quant.is_quant(t)}
    if not schemes:
        return {}
    if len(schemes) > 1:
        raise ValueError(f"params: fp8 leaves of several schemes {sorted(schemes)}; expected one per checkpoint")
    return {"quantization_config": {"quant_method": METHOD, "scheme": schemes.pop()}}


def split(src):
    """``(src without the scale tensors, {weight key: scale TensorInfo}, scheme or None)``."""
    scales = {k[: -len(SUFFIX)]: info for k, info in src.tensors.items() if k.endswith(".weight" + SUFFIX)}
    scales = {k: info for k, info in scales.items() if k in src.tensors}
    if not scales:
        return src, {}, None
    qc = (src.config_json or {}).get("quantization_config") or {}
    scheme = qc.get("scheme")
    if qc.get("quant_method") != METHOD or scheme not in quant.SCHEMES:
        raise F.CheckpointError(
            f"{src.path}: holds '*.weight_scale' tensors but config.json's quantization_config is {qc or None}; "
            f"expected {{'quant_method': {METHOD!r}, 'scheme': one of {list(quant.SCHEMES)}}} "
            "(what weights.save writes)"
        )
    kept = {k: v for k, v in src.tensors.items() if not (k.endswith(SUFFIX) and k[: -len(SUFFIX)] in scales)}
    return dataclasses.replace(src, tensors=kept), scales, scheme


def config_json(cfg: dict) -> dict:
    """config.json without our quantization entry (not a diffusers config argument)."""
    qc = cfg.get("quantization_config")
    return (
        {k: v for k, v in cfg.items() if k != "quantization_config"} if qc and qc.get("quant_method") == METHOD else cfg
    )


def wrap(flat: dict, scales: dict, scheme: str, regions: dict, compute_dtype) -> dict:
    """``flat`` with each quantized weight (its fp8 local rows/columns ``regions[k]``) a
    `QuantTensor` with the matching rows of its scales."""
    reader = F.Reader()
    out = dict(flat)
    for k, info in scales.items():
        rows = regions[k][0] if scheme == "fp8-row" else [(0, 1)]
        scale = torch.empty(sum(b - a for a, b in rows), 1, dtype=torch.float32)
        at = 0
        for a, b in rows:
            dest = torch.empty(b - a, 1, dtype=info.torch_dtype)
            reader.read_into(info, (slice(a, b), slice(0, 1)), dest)
            scale[at : at + b - a] = dest.float()
            at += b - a
        q = flat[k]
        out[k] = quant.QuantTensor(q, scale.to(q.device), compute_dtype, scheme)
    return out

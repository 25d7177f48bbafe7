"""Input validation shared by the families: every error names the argument, the
expected and the actual value. Checks read only shapes, dtypes and devices (static
under tracing), never tensor values, so they cost nothing inside a compiled graph."""

from __future__ import annotations

import torch

from sharding.tree import get

from ..params import COMPUTE_DTYPES


def _fmt(shape) -> str:
    """A shape as Python prints a tuple (``(2,)``, ``(2, 3)``), ``*`` for any size."""
    items = ["*" if s is None else str(s) for s in shape]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def check_tensor(name: str, x, shape, dtype=None, device=None) -> None:
    """``x`` must be a tensor of ``shape`` (None = any size), ``dtype`` and ``device``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape {_fmt(shape)}, got {type(x).__name__}")
    if x.ndim != len(shape) or any(e is not None and e != a for e, a in zip(shape, x.shape)):
        raise ValueError(f"{name}: expected shape {_fmt(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype} (the params' dtype), got {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected device {device} (the params' device), got {x.device}")


def check_streams(config, leaf: torch.Tensor, x, t, txt) -> tuple[int, int]:
    """The inputs every family shares: x (B, S, in_channels) and txt (B, S_txt,
    joint_attention_dim) in the params' dtype and device, t (B,) real. Returns (B, S).
    Params in a dtype the model cannot compute in (fp8 checkpoints) are refused first."""
    if leaf.dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"params: stored as {leaf.dtype}, which fd.apply cannot compute in (no fp8 compute yet); expected one of "
            f"{COMPUTE_DTYPES}: load with weights.load(..., dtype=torch.bfloat16) or convert: "
            "torch.utils._pytree.tree_map(lambda t: t.to(torch.bfloat16), params)"
        )
    check_tensor("x", x, (None, None, config.in_channels), leaf.dtype, leaf.device)
    B, S = x.shape[:2]
    check_tensor("txt", txt, (B, None, config.joint_attention_dim), leaf.dtype, leaf.device)
    check_tensor("t", t, (B,), device=leaf.device)
    check_floating("t", t)
    return B, S


def check_guidance(config, guidance, batch: int, device) -> None:
    """guidance (B,) exactly when the model embeds it (``guidance_embeds``)."""
    if config.guidance_embeds and guidance is None:
        raise ValueError(f"guidance: this model has guidance_embeds=True and needs guidance of shape ({batch},)")
    if not config.guidance_embeds and guidance is not None:
        raise ValueError("guidance: this model has guidance_embeds=False; expected None, got a tensor")
    if guidance is not None:
        check_tensor("guidance", guidance, (batch,), device=device)
        check_floating("guidance", guidance)


def check_floating(name: str, x) -> None:
    """Timesteps, guidance: any real floating or integer dtype (cast as diffusers casts
    them), never bool or complex."""
    if x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected a real floating or integer tensor, got {x.dtype}")


def check_ids(name: str, ids, seq: int, n_axes: int, batch: int, device=None) -> torch.Tensor:
    """Position ids as diffusers accepts them: (S, n_axes), or (B or 1, S, n_axes)
    whose first item is used (diffusers' deprecated 3-D form), of any real dtype (cast to
    fp32 like diffusers), on ``device``. Returns the 2-D ids."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape ({seq}, {n_axes}), got {type(ids).__name__}")
    if ids.ndim == 3 and ids.shape[0] in (1, batch):
        ids = ids[0]
    if ids.ndim != 2 or tuple(ids.shape) != (seq, n_axes):
        raise ValueError(
            f"{name}: expected shape ({seq}, {n_axes}) or ({batch}, {seq}, {n_axes}), got {tuple(ids.shape)}"
        )
    if ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name}: expected a real tensor, got {ids.dtype}")
    if device is not None and ids.device != device:
        raise ValueError(f"{name}: expected device {device} (the params' device), got {ids.device}")
    return ids


def reference_leaf(params, path: str) -> torch.Tensor:
    """The leaf whose dtype and device define the model's (``x_embedder.weight``, say)."""
    return get(params.tree, path)


def check_rope(rope, rows: int, head_dim: int, device=None, batch=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A precomputed RoPE table as ``apply`` builds it from position ids: (cos, sin), each
    (rows, head_dim) float32, rows in (txt; img) order; where the family takes one table
    per batch row (``batch`` given: rows of several image sizes in one call), each may be
    (batch, rows, head_dim). Returns the pair as a tuple."""
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise ValueError(f"rope: expected a (cos, sin) pair of tensors, got {type(rope).__name__}")
    per_row = batch is not None and isinstance(rope[0], torch.Tensor) and rope[0].ndim == 3
    for name, a in zip(("rope[0] (cos)", "rope[1] (sin)"), rope):
        check_tensor(name, a, (batch, rows, head_dim) if per_row else (rows, head_dim), torch.float32, device)
    return tuple(rope)


def img_valid_bias(img_valid, batch: int, seq: int, device=None, name: str = "img_valid") -> torch.Tensor | None:
    """``img_valid`` (B, S_img) bool or int, 1 = a real image token, 0 = padding (a row that
    holds a smaller image than the call's longest, `functional_dit.pipelines.sampler._packing`),
    as an additive fp32 key bias (0 keep, -inf drop); None for None. ``name``: the
    argument's name in errors (another stream's mask, e.g. FLUX.3's ``image_cond_valid``)."""
    if img_valid is None:
        return None
    check_tensor(name, img_valid, (batch, seq), device=device)
    if img_valid.dtype.is_floating_point or img_valid.dtype.is_complex:
        raise ValueError(f"{name}: expected a bool or integer tensor (1 = real token), got {img_valid.dtype}")
    zero = torch.zeros((), dtype=torch.float32, device=img_valid.device)
    return torch.where(img_valid.bool(), zero, torch.full_like(zero, float("-inf")))


def check_rope_or_ids(rope, **ids) -> None:
    """``rope`` replaces the position ids: passing both is ambiguous."""
    given = [name for name, v in ids.items() if v is not None]
    if rope is not None and given:
        raise ValueError(f"rope: replaces {' and '.join(ids)}; pass either rope or {given[0]}, not both")

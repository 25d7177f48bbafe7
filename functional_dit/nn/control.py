"""ControlNet residuals fed into a transformer's blocks, as diffusers' transformers take them.

``FluxTransformer2DModel`` (``controlnet_block_samples``, ``controlnet_single_block_samples``,
``controlnet_blocks_repeat``) and ``QwenImageTransformer2DModel`` (``controlnet_block_samples``)
add, after block ``i`` of a segment of ``n`` blocks, the image-stream residual
``samples[i // ceil(n / len(samples))]`` — or, with ``repeat`` (XLabs' ControlNets),
``samples[i % len(samples)]``. `per_block` does that index arithmetic once, in the full
view; `local` cuts each residual to this rank's batch (``dp``) and image tokens (``sp``),
as the image stream itself is cut (`nn.layers.shard_joint`).
"""

from __future__ import annotations

import torch

import sharding

from .checks import check_tensor


def check_samples(name: str, samples, shape: tuple, dtype, device) -> list:
    """``samples``: a non-empty list or tuple of tensors of ``shape`` (B, S_img, C) in the
    params' dtype and device."""
    if not isinstance(samples, (list, tuple)) or not samples:
        raise ValueError(f"{name}: expected a non-empty list of {shape} tensors, got {samples!r:.80}")
    for i, s in enumerate(samples):
        check_tensor(f"{name}[{i}]", s, shape, dtype, device)
    return list(samples)


def per_block(samples, n_blocks: int, repeat: bool = False) -> list | None:
    """The residual after each of ``n_blocks`` blocks (diffusers' interval arithmetic), or
    None when ``samples`` is None (or there are no blocks)."""
    if samples is None or not n_blocks:
        return None
    n = len(samples)
    if repeat:
        return [samples[i % n] for i in range(n_blocks)]
    interval = -(-n_blocks // n)  # int(np.ceil(n_blocks / n)), as diffusers computes it
    return [samples[i // interval] for i in range(n_blocks)]


def local(residuals: list | None) -> list | None:
    """Each (B, S_img, C) residual's local view: this rank's batch items over ``dp`` and
    image tokens over ``sp`` (padded like the image stream); the identity off a mesh."""
    if residuals is None:
        return None
    cut = {}  # a repeated residual is cut once
    for r in residuals:
        if id(r) not in cut:
            cut[id(r)] = sharding.shard(sharding.shard(r, "dp", 0), "sp", 1)
    return [cut[id(r)] for r in residuals]


def add_image(x: torch.Tensor, residual: torch.Tensor, txt_len: int) -> torch.Tensor:
    """A joint (txt; img) sequence x (B, T + S, C) with ``residual`` (B, S, C) added to its
    image tokens (FLUX.1's single blocks, which diffusers runs on the image stream)."""
    return torch.cat([x[:, :txt_len], x[:, txt_len:] + residual], 1)

"""The latent helpers the families' sampling steps (`functional_dit.pipelines.families`)
share with the image jobs: 2x2 packing, position ids, repeating a reference to the batch,
the CFG combination."""

from __future__ import annotations

import torch


def pack_2x2(z: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 · W/2, 4C): 2x2 patches, channels first (FLUX.1, Qwen-Image)."""
    B, C, H, W = z.shape
    return z.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // 2) * (W // 2), C * 4)


def unpack_2x2(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack_2x2` for a latent of h x w (before packing)."""
    B, _, C4 = x.shape
    return x.view(B, h // 2, w // 2, C4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C4 // 4, h, w)


def grid_ids(h: int, w: int, n_axes: int, dtype, device, t: int = 0) -> torch.Tensor:
    """(h·w, n_axes) positions of an h x w token grid: axis 0 = t, 1 = row, 2 = col, rest 0."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.zeros(h * w, n_axes, dtype=torch.int64)
    ids[:, 0], ids[:, 1], ids[:, 2] = t, rows.reshape(-1), cols.reshape(-1)
    return ids.to(device=device, dtype=dtype)


def flux2_vae_input(vae, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """FLUX.2's (and FLUX.3's) patchified tokens (B, h/2 · w/2, C) -> the VAE's input
    (B, C/4, h, w): de-normalised by the VAE's batch-norm statistics, then unpatchified."""
    B, _, C = x.shape
    z = x.permute(0, 2, 1).reshape(B, C, h // 2, w // 2)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
    z = z * std + mean
    return z.reshape(B, C // 4, 2, 2, h // 2, w // 2).permute(0, 1, 4, 2, 5, 3).reshape(B, C // 4, h, w)


def _batch(t: torch.Tensor, B: int) -> torch.Tensor:
    """Repeat a batch of b to B rows (B a multiple of b), as the pipelines repeat references."""
    return t if t.shape[0] == B else t.repeat(B // t.shape[0], *([1] * (t.ndim - 1)))


# ----------------------------------------------------------------------------- CFG


def combine(pred: torch.Tensor, scale: float, normalise: bool) -> torch.Tensor:
    """[cond; uncond] predictions -> ``uncond + scale (cond - uncond)``; Qwen-Image rescales
    each token to the conditional prediction's norm (``normalise``)."""
    cond, uncond = pred.chunk(2)
    out = uncond + scale * (cond - uncond)
    if normalise:
        out = out * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(out, dim=-1, keepdim=True))
    return out


def copy_generator(gen: torch.Generator) -> torch.Generator:
    """A generator in ``gen``'s state: each chunk redraws the batch from the same start."""
    g = torch.Generator(gen.device)
    g.set_state(gen.get_state())
    return g


def pad_to(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to ``n`` (the padded model calls' rows)."""
    if x.shape[dim] == n:
        return x
    shape = list(x.shape)
    shape[dim] = n - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim)


def text_mask(p) -> torch.Tensor:
    """A `Prompt`'s mask (1 = real token), ones where it has none."""
    ones = torch.ones(p.txt.shape[:2], dtype=torch.long, device=p.txt.device)
    return ones if p.mask is None else p.mask.to(torch.long)

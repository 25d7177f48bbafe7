"""Ring attention over a mesh axis, and its composition with Ulysses (USP).

Ring attention (Liu et al., "Ring Attention with Blockwise Transformers", 2023): the
sequence is split over the ranks of the ``ring`` axis; each rank keeps its query block
and the key/value blocks travel around the ring, one neighbour-to-neighbour pass per
step (`ppermute`), so after ``n - 1`` passes every query block has met every key block.
Each step's partial attention comes with its log-sum-exp; the partial results are
merged in fp32 by the online-softmax rule (Milakov & Gimelshein 2018; FlashAttention),
so the result equals attention over the whole sequence up to rounding.

USP (Fang & Zhao, "USP: A Unified Sequence Parallelism Approach", 2024): Ulysses'
all-to-all over ``sp`` first trades sequence for heads inside each ring group; the ring
then runs over the ``ring`` axis with this rank's heads. The sequence is split over the
two axes ring-major (`sharding._seq.SEQUENCE`), so a ring rank's block after the
all-to-all is one contiguous run of the sequence, and positions are known statically
(`offsets`): masks that depend on positions (a causal text segment) stay exact.

The key bias (padding, prompt masks) travels with its key block: it is all-gathered
over the ring once (it is small: one number per key) and each step takes its block's
slice. Gradients: autograd through the passes (`ppermute`'s backward is the pass
back) and through the merge; the block kernel is plain differentiable maths.
"""

from __future__ import annotations

import torch

from ._axes import all_gather, axis_index, axis_size, ppermute, ulysses


def merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_o: torch.Tensor):
    """Two partial attentions over disjoint key sets -> the attention over their union.

    out, o (B, S, H, D) fp32 each normalised over its own keys; lse, lse_o (B, S, H) fp32
    their log-sum-exp of scores (-inf where a block had no unmasked key)."""
    new = torch.logaddexp(lse, lse_o)
    safe = torch.where(torch.isfinite(new), new, torch.zeros((), device=new.device))  # no key at all yet
    w, w_o = torch.exp(lse - safe)[..., None], torch.exp(lse_o - safe)[..., None]
    return out * w + o * w_o, new


def offsets(length: int, axis: str = "ring") -> int:
    """The position of this rank's first row in the sequence the ring spans, when every
    rank holds ``length`` rows (the blocks are laid out rank-major)."""
    return axis_index(axis) * length


def ring_attention(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias, axis: str = "ring"):
    """Attention of this rank's queries over the keys of every rank of ``axis``.

    q, k, v (B, L, H, D): this rank's block (every rank the same L); ``key_bias`` (B, L)
    additive (0 keep, -inf drop) or None. ``fn(q, k, v, key_bias, q_start, k_start)`` is
    the block kernel: (out fp32 (B, L, H, D) normalised over the block's keys, lse fp32
    (B, L, H)); ``q_start``, ``k_start`` the positions of the blocks' first rows (for
    position-dependent masks). Returns (B, L, H, D) in q's dtype."""
    n, me = axis_size(axis), axis_index(axis)
    L = k.shape[1]
    if n == 1:
        return fn(q, k, v, key_bias, 0, 0)[0].to(q.dtype)
    if key_bias is not None:
        key_bias = all_gather(key_bias, axis, dim=1)  # (B, n * L): every block's bias
    kv = torch.stack([k, v])  # one pass moves both
    out = lse = None
    for step in range(n):
        # the next block's pass is issued before this block's attention, so a compiled
        # graph (whose waits sit at first use) overlaps the two
        arriving = ppermute(kv, axis, 1) if step < n - 1 else None
        src = (me - step) % n  # whose block this rank holds now
        bias = None if key_bias is None else key_bias[:, src * L : (src + 1) * L]
        o, lse_o = fn(q, kv[0], kv[1], bias, me * q.shape[1], src * L)
        out, lse = (o, lse_o) if out is None else merge(out, lse, o, lse_o)
        kv = arriving
    return out.to(q.dtype)


def sequence_attention(fn, block_fn, q, k, v, key_bias, sp: str = "sp", ring: str = "ring"):
    """Attention over a sequence split over ``sp`` and ``ring`` (ring-major): Ulysses'
    all-to-all over ``sp`` (heads for sequence), then over ``ring`` `ring_attention`
    with ``block_fn``; with no ring, ``fn(q, k, v, key_bias)`` on the whole sequence, as
    before. q, k, v (B, S_local, H, D); key_bias (B, S_local) or None."""
    if axis_size(ring) == 1:
        return ulysses(fn, q, k, v, key_bias, sp)
    return ulysses(lambda q, k, v, b: ring_attention(block_fn, q, k, v, b, ring), q, k, v, key_bias, sp)

"""Memory per rank: the peak over the training steps (CUDA: the caching allocator's
``max_memory_allocated``; CPU: the process's peak resident set, ``VmHWM``, reset at the
start of training where Linux allows it) and the bytes the frozen weights and the LoRA hold
as stored, printed by every rank at the end."""

from __future__ import annotations

import os
import re

import torch
from torch.distributed.tensor import DTensor

import functional_dit as fd
from functional_dit.lora import DEFAULT_TARGETS, linear_modules
from functional_dit.nn.layerwise import skip_by_patterns
from sharding.tree import flatten

MIB = 2**20
FP8_SKIP = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")  # diffusers' layerwise-casting skip list


def _rss() -> int | None:
    """This process's resident set in bytes (Linux), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def _hwm() -> int | None:
    """This process's peak resident set (``VmHWM``) in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            line = next(ln for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def start(device: torch.device) -> int | None:
    """Before the first step: the peak reset (CUDA: the allocator's statistics; CPU: the
    peak resident set, by writing 5 to ``/proc/self/clear_refs``); returns the memory in use
    now (allocated, or resident), which the peak is compared with."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None  # (no reset: the peak since the process started; no baseline)
    return _rss()


def stored_bytes(leaves) -> int:
    """The bytes ``leaves`` hold on this rank: a DTensor's local shard, an fp8-stored leaf's
    storage (``fd.layerwise_cast``), else the tensor's own."""
    total = 0
    for t in leaves:
        t = t.to_local() if isinstance(t, DTensor) else t
        t = getattr(t, "stored", t)
        total += t.nelement() * t.element_size()
    return total


def figures(device: torch.device, base: int | None, params, adapter) -> dict:
    """After the last step: the peak (MiB), its excess over ``base`` (None without one),
    what the frozen weights and the LoRA factors hold on this rank, and what was measured."""
    if device.type == "cuda":
        peak, what = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    else:
        peak, what = _hwm(), "VmHWM, the process's peak resident set"
    out = {"peak_memory_mib": None if peak is None else peak / MIB, "measured": what}
    out["peak_over_start_mib"] = None if peak is None or base is None else (peak - base) / MIB
    out["base_weights_mib"] = stored_bytes(params.leaves()) / MIB
    out["lora_mib"] = stored_bytes(adapter.leaves()) / MIB
    return out


def line(rank: int, f: dict) -> str:
    """The line each rank prints."""
    if f["peak_memory_mib"] is None:
        return f"rank {rank}: peak memory not measured here (no /proc); base weights {f['base_weights_mib']:.2f} MiB"
    over = (
        "" if f["peak_over_start_mib"] is None else f", {f['peak_over_start_mib']:.1f} MiB above the start of training"
    )
    return (
        f"rank {rank}: peak memory {f['peak_memory_mib']:.1f} MiB ({f['measured']}){over}; "
        f"base weights {f['base_weights_mib']:.2f} MiB, LoRA {f['lora_mib']:.2f} MiB as stored"
    )


GIB = 2**30


def computed(preset: str, rank: int = 16, tokens: int = 4096 + 512) -> dict:
    """Computed, not measured: a preset's sizes for training, in GiB (bytes / 2^30) but
    ``params`` (billions): the frozen weights in bf16 and with ``--base-dtype fp8`` (the
    skip list kept in bf16), the default-target LoRA at ``rank`` with its fp32 gradient and
    AdamW moments (4 fp32 copies), and the block inputs that ``--checkpoint-blocks`` keeps
    for one item of ``tokens`` (image + text) in bf16: blocks x tokens x width x 2 bytes,
    a lower bound of the activations (one block's recomputation adds to it; without
    checkpointing each block keeps many times that)."""
    specs = flatten(fd.param_specs(preset))
    skipped = skip_by_patterns(FP8_SKIP)
    numel = {k: s.numel for k, s in specs.items()}
    lora = sum(
        rank * sum(w.shape)
        for m, w in linear_modules(fd.PRESETS[preset]).items()
        if any(m == t or m.endswith("." + t) for t in DEFAULT_TARGETS)
    )
    blocks = {m.group(1) for k in specs if (m := re.match(r"^(.*blocks.*?\.\d+)\.", k))}
    width = next(s.shape[0] for k, s in specs.items() if k.endswith("attn.to_q.weight"))
    return {
        "params": sum(numel.values()) / 1e9,
        "weights_bf16": 2 * sum(numel.values()) / GIB,
        "weights_fp8": sum(n * (2 if skipped(k) else 1) for k, n in numel.items()) / GIB,
        "lora_params": lora / 1e6,
        "lora_and_adamw": 4 * 4 * lora / GIB,
        "block_inputs": len(blocks) * tokens * width * 2 / GIB,
        "blocks": len(blocks),
    }

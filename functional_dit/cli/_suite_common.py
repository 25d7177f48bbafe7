"""What the sections of ``bench --suite gpu`` share (`functional_dit.cli.bench_suite`):
timing on the device, peak memory, the diffusers module with random weights and our
params sharing its storage, and the per-family loop that keeps to the budget."""

from __future__ import annotations

import statistics
import time

import torch

from .. import api as _api
from .. import tiny


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_timed(fn, device) -> tuple:
    """(``fn()``, the seconds it took), the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = fn()
    sync(device)
    return out, time.perf_counter() - start


def timed(fn, device) -> float:
    """Seconds of one call of ``fn`` (`run_timed`)."""
    return run_timed(fn, device)[1]


def alternate(contenders: dict, runs: int, device) -> dict:
    """``{name: median seconds}`` over ``runs`` rounds, each round running every contender
    once in turn (after one warm-up call each), so all see the same load."""
    with torch.no_grad():
        for fn in contenders.values():
            fn()
    times: dict = {name: [] for name in contenders}
    for _ in range(runs):
        for name, fn in contenders.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def peaks(device, **contenders) -> dict:
    """``{"peak_NAME_gib": GiB}``: the peak memory allocated during one call of each
    contender (None off CUDA), and ``held_peak_gib``, the peak before these measurements
    reset the allocator's counter (the section's runner takes the largest, so its
    per-section peak still covers everything)."""
    if torch.device(device).type != "cuda":
        return {f"peak_{name}_gib": None for name in contenders} | {"held_peak_gib": None}
    out, held = {}, 0.0
    for name, fn in contenders.items():
        sync(device)
        held = max(held, torch.cuda.max_memory_allocated() / 2**30)
        torch.cuda.reset_peak_memory_stats()
        timed(fn, device)
        out[f"peak_{name}_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out | {"held_peak_gib": held}


def output(y) -> torch.Tensor:
    """The sample tensor of ``fd.apply``'s result or a diffusers module's output."""
    return y if isinstance(y, torch.Tensor) else y[0]


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (random weights: the output's scale is arbitrary)."""
    a, b = output(a).float(), output(b).float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def stock_module(config, device, dtype, seed: int = 0):
    """diffusers' transformer class for ``config``, built on ``device`` with torch's default
    random init (seeded), then cast to ``dtype``: nothing is downloaded."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    cfg = _api.config_to_diffusers(config)
    cls = getattr(diffusers, cfg.pop("_class_name"))
    torch.manual_seed(seed)
    with torch.device(device):  # drawn there (a released width's billions of weights), tables made there
        module = cls(**{k: v for k, v in cfg.items() if not k.startswith("_")})
        if dtype != torch.float32:
            module = module.to(dtype)
            tiny.fix_buffers(module, dtype)
    return module.eval().requires_grad_(False)


def models(config, device, dtype):
    """(the diffusers module, our params sharing its storage: ``fd.from_diffusers``), so
    both sides compute with the same weights and hold one copy of them."""
    module = stock_module(config, device, dtype)
    return module, _api.from_diffusers(module)


def describe(config) -> str:
    """``2+4 blocks, 24x128`` (double + single blocks, heads x head dim)."""
    blocks = "+".join(str(getattr(config, k)) for k in ("num_layers", "num_single_layers") if hasattr(config, k))
    return f"{blocks} blocks, {config.num_attention_heads}x{config.attention_head_dim}"


def error_line(e: BaseException) -> str:
    first = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {first}"


def each(names, window, need: float, body, key: str = "family"):
    """``body(name)`` (a row dict) for each name while ``window`` has room for one more —
    ``need`` seconds at first, then as long as the last one took; a name without room gets
    a row saying so (``{key: name, "skipped": why}``), one whose body raised a row with
    the error."""
    for name in names:
        if not window.room(need):
            yield {key: name, "skipped": f"needs ~{need:.0f} s, {max(window.left(), 0):.0f} s left"}
            continue
        start = time.perf_counter()
        try:
            row = body(name)
        except Exception as e:  # noqa: BLE001 - reported in its row (an OOM, a refusal), the suite goes on
            row = {key: name, "error": error_line(e)}
        need = time.perf_counter() - start
        yield row

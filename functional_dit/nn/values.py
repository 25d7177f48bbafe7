"""Checks of input *values* in eager mode: ``t`` in [0, 1] and finite inputs.

The shape/dtype checks (`_checks`) are free under tracing; these read tensor values, so
they cost a host sync. They run only on plain CPU/CUDA tensors outside any tracing:
never under ``torch.compile``, ``torch.export``, torch.func transforms or on XLA
devices (Neuron, TPU), where a sync would split or stall the graph. The weights are
not checked (one pass over every parameter per call). See docs/numerics.md.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_SKIPPED = contextvars.ContextVar("fd_values_skipped", default=False)


@contextlib.contextmanager
def skipped():
    """No value checks inside, as on XLA devices: the strict device loop
    (`functional_dit.pipelines.sampler_xla`) runs this way on the CPU to see the XLA path's syncs."""
    token = _SKIPPED.set(True)
    try:
        yield
    finally:
        _SKIPPED.reset(token)


def _eager(tensors) -> bool:
    """True when every tensor is a plain CPU/CUDA tensor and nothing is being traced."""
    if torch.compiler.is_compiling() or _SKIPPED.get():
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    tensors = list(tensors)
    plain = all(type(t) is torch.Tensor and t.device.type in ("cpu", "cuda") and not wrapped(t) for t in tensors)
    return plain and len({t.device for t in tensors}) == 1  # else the device check will refuse them


def check_values(t, **inputs) -> None:
    """``t`` within [0, 1] (what diffusers pipelines pass: scheduler timesteps / 1000) and
    ``t`` and every input tensor finite; one host sync. A ValueError names the input."""
    named = {"t": t, **{k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}}
    if not _eager(named.values()):
        return
    with torch.no_grad():
        flags = [torch.isfinite(v).all() for v in named.values()]
        tf = t.detach().float()
        lo_hi = torch.stack([tf.min(), tf.max()]) if t.numel() else torch.zeros(2)
        *finite, lo, hi = torch.stack([*[f.float() for f in flags], *lo_hi.to(t.device)]).tolist()
    for name, ok in zip(named, finite):
        if not ok:
            raise ValueError(f"{name}: expected finite values, got NaN or inf")
    if lo < 0 or hi > 1:
        raise ValueError(
            f"t: expected timesteps in [0, 1] (sigmas: a scheduler's timesteps / 1000, as diffusers pipelines "
            f"pass them), got values in [{lo:g}, {hi:g}]"
        )

"""The denoising loop for lazy devices (torch_xla: TPU, Neuron, its CPU device): one
graph per step, the same graph at every step.

`fd.sample`'s usual loop indexes the scheduler's sigmas with a Python step counter and
lets the lazy graph grow over the whole loop, so on torch_xla every step count is a new
program. Here the schedule is computed on the host before the loop — each step's model
timestep ``t`` (B,) and Euler increment ``dt`` (a 0-d tensor, as the scheduler's
``sigma_next - sigma``), and a family's extra per-step inputs (FLUX.3's flow-map target
timestep, `Steps.step_inputs`) — and moved to the device once; a step is then a pure function of
device data (`step`: the model call, CFG, the Euler update of
``FlowMatchEulerDiscreteScheduler.step``), cut off by ``torch_xla.sync()``. Changing the
seed, the step count or the sigmas changes only data, never the graph. On the CPU the
same loop gives the scheduler's results bit for bit.

`NoHostSync` makes any device-to-host read inside a step (``.item()``, ``.tolist()``,
``bool(t)``, ``float(t)``, ``.numpy()``, ``.cpu()``) raise; the loop runs under it with
``static(strict=True)``. docs/xla.md says what was verified where.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os

import torch
from torch.overrides import TorchFunctionMode

from .. import families as _families
from ..nn import scan as _scan
from ..nn import values as _values
from . import schedule as _schedule
from .families import Steps, combine

_FORCED: contextvars.ContextVar = contextvars.ContextVar("fd_static_loop", default=None)


@dataclasses.dataclass
class Options:
    """How `static` runs the loop: ``strict`` raises on host reads inside a step;
    ``record`` (a list) gets one dict per loop: steps, and on torch_xla the compiles,
    executions and device-to-host transfers inside the loop. ``scan``: each segment of
    blocks as one scan over its weights stacked once before the loop (`nn.scan`); None:
    as the ``FD_XLA_SCAN_BLOCKS`` environment variable says (``1``: on)."""

    strict: bool = False
    record: list | None = None
    scan: bool | None = None


@contextlib.contextmanager
def static(strict: bool = False, record: list | None = None, scan: bool | None = None):
    """Run `fd.sample`'s supported loops as `denoise` on any device (on torch_xla it is
    always used), optionally ``strict``, recording per-loop counters, and with scanned
    block segments."""
    if scan not in (None, True, False):
        raise ValueError(f"scan: expected True, False or None, got {scan!r}")
    token = _FORCED.set(Options(strict, record, scan))
    try:
        yield
    finally:
        _FORCED.reset(token)


def wanted(model, job, pipe, device) -> bool:
    """Whether `fd.sample` runs this chunk through `denoise`: on a lazy (xla) device or
    under `static`, for the families whose step is a fixed graph. Step caches decide on
    the host and a stochastic scheduler draws noise: those keep the usual loop."""
    if torch.device(device).type != "xla" and _FORCED.get() is None:
        return False
    fixed = model.fixed_graph
    stochastic = pipe.scheduler.config.get("stochastic_sampling", False)
    # an inpainting blend runs on the device when the model gives it as data (`blend_parts`)
    blends = model.blends_steps and type(model).blend_parts is Steps.blend_parts
    return fixed and job.cache is None and not stochastic and not blends


def euler(x: torch.Tensor, pred: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """``FlowMatchEulerDiscreteScheduler.step``: ``x + dt · pred`` in fp32, returned in
    the prediction's dtype (``dt`` 0-d fp32, so it does not widen a bf16 ``pred``)."""
    return (x.to(torch.float32) + dt * pred).to(pred.dtype)


def step(model, x, t, dt, cond, cfg: float | None, normalise: bool, extra: dict | None = None) -> torch.Tensor:
    """One sampler step on device data: the model call ([cond; uncond] as one batch with
    CFG; ``extra`` its per-step keywords, `extras`), the guidance combination and the
    Euler update. x (B, S, C), t (B or 2B,). ``model`` is any callable ``(x, t, cond,
    **extra) -> velocity``."""
    xin = torch.cat([x, x]) if cfg is not None else x
    pred = model(xin, t, cond, **(extra or {}))
    if cfg is not None:
        pred = combine(pred, cfg, normalise)
    return euler(x, pred, dt)


def carried(model, x, t, dt, cond, cfg: float | None, normalise: bool, extra: dict | None = None) -> tuple:
    """`step` that also returns the model after its call (``model.call``: a KV cache the
    first step extracted kept for the next, `sampler._state.Bound`)."""
    xin = torch.cat([x, x]) if cfg is not None else x
    pred, model = model.call(xin, t, cond, **(extra or {}))
    if cfg is not None:
        pred = combine(pred, cfg, normalise)
    return euler(x, pred, dt), model


def plan(sched, batch: int, dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's (t, dt), computed on the host from the scheduler's CPU timesteps and
    sigmas exactly as the usual loop computes them, then moved to ``device`` once. A cut
    schedule (img2img, inpainting) steps from ``sigmas[begin_index]`` on, as
    ``sched.step`` does."""
    ts, sigmas, b = sched.timesteps, sched.sigmas, sched.begin_index or 0
    if ts.device.type != "cpu" or sigmas.device.type != "cpu":
        raise ValueError(f"sched: expected the schedule on the cpu, got {ts.device} and {sigmas.device}")
    out = []
    for i in range(len(ts)):
        t = ts[i].expand(batch).to(dtype) / 1000
        out.append((t.to(device), (sigmas[b + i + 1] - sigmas[b + i]).to(device)))
    return out


def extras(model, sched, batch: int, dtype, device) -> list[dict]:
    """Every step's extra model inputs (`Steps.step_inputs`), computed on the host from the
    CPU schedule and moved to ``device`` once, with `plan`."""
    return [{k: v.to(device) for k, v in e.items()} for e in model.step_inputs(sched, batch, dtype)]


def _sync(device):
    """``torch_xla.sync`` on xla (cuts the lazy graph here), nothing elsewhere."""
    if torch.device(device).type != "xla":
        return lambda: None
    # optional: torch_xla, XLA devices only
    import torch_xla

    return torch_xla.sync


def denoise(model, sched, x, cond, cfg: float | None, normalise: bool, callback):
    """`fd.sample`'s steps of one item (`sampler._state.step`) as fixed device steps:
    ``model`` the item's (`sampler._state.bound`: its steps, params, tables and batch
    ``apply``), ``sched`` a copy of its scheduler.
    ``callback(i, t, x)`` gets the host timestep."""
    opts = _FORCED.get() or Options()
    batch = x.shape[0] * (1 if cfg is None else 2)
    steps = plan(sched, batch, x.dtype, x.device)
    more = extras(model, sched, batch, x.dtype, x.device)
    parts = model.blend_parts()
    blends = [None] * len(steps) if parts is None else [s.to(x.device) for s in _schedule.blend_plan(sched, x.dtype)]
    sync = _sync(x.device)
    with _scanned(model, opts, x.device) as segments:
        sync()  # inputs, RoPE tables, references, schedule and stacked blocks become device data first
        counters = _Counters(x.device, opts.record, segments)
        for i, ((t, dt), extra, mix) in enumerate(zip(steps, more, blends)):
            with _strict() if opts.strict else contextlib.nullcontext():
                x, model = carried(model, x, t, dt, cond, cfg, normalise, extra)
                x = x if mix is None else _schedule.blend_at(x, mix, *parts)
                sync()
            _advance(sched, i)
            if callback is not None:
                x = callback(i, sched.timesteps[i], x)
        counters.done(len(steps))
    return x


def _advance(sched, i: int) -> None:
    """The scheduler's step index as ``sched.step`` leaves it after step ``i``, for hooks
    that read it (``scale_noise`` in a callback's blend, ``callback_on_step_end``)."""
    sched._step_index = (sched.begin_index or 0) + i + 1


def scanning(opts: Options) -> bool:
    """Whether the loop scans the block segments: ``opts.scan``, else ``FD_XLA_SCAN_BLOCKS``."""
    if opts.scan is not None:
        return opts.scan
    value = os.environ.get("FD_XLA_SCAN_BLOCKS", "0")
    if value not in ("0", "1"):
        raise ValueError(f"FD_XLA_SCAN_BLOCKS: expected 0 or 1, got {value!r}")
    return value == "1"


def _scanned(model, opts: Options, device):
    """`nn.scan.stacked` over the model's params for the segments its family scans, with
    torch_xla's scan on xla (the eager `nn.scan.eager_scan` elsewhere); else nothing.
    FLUX.2's reference KV cache keeps the block loop (its blocks read and write per-block KV)."""
    params = getattr(model, "params", None)
    use = params is not None and not getattr(model, "kv", None) and scanning(opts)
    names = getattr(_families.of(params), "SCANNED", ()) if use else ()
    if not names:
        return contextlib.nullcontext({})
    if torch.device(device).type != "xla":
        return _scan.stacked(params, names, _scan.eager_scan)
    # optional: torch_xla, XLA devices only
    from torch_xla.experimental.scan import scan

    return _scan.stacked(params, names, functools.partial(scan, is_fn_pure=True))


@contextlib.contextmanager
def _strict():
    """`NoHostSync`, with the eager value checks off as they are on XLA (`_values`)."""
    with _values.skipped(), NoHostSync():
        yield


class _Counters:
    """torch_xla's compile / execute / transfer-to-host counts over one loop, appended to
    ``record`` (nothing is recorded without it)."""

    NAMES = {"compiles": "CompileTime", "executions": "ExecuteTime", "transfers": "TransferFromDeviceTime"}

    def __init__(self, device, record, segments=()):
        self.record, self.met, self.scanned = record, None, sorted(segments)
        if record is not None and torch.device(device).type == "xla":
            # optional: torch_xla, XLA devices only
            import torch_xla.debug.metrics as met

            self.met = met
        self.start = self._read()

    def _read(self) -> dict:
        if self.met is None:
            return {}
        # optional: torch_xla, XLA devices only
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()  # executions are counted when they finish
        data = {k: self.met.metric_data(v) for k, v in self.NAMES.items()}
        return {k: 0 if v is None else v[0] for k, v in data.items()}

    def done(self, steps: int) -> None:
        if self.record is not None:
            end = self._read()
            scanned = dict(scanned=self.scanned) if self.scanned else {}
            self.record.append(dict(steps=steps, **scanned, **{k: end[k] - self.start[k] for k in end}))


class HostSyncError(RuntimeError):
    """A tensor was read on the host inside a step that must stay on the device."""


_HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__array__,
}


class NoHostSync(TorchFunctionMode):
    """Raises `HostSyncError` on every read of tensor data by the host (``.item()``,
    ``.tolist()``, ``bool``/``float``/``int`` of a tensor, ``.numpy()``) and on copies
    from a non-CPU device to the CPU: each is a device-to-host round trip on a lazy
    device. Works on the CPU too, where no such read costs anything."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS or _to_host(func, args, kwargs):
            name = getattr(func, "__name__", str(func))
            raise HostSyncError(f"{name}: a host read of tensor data inside the device loop")
        return func(*args, **kwargs)


def _to_host(func, args, kwargs) -> bool:
    """``x.cpu()`` / ``x.to("cpu")`` of a tensor that is not on the CPU."""
    if func not in (torch.Tensor.cpu, torch.Tensor.to) or not args or not isinstance(args[0], torch.Tensor):
        return False
    if args[0].device.type == "cpu":
        return False
    if func is torch.Tensor.cpu:
        return True
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"

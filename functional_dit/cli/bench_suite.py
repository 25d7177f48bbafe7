"""``python -m functional_dit bench --suite gpu --out FILE``: a GPU's whole picture in one
command, side by side with diffusers in the same run, within a time budget.

Sections, in order (each with its share of the budget; a section or a family is skipped
with a printed reason when what is left is too small, and a section that runs past its
share is stopped, so the command always finishes and writes its report):

- ``forward``: eager ``fd.apply`` (on ``fd.prepare``d params) vs the diffusers module;
- ``compiled``: ``torch.compile`` of both, first call (compile) and steady state;
- ``fp8``: ours compiled on ``fd.quantize(params, "fp8-row")`` vs ours compiled in bf16;
- ``sample``: a 28-step ``fd.sample`` vs the stock pipeline, without and with a step cache;
- ``serve``: the server's engine in-process (continuous batching, and batching off) at
  concurrency 1 / 4 / 16 vs the stock pipeline one image at a time;

and peak memory (``torch.cuda.max_memory_allocated``) per section. On a GPU: the released
models' transformer widths at reduced depth (`plan`), bf16, a 1024² image; on a CPU the
same sections on the tiny presets and 64² images, in about a minute (what the tests run).
The sections are `functional_dit.cli._suite_forward` and `functional_dit.cli._suite_pipes`,
the report `functional_dit.cli._suite_report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import signal
import sys
import threading
import time

import torch

from .. import api as _api
from .. import families
from ..pipelines import cache
from ..pipelines.families import product as _product
from . import _quiet, _suite_forward, _suite_pipes, _suite_report
from ._suite_common import error_line

GPU_BUDGET_S = 450.0  # the whole command, start-up included, stays under 8 minutes
CPU_BUDGET_S = 55.0  # about a minute with start-up
# Each section's share of the budget (what one leaves passes to the next); 0.06 is left for the report.
GPU_SHARES = {"forward": 0.10, "compiled": 0.40, "fp8": 0.18, "sample": 0.12, "serve": 0.14}  # compiles dominate
CPU_SHARES = {"forward": 0.20, "compiled": 0.12, "fp8": 0.12, "sample": 0.22, "serve": 0.28}  # no compile
SECTIONS = {  # name -> (the section's rows generator, its title)
    "forward": (_suite_forward.forward, "Forward, eager"),
    "compiled": (_suite_forward.compiled, "Forward, torch.compile"),
    "fp8": (_suite_forward.fp8, "fp8-row compute, compiled, vs bf16 compiled"),
    "sample": (_suite_pipes.sample, "Sampling: fd.sample vs the stock pipeline, without and with a step cache"),
    "serve": (_suite_pipes.serve, "Serving: the server's engine vs the stock pipeline one image at a time"),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the suite measures on this device (`plan`)."""

    device: str
    dtype: torch.dtype
    budget: float
    configs: dict  # family key -> the transformer config of the forward sections
    hw: tuple  # latent tokens (h, w) of the forward sections
    txt_len: int  # text tokens of the forward sections
    runs: int  # alternating rounds per timed figure (median)
    backend: str | None  # torch.compile's backend; None: eager in its place
    compiled: tuple  # families compiled (and run in fp8)
    sample: tuple  # families sampled (those with a step-cache bench run)
    steps: int
    size: int  # image side in pixels, sample and serve
    cache: str  # the step cache of the sample section (a spec, as generate's --cache)
    serve: str | None  # the family served (one with a tiny pipeline)
    concurrency: tuple = (1, 4, 16)
    need: dict = dataclasses.field(default_factory=dict)  # section -> seconds one family needs, at least
    shares: dict = dataclasses.field(default_factory=lambda: dict(GPU_SHARES))  # section -> share of the budget

    @property
    def gpu(self) -> bool:
        return torch.device(self.device).type == "cuda"


def released_shape(key: str):
    """A released model's transformer at reduced depth: its preset (`fd.PRESETS`: width,
    heads x head dim, MLP ratio, RoPE) with the block counts of the family's mid config
    (the bench's; a released FLUX.2-dev or Qwen-Image forward does not fit beside diffusers)."""
    product = _product(key)
    preset, mid = _api.PRESETS[product.RELEASED], product.MID_CONFIG
    depth = {k: getattr(mid, k) for k in ("num_layers", "num_single_layers") if hasattr(preset, k)}
    return dataclasses.replace(preset, **depth)


def _tiny_configs() -> dict:
    return {fam.KEY: families.tiny_config(fam) for fam in families.FAMILIES}


DEFAULT_CACHE = "taylorseer:interval=2,warmup=2,order=1"  # skips every other step, whatever the weights


def plan(device: str, budget: float | None, names: list[str], cache=None, backend: str | None = None) -> Plan:
    """The GPU plan (released widths, bf16, 1024², 28 steps, inductor) or the CPU plan (the
    tiny presets, fp32, 64², 4 steps, no compile: eager in its place, unless ``backend``
    names one, and then for the first family only)."""
    gpu = torch.device(device).type == "cuda"
    configs = {k: released_shape(k) if gpu else _tiny_configs()[k] for k in names}  # in --families' order
    sampled = tuple(k for k in _suite_pipes.sampled_families() if k in names)
    backend = backend or ("inductor" if gpu else "none")
    common = dict(device=device, configs=configs, sample=sampled, cache=cache or DEFAULT_CACHE,
                  serve=next(iter(sampled), None),  # the first sampled family (FLUX.1 in the bench's order)
                  backend=None if backend == "none" else backend)  # fmt: skip
    if gpu:
        need = dict(forward=10, compiled=60, fp8=40, sample=25, serve=40)
        return Plan(dtype=torch.bfloat16, budget=budget or GPU_BUDGET_S, hw=(64, 64), txt_len=512, runs=5,
                    compiled=tuple(configs), steps=28, size=1024, need=need, **common)  # fmt: skip
    compiled = tuple(configs) if common["backend"] is None else tuple(configs)[:1]
    need = dict(forward=0.5, compiled=0.5 if common["backend"] is None else 4, fp8=0.5, sample=1, serve=3)
    return Plan(dtype=torch.float32, budget=budget or CPU_BUDGET_S, hw=(8, 8), txt_len=16, runs=3,
                compiled=compiled, steps=4, size=64, need=need, shares=CPU_SHARES, **common)  # fmt: skip


# ----------------------------------------------------------------------------- the budget


class OutOfTime(BaseException):
    """A section ran past its share of the budget (raised in the main thread by `_alarm`);
    a BaseException, so no ``except Exception`` on the way swallows it."""


@dataclasses.dataclass(frozen=True)
class Window:
    """Until when a section may run (``end``, `time.perf_counter` seconds)."""

    end: float

    def left(self) -> float:
        return self.end - time.perf_counter()

    def room(self, need: float) -> bool:
        return self.left() >= need


@contextlib.contextmanager
def _alarm(seconds: float):
    """Raise `OutOfTime` in the main thread after ``seconds`` (a no-op off the main thread
    or without ``signal.setitimer``)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def ring(signum, frame):
        raise OutOfTime()

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def windows(start: float, budget: float, shares: dict) -> dict:
    """Each section's end: its share added to the previous ones' (time a section leaves
    unused passes to the next)."""
    out, total = {}, 0.0
    for name in SECTIONS:
        total += shares[name]
        out[name] = Window(start + budget * total)
    return out


# ----------------------------------------------------------------------------- running


def _clean(device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device, rows: list[dict]) -> float | None:
    """The section's peak: the allocator's since the section began, or since the last reset
    by a row's own measurement (`_suite_common.peaks`), whichever is larger."""
    if torch.device(device).type != "cuda":
        return None
    held = [r["held_peak_gib"] for r in rows if r.get("held_peak_gib") is not None]
    return max([torch.cuda.max_memory_allocated() / 2**30, *held])


def _say(t0: float, name: str, what: str) -> None:
    print(f"[{time.perf_counter() - t0:6.1f} s] {name}: {what}", flush=True)


def _rows(name: str, p: Plan, window: Window, t0: float) -> tuple[list, str | None]:
    """(section ``name``'s rows as they came, why it stopped early or None): its share ran
    out, or it failed before its first family."""
    rows, stopped = [], None
    try:
        with _alarm(window.left()):
            for row in SECTIONS[name][0](p, window):
                rows.append(row)
                _say(t0, name, _suite_report.progress(row))
    except OutOfTime:
        stopped = f"its share of the budget ran out after {len(rows)} row(s)"
    except Exception as e:  # noqa: BLE001 - a section that cannot start (an OOM) is reported, the rest run
        stopped = f"failed: {error_line(e)}"
    if stopped:
        _say(t0, name, f"stopped ({stopped})")
    return rows, stopped


def run_section(name: str, p: Plan, window: Window, t0: float) -> dict:
    """One section's record: its rows (families), or why it was skipped or stopped, its
    seconds and its peak memory."""
    out = dict(name=name, title=SECTIONS[name][1], rows=[], skipped=None, stopped=None, seconds=0.0, peak_gib=None)
    if not window.room(p.need[name]):
        out["skipped"] = f"needs at least {p.need[name]:.0f} s, {max(window.left(), 0):.0f} s left of its share"
        _say(t0, name, f"skipped ({out['skipped']})")
        return out
    _say(t0, name, f"started ({window.left():.0f} s of the budget for it)")
    _clean(p.device)
    start = time.perf_counter()
    out["rows"], out["stopped"] = _rows(name, p, window, t0)
    out["seconds"], out["peak_gib"] = time.perf_counter() - start, _peak_gib(p.device, out["rows"])
    _clean(p.device)
    _say(t0, name, f"done in {out['seconds']:.1f} s")
    return out


def _cache_spec(specs) -> str | None:
    """The sample section's one step cache (``--cache``), checked as fd.sample parses it."""
    if not specs:
        return None
    if len(specs) > 1:
        raise ValueError(f"--cache: the suite takes one step-cache spec, got {len(specs)}: {specs}")
    try:
        cache.parse(specs[0])
    except ValueError as e:
        raise ValueError(f"--cache: {str(e).removeprefix('cache: ')}") from None
    return specs[0]


def _process_start() -> float:
    """The `time.perf_counter` reading at this process's start (Linux's /proc; elsewhere now)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = float(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.perf_counter()
    return time.perf_counter() - max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def _device(args) -> str:
    """``--device`` where given on the command line, else CUDA where there is one."""
    given = any(a == "--device" or a.startswith("--device=") for a in getattr(args, "argv", []))
    return args.device if given or not torch.cuda.is_available() else "cuda"


def _check(args) -> list[str]:
    """The flags the suite reads, checked before anything loads; returns the families."""
    if args.suite != "gpu":
        raise ValueError(f"--suite: expected 'gpu', got {args.suite!r}")
    if args.compile_backend is not None and args.no_compile:
        raise ValueError(f"--compile-backend: expected none with --no-compile, got {args.compile_backend!r}")
    if args.budget is not None and not args.budget > 0:
        raise ValueError(f"--budget: expected a positive number of seconds, got {args.budget}")
    names = [n for n in args.families.split(",") if n]
    unknown = sorted(set(names) - set(_tiny_configs()))
    if unknown or not names:
        raise ValueError(f"--families: expected a subset of {sorted(_tiny_configs())}, got {unknown or names}")
    return names


def run(args) -> int:
    """``bench --suite gpu``: every section in turn, then the report (``--out``)."""
    t0 = time.perf_counter()
    names = _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = "none" if args.no_compile else args.compile_backend
    p = plan(_device(args), args.budget, names, _cache_spec(args.cache), backend)
    started = datetime.datetime.now(datetime.timezone.utc)
    ends = windows(t0, p.budget - (t0 - _process_start()), p.shares)  # start-up counts: the command stays within it
    with _quiet.loading():  # the libraries' notices and loading bars, not the suite's progress
        results = [run_section(name, p, ends[name], t0) for name in SECTIONS]
    command = "python -m functional_dit " + " ".join(getattr(args, "argv", sys.argv[1:]))
    text = _suite_report.markdown(p, results, command, started, time.perf_counter() - _process_start())
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        _say(t0, "report", f"wrote {args.out}")
    else:
        print(text)
    return 0

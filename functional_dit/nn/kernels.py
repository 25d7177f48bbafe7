"""Kernel selection by measurement: which of an op's kernels `fd.prepare`'d params run.

Every fast eager kernel (`_layers`) has an exact twin computing the same maths (see
docs/architecture.md, Fast eager kernels). Which is faster depends on the machine: a
GEMM with a fused GELU epilogue, a three-pass RMS norm or two GEMMs in place of one win
on one CPU and lose on another. Under ``kernels="auto"`` (`fd.prepare`'s default) the
first call of an op at a new (device kind, dtype, shapes) times its kernels there, on the
very arguments, in a short alternating micro-benchmark, and every later call with that
key runs the winner. ``"fast"`` and ``"exact"`` pin the choice without measuring.

A fast kernel must beat the exact one by `MARGIN` to be chosen: a tie goes to the exact
kernel (bitwise equal to diffusers). The choices live for the process
(`kernel_choices` lists them, with their timings); with ``FUNCTIONAL_DIT_KERNEL_CACHE``
set to a file path the timings are also kept there, keyed by the machine (CPU or GPU
model, torch version, thread count), and read back by later processes.

Ranks of one mesh must run the same kernels (replicated activations are computed on every
rank, and a different rounding order would break bitwise-identical outputs across ranks).
Under a bound mesh of more than one rank, each rank times its kernels, the timings are
summed over the whole mesh (one all-reduce per mesh axis) and every rank picks from the
same sums, so all pick alike. This holds because the ranks of a mesh run the same calls
in the same order (which their collectives already require), so they meet a new key at
the same op together; keys that differ between ranks make every rank run the exact
kernel.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
import zlib
from collections.abc import Callable

import torch

import sharding

MODES = ("auto", "fast", "exact")
MARGIN = 0.03  # a fast kernel must be this much faster than the exact one to be chosen
ROUNDS = 7  # alternating rounds per measurement
MIN_SAMPLE_S = 1e-3  # each sample repeats the kernel until it lasts at least this long
MAX_REPS = 50
CACHE_ENV = "FUNCTIONAL_DIT_KERNEL_CACHE"

_CHOICES: dict = {}  # key -> {"op", "key", "choice", "times", "why"}
_clock = time.perf_counter  # the clock kernels are timed by (tests give one a kernel can slow down)


def check_mode(kernels) -> str:
    """``kernels`` if it names a mode, else a ValueError naming the argument."""
    if kernels not in MODES:
        raise ValueError(f"kernels: expected one of {list(MODES)}, got {kernels!r}")
    return kernels


# ----------------------------------------------------------------------------- keys


def _sig(a):
    """A hashable summary of one argument: shapes, strides and dtypes of its tensors."""
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.stride(), a.dtype)
    if isinstance(a, dict):
        return tuple((k, _sig(v)) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return tuple(_sig(v) for v in a)
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    return type(a).__name__


def _first_tensor(args) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (dict, list, tuple)):
            t = _first_tensor(a.values() if isinstance(a, dict) else a)
            if t is not None:
                return t
    return None


def _mesh_key():
    """The bound mesh's layout (names, sizes) when it has more than one rank, else None."""
    mesh = sharding.current_mesh()
    if mesh is None or mesh.size() == 1:
        return None
    return tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape)


def key(op: str, args) -> tuple:
    """The key a choice is cached under: the op, the device kind, the arguments' shapes
    (dtypes, strides), the thread count and, under a mesh of several ranks, its layout."""
    t = _first_tensor(args)
    device = "none" if t is None else t.device.type
    return (op, device, _sig(args), torch.get_num_threads(), _mesh_key())


# ----------------------------------------------------------------------------- timing


def _sync(t: torch.Tensor | None) -> None:
    if t is not None and t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


def _sample(fn: Callable, args, reps: int, probe) -> float:
    _sync(probe)
    start = _clock()
    for _ in range(reps):
        fn(*args)
    _sync(probe)
    return (_clock() - start) / reps


def measure(variants: dict, args, rounds: int = ROUNDS) -> dict:
    """``{name: seconds per call}`` of each kernel on ``args``: two warm-up calls each (the
    first may measure nested ops), then ``rounds`` alternating rounds, each sample repeated
    to `MIN_SAMPLE_S`; the fastest sample per kernel (on a shared machine other work only
    ever adds time, so the minimum is the least noisy estimate of a kernel's own cost)."""
    probe = _first_tensor(args)
    with torch.no_grad():
        for fn in variants.values():
            _sample(fn, args, 1, probe)
        second = {name: _sample(fn, args, 1, probe) for name, fn in variants.items()}
        reps = {name: max(1, min(MAX_REPS, int(MIN_SAMPLE_S / max(s, 1e-9)))) for name, s in second.items()}
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                times[name].append(_sample(fn, args, reps[name], probe))
    return {name: min(ts) for name, ts in times.items()}


def decide(times: dict, margin: float = MARGIN) -> str:
    """The exact kernel unless a fast one is faster by ``margin``; then the fastest."""
    best = min((n for n in times if n != "exact"), key=times.__getitem__, default="exact")
    return best if times[best] < times["exact"] * (1 - margin) else "exact"


# ----------------------------------------------------------------------------- ranks


def _agree(k: tuple, times: dict) -> tuple[dict, bool]:
    """Under a mesh of several ranks: (the timings summed over the mesh, whether every
    rank measured the same key). One sum and one max all-reduce per mesh axis."""
    import torch.distributed as dist

    mesh = sharding.current_mesh()
    names = list(times)
    h = float(zlib.crc32(repr(k[:4]).encode()))
    sums = torch.tensor([times[n] for n in names], dtype=torch.float64)
    keys = torch.tensor([h, -h], dtype=torch.float64)
    for dim, axis in enumerate(mesh.mesh_dim_names or ()):
        if mesh.size(dim) > 1:
            dist.all_reduce(sums, group=mesh.get_group(axis))
            dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=mesh.get_group(axis))
    return dict(zip(names, sums.tolist())), bool(keys[0] == -keys[1])


# ----------------------------------------------------------------------------- disk cache


def machine_id() -> str:
    """The CPU model (and GPU model when CUDA is available), torch version, threads."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    gpu = f" | {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}{gpu} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def _disk_key(k: tuple) -> str:
    return f"{machine_id()} | {k[0]} | {k[1]} | {k[2]!r}"


def _disk_read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _disk_write(path: str, entry_key: str, times: dict) -> None:
    """Add one entry to the JSON cache at ``path``: written to a temporary file in the same
    folder and renamed over the old one (atomic: readers see the old or the new file)."""
    data = _disk_read(path)
    data[entry_key] = times
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".kernels-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _local_times(k: tuple, variants: dict, args) -> tuple[dict, str]:
    """This process's timings for key ``k``: from the disk cache if it holds them, else
    measured now (and stored there when the cache is on)."""
    path = os.environ.get(CACHE_ENV)
    entry = _disk_key(k) if path else None
    if path:
        times = _disk_read(path).get(entry)
        if isinstance(times, dict) and set(times) == set(variants):
            return times, "disk cache"
    times = measure(variants, args)
    if path:
        _disk_write(path, entry, times)
    return times, "measured"


# ----------------------------------------------------------------------------- choice


def choose(op: str, variants: dict, args, mode: str) -> str:
    """The kernel of ``variants`` (``{"exact": fn, fast name: fn, ...}``, exact first) that
    op ``op`` runs on ``args`` under ``mode``; measured once per key under "auto"."""
    if mode != "auto":
        return "exact" if mode == "exact" else next(n for n in variants if n != "exact")
    k = key(op, args)
    hit = _CHOICES.get(k)
    if hit is not None:
        return hit["choice"]
    times, why = _local_times(k, variants, args)
    same = True
    if k[4] is not None:
        times, same = _agree(k, times)
        why += ", summed over the mesh's ranks"
    choice = decide(times) if same else "exact"
    _CHOICES[k] = dict(op=op, key=k, choice=choice, times=times, why=why if same else "ranks disagree on the key")
    return choice


def run(op: str, variants: dict, mode: str, *args):
    """``variants[choose(...)](*args)``: op ``op`` with the kernel chosen under ``mode``."""
    return variants[choose(op, variants, args, mode)](*args)


def kernel_choices() -> list[dict]:
    """Every choice made under ``kernels="auto"`` in this process: per op and key (device
    kind, argument shapes, threads, mesh), the kernel chosen, each kernel's measured
    seconds per call and why (measured here, read from the disk cache, summed over ranks)."""
    return [dict(v) for v in _CHOICES.values()]


def clear() -> None:
    """Forget the choices made in this process (the disk cache stays)."""
    _CHOICES.clear()

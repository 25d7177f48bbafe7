"""Which kernel each replaceable op runs: the one place the fast eager kernels are chosen.

An op of `layers` marked ``@replaceable(fast.op)`` runs its exact maths (the code a reader
sees) unless all of these hold, then its fast twin in `fast` (same maths, another rounding
order; see docs/architecture.md, Fast eager kernels):

- The fast kernels are on (`fast_kernels`). `fd.apply` turns them on only for
  `fd.prepare`'d params, with no input needing autograd and none inside a ``torch.func``
  transform (`fused.active`): the fast kernels work in place and call backend ops that
  have no derivative or batching rules.
- Not under ``torch.compile`` or ``torch.export`` (``torch.compiler.is_compiling``):
  compiled code fuses the exact maths itself, and in-place ops on graph inputs break
  tracing.
- The op's own condition in `WHEN`: no LoRA factors on the layer (their updates are per
  layer, the fast kernels see only the base weight) and no fp8 weight (`quant`: its
  scaled GEMM is the exact op's); the RMS norm's three-pass kernel
  on a CPU only (a GPU's fused kernel is faster; docs/notes.md).
- A projection group runs as one GEMM only where `fd.prepare` laid its weights out as one
  buffer, read off their storage on every call (`fused.fused`), so a layout can never
  be stale.

Among an op's kernels (``{"exact": fn, fast name: fn, ...}``, in `fast`) `CANDIDATES` drops
those that cannot run on the arguments at hand: oneDNN's GELU epilogue needs a CPU, fp32
and a torch built with it; the three-pass RMS norm is for a CPU, torch's fused one for
other devices. (The complex-product RoPE checks its own layout: where x's pairs are not
complex numbers in memory it runs the real product.)
Which of the rest runs is then `choose`'s: ``"fast"`` the first fast one, ``"exact"`` the
exact one, ``"auto"`` (`fd.prepare`'s default) the one measured faster here.

Measurement: the first call of an op at a new (device kind, dtype, shapes) times its
kernels there, on the very arguments, in a short alternating micro-benchmark, and every
later call with that key runs the winner. A fast kernel must beat the exact one by
`MARGIN` to be chosen: a tie goes to the exact kernel (bitwise equal to diffusers). The
choices live for the process (`kernel_choices` lists them, with their timings); with
``FUNCTIONAL_DIT_KERNEL_CACHE`` set to a file path the timings are also kept there, keyed
by the machine (CPU or GPU model, torch version, thread count), and read back by later
processes.

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
import contextvars
import functools
import json
import os
import platform
import tempfile
import time
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

import sharding

from . import quant

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


# ----------------------------------------------------------------------------- on or off

_MODE = contextvars.ContextVar("functional_dit_fast_kernels", default=None)  # None | "fast" | "auto"


@contextlib.contextmanager
def fast_kernels(enabled: bool | str = True):
    """Run the replaceable ops inside with their fast kernels. ``enabled``: True or "fast"
    (every fast kernel), "auto" (each op's kernel measured faster here), False or "exact"
    (the exact maths). Set by `fd.apply` for prepared params only (see the module docstring)."""
    mode = ("fast" if enabled else "exact") if isinstance(enabled, bool) else enabled
    token = _MODE.set(None if check_mode(mode) == "exact" else mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def fast() -> bool:
    """Whether the fast kernels are on here: inside `fast_kernels`, not compiling."""
    return not torch.compiler.is_compiling() and _MODE.get() is not None


def _no_lora(p, *args, **kwargs) -> bool:
    return "lora" not in p and not quant.is_quant(p["weight"])


def _none_lora(ps, *args, **kwargs) -> bool:
    return not any("lora" in p or quant.is_quant(p["weight"]) for p in ps)


def _x_on_cpu(p, x, *args, **kwargs) -> bool:
    return x.device.type == "cpu"


# op -> when its fast twin may run at all (the module docstring says why)
WHEN = {
    "linear_gelu": _no_lora,
    "row_linear_cat": _no_lora,
    "col_linear_split": _no_lora,
    "linear_group": _none_lora,
    "linear_group_gelu": _none_lora,
    "rms_norm": _x_on_cpu,
}


def replaceable(fast_op: Callable):
    """Decorator of an exact op: calls run ``fast_op`` (same arguments) where `fast` is on
    and the op's `WHEN` holds, else the exact op. ``op.exact`` is the exact op itself."""

    def wrap(exact: Callable) -> Callable:
        when = WHEN.get(exact.__name__)

        @functools.wraps(exact)
        def op(*args, **kwargs):
            if fast() and (when is None or when(*args, **kwargs)):
                return fast_op(*args, **kwargs)
            return exact(*args, **kwargs)

        op.exact = exact
        return op

    return wrap


def onednn_linear_pointwise():
    """oneDNN's linear with a fused epilogue (CPU, fp32), or None where torch lacks it."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    return op if op is not None and torch.backends.mkldnn.is_available() else None


def _onednn_gelu(p, x, *args) -> bool:
    return (
        onednn_linear_pointwise() is not None
        and x.device.type == "cpu"
        and x.dtype == p["weight"].dtype == torch.float32
    )


def _on_cpu(x, *args) -> bool:
    return x.device.type == "cpu"


def _off_cpu(x, *args) -> bool:
    return x.device.type != "cpu"


# (op, kernel) -> whether that kernel can run on the op's kernel arguments
CANDIDATES = {
    ("linear_gelu", "onednn_epilogue"): _onednn_gelu,
    ("rms_norm_fp32", "three_pass"): _on_cpu,
    ("rms_norm_fp32", "torch_fused"): _off_cpu,
}


def candidates(op: str, variants: dict, args) -> dict:
    """The kernels of ``variants`` that `CANDIDATES` lets run on ``args`` (exact always)."""
    return {n: fn for n, fn in variants.items() if CANDIDATES.get((op, n), lambda *a: True)(*args)}


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
    """``variants[choose(...)](*args)``: op ``op`` with the kernel chosen under ``mode``
    among its `candidates` (the exact one, nothing measured, when it is the only one)."""
    variants = candidates(op, variants, args)
    if len(variants) == 1:
        return variants["exact"](*args)
    return variants[choose(op, variants, args, mode)](*args)


def select(op: str, variants: dict, *args):
    """`run` under the mode `fast_kernels` set. The kernels must not mutate their
    arguments nor communicate (under "auto" each rank times them on its own)."""
    return run(op, variants, _MODE.get(), *args)


def kernel_choices() -> list[dict]:
    """Every choice made under ``kernels="auto"`` in this process: per op and key (device
    kind, argument shapes, threads, mesh), the kernel chosen, each kernel's measured
    seconds per call and why (measured here, read from the disk cache, summed over ranks)."""
    return [dict(v) for v in _CHOICES.values()]


def clear() -> None:
    """Forget the choices made in this process (the disk cache stays)."""
    _CHOICES.clear()

"""``python -m functional_dit check --device DEV``: a one-command hardware check.

For each family's tiny config: ``fd.apply`` on the device vs CPU eager at the same
weights and inputs (parity); a second call with another timestep must not recompile; on
XLA devices no ``aten::`` op may fall back to the CPU. ``--mode`` is ``compile`` (default
off XLA), ``lazy`` (default on XLA) or ``eager`` (`fd.prepare`'d params). Not in the test
suite: torch_xla needs its own environment (docs/cli.md, "check").
``--sample`` checks ``fd.sample`` end to end instead (`functional_dit.cli._check_sample`):
parity with the CPU, and on XLA the compiles per image (none for another seed and step
count), host transfers in the loop and fallbacks (docs/xla.md).
"""

from __future__ import annotations

import contextlib

import torch

from .. import api as _api
from .. import families
from ..pipelines.families import product as _product
from . import _check_sample
from . import _xla_metrics as _metrics
from ._args import CLIError
from ._bench_models import inputs
from ._checks import check_device


def _tiny_inputs(config, seed: int = 0):
    """Small fd.apply kwargs on the CPU for a tiny config (batch 1, 4 x 4 latents, 8 text tokens)."""
    kw, _ = inputs(config, "cpu", torch.float32, seed=seed, hw=(4, 4), txt_len=8)
    return kw


def _to(kw: dict, device, dtype) -> dict:
    out = {}
    for k, v in kw.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, dtype) if k in ("x", "txt", "pooled") else v.to(device)  # ids, t stay fp32
        out[k] = v
    return out


def _precision_casts(device):
    """Inductor rounding at explicit bf16/fp16 casts as eager does (``emulate_precision_casts``):
    without it compiled bf16 FLUX loses the timestep's bf16 rounding and drifts from eager
    (docs/notes.md). Off on the CPU before torch 2.10, whose code generator crashes with it."""
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 10) and torch.device(device).type == "cpu":
        return contextlib.nullcontext()

    try:
        # torch's inductor: only where torch.compile is checked
        import torch._inductor.config as inductor_config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(inductor_config, "emulate_precision_casts"):
        return contextlib.nullcontext()
    return inductor_config.patch(emulate_precision_casts=True)


def check_family(name, config, device, dtype, mode, backend, tol) -> dict:
    params = _api.init(config, seed=0, dtype=dtype)  # the reference: CPU eager in the same dtype
    kw = _tiny_inputs(config)
    with torch.no_grad():
        want = _api.apply(params, **_to(kw, "cpu", dtype)).float()
    dev_params = _api.init(config, seed=0, dtype=dtype, device=device)
    kw_dev, kw2 = _to(kw, device, dtype), _to(dict(kw, t=kw["t"] * 0.5), device, dtype)
    met = _metrics.xla() if torch.device(device).type == "xla" else None
    if met is not None:
        met.clear_all()
    report = {}
    with torch.no_grad():
        if mode == "compile":
            torch._dynamo.reset()
            f = torch.compile(_api.apply, fullgraph=True, dynamic=False, backend=backend)
            with _precision_casts(device):
                got = f(dev_params, **kw_dev).cpu()
                try:
                    with torch._dynamo.config.patch(error_on_recompile=True):
                        f(dev_params, **kw2).cpu()
                    report["recompiled"] = False
                except Exception as e:  # dynamo raises its RecompileError (torch._dynamo.exc)
                    report["recompiled"] = f"{type(e).__name__}: {e}"
        elif mode == "eager":  # the prepared layout: fast eager kernels on the device
            got = _api.apply(_api.prepare(dev_params), **kw_dev).cpu()
            report["recompiled"] = None  # nothing is compiled: the question does not apply
        else:
            got = _api.apply(dev_params, **kw_dev).cpu()
            before = _metrics.compiles(met) if met is not None else None
            _api.apply(dev_params, **kw2).cpu()
            report["recompiled"] = None if met is None else _metrics.compiles(met) != before
    err = (got.float() - want).abs().max().item()
    report.update(max_abs_err=err, scale=want.abs().max().item(), parity=err <= tol * max(1.0, want.abs().max().item()))
    report["aten_fallbacks"] = _metrics.aten_fallbacks(met) if met is not None else []
    report["ok"] = report["parity"] and report["recompiled"] in (False, None) and not report["aten_fallbacks"]
    return report


def row(r: dict, tol: float) -> str:
    """A family's line after its name: status, error, and the recompile question only where
    something was compiled or traced (``r["recompiled"]`` None: not asked)."""
    status = "ok" if r["ok"] else "FAIL"
    recompiled = "" if r["recompiled"] is None else f"recompiled on a new timestep: {r['recompiled']}; "
    return (
        f"{status:<4}  max|err| {r['max_abs_err']:.2e} (output scale {r['scale']:.2f}, tol {tol:g}); "
        f"{recompiled}aten:: fallbacks: {r['aten_fallbacks'] or 'none'}"
    )


def add_arguments(p) -> None:
    p.add_argument("--device", required=True, help="cuda, xla, neuron, ... (cpu checks the check itself)")
    p.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    p.add_argument(
        "--mode", choices=("compile", "lazy", "eager"), default=None, help="default: lazy on xla, else compile"
    )
    p.add_argument("--backend", default=None, help="torch.compile backend (default: inductor; openxla on xla)")
    p.add_argument("--sample", action="store_true", help="fd.sample end to end instead (docs/xla.md)")
    p.add_argument(
        "--only", default=None, help="the tiny families (--sample: cases) whose name contains this (default: all)"
    )
    p.add_argument("--scan-blocks", action="store_true", help="with --sample: block segments as one scan each")


def run(args) -> int:
    if args.dtype not in ("float32", "bfloat16"):
        raise CLIError(f"--dtype: expected float32 or bfloat16, got {args.dtype!r}")
    dtype = getattr(torch, args.dtype)
    device = args.device
    check_device(device)
    if torch.device(device).type == "xla":
        import torch_xla  # noqa: F401  (registers the device)
    mode = args.mode or ("lazy" if torch.device(device).type == "xla" else "compile")
    backend = args.backend or ("openxla" if torch.device(device).type == "xla" else "inductor")
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # fp32: kernel order only; bf16: storage rounding
    if getattr(args, "sample", False):
        scan = getattr(args, "scan_blocks", False)
        ok = _check_sample.run(device, dtype, tol, scan, getattr(args, "only", None))
        how = "strict: no host reads in a step" + (", blocks scanned" if scan else "")
        print(f"device {device}, dtype {args.dtype}, fd.sample (fixed-graph loop, {how})")
        return 0 if ok else 1
    ok = True
    chosen = [fam for fam in families.FAMILIES if args.only is None or args.only in fam.TINY]
    width = max((len(fam.TINY) for fam in chosen), default=0)  # the name column, sized from the names
    for fam in chosen:
        why = _product(fam).CHECK_EAGER_ONLY
        if why is not None and mode != "eager":
            print(f"{fam.TINY:<{width}}  skip  {mode}: {why}; eager only")
            continue
        r = check_family(fam.TINY, families.tiny_config(fam), device, dtype, mode, backend, tol)
        ok &= r["ok"]
        print(f"{fam.TINY:<{width}}  {row(r, tol)}")
    print(f"device {device}, dtype {args.dtype}, mode {mode}" + (f", backend {backend}" if mode == "compile" else ""))
    return 0 if ok else 1

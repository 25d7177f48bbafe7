"""The forward sections of ``bench --suite gpu`` (`functional_dit.cli.bench_suite`): per
family, one transformer forward of one image, ours against the diffusers module holding
the same weights — eager, ``torch.compile``d, and ours compiled in fp8-row against ours
compiled in bf16. Each section yields one row (a dict) per family."""

from __future__ import annotations

import functools

import torch

from .. import api as _api
from ..nn import quant as _quant
from ._bench_models import inputs
from ._suite_common import alternate, describe, each, models, peaks, rel_err, timed


def _setup(name, p):
    """(config, diffusers module, our params, fd.apply kwargs, the module's kwargs)."""
    config = p.configs[name]
    module, params = models(config, p.device, p.dtype)
    kw, dkw = inputs(config, p.device, p.dtype, hw=p.hw, txt_len=p.txt_len)
    return config, module, params, kw, dkw


def _eager_row(name, p) -> dict:
    config, module, params, kw, dkw = _setup(name, p)
    ours = functools.partial(_api.apply, _api.prepare(params), **kw)  # fused q/k/v, kernels="auto"
    theirs = functools.partial(module, **dkw)
    med = alternate({"ours": ours, "diffusers": theirs}, p.runs, p.device)
    with torch.no_grad():
        err = rel_err(ours(), theirs())
    return dict(
        family=name,
        shape=describe(config),
        params_b=_api.num_params(config) / 1e9,
        ours_s=med["ours"],
        diffusers_s=med["diffusers"],
        ratio=med["ours"] / med["diffusers"],
        rel_err=err,
        **peaks(p.device, ours=ours, diffusers=theirs),
    )


def forward(p, window):
    """Eager: ``fd.apply`` on ``fd.prepare``d params vs the diffusers module."""
    yield from each(p.configs, window, p.need["forward"], lambda name: _eager_row(name, p))


def _compiled_call(fn, args: tuple, kwargs: dict, p):
    """(a call of ``torch.compile(fn)`` on these inputs, the seconds of its first call, a
    note): ``fullgraph=True``, or ``fullgraph=False`` with dynamo's reason where it refuses
    one graph; without a backend (``p.backend`` None) the plain call, and a note saying so."""
    if p.backend is None:  # no compile (a CPU run's default): eager in its place, said in the row
        call = functools.partial(fn, *args, **kwargs)
        return call, timed(call, p.device), "eager, not compiled (--compile-backend none)"
    note = ""
    for fullgraph in (True, False):
        compiled = torch.compile(fn, backend=p.backend, fullgraph=fullgraph, dynamic=False)
        call = functools.partial(compiled, *args, **kwargs)
        try:
            return call, timed(call, p.device), note
        except torch._dynamo.exc.Unsupported as e:
            note = f"fullgraph=False ({str(e).splitlines()[0][:90]})"
    raise AssertionError("unreachable: fullgraph=False takes graph breaks")


def _notes(**by_contender) -> str:
    """One note where the contenders' agree, else each contender's own."""
    notes = set(by_contender.values())
    if len(notes) == 1:
        return notes.pop()
    return "; ".join(f"{who}: {n}" for who, n in by_contender.items() if n)


def _compiled_row(name, p) -> dict:
    torch._dynamo.reset()  # each family compiles from nothing
    config, module, params, kw, dkw = _setup(name, p)
    ours, first_ours, note_ours = _compiled_call(_api.apply, (params,), kw, p)
    theirs, first_theirs, note_theirs = _compiled_call(module, (), dkw, p)
    med = alternate({"ours": ours, "diffusers": theirs}, p.runs, p.device)
    with torch.no_grad():
        err = rel_err(ours(), theirs())
    notes = _notes(ours=note_ours, diffusers=note_theirs)
    return dict(
        family=name,
        shape=describe(config),
        first_ours_s=first_ours,
        first_diffusers_s=first_theirs,
        ratio_first=first_ours / first_theirs,
        ours_s=med["ours"],
        diffusers_s=med["diffusers"],
        ratio=med["ours"] / med["diffusers"],
        rel_err=err,
        note=notes,
        **peaks(p.device, ours=ours, diffusers=theirs),
    )


def compiled(p, window):
    """``torch.compile(fd.apply)`` on the plain params vs ``torch.compile(module)``."""
    yield from each(p.compiled, window, p.need["compiled"], lambda name: _compiled_row(name, p))


def _fp8_row(name, p) -> dict:
    torch._dynamo.reset()
    config, module, params, kw, _ = _setup(name, p)
    del module  # our params keep its weights alive; its forward is not timed here
    quantized = _quant.quantize(params, "fp8-row")  # the default skip list (docs/quantization.md)
    bf16, _, note_bf16 = _compiled_call(_api.apply, (params,), kw, p)
    fp8, first_fp8, note_fp8 = _compiled_call(_api.apply, (quantized,), kw, p)
    med = alternate({"bf16": bf16, "fp8": fp8}, p.runs, p.device)
    with torch.no_grad():
        err = rel_err(fp8(), bf16())
    notes = _notes(bf16=note_bf16, fp8=note_fp8)
    return dict(
        family=name,
        shape=describe(config),
        first_fp8_s=first_fp8,
        bf16_s=med["bf16"],
        fp8_s=med["fp8"],
        ratio=med["fp8"] / med["bf16"],
        rel_err=err,
        note=notes,
        **peaks(p.device, bf16=bf16, fp8=fp8),
    )


def fp8(p, window):
    """Ours compiled on ``fd.quantize(params, "fp8-row")`` vs ours compiled in the compute dtype."""
    yield from each(p.compiled, window, p.need["fp8"], lambda name: _fp8_row(name, p))

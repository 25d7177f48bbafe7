"""Kernel selection by measurement (`functional_dit.nn.kernels`, ``fd.prepare(kernels=...)``):
the mechanism picks the faster of two kernels when one is made artificially slow (no
timed assertion on real kernels), the "exact" / "fast" / "auto" pins, the places where no
selection runs (autograd, torch.func, torch.compile), the disk cache, and ranks of one mesh
agreeing on every choice."""

from __future__ import annotations

import json
import time

import cases_flux1
import pytest
import torch
from _dist import spawn
from oracle import diffusers_model

import functional_dit as fd
import sharding
from functional_dit.nn import fast as _fast
from functional_dit.nn import kernels as _kernels
from functional_dit.nn import layers as L

FP32 = dict(rtol=1e-5, atol=1e-5)  # the fast kernels: another rounding order (docs/architecture.md)
SLOW_S = 1.0  # the artificial slowdown per call: far above a tiny kernel's cost and any load's noise


class _Clock:
    """The real clock plus the time the slowed kernels have "spent": a kernel made slow
    advances this clock by `SLOW_S` per call, so the slowdown does not depend on how
    loaded the machine is (a sleep's wake-up does)."""

    def __init__(self):
        self.extra = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.extra


def _install_clock() -> _Clock:
    clock = _Clock()
    _kernels._clock = clock
    return clock


def _slowed(fn, clock: _Clock):
    def slow(*args):
        clock.extra += SLOW_S
        return fn(*args)

    return slow


@pytest.fixture()
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(_kernels, "_clock", c)
    return c


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.delenv(_kernels.CACHE_ENV, raising=False)
    _kernels.clear()
    yield
    _kernels.clear()


def _flux1():
    module, params = diffusers_model(cases_flux1.TINY, seed=11)
    kw = cases_flux1.inputs(params.config, batch=1, seed=1)
    return module, params, kw, cases_flux1.diffusers_kwargs(kw)


# ----------------------------------------------------------------------------- the mechanism


def test_decide_keeps_the_exact_kernel_on_a_tie():
    assert _kernels.decide({"exact": 1.0, "fast": 0.99}) == "exact"  # within MARGIN: exact
    assert _kernels.decide({"exact": 1.0, "fast": 0.5, "faster": 0.4}) == "faster"
    assert _kernels.decide({"exact": 1.0, "fast": 1.5}) == "exact"


@pytest.mark.parametrize("slow", ["exact", "addcmul"])
def test_selection_picks_the_kernel_not_made_slow(monkeypatch, clock, slow):
    """Through the real layer: the gated residual's two kernels, one slowed down; "auto"
    picks the other, once per shape, and `fd.kernel_choices` says why."""
    monkeypatch.setitem(_fast.GATED, slow, _slowed(_fast.GATED[slow], clock))
    x, gate, y = torch.randn(2, 5, 8), torch.randn(2, 1, 8), torch.randn(2, 5, 8)
    with _kernels.fast_kernels("auto"):
        out = L.gated(x, gate, y)
        L.gated(x, gate, y)  # the same key: no second measurement
        L.gated(x[:1], gate[:1], y[:1])  # a new shape: measured again
    torch.testing.assert_close(out, x + gate * y, **FP32)
    choices = fd.kernel_choices()
    assert [c["op"] for c in choices] == ["gated", "gated"]
    want = "addcmul" if slow == "exact" else "exact"
    for c in choices:
        assert c["choice"] == want and c["why"] == "measured"
        assert c["times"][slow] > SLOW_S > c["times"][want]


def test_selection_among_three_kernels_inside_a_model(monkeypatch, clock):
    """FLUX.1's GELU MLP input has three kernels; with two slowed the third is chosen, and
    the prepared model still equals diffusers."""
    module, params, kw, dkw = _flux1()
    for name in ("exact", "onednn_epilogue"):
        monkeypatch.setitem(_fast.GELU, name, _slowed(_fast.GELU[name], clock))
    with torch.no_grad():
        out = fd.apply(fd.prepare(params), **kw)
        (ref,) = module(**dkw)
    torch.testing.assert_close(out, ref, **FP32)
    gelu = [c for c in fd.kernel_choices() if c["op"] == "linear_gelu"]
    assert gelu and all(c["choice"] == "inplace" for c in gelu)
    ops = {c["op"] for c in fd.kernel_choices()}
    assert {"norm_modulate", "gated", "linear_group", "rms_norm", "apply_rope", "linear_group_gelu"} <= ops


def test_the_exact_entries_of_the_kernel_tables_are_the_exact_maths(monkeypatch, clock):
    """Every fast kernel of every table in `nn.fast` slowed: "auto" keeps each op's "exact"
    entry, and the prepared model is then bitwise the plain params' (the exact maths of
    `nn.layers`), so the tables' exact entries restate that maths and nothing else."""
    params = fd.init(cases_flux1.TINY, seed=0)
    kw = cases_flux1.inputs(params.config, batch=1, seed=1)
    tables = [v for v in vars(_fast).values() if isinstance(v, dict) and "exact" in v]
    for table in tables:
        for name in [n for n in table if n != "exact"]:
            monkeypatch.setitem(table, name, _slowed(table[name], clock))
    with torch.no_grad():
        auto = fd.apply(fd.prepare(params), **kw)
        plain = fd.apply(params, **kw)
    choices = fd.kernel_choices()
    assert choices and {c["choice"] for c in choices} == {"exact"}
    assert torch.equal(auto, plain)


# ----------------------------------------------------------------------------- pins


def _count_fast_calls(monkeypatch) -> list:
    calls = []

    def counted(*args):
        calls.append(1)
        return torch.addcmul(*args)

    monkeypatch.setitem(_fast.GATED, "addcmul", counted)
    return calls


def test_kernels_pins(monkeypatch):
    """Pin "exact": bitwise the plain params' result (the same kernels, unfused projections);
    "fast": every fast kernel, nothing measured; "auto" (the default): measured choices.
    All within the fp32 tolerance of diffusers."""
    module, params, kw, dkw = _flux1()
    calls = _count_fast_calls(monkeypatch)
    with torch.no_grad():
        (ref,) = module(**dkw)
        plain = fd.apply(params, **kw)
        exact = fd.apply(fd.prepare(params, kernels="exact"), **kw)
        assert not calls and not fd.kernel_choices()
        fast = fd.apply(fd.prepare(params, kernels="fast"), **kw)
        assert calls and not fd.kernel_choices()
        auto = fd.apply(fd.prepare(params), **kw)
    assert torch.equal(exact, plain)
    for out in (exact, fast, auto):
        torch.testing.assert_close(out, ref, **FP32)
    assert fd.kernel_choices() and all(c["choice"] in c["times"] for c in fd.kernel_choices())


def test_kernels_bad_value():
    params = fd.init(cases_flux1.TINY, seed=0)
    with pytest.raises(ValueError, match=r"kernels: expected one of \['auto', 'fast', 'exact'\], got 'quick'"):
        fd.prepare(params, kernels="quick")


def test_no_selection_under_autograd_torch_func_or_compile():
    """The fast kernels are off there, so nothing is measured."""
    _, params, kw, _ = _flux1()
    prepared = fd.prepare(params)
    x = kw["x"].clone().requires_grad_(True)
    fd.apply(prepared, **dict(kw, x=x)).sum().backward()
    with torch.no_grad():
        torch.func.vmap(lambda xi: fd.apply(prepared, **dict(kw, x=xi)))(torch.stack([kw["x"]] * 2))
    with _kernels.fast_kernels("auto"):
        torch.compile(L.gated, fullgraph=True)(*(torch.randn(2, 3) for _ in range(3)))
    assert fd.kernel_choices() == []


# ----------------------------------------------------------------------------- disk cache


def test_disk_cache_is_written_atomically_and_read_back(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "kernels.json"
    monkeypatch.setenv(_kernels.CACHE_ENV, str(path))
    x, gate, y = torch.randn(2, 5, 8), torch.randn(2, 1, 8), torch.randn(2, 5, 8)
    with _kernels.fast_kernels("auto"):
        L.gated(x, gate, y)
        (first,) = fd.kernel_choices()
        saved = json.loads(path.read_text())
        (entry,) = saved
        assert entry.startswith(_kernels.machine_id()) and saved[entry] == first["times"]
        assert [p.name for p in path.parent.iterdir()] == ["kernels.json"]  # no temporary file left
        _kernels.clear()
        L.gated(x, gate, y)
    (again,) = fd.kernel_choices()
    assert again["why"] == "disk cache" and again["times"] == first["times"] and again["choice"] == first["choice"]


# ----------------------------------------------------------------------------- ranks


def _ranks_work(rank, world):
    """tp=2 prepared FLUX.1 under "auto", rank 1's fast RoPE made slow: both ranks pick
    from the summed timings, so alike; outputs bitwise equal across ranks."""
    if rank == 1:
        _fast.ROPE["complex"] = _slowed(_fast.ROPE["complex"], _install_clock())
    mesh = sharding.make_mesh(tp=world)
    params = fd.init(cases_flux1.TINY, seed=0)
    kw = cases_flux1.inputs(params.config, batch=1, seed=1)
    with torch.no_grad():
        out = fd.apply(fd.prepare(sharding.shard_params(params, mesh)), **kw)
        plain = fd.apply(params, **kw)
    choices = [(c["op"], repr(c["key"]), c["choice"], c["why"]) for c in fd.kernel_choices()]
    return out, plain, choices


def test_ranks_of_a_mesh_choose_alike():
    (out0, plain, c0), (out1, _, c1) = spawn(_ranks_work, 2, timeout=300)
    assert c0 == c1 and c0
    assert all(why.endswith("summed over the mesh's ranks") for *_, why in c0)
    assert {choice for op, _, choice, _ in c0 if op == "apply_rope"} == {"exact"}  # rank 1's slowness counts
    assert torch.equal(out0, out1)
    torch.testing.assert_close(out0, plain, **FP32)


# ----------------------------------------------------------------------------- bench's report


def test_bench_report_keeps_one_section_per_machine_kind(tmp_path, monkeypatch):
    from functional_dit.cli import _bench_models, bench

    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\nintro\n\n## Intel(R) Xeon(R) Processor\n\n- old Intel figures\n")
    monkeypatch.setattr(_bench_models, "cpu_model", lambda: "AMD EPYC")
    assert _bench_models.machine_kind() == "AMD EPYC" + (
        f" + {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    )
    monkeypatch.setattr(bench, "machine_kind", lambda: "AMD EPYC")
    bench.write_report(str(path), "# Benchmarks\n\n## AMD EPYC\n\n- first AMD figures\n")
    bench.write_report(str(path), "# Benchmarks\n\n## AMD EPYC\n\n- new AMD figures\n")
    head, parts = bench.sections(path.read_text())
    assert "intro" in head and list(parts) == ["Intel(R) Xeon(R) Processor", "AMD EPYC"]
    assert "- old Intel figures" in parts["Intel(R) Xeon(R) Processor"]
    assert "- new AMD figures" in parts["AMD EPYC"] and "- first AMD figures" not in path.read_text()

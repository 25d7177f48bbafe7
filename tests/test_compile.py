"""torch.compile of fd.apply: zero graph breaks for every family, plain and sharded;
regional compilation (each kind of block traced once, reused for every layer); a new
timestep (another sampling step) never recompiles; and the fused eager layout
(`fd.prepare`) computes what the plain params do.

aot_eager (dynamo + AOTAutograd, no C++ compile) keeps these fast; what they check —
what dynamo captures — does not depend on the backend."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from _dist import spawn

import functional_dit as fd
import sharding
from functional_dit.nn import fused as _fuse

FAMILIES = ["cases_flux1", "cases_flux2", "cases_qwenimage"]


def _tiny(cases):
    mod = importlib.import_module(cases)
    return mod, mod.TINY


class _Capture:
    """A dynamo backend that keeps the graphs it is given, then runs them as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _compile_counts(fn, *args, **kwargs):
    """(output, graph breaks, captured graphs) of ``torch.compile(fn)`` on one call."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend = _Capture()
    out = torch.compile(fn, backend=backend, dynamic=False)(*args, **kwargs)
    return out, sum(counters["graph_break"].values()), backend.graphs


def _invoke_subgraphs(graphs) -> tuple[int, int]:
    """(calls of a nested compile region, distinct region bodies) in the captured graphs."""
    calls, bodies = 0, set()
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "invoke_subgraph" in str(node.target):
                calls += 1
                bodies.add(node.args[0].target if hasattr(node.args[0], "target") else str(node.args[0]))
    return calls, len(bodies)


@pytest.mark.parametrize("cases", FAMILIES)
def test_compile_has_zero_graph_breaks_and_compiles_each_block_kind_once(cases):
    mod, config = _tiny(cases)
    config = dataclasses.replace(config, num_layers=3)
    params = fd.init(config, seed=0)
    kw = mod.inputs(config, batch=1, seed=0)
    out, breaks, graphs = _compile_counts(fd.apply, params, **kw)
    assert breaks == 0, f"{cases}: {breaks} graph breaks"
    assert len(graphs) == 1, f"{cases}: {len(graphs)} graphs"
    torch.testing.assert_close(out, fd.apply(params, **kw), rtol=1e-5, atol=1e-5)  # same ops, traced
    if hasattr(torch.compiler, "nested_compile_region"):
        layers = config.num_layers + getattr(config, "num_single_layers", 0)
        kinds = 1 + (getattr(config, "num_single_layers", 0) > 0)
        assert _invoke_subgraphs(graphs) == (layers, kinds), f"{cases}: regions not reused per layer"


@pytest.mark.parametrize("cases", FAMILIES)
def test_a_new_timestep_does_not_recompile(cases):
    mod, config = _tiny(cases)
    params = fd.init(config, seed=0)
    kw = mod.inputs(config, batch=1, seed=0)
    torch._dynamo.reset()
    f = torch.compile(fd.apply, fullgraph=True, dynamic=False, backend="aot_eager")
    f(params, **kw)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in (0.75, 0.25):  # later sampling steps: new t (and guidance) values, same shapes
            kw2 = dict(kw, t=kw["t"] * step)
            if kw.get("guidance") is not None:
                kw2["guidance"] = kw["guidance"] + step
            torch.testing.assert_close(f(params, **kw2), fd.apply(params, **kw2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cases", FAMILIES)
def test_prepare_keeps_keys_and_values_and_fuses(cases):
    mod, config = _tiny(cases)
    params = fd.init(config, seed=0)
    kw = mod.inputs(config, batch=2, seed=0)
    prepared = fd.prepare(params)
    a, b = params.flat(), prepared.flat()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    attn = prepared["transformer_blocks"]["0"]["attn"]
    assert _fuse.fused([attn["to_q"], attn["to_k"], attn["to_v"]]) is not None
    assert _fuse.fused([params["transformer_blocks"]["0"]["attn"][n] for n in ("to_q", "to_k", "to_v")]) is None
    with torch.no_grad():
        # one matmul over [q; k; v] instead of three: the same products, summed in the same
        # order per output element by the GEMM here; a tolerance in case a BLAS blocks differently
        torch.testing.assert_close(fd.apply(prepared, **kw), fd.apply(params, **kw), rtol=1e-5, atol=1e-5)


def test_prepared_layout_is_never_stale():
    import cases_flux1 as C

    params = fd.prepare(fd.init(C.TINY, seed=0))
    kw = C.inputs(C.TINY, batch=1, seed=0)
    block = params["single_transformer_blocks"]["0"]
    group = [block["attn"]["to_q"], block["attn"]["to_k"], block["attn"]["to_v"], block["proj_mlp"]]
    assert _fuse.fused(group) is not None
    with torch.no_grad():
        block["attn"]["to_k"]["weight"].mul_(2)  # in place: the fused buffer itself changes
        tree = sharding.tree.map_tree(lambda _, leaf: leaf, params.tree)  # new dicts, the same tensors
        tree["single_transformer_blocks"]["0"]["attn"]["to_k"]["weight"] = block["attn"]["to_k"]["weight"].clone()
        replaced = params.replace(tree)  # a new tensor: that group runs unfused
        plain = fd.init(C.TINY, seed=0)
        plain["single_transformer_blocks"]["0"]["attn"]["to_k"]["weight"].mul_(2)
        want = fd.apply(plain, **kw)
        torch.testing.assert_close(fd.apply(params, **kw), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fd.apply(replaced, **kw), want, rtol=1e-5, atol=1e-5)
    new = replaced["single_transformer_blocks"]["0"]
    assert _fuse.fused([new["attn"]["to_q"], new["attn"]["to_k"], new["attn"]["to_v"], new["proj_mlp"]]) is None


def test_prepare_refuses_params_that_require_grad_and_grads_flow_unfused():
    import cases_flux1 as C

    params = fd.init(C.TINY, seed=0)
    for t in params.leaves():
        t.requires_grad_(True)
    with pytest.raises(ValueError, match="params: prepare is for inference"):
        fd.prepare(params)
    attn = params["transformer_blocks"]["0"]["attn"]
    assert _fuse.fused([attn["to_q"], attn["to_k"], attn["to_v"]]) is None
    fd.apply(params, **C.inputs(C.TINY, batch=1, seed=0)).sum().backward()
    assert attn["to_k"]["weight"].grad is not None


def _sharded_breaks(rank, world):
    """Per family at tp=world: graph breaks and graphs of torch.compile(fd.apply) on
    sharded params, and whether it matches eager (on the `fd.prepare`d layout)."""
    import cases_flux1
    import cases_flux2
    import cases_qwenimage

    mesh = sharding.make_mesh(tp=world, device_type="cpu")
    report = {}
    for mod in (cases_flux1, cases_flux2, cases_qwenimage):
        config = mod.TINY
        s = sharding.shard_params(fd.init(config, seed=0), mesh)
        kw = mod.inputs(config, batch=1, seed=0)
        out, breaks, graphs = _compile_counts(fd.apply, s, **kw)
        prepared = fd.prepare(s)
        local, _ = sharding.local_view(prepared)
        attn = local["transformer_blocks"]["0"]["attn"]
        fused = _fuse.fused([attn["to_q"], attn["to_k"], attn["to_v"]])  # this rank's rows, one buffer
        with torch.no_grad():
            eager = fd.apply(prepared, **kw)
        err = (out - eager).abs().max().item()
        report[type(config).__name__] = (breaks, len(graphs), err, None if fused is None else fused[0].shape[0])
    return report


def test_sharded_compile_has_zero_graph_breaks_and_prepare_fuses_local_rows():
    for rank_report in spawn(_sharded_breaks, 2, timeout=600):
        for name, (breaks, graphs, err, fused_rows) in rank_report.items():
            assert breaks == 0 and graphs == 1, f"{name}: {breaks} graph breaks, {graphs} graphs"
            assert err < 1e-5, f"{name}: compiled differs from eager (prepared) by {err}"
            assert fused_rows is not None, f"{name}: the prepared local q/k/v are not one buffer"


def test_compile_with_lora_on_the_fly_has_zero_graph_breaks():
    """fd.apply(..., lora=[...]) under torch.compile: one graph, no break (a
    functools.cached_property on the adapter config used to take an RLock, which dynamo
    cannot enter: 'Unsupported context manager', one break per adapted block kind)."""
    import cases_flux1 as C

    import functional_dit.lora as lora

    params = fd.init(C.TINY, seed=0)
    kw = C.inputs(C.TINY, batch=1, seed=0)
    one = lora.init(params, rank=4, seed=1, zero_b=False)
    two = lora.init(params, rank=2, alpha=4.0, seed=2, zero_b=False, targets=["transformer_blocks.0.attn.to_q"])
    pairs = [(one, 0.8), (two, 0.5)]
    out, breaks, graphs = _compile_counts(fd.apply, params, lora=pairs, **kw)
    assert breaks == 0 and len(graphs) == 1, (breaks, len(graphs))
    torch.testing.assert_close(out, fd.apply(params, lora=pairs, **kw), rtol=1e-5, atol=1e-5)  # same ops, traced

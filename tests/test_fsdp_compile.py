"""Fully sharded params (an "fsdp" mesh axis) under torch.compile and the diffusers adapter,
on 2 CPU gloo ranks.

Compile: ``torch.compile(fd.apply, fullgraph=True, dynamic=False)`` over fsdp=2 params has
no graph break, equals eager fsdp (forward, and ``.grad.full_tensor()`` of every leaf), keeps
the prefetch in the traced graph (block i+1's all-gather issued before block i computes,
waited after it), does not recompile for later sampling steps and names
``fsdp_options(reshard_after_forward=True)`` (eager only) when asked to trace it. Adapter: a stock
diffusers pipeline with ``fd.DiffusersTransformer`` over fsdp=2 params equals one process.
aot_eager (dynamo + AOTAutograd) as tests/test_compile.py: what dynamo captures does not
depend on the backend.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree
from _dist import spawn
from test_adapter import PROMPT, SEED, SHORT, adapter, max_err, run
from test_compile import _Capture

import functional_dit as fd
import sharding
from functional_dit import tiny

FP32 = 1e-5  # fsdp vs one process: the batch split changes the GEMMs' row counts (fp32 rounding)
SCAN_ARGS = dict(height=32, width=32, output_type="latent", steps=2, seed=0, guidance=4.0)
KINDS = {  # the pipelines the adapter runs on fsdp=2, with their call arguments
    "flux": dict(prompt=PROMPT, **SHORT),
    "qwen-image": dict(prompt=["a cat", PROMPT], negative_prompt=["blurry", "dark"], true_cfg_scale=2.0),
}


def _overlapped(gm) -> int:
    """How many block calls (compile regions) of the traced graph run while an all-gather
    is issued and not yet waited: the prefetch, as the compiled code will run it."""
    in_flight, count = set(), 0
    for node in gm.graph.nodes:
        name = str(node.target)
        if "all_gather_into_tensor" in name:
            in_flight.add(node)
        elif "wait_tensor" in name:
            in_flight.discard(node.args[0])
        elif "invoke_subgraph" in name:
            count += bool(in_flight)
    return count


def _grads(params) -> dict:
    return {k: v.grad.full_tensor() for k, v in params.flat().items()}


def _compile_rank(rank, world):
    import cases_flux1 as C
    from torch._dynamo.utils import counters

    config = dataclasses.replace(C.TINY, num_layers=3, num_single_layers=0)  # one block kind: compile time
    mesh = sharding.make_mesh(fsdp=world, device_type="cpu")
    s = sharding.shard_params(fd.init(config, seed=0), mesh)
    kw = C.inputs(config, batch=2, seed=0)
    report = {}
    torch._dynamo.reset()
    counters.clear()
    backend = _Capture()
    f = torch.compile(fd.apply, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        report["forward"] = (f(s, **kw), fd.apply(s, **kw))
        with torch._dynamo.config.patch(error_on_recompile=True):
            steps = [dict(kw, t=kw["t"] * a, guidance=kw["guidance"] + a) for a in (0.75, 0.25)]  # later steps
            report["steps"] = [(f(s, **k), fd.apply(s, **k)) for k in steps]
    report["breaks"], report["graphs"] = sum(counters["graph_break"].values()), len(backend.graphs)
    report["overlapped"] = _overlapped(backend.graphs[0]) if hasattr(torch.compiler, "nested_compile_region") else None
    # gradients on one block: tracing the backward costs ~4 x the forward's compile per block
    config = dataclasses.replace(config, num_layers=1)
    s = sharding.shard_params(fd.init(config, seed=0), mesh)
    for leaf in s.leaves():
        leaf.requires_grad_()
    w = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(5))
    g = torch.compile(fd.apply, backend="aot_eager", fullgraph=True, dynamic=False)
    (g(s, **kw) * w).sum().backward()
    compiled = _grads(s)
    for leaf in s.leaves():
        leaf.grad = None
    (fd.apply(s, **kw) * w).sum().backward()
    report["grads"] = (compiled, _grads(s))
    try:  # the re-gather in backward is eager only: a clear message under fullgraph
        with sharding.fsdp_options(reshard_after_forward=True):
            torch.compile(fd.apply, backend="aot_eager", fullgraph=True, dynamic=False)(s, **kw)
        report["reshard"] = "no error"
    except Exception as e:  # noqa: BLE001 - dynamo wraps the ValueError raised while tracing
        report["reshard"] = str(e)
    return report


def test_compiled_fsdp_equals_eager_with_the_prefetch_in_the_graph_and_no_recompile():
    for report in spawn(_compile_rank, 2, timeout=600):
        assert report["breaks"] == 0 and report["graphs"] == 1, (report["breaks"], report["graphs"])
        for got, want in [report["forward"], *report["steps"]]:
            torch.testing.assert_close(got, want, rtol=FP32, atol=FP32)  # the same ops, traced
        if report["overlapped"] is not None:
            # 3 double blocks: the first two compute with the next one's gather in flight
            assert report["overlapped"] == 2, report["overlapped"]
        compiled, eager = report["grads"]
        for k, want in eager.items():
            err = (compiled[k] - want).abs().max() / want.abs().max().clamp_min(1e-30)
            assert err <= FP32, (k, err.item())  # same collectives, traced: fp32 sums in the same order
        assert "fsdp_options: reshard_after_forward=True is for eager training" in report["reshard"], report["reshard"]


def _adapter_rank(rank, world):
    mesh = sharding.make_mesh(fsdp=world)
    out = {}
    for kind, kwargs in KINDS.items():
        params = sharding.shard_params(fd.init(tiny.transformer_config(kind), seed=SEED), mesh)
        out[kind] = run(tiny.pipeline(kind, seed=SEED, transformer=fd.DiffusersTransformer(params)), **kwargs)
    return out


def test_adapter_on_fsdp2_pipelines_equal_one_process():
    ranks = spawn(_adapter_rank, 2, timeout=600)
    for kind, kwargs in KINDS.items():
        want = run(tiny.pipeline(kind, seed=SEED, transformer=adapter(kind)), **kwargs)
        assert want.abs().max() > 0.1  # a real result
        for r, got in enumerate(ranks):
            assert max_err(got[kind], want) <= FP32, (kind, r)
        assert torch.equal(ranks[0][kind], ranks[1][kind])  # the same latents on every rank


def _prepared_rank(rank, world):
    import cases_flux1 as C

    from functional_dit.nn import fused as _fuse
    from sharding.internal import wrap_tree

    mesh = sharding.make_mesh(fsdp=world, device_type="cpu")
    kw = C.inputs(C.TINY, batch=2, seed=0)
    prepared = fd.prepare(sharding.shard_params(fd.init(C.TINY, seed=0), mesh))
    local, _ = sharding.local_view(prepared)
    hits, fused = [], _fuse.fused

    def spy(ps):  # what the fast path's projections find
        wb = fused(ps)
        hits.append(wb is not None)
        return wb

    _fuse.fused = spy
    try:
        with torch.no_grad(), sharding.bind(mesh):
            out = fd.apply(prepared, **kw)
            tree = wrap_tree(local.tree, local.config, mesh)  # blocks as the block loop gathers them
            double = tree["transformer_blocks"]["0"].gathered()["attn"]
            single = tree["single_transformer_blocks"]["0"].gathered()
    finally:
        _fuse.fused = fused
    groups = {
        "q/k/v": [double[n] for n in ("to_q", "to_k", "to_v")],
        "added q/k/v": [double[n] for n in ("add_q_proj", "add_k_proj", "add_v_proj")],
        "single q/k/v/mlp": [
            single["attn"]["to_q"],
            single["attn"]["to_k"],
            single["attn"]["to_v"],
            single["proj_mlp"],
        ],
    }
    return out, any(hits), {name: fused(ps) is not None for name, ps in groups.items()}


def test_prepared_params_on_fsdp2_run_the_fused_path_and_equal_one_process():
    import cases_flux1 as C

    kw = C.inputs(C.TINY, batch=2, seed=0)
    with torch.no_grad():
        want = fd.apply(fd.init(C.TINY, seed=0), **kw)
    for out, hit, groups in spawn(_prepared_rank, 2, timeout=300):
        # fused GEMMs and fast kernels vs the plain projections, and the batch split: fp32 rounding
        torch.testing.assert_close(out, want, rtol=FP32, atol=FP32)
        assert hit  # the forward ran one GEMM over a gathered buffer
        # each group gathered as one buffer, FLUX.1's single-block [q, k, v, MLP] too, whose
        # leaves fsdp splits on different dims (q/k/v on their rows, the MLP input on its input dim)
        assert groups == {"q/k/v": True, "added q/k/v": True, "single q/k/v/mlp": True}, groups


def _scan_rank(rank, world):
    from functional_dit.nn import scan as _scan
    from functional_dit.pipelines import sampler_xla

    pipe, params = tiny.pipeline("flux"), fd.init(tiny.transformer_config("flux"), seed=0)
    sharded = sharding.shard_params(params, sharding.make_mesh(fsdp=world, device_type="cpu"))
    calls, scan = [], _scan.eager_scan

    def spy(fn, carry, xs):  # the scan the fixed-graph loop runs on the CPU: what it scans over
        calls.append(pytree.tree_leaves(xs)[0].shape)
        return scan(fn, carry, xs)

    record, _scan.eager_scan = [], spy
    try:
        with sampler_xla.static(strict=True, record=record, scan=True):
            got = fd.sample(sharded, pipe, "a red cube", **SCAN_ARGS)
    finally:
        _scan.eager_scan = scan
    return got, record, calls


def test_scanned_fixed_graph_loop_on_fsdp2_gathers_in_the_body_and_equals_one_process():
    params = fd.init(tiny.transformer_config("flux"), seed=0)
    want = fd.sample(params, tiny.pipeline("flux"), "a red cube", **SCAN_ARGS)
    full = params["transformer_blocks"]["0"]["norm1"]["linear"]["weight"].shape
    for got, record, calls in spawn(_scan_rank, 2, timeout=300):
        assert record == [{"steps": 2, "scanned": ["single_transformer_blocks", "transformer_blocks"]}], record
        assert len(calls) == 4  # 2 segments x 2 steps, each one scan
        # the scan runs over this rank's stacked shards: the first leaf (a double block's AdaLN
        # weight) is half of its full size, the block gathered in the scan body
        assert calls[0][0] == len(params["transformer_blocks"]) and calls[0][1:].numel() * 2 == full.numel()
        torch.testing.assert_close(got, want, rtol=FP32, atol=FP32)  # the batch split: fp32 rounding

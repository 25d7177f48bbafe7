"""`fd.sample`'s loop for lazy devices (`functional_dit.pipelines.sampler_xla`), tested on the CPU:
the fixed-graph loop gives the usual loop's latents bit for bit, one sampler step
exports under strict ``torch.export`` with static shapes and no data-dependent op, and
no step reads tensor data on the host (`NoHostSync`). The torch_xla run itself (compile
counts, fallbacks) is ``python -m functional_dit check --device xla --sample``
(docs/xla.md): its environment is too large for the suite.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import functional_dit as fd
from functional_dit import tiny
from functional_dit.pipelines import sampler as _sample
from functional_dit.pipelines import sampler_xla as _sample_xla

SIZE = dict(height=32, width=32, output_type="latent")
BANNED = (  # data-dependent shapes or indices, host reads, complex numbers
    "aten.item",
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten.scatter",
    "aten.index_put",
    "aten.view_as_complex",
    "aten.polar",
)


def ref_image(w=80, h=64, seed=0) -> Image.Image:
    """FLUX.2's image processor refuses references under 64 px a side."""
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


# (name, tiny pipeline kind, fd.sample kwargs): each model path of the fixed loop
CASES = [
    ("flux1-dev", "flux", dict(guidance=5.0)),
    ("flux1-true-cfg", "flux", dict(true_cfg=2.0, negative_prompt="blurry")),
    ("flux2-klein-cfg-ref", "flux2-klein", dict(true_cfg=4.0, image=ref_image())),
    ("flux2-klein-kv", "flux2-klein-kv", dict(image=ref_image())),
    ("qwen-image-ragged-cfg", "qwen-image", dict(true_cfg=4.0, negative_prompt="blurry, low quality")),
    ("flux3-flow-map", "flux3-distilled", {}),  # the target timesteps moved once with t and dt
    ("qwen-image-2.1-kv-cfg", "qwen-image-2.1", dict(true_cfg=3.0, negative_prompt="blur")),  # layouts read once
]


@pytest.fixture(scope="module")
def models():
    """One tiny pipeline and fd params per kind, shared by the tests."""
    kinds = {kind for _, kind, _ in CASES}
    return {k: (tiny.pipeline(k), fd.init(tiny.transformer_config(k), seed=0)) for k in kinds}


@pytest.mark.parametrize("name, kind, kw", CASES, ids=[c[0] for c in CASES])
def test_fixed_loop_equals_usual_loop_bitwise_and_reads_nothing_on_the_host(models, name, kind, kw):
    pipe, params = models[kind]
    args = dict(SIZE, steps=3, seed=[3], **kw)
    want = fd.sample(params, pipe, "a red cube", **args)
    record = []
    with _sample_xla.static(strict=True, record=record):  # any host read inside a step raises
        got = fd.sample(params, pipe, "a red cube", **args)
    assert record == [{"steps": 3}], "the fixed loop ran (on the CPU it records no XLA counters)"
    # Bitwise: the same kernels on the same inputs in the same order on this CPU; only
    # the schedule's indexing moved before the loop.
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Step(torch.nn.Module):
    """One sampler step of a prepared family model, tensors in and out."""

    def __init__(self, model, cfg, normalise):
        super().__init__()
        self.model, self.cfg, self.normalise = model, cfg, normalise

    def forward(self, x, t, dt, txt, pooled, mask):
        cond = _sample.Prompt(txt, pooled, mask, self.cond_ids)
        return _sample_xla.step(self.model, x, t, dt, cond, self.cfg, self.normalise)


def _captured_steps(pipe, params, kw) -> list[tuple]:
    """The (model, x, t, dt, cond, cfg, normalise) of every step of a 2-step fd.sample
    (the model as that step got it: its tables hold the KV cache an earlier step extracted)."""
    seen, real = [], _sample_xla.carried

    def spy(model, x, t, dt, cond, cfg, normalise, extra=None):
        seen.append((model, x, t, dt, cond, cfg, normalise))
        return real(model, x, t, dt, cond, cfg, normalise, extra)

    with pytest.MonkeyPatch.context() as patch, _sample_xla.static():
        patch.setattr(_sample_xla, "carried", spy)
        fd.sample(params, pipe, "a red cube", **dict(SIZE, steps=2, seed=0, **kw))
    return seen


def _graph_ops(program) -> set[str]:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("name, kind, kw", [CASES[3], CASES[4]], ids=[CASES[i][0] for i in (3, 4)])
def test_strict_export_of_one_sampler_step(models, name, kind, kw):
    """The last step (FLUX.2-klein-kv: the one reading the extracted reference cache;
    Qwen-Image: masked ragged text, normalised CFG): static shapes, no data-dependent
    op, the same result as the eager step. (FLUX.1's step is fd.apply's, exported in
    test_export, plus the same Euler update.)"""
    pipe, params = models[kind]
    model, x, t, dt, cond, cfg, normalise = _captured_steps(pipe, params, kw)[-1]
    step = _Step(model, cfg, normalise)
    step.cond_ids = cond.txt_ids
    args = (x, t, dt, cond.txt, cond.pooled, cond.mask)
    program = torch.export.export(step, args, strict=True)
    ops = _graph_ops(program)
    assert not [op for op in ops if op.startswith(BANNED)], ops
    assert not program.range_constraints, "no symbolic sizes: every shape is static"
    torch.testing.assert_close(program.module()(*args), step(*args), rtol=0, atol=0)


class _Unpack(torch.nn.Module):
    def __init__(self, model, h, w):
        super().__init__()
        self.model, self.h, self.w = model, h, w

    def forward(self, x):
        return self.model.decode_latents(x, self.h, self.w)


def test_flux2_unpacking_is_static_reshapes(models):
    """FLUX.2(-klein)'s latents -> VAE input without the pipeline's scatter by position ids."""
    pipe, params = models["flux2-klein-kv"]
    model, x, *_ = _captured_steps(pipe, params, CASES[3][2])[-1]
    program = torch.export.export(_Unpack(model.steps, 4, 4), (x,), strict=True)
    ops = _graph_ops(program)
    assert not [op for op in ops if op.startswith(BANNED)], ops
    z = pipe._unpack_latents_with_ids(x, pipe._prepare_latent_ids(torch.zeros(1, 1, 2, 2)))  # the stock scatter
    bn = pipe.vae.bn
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    want = pipe._unpatchify_latents(z * std + bn.running_mean.view(1, -1, 1, 1))
    torch.testing.assert_close(program.module()(x), want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "read",
    [
        lambda v: v.sum().item(),
        lambda v: v.tolist(),
        lambda v: bool(v.sum() > 0),
        lambda v: float(v.sum()),
        lambda v: int(v.sum()),
        lambda v: v.numpy(),
        lambda v: range(10)[v[0].long()],
    ],
    ids=["item", "tolist", "bool", "float", "int", "numpy", "index"],
)
def test_no_host_sync_refuses_every_host_read(read):
    v = torch.ones(3)
    with _sample_xla.NoHostSync():
        v = v * 2 + 1  # device work is fine
        with pytest.raises(_sample_xla.HostSyncError, match="host read of tensor data"):
            read(v)
    read(v)  # outside the mode it works


def test_eager_value_checks_are_fd_applys_only_host_read():
    """``fd.apply`` reads t and the inputs on the host only for its eager value checks
    (`functional_dit.nn.values`), which are off on XLA and in the strict loop."""
    config = tiny.transformer_config("flux")
    params = fd.init(config, seed=0)
    kw = dict(x=torch.randn(1, 4, config.in_channels), t=torch.full((1,), 0.5), txt=torch.randn(1, 3, 32))
    kw.update(
        pooled=torch.randn(1, 24), guidance=torch.full((1,), 3.5), img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3)
    )
    with _sample_xla.NoHostSync(), pytest.raises(_sample_xla.HostSyncError, match="tolist"):
        fd.apply(params, **kw)
    with _sample_xla._strict():
        got = fd.apply(params, **kw)
    torch.testing.assert_close(got, fd.apply(params, **kw), rtol=0, atol=0)


def test_plan_is_the_schedule_moved_once():
    sched = _sample._scheduler(tiny.pipeline("flux"), "flux1", 4, 3, "cpu")
    steps = _sample_xla.plan(sched, 2, torch.bfloat16, "cpu")
    assert [tuple(t.shape) for t, _ in steps] == [(2,)] * 3 and all(dt.ndim == 0 for _, dt in steps)
    torch.testing.assert_close(torch.stack([dt for _, dt in steps]), sched.sigmas.diff(), rtol=0, atol=0)
    meta = _sample._scheduler(tiny.pipeline("flux"), "flux1", 4, 3, "meta")
    with pytest.raises(ValueError, match="sched: expected the schedule on the cpu, got meta"):
        _sample_xla.plan(meta, 2, torch.float32, "cpu")


def test_check_sample_on_cpu_runs_the_fixed_loop(monkeypatch, capsys):
    """``check --device cpu --sample`` (the XLA check's own check), on its first case:
    on the CPU the fixed loop equals the usual one, so both images match exactly."""
    from functional_dit.__main__ import main
    from functional_dit.cli import _check_sample

    first = _check_sample.cases()[0]
    monkeypatch.setattr(_check_sample, "cases", lambda: [first])
    assert main(["check", "--device", "cpu", "--sample"]) == 0
    out = capsys.readouterr().out
    assert f"{first[0]:<20} ok" in out and out.count("max|err| 0.00e+00") == 2, out
    assert "fd.sample (fixed-graph loop, strict: no host reads in a step)" in out

"""Block segments as one scan over stacked weights (`functional_dit.nn.scan`), tested on
the CPU with the eager scan: the same results as the plain per-block loop, bit for bit.
The torch_xla scan itself (graph size, compile time) is measured by ``check --device xla
--sample --scan-blocks`` (docs/xla.md)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils import _pytree as pytree

import functional_dit as fd
from functional_dit import tiny
from functional_dit.nn import scan as _scan
from functional_dit.pipelines import sampler_xla as _sample_xla

SEGMENTS = ("transformer_blocks", "single_transformer_blocks")


def _inputs(config, batch=2, seq=6, txt=5):
    g = torch.Generator().manual_seed(0)
    return dict(
        x=torch.randn(batch, seq, config.in_channels, generator=g),
        t=torch.tensor([0.3, 0.8])[:batch],
        txt=torch.randn(batch, txt, config.joint_attention_dim, generator=g),
        pooled=torch.randn(batch, config.pooled_projection_dim, generator=g),
        guidance=torch.full((batch,), 3.5) if config.guidance_embeds else None,
        img_ids=torch.randn(seq, 3, generator=g),
        txt_ids=torch.zeros(txt, 3),
    )


def test_scanned_segments_equal_the_block_loop_bitwise():
    config = dataclasses.replace(tiny.transformer_config("flux"), num_layers=3, num_single_layers=4)
    params = fd.init(config, seed=0)
    kw = _inputs(config)
    want = fd.apply(params, **kw)
    calls = []

    def scan(fn, carry, xs):
        calls.append(pytree.tree_leaves(xs)[0].shape[0])
        return _scan.eager_scan(fn, carry, xs)

    with _scan.stacked(params, SEGMENTS, scan) as segments:
        got = fd.apply(params, **kw)
        other = fd.apply(fd.init(config, seed=1), **kw)  # other params: the plain loop
    assert calls == [3, 4], "both segments ran as one scan each, over every block"
    assert segments["transformer_blocks"]["attn"]["to_q"]["weight"].shape[0] == 3
    # Bitwise: the same kernels on the same values (a slice of a stacked weight is a
    # contiguous copy of it), in the same order.
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(other, fd.apply(fd.init(config, seed=1), **kw), rtol=0, atol=0)


def test_fixed_loop_with_scanned_blocks_equals_usual_loop_bitwise(monkeypatch):
    pipe, params = tiny.pipeline("flux"), fd.init(tiny.transformer_config("flux"), seed=0)
    args = dict(height=32, width=32, output_type="latent", steps=2, seed=0, guidance=4.0)
    want = fd.sample(params, pipe, "a red cube", **args)
    record = []
    with _sample_xla.static(strict=True, record=record, scan=True):
        got = fd.sample(params, pipe, "a red cube", **args)
    assert record == [{"steps": 2, "scanned": sorted(SEGMENTS)}]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    monkeypatch.setenv("FD_XLA_SCAN_BLOCKS", "yes")
    with pytest.raises(ValueError, match="FD_XLA_SCAN_BLOCKS: expected 0 or 1, got 'yes'"), _sample_xla.static():
        fd.sample(params, pipe, "a red cube", **args)
    with pytest.raises(ValueError, match="scan: expected True, False or None, got 'on'"):
        _sample_xla.static(scan="on").__enter__()


def test_check_sample_scan_blocks_on_cpu(capsys):
    """``check --device cpu --sample --only flux1-dev --scan-blocks``: the eager scan on
    the CPU equals the usual loop exactly; a name matching no case is refused."""
    from functional_dit.__main__ import main
    from functional_dit.cli import _check_sample

    assert main(["check", "--device", "cpu", "--sample", "--only", "flux1-dev", "--scan-blocks"]) == 0
    out = capsys.readouterr().out
    assert "flux1-dev            ok" in out and out.count("max|err| 0.00e+00") == 2, out
    assert out.count(", blocks scanned") == 3 and "flux1-true-cfg" not in out, out
    with pytest.raises(ValueError, match="only: no case name contains 'nope'"):
        _check_sample.run("cpu", torch.float32, 1e-4, only="nope")


# (tiny kind, fd.sample kwargs, its scanned segments): FLUX.2 without reference KV, Qwen-Image
FAMILIES = [
    ("flux2-klein", dict(true_cfg=4.0), SEGMENTS),
    ("qwen-image", dict(true_cfg=4.0, negative_prompt="blurry"), ("transformer_blocks",)),
]


@pytest.mark.parametrize("kind, kw, names", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_more_families_scan_their_blocks_bitwise(kind, kw, names, monkeypatch):
    config = tiny.transformer_config(kind)
    pipe, params = tiny.pipeline(kind), fd.init(config, seed=0)
    args = dict(height=32, width=32, output_type="latent", steps=2, seed=0, **kw)
    want = fd.sample(params, pipe, "a red cube", **args)
    calls, eager = [], _scan.eager_scan

    def scan(fn, carry, xs):
        calls.append(pytree.tree_leaves(xs)[0].shape[0])
        return eager(fn, carry, xs)

    monkeypatch.setattr(_scan, "eager_scan", scan)
    record = []
    with _sample_xla.static(strict=True, record=record, scan=True):
        got = fd.sample(params, pipe, "a red cube", **args)
    assert record == [{"steps": 2, "scanned": sorted(names)}]
    sizes = [len(params.tree[n]) for n in names]
    assert calls == sizes * 2, "each segment ran as one scan over all its blocks, at each step"
    # Bitwise: the same kernels on the same values, in the same order (as for FLUX.1).
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_flux2_reference_kv_keeps_the_block_loop():
    """klein's reference KV cache reads and writes per-block KV: nothing is stacked."""
    pipe, params = tiny.pipeline("flux2-klein-kv"), fd.init(tiny.transformer_config("flux2-klein-kv"), seed=0)
    image = Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype("uint8"))
    args = dict(height=32, width=32, output_type="latent", steps=2, seed=0, image=image)
    want, record = fd.sample(params, pipe, "a red cube", **args), []
    with _sample_xla.static(strict=True, record=record, scan=True):
        got = fd.sample(params, pipe, "a red cube", **args)
    assert record == [{"steps": 2}], "no segment was scanned"
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same loop: bitwise

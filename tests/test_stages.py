"""Each family's forward as stages (`functional_dit.nn.stages`, ``fam.stages``): what the step
caches run block by block is the family's forward (bitwise), with its KV caches, and a
subset of batch items (``Stages.take``) computes what those items compute in the whole batch."""

from __future__ import annotations

import dataclasses

import cases_flux1 as c1
import cases_flux2 as c2
import cases_flux3 as c3
import cases_qwenimage as cq
import cases_qwenimage21 as c21
import pytest
import torch

import functional_dit as fd
from functional_dit import families
from functional_dit.nn import stages as _stages

Q21 = dataclasses.replace(fd.PRESETS["qwen-image-2.1-tiny"], causal_condition=True)


def _cases():
    """(name, config, fd.apply kwargs); a KV cache's cached step built from its extract step."""
    out = [
        ("flux1", c1.TINY, c1.inputs(c1.TINY)),
        ("flux2", c2.TINY, c2.inputs(c2.TINY)),
        ("klein-extract", c2.TINY_KLEIN, c2.inputs(c2.TINY_KLEIN, ref_hw=(2, 2))),
        ("qwen-edit", cq.TINY_EDIT, cq.inputs(cq.TINY_EDIT)),  # zero_cond_t: halved modulations
        ("flux3-ref", fd.PRESETS["flux3-tiny"], c3.inputs(fd.PRESETS["flux3-tiny"], ref_hw=(2, 2))),
        ("qwen21-extract", Q21, dict(c21.inputs(Q21), kv_cache="extract")),
    ]
    _, cache = fd.apply(fd.init(c2.TINY_KLEIN, seed=1), **out[2][2])
    out.append(("klein-cached", c2.TINY_KLEIN, c2.next_step(out[2][2], cache)))
    _, cache = fd.apply(fd.init(Q21, seed=1), **out[5][2])
    out.append(("qwen21-cached", Q21, dict(out[5][2], kv_cache=cache)))
    return out


CASES = _cases()


def _stages_of(params, kw):
    fam = families.of(params)
    x, t, txt = kw["x"], kw["t"], kw["txt"]
    rest = {k: v for k, v in kw.items() if k not in ("x", "t", "txt")}
    return fam.stages(params, x, t, txt, **fam.check_inputs(params, x, t, txt, **rest))


@pytest.mark.parametrize("name,config,kw", CASES, ids=[c[0] for c in CASES])
def test_blocks_one_by_one_are_the_forward_and_a_subset_its_rows(name, config, kw):
    params = fd.init(config, seed=1)
    want = fd.apply(params, **kw)
    s = _stages_of(params, kw)
    assert s.blocks and len(s.attention) == len(s.blocks)
    out = s.final(s.image(s.run(s.run(s.streams, s.blocks[:1]), s.blocks[1:])), s.ctx)
    if s.extra is not None:
        out, extra = out, s.extra(s.ctx)
        want, want_extra = want
        assert all(torch.equal(a, b) for a, b in zip(extra.flat().values(), want_extra.flat().values()))
    assert torch.equal(out, want)
    if s.extra is not None:  # an extract pass runs on the whole batch (every cache's first step)
        return
    idx = torch.tensor([1])
    sub = _stages_of(params, kw)
    img = sub.image(sub.run(_stages.take_streams(sub.streams, idx), sub.blocks, sub.take(idx)))
    # the one item alone: other GEMM shapes than in the batch of 2 (fp32 rounding)
    torch.testing.assert_close(sub.final(img, sub.take(idx)), want[1:], rtol=1e-5, atol=1e-5)

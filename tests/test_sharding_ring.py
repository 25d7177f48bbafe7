"""Ring attention and USP (Ulysses x ring, x tp) on 4 CPU gloo ranks equal one process.

One spawn runs every case: each family's forward on ring=4, sp=2 x ring=2 and tp=2 x
ring=2 (tiny configs with 2 or 4 heads, so the degree 4 exceeds the heads or does not
divide them, and sequence lengths the ring does not divide); the KV caches (FLUX.2's
reference tokens, Qwen-Image 2.1's prefix) extracted and used on the ring; gradients
under ring and USP equal unsharded autograd; LoRA on the fly; `fd.sample` with a
First-Block Cache on USP equals one process, decisions included; `torch.compile`
(fullgraph) of USP equals one process. The block kernel and
the merge are checked in-process against SDPA, and the plan's errors name the values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from _dist import spawn

import functional_dit as fd
import sharding
from functional_dit.nn import layers as L

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md#numerics: sharded vs unsharded at the fp32 tolerance
REL = 1e-4  # gradients: of each tensor's largest entry (sums run in another order; as test_grad_sharded)
SEED = 7
MESHES = [dict(ring=4), dict(sp=2, ring=2), dict(tp=2, ring=2)]
LORA_MESH = dict(sp=2, ring=2)


def _cases() -> list:
    """(name, config, inputs): every family, odd lengths (txt 7 + img 9 = 16 tokens split
    as 7 + 9 over 4 ranks: both padded), ragged / holed text masks, both KV caches."""
    import cases_flux1 as F1
    import cases_flux2 as F2
    import cases_flux3 as F3
    import cases_qwenimage as Q
    import cases_qwenimage21 as Q21

    kv = F2.inputs(F2.TINY, batch=3, txt_len=5, h=3, w=3, ref_hw=(2, 3), ref_fixed_timestep=0.0, seed=4)
    f2_cache = fd.apply(fd.init(F2.TINY, seed=SEED), **kv)[1]
    extract = Q21.inputs(Q21.TINY, "edit", 3, ragged=True, seed=3)
    q21_cache = fd.apply(fd.init(Q21.TINY, seed=SEED), **extract, kv_cache="extract")[1]
    return [
        ("flux1/odd-2h", F1.TINY, F1.inputs(F1.TINY, batch=3, txt_len=7, h=3, w=3, seed=1)),
        ("flux2/odd", F2.TINY, F2.inputs(F2.TINY, batch=3, txt_len=7, h=3, w=3, seed=1)),
        ("flux2/klein-2h", F2.TINY_KLEIN, F2.inputs(F2.TINY_KLEIN, batch=2, txt_len=5, h=3, w=3, seed=3)),
        ("flux2/kv-extract", F2.TINY, kv),
        ("flux2/kv-cached", F2.TINY, F2.next_step(kv, f2_cache)),
        ("qwen/holes", Q.TINY, Q.inputs(Q.TINY, batch=2, txt_len=9, img_shapes=[(1, 3, 3)], holes=True, seed=2)),
        ("qwen/edit", Q.TINY_EDIT, Q.inputs(Q.TINY_EDIT, batch=2, txt_len=5, img_shapes=[(1, 3, 3), (1, 2, 3)])),
        ("flux3/refs", F3.TINY, F3.inputs(F3.TINY, 3, 5, 3, 3, ref_hw=(1, 3), seed=1)),
        ("qwen21/extract", Q21.TINY, {**extract, "kv_cache": "extract"}),
        (
            "qwen21/cached",
            Q21.TINY,
            {**extract, "x": extract["x"] * 0.5, "t": extract["t"] * 0.5, "kv_cache": q21_cache},
        ),
    ]


GRAD_CASES = {  # case -> the mesh its gradients run on (one each keeps the spawn short)
    "flux1/odd-2h": dict(ring=4),
    "qwen/holes": dict(sp=2, ring=2),
    "qwen21/extract": dict(tp=2, ring=2),
}


def fits(config, shape) -> bool:
    """Heads split over tp, then over sp (Ulysses; the ring needs no division); TINY_KLEIN's
    single blocks cannot shard over tp (its MLP width is no multiple of its inner width)."""
    tp, sp = shape.get("tp", 1), shape.get("sp", 1)
    whole_units = tp == 1 or getattr(config, "mlp_hidden_dim", 0) % config.inner_dim == 0
    return config.num_attention_heads % (tp * sp) == 0 and whole_units


def tensors(result) -> list:
    if isinstance(result, torch.Tensor):
        return [result]
    return [result[0]] + list(result[1].flat().values())


def _weights(out):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(11))


def _grads(params, kw, w) -> dict:
    """d sum(apply * w) / d params, full tensors (``unshard`` of sharded grads)."""
    for leaf in params.leaves():
        leaf.requires_grad_()
    (fd.apply(params, **kw[0] if isinstance(kw, tuple) else kw) * w).sum().backward()
    grads = pytree.tree_map(lambda t: torch.zeros_like(t) if t.grad is None else t.grad.detach(), params)
    return sharding.unshard(grads).flat() if sharding.local_view(params)[1] is not None else grads.flat()


def _sample(params, pipe):
    """FLUX.1 tiny with true CFG and a First-Block Cache: (latents, the cache's decisions)."""
    kw = dict(height=48, width=48, steps=6, seed=5, true_cfg=2.0, negative_prompt="blurry", output_type="latent")
    run = fd.CacheRun(fd.FirstBlockCache(0.9))
    return fd.sample(params, pipe, "a red cube", cache=run, max_sequence_length=16, **kw), run.decisions


def _lora(config):
    """A rank-2 LoRA on every linear layer, B nonzero (PEFT's init otherwise)."""
    from functional_dit import lora

    return lora.init(config, rank=2, targets=tuple(lora.linear_modules(config)), alpha=4.0, seed=3, zero_b=False)


def _work(rank, world, cases, grad_cases, lora_case, compile_case):
    from functional_dit import tiny

    res = {}
    for shape in MESHES:
        mesh = sharding.make_mesh(**shape)
        for name, config, kw in cases:
            if fits(config, shape):
                res[("out", str(shape), name)] = tensors(
                    fd.apply(sharding.shard_params(fd.init(config, seed=SEED), mesh), **kw)
                )
        for name, config, kw, w in grad_cases:
            if GRAD_CASES[name] == shape:
                res[("grad", str(shape), name)] = _grads(sharding.shard_params(fd.init(config, seed=SEED), mesh), kw, w)
        if shape == LORA_MESH:
            config, kw, ad = lora_case
            s = sharding.shard_params(fd.init(config, seed=SEED), mesh)
            res[("lora", str(shape))] = fd.apply(s, **kw, lora=[(sharding.shard_params(ad, mesh), 0.7)])
    pipe = tiny.pipeline("flux")
    mesh = sharding.make_mesh(sp=2, ring=2)
    res["sample"] = _sample(sharding.shard_params(fd.from_diffusers(pipe.transformer), mesh), pipe)
    res["compiled"] = _compiled(mesh, *compile_case)
    return res


def _compiled(mesh, config, kw):
    """The compiled `fd.apply` on ``mesh``: fullgraph (no graph break: the ring's passes
    are functional collectives), aot_eager and dynamic=False as test_sharding's compile
    test (dynamo and AOTAutograd, no inductor)."""
    s = sharding.shard_params(fd.init(config, seed=SEED), mesh)
    return torch.compile(fd.apply, fullgraph=True, dynamic=False, backend="aot_eager")(s, **kw)


def test_ring_and_usp_equal_one_process():
    import cases_flux1 as F1

    from functional_dit import tiny

    cases = _cases()
    refs = {n: tensors(fd.apply(fd.init(c, seed=SEED), **kw)) for n, c, kw in cases}
    grad_cases, grad_refs = [], {}
    for name, config, kw in cases:
        if name in GRAD_CASES:
            kw = {k: v for k, v in kw.items() if k != "kv_cache"} if name == "qwen21/extract" else kw
            w = _weights(fd.apply(fd.init(config, seed=SEED), **kw))
            grad_cases.append((name, config, kw, w))
            grad_refs[name] = _grads(fd.init(config, seed=SEED), kw, w)
    lkw = F1.inputs(F1.TINY, batch=2, txt_len=5, h=3, w=3, seed=9)
    ad = _lora(F1.TINY)
    lora_ref = fd.apply(fd.init(F1.TINY, seed=SEED), **lkw, lora=[(ad, 0.7)])
    pipe = tiny.pipeline("flux")
    sample_ref = _sample(fd.from_diffusers(pipe.transformer), pipe)

    one_block = dataclasses.replace(F1.TINY, num_layers=1, num_single_layers=1)
    ckw = F1.inputs(one_block, batch=2, txt_len=5, h=2, w=3, seed=1)  # 5 + 6 tokens over 4 ranks: padded
    compile_ref = fd.apply(fd.init(one_block, seed=SEED), **ckw)

    per_rank = spawn(_work, 4, cases, grad_cases, (F1.TINY, lkw, ad), (one_block, ckw), init=False, timeout=600)

    r0 = per_rank[0]
    for shape in MESHES:  # every family ran on every mesh
        ran = {k[2].split("/")[0] for k in r0 if k[0] == "out" and k[1] == str(shape)}
        assert ran == {"flux1", "flux2", "qwen", "flux3", "qwen21"}, (shape, ran)
    for key, out in r0.items():
        if key[0] == "out":
            for i, (o, want) in enumerate(zip(out, refs[key[2]], strict=True)):
                torch.testing.assert_close(o, want, **FP32, msg=lambda m, k=key, i=i: f"{k} tensor {i}: {m}")
            assert all(all(torch.equal(a, b) for a, b in zip(r[key], out)) for r in per_rank), f"{key}: ranks differ"
        elif key[0] == "grad":
            for k, g in grad_refs[key[2]].items():
                err = (out[k] - g).abs().max() / g.abs().max().clamp_min(1e-30)
                assert err <= REL, f"{key} grad {k}: off by {err:.2e} of its max"
        elif key[0] == "lora":
            torch.testing.assert_close(out, lora_ref, **FP32)
    assert sum(k[0] == "grad" for k in r0 if isinstance(k, tuple)) == len(GRAD_CASES)
    assert ("lora", str(LORA_MESH)) in r0
    latents, decisions = sample_ref
    assert any(not c for d in decisions for c in d), decisions  # the cache did skip steps
    for r in per_rank:
        assert r["sample"][1] == decisions
        torch.testing.assert_close(r["sample"][0], latents, **FP32)
        assert torch.equal(r["sample"][0], r0["sample"][0])
        # compiled vs one process at the fp32 tolerance, not bitwise vs eager: eager inference
        # runs the ring blocks in torch's fused CPU kernel, compiled code the exact maths
        torch.testing.assert_close(r["compiled"], compile_ref, **FP32)


# ----------------------------------------------------------------------------- in process


def test_block_kernel_and_merge_equal_sdpa():
    """`attention_lse` over key blocks, merged by `sharding.merge`, equals SDPA over all
    keys (a key-padding bias, a fully masked block and a position mask included)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 8, generator=g) for _ in range(3))
    bias = torch.zeros(2, 5)
    bias[0, 1:3] = float("-inf")
    bias[1, 3:] = float("-inf")  # batch 1: the block (3, 4) below has no key left
    mask = torch.where(torch.rand(5, 5, generator=g) < 0.3, float("-inf"), 0.0)
    mask[:, 0] = 0  # every query keeps a key
    full = bias[:, None, None] + mask
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=full).transpose(1, 2)
    for grad in (False, True):  # the fused CPU kernel, then the exact maths autograd differentiates
        q.requires_grad_(grad)
        out = lse = None
        for lo, hi in ((0, 3), (3, 5)):
            o, l_ = L.attention_lse(q, k[:, lo:hi], v[:, lo:hi], bias[:, lo:hi], mask[:, lo:hi])
            out, lse = (o, l_) if out is None else sharding.merge(out, lse, o, l_)
        torch.testing.assert_close(out, ref, **FP32)
        empty = L.attention_lse(q, k[:, 3:], v[:, 3:], bias[:, 3:])
        assert torch.equal(empty[0][1], torch.zeros_like(empty[0][1])) and torch.isinf(empty[1][1]).all()
        if grad:  # finite gradients through the empty block
            q.grad = None
            (out.sum() + empty[0].sum()).backward()
            assert torch.isfinite(q.grad).all()


def test_plan_heads_and_mesh_errors_name_values():
    """24 heads: tp=2 x sp=8 cannot split them (named, with the ring as the way out);
    tp=2 x sp=4 x ring=4 (32 ranks) can; make_mesh refuses a bad ring degree."""
    config = fd.PRESETS["flux1-dev"]
    with pytest.raises(ValueError, match=r"12 heads per rank .* sp=8; a ring axis"):
        sharding.plan(config, {"tp": 2, "sp": 8})
    sharding.plan(config, {"tp": 2, "sp": 4, "ring": 4})
    with pytest.raises(ValueError, match="ring: expected a positive int, got 0"):
        sharding.make_mesh(ring=0)


def test_sequence_parallel_table_example():
    """examples/sequence_parallel_table.py: Ulysses is refused exactly where 24 heads do
    not divide by 16; ring and USP fill every row; the ring sends more than Ulysses."""
    import sys

    sys.path.insert(0, "examples")
    try:
        import sequence_parallel_table as T
    finally:
        sys.path.remove("examples")
    lines = T.table()
    assert len(lines) == 2 + 3 * 3 * 2
    for line in lines[2:]:
        name, _, n, uly, ring, usp = (c.strip() for c in line.strip("|").split("|"))
        heads = fd.PRESETS[name].num_attention_heads
        assert (uly == "—") == (heads % int(n) != 0), line
        assert "—" not in (ring, usp), line
        if uly != "—":
            assert float(ring.split("/")[1]) > float(uly.split("/")[1]), line

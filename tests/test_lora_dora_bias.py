"""DoRA and LoRA biases (PEFT's ``use_dora`` and ``lora_bias``) against PEFT itself.

The oracle is a stock diffusers transformer with ``add_adapter(peft.LoraConfig(use_dora=
True or lora_bias=True, init_lora_weights=False))`` on every linear layer, its magnitudes
and biases then drawn at random (PEFT's initial magnitude ``||W + s B A||`` makes DoRA's
factor 1 everywhere, and its initial bias is zero: neither would show), at a
``set_adapters`` weight of 0.7. The stock ``save_lora_adapter`` writes it, `lora.load`
reads it, and ``fd.apply(..., lora=[(adapter, 0.7)])`` must equal the stock forward and
the stock gradients of every factor (A, B, bias, magnitude); `lora.merge` must equal the
on-the-fly result (or refuse a bias on a layer without one, as PEFT's merge does); and
`lora.save` writes a file the stock ``load_lora_adapter`` reads back to the same output.
Under tp=2 (one gloo spawn) the on-the-fly and merged outputs and the factor gradients
equal the single-device ones.
"""

from __future__ import annotations

import importlib
import json

import peft
import pytest
import torch
from _dist import spawn
from oracle import diffusers_model, max_err
from safetensors.torch import save_file

import functional_dit as fd
import functional_dit.lora as lora
import sharding
from sharding.tree import nest

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md: fp32 parity with diffusers
# Gradients sum over every token and go through the whole model: a few more fp32 roundings
# than the forward (fp32 eps ~1.2e-7, gradients of size ~1e-2..1).
GRAD = dict(rtol=1e-4, atol=1e-5)
WEIGHT = 0.7  # the set_adapters weight / our scale
FAMILIES = ["flux1", "flux2", "qwenimage"]
VARIANTS = {"dora": dict(use_dora=True), "bias": dict(lora_bias=True)}


def _case(name):
    cases = importlib.import_module(f"cases_{name}")
    return cases, cases.TINY


def _call(params, kw, **extra):
    kw = dict(kw)
    return fd.apply(params, kw.pop("x"), kw.pop("t"), kw.pop("txt"), **kw, **extra)


def _loss(out):
    return (out.double() ** 2).mean()


def _stock_adapter(module, params, variant, seed=5):
    """PEFT adapter "x" on every linear layer of ``module``, factors random, weight 0.7."""
    torch.manual_seed(seed)
    targets = sorted(lora.linear_modules(params.config))
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False, **VARIANTS[variant])
    module.add_adapter(cfg, adapter_name="x")
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "lora_magnitude_vector" in n:
                p.mul_(torch.rand_like(p) + 0.5)  # the DoRA factor m / ||W + sBA|| in [0.5, 1.5)
            elif n.endswith("lora_B.x.bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    module.set_adapters("x", WEIGHT)


def _ours(peft_name: str, adapter: str = "x") -> str:
    """PEFT's parameter name -> our Adapter key (the adapter name dropped, as saved)."""
    name = peft_name.replace(f".lora_magnitude_vector.{adapter}.weight", ".lora_magnitude_vector")
    return name.replace(f".{adapter}.", ".")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", FAMILIES)
def test_matches_peft_forward_gradients_merge_and_files(name, variant, tmp_path):
    cases, config = _case(name)
    module, params = diffusers_model(config, seed=3)
    _stock_adapter(module, params, variant)
    module.save_lora_adapter(str(tmp_path / "stock"), adapter_name="x")
    ad = lora.load(tmp_path / "stock", params)  # ours reads the stock file
    assert (ad.config.use_dora, ad.config.lora_bias) == (variant == "dora", variant == "bias")
    kw = cases.inputs(config)
    ref = module(**cases.diffusers_kwargs(kw))[0]
    _loss(ref).backward()
    want = {_ours(n): p.grad for n, p in module.named_parameters() if p.requires_grad}
    assert set(want) == set(ad.flat())
    for v in ad.leaves():
        v.requires_grad_()
    fly = _call(params, kw, lora=[(ad, WEIGHT)])
    _loss(fly).backward()
    base = _call(params, kw).detach()
    assert max_err(ref, base) > 1e-2  # the adapter changes the output
    torch.testing.assert_close(fly, ref, **FP32)
    for k, g in want.items():  # None for a layer the tiny inputs do not reach, in both
        torch.testing.assert_close(ad.flat()[k].grad, g, **GRAD, msg=lambda m, k=k: f"{k}: {m}")
    errs = [max_err(ad.flat()[k].grad, g) for k, g in want.items() if g is not None]
    print(f"{name} {variant}: max |ours - PEFT| forward {max_err(fly, ref):.2e}, grads {max(errs):.2e}")
    ad = ad.replace(torch.utils._pytree.tree_map(lambda v: v.detach(), ad.tree))
    _check_merge(params, ad, kw, fly.detach(), variant)
    _check_our_file(config, ad, kw, ref.detach(), cases, tmp_path)


def _check_merge(params, ad, kw, fly, variant):
    """merge == attach; a bias on a layer without one is refused, as PEFT's merge does."""
    biasless = [m for m in lora.linear_modules(params.config) if params.flat().get(f"{m}.bias") is None]
    if variant == "bias" and biasless:
        with pytest.raises(ValueError, match="has a lora_B bias .* the base layer has none"):
            lora.merge(params, ad, WEIGHT)
        return
    with torch.no_grad():
        merged = _call(lora.merge(params, ad, WEIGHT), kw)
    torch.testing.assert_close(merged, fly, **FP32)


def _check_our_file(config, ad, kw, ref, cases, tmp_path):
    """`lora.save` -> the stock ``load_lora_adapter`` (a fresh module) gives the stock
    output; `lora.load` of it gives the adapter back bitwise."""
    path = tmp_path / "ours.safetensors"
    lora.save(ad, path)
    back = lora.load(path, fd.init(config, seed=3))
    assert back.config.use_dora == ad.config.use_dora and back.config.lora_bias == ad.config.lora_bias
    assert all(torch.equal(back.flat()[k], v) for k, v in ad.flat().items()) and set(back.flat()) == set(ad.flat())
    fresh, _ = diffusers_model(config, seed=3)
    fresh.load_lora_adapter(str(tmp_path), weight_name="ours.safetensors", prefix="transformer", adapter_name="y")
    fresh.set_adapters("y", WEIGHT)
    with torch.no_grad():
        torch.testing.assert_close(fresh(**cases.diffusers_kwargs(kw))[0], ref, **FP32)


def test_bad_input_is_refused(tmp_path):
    cases, config = _case("flux1")
    params = fd.init(config, seed=0)
    with pytest.raises(ValueError, match="lora_bias: a LoRA bias is not supported with DoRA"):
        lora.init(params, lora_bias=True, use_dora=True)
    with pytest.raises(ValueError, match="use_dora=True needs the base Params"):
        lora.init(config, use_dora=True)
    ad = lora.init(params, rank=2, use_dora=True, zero_b=False)
    state = lora.to_state_dict(ad)
    key = next(k for k in state if k.endswith("lora_magnitude_vector"))
    with pytest.raises(ValueError, match="no lora_magnitude_vector"):
        lora.from_state_dict({k: v for k, v in state.items() if k != key}, params)
    with pytest.raises(ValueError, match=r"expected lora_magnitude_vector of shape \(\d+,\), got \(3,\)"):
        lora.from_state_dict({**state, key: torch.ones(3)}, params)
    kohya = {"lora_unet_single_blocks_0_linear1.lora_down.weight": torch.zeros(2, 32)}
    kohya["lora_unet_single_blocks_0_linear1.dora_scale"] = torch.ones(1, 32)
    save_file(kohya, tmp_path / "k.safetensors")
    with pytest.raises(ValueError, match="dora_scale"):
        lora.load(tmp_path / "k.safetensors", params)
    meta = {lora.METADATA_KEY: json.dumps({"transformer.use_dora": True, "transformer.lora_alpha": 2})}
    plain = lora.to_state_dict(lora.init(params, rank=2))
    with pytest.raises(ValueError, match="no lora_magnitude_vector"):
        lora.from_state_dict(plain, params, meta)
    bare = ad.replace(lora.init(params, rank=2).tree)  # DoRA config, factors only
    with pytest.raises(ValueError, match="has use_dora=True but its tree has no .*lora_magnitude_vector"):
        _call(params, cases.inputs(config), lora=[(bare, 1.0)])
    biased = lora.to_state_dict(lora.init(params, rank=2, lora_bias=True))
    meta = {lora.METADATA_KEY: json.dumps({"lora_bias": False, "lora_alpha": 2})}
    with pytest.raises(ValueError, match="lora_B.bias keys in the file, but its metadata says lora_bias=False"):
        lora.from_state_dict(biased, params, meta)


def test_init_matches_peft_initialisation():
    """`lora.init(use_dora=True)` starts at PEFT's magnitude ||W + sBA|| (DoRA factor 1),
    so the adapted output equals plain LoRA's at the same A and B; a zero bias adds nothing."""
    cases, config = _case("flux2")
    params = fd.init(config, seed=0)
    kw = cases.inputs(config)
    dora = lora.init(params, rank=2, alpha=4.0, use_dora=True, zero_b=False, seed=2)
    plain = lora.init(params, rank=2, alpha=4.0, zero_b=False, seed=2)
    biased = lora.init(params, rank=2, alpha=4.0, lora_bias=True, seed=2)
    with torch.no_grad():
        want = _call(params, kw, lora=[(plain, 1.0)])
        torch.testing.assert_close(_call(params, kw, lora=[(dora, 1.0)]), want, **FP32)
        torch.testing.assert_close(_call(params, kw, lora=[(biased, 1.0)]), _call(params, kw), **FP32)


@pytest.mark.parametrize("init", [True, False])
def test_adapter_new_adapter_initialises_as_peft(init):
    """The diffusers adapter's ``add_adapter`` builds its `lora.Adapter` with
    ``new_adapter``: a zero bias (``init_lora_weights=True``; else random, non-zero) and
    DoRA's magnitude ``||W + s B A||`` per row, as PEFT's ``add_adapter`` sets them."""
    from functional_dit.pipelines.adapter._peft import new_adapter

    _, config = _case("flux1")
    module, params = diffusers_model(config, seed=3)
    targets = ["to_q", "to_out.0", "proj_out"]
    for variant in ("dora", "bias"):
        cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=init, **VARIANTS[variant])
        ad = new_adapter(params, cfg)
        assert (ad.config.use_dora, ad.config.lora_bias) == (variant == "dora", variant == "bias")
        assert {m for m, _, _ in ad.config.modules} == {n[: -len(".weight")] for n, _ in _peft_targets(module, targets)}
        for m, _, _ in ad.config.modules:
            A, B = ad.factors(m)
            W = params.flat()[f"{m}.weight"]
            if variant == "dora":  # PEFT's DoraLinearLayer.update_layer at the same W, A, B
                want = torch.linalg.norm(W + ad.config.scale(m) * (B @ A), dim=1)
                torch.testing.assert_close(ad.magnitude(m), want, **FP32)
            else:
                assert (ad.bias(m).abs().sum() > 0) != init, m
    module.add_adapter(peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, use_dora=True), adapter_name="d")
    ours = new_adapter(params, peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, use_dora=True))
    stock = {_ours(n, "d"): p for n, p in module.named_parameters() if "lora_magnitude_vector" in n}
    assert set(stock) == {k for k in ours.flat() if k.endswith("lora_magnitude_vector")}
    for k, v in stock.items():  # B = 0: both ||W||, whatever the RNG drew for A
        torch.testing.assert_close(ours.flat()[k], v, **FP32)


def _peft_targets(module, targets):
    """The linear weights PEFT's name matching picks: the module name or a dotted suffix."""
    names = [n[: -len(".weight")] for n, p in module.named_parameters() if n.endswith(".weight") and p.ndim == 2]
    return [
        (n + ".weight", None) for n in names if "lora" not in n and any(n == t or n.endswith("." + t) for t in targets)
    ]


# ----------------------------------------------------------------------------- tensor parallelism

TP_CASES = {"flux1": "dora", "flux2": "dora", "qwenimage": "bias"}  # flux2: fused blocks, no base biases


def _tp_adapter(config, variant):
    params = fd.init(config, seed=11)
    every = tuple(lora.linear_modules(config))
    ad = lora.init(params, rank=4, targets=every, alpha=8.0, seed=1, zero_b=False, **VARIANTS[variant])
    g = torch.Generator().manual_seed(2)
    flat = {
        k: v * (torch.rand(v.shape, generator=g) + 0.5) if k.endswith("magnitude_vector") else v
        for k, v in ad.flat().items()
    }
    return params, ad.replace(nest(flat))


def _mergeable(params, variant) -> bool:
    return variant == "dora" or all(
        params.flat().get(f"{m}.bias") is not None for m in lora.linear_modules(params.config)
    )


def _tp_work(rank, world, cases):
    mesh = sharding.make_mesh(tp=world)
    out = {}
    for name, (config, kw, variant) in cases.items():
        params, ad = _tp_adapter(config, variant)
        s, sa = sharding.shard_params(params, mesh), sharding.shard_params(ad, mesh)
        with torch.no_grad():
            fly = _call(s, kw, lora=[(sa, WEIGHT)])
            merged = _call(lora.merge(s, sa, WEIGHT), kw) if _mergeable(params, variant) else None
        for v in sa.leaves():
            v.requires_grad_()
        _loss(_call(s, kw, lora=[(sa, WEIGHT)])).backward()
        grads = sharding.unshard(torch.utils._pytree.tree_map(lambda v: v.grad, sa)).flat()
        out[name] = dict(fly=fly, merged=merged, grads=grads)
    return out


def test_tp2_dora_and_bias_equal_single_device():
    cases, refs = {}, {}
    for name, variant in TP_CASES.items():
        C, config = _case(name)
        kw = C.inputs(config, batch=2, txt_len=5, seed=3)
        kw.pop("kv_cache", None)
        params, ad = _tp_adapter(config, variant)
        for v in ad.leaves():
            v.requires_grad_()
        out = _call(params, kw, lora=[(ad, WEIGHT)])
        _loss(out).backward()
        refs[name] = (out.detach(), {k: v.grad for k, v in ad.flat().items()})
        cases[name] = (config, kw, variant)
    per_rank = spawn(_tp_work, 2, cases, init=False, timeout=400)
    for rank, res in enumerate(per_rank):
        for name, (out, grads) in refs.items():
            r = res[name]
            torch.testing.assert_close(r["fly"], out, **FP32)  # sharded vs unsharded at the fp32 tolerance
            if _mergeable(fd.init(cases[name][0], seed=11), cases[name][2]):
                torch.testing.assert_close(r["merged"], out, **FP32)
            assert set(r["grads"]) == set(grads)
            for k, g in grads.items():
                torch.testing.assert_close(
                    r["grads"][k], g, **GRAD, msg=lambda m, k=k, rank=rank: f"rank {rank} {k}: {m}"
                )
            print(f"{name} {TP_CASES[name]} rank {rank}: max |tp2 - single| {max_err(r['fly'], out):.2e}")

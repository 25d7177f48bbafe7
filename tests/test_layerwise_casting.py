"""Layerwise casting: `fd.layerwise_cast` under `fd.apply`, and
`fd.DiffusersTransformer.enable_layerwise_casting` against the stock diffusers method.

The oracle for the adapter is the stock module at the same weights with its own
``enable_layerwise_casting`` (diffusers' hooks): the same leaves end up in the storage
dtype (compared leaf by leaf, with the default, given and class skip rules, PEFT factors
included), holding the same bytes; the outputs match; ``dtype``, the memory footprint and
the saved checkpoint's dtypes are the stock ones. The oracle for the core transform is
`fd.apply` on the same params dequantized first: casting at each op reads exactly the
values a dequantized copy holds, so outputs and gradients are bitwise equal.
"""

from __future__ import annotations

import dataclasses

import diffusers
import peft
import pytest
import torch
from _dist import spawn
from cases_flux1 import diffusers_kwargs as flux1_kwargs
from cases_flux1 import inputs as flux1_inputs
from cases_flux2 import TINY as FLUX2
from cases_flux2 import diffusers_kwargs as flux2_kwargs
from cases_flux2 import inputs as flux2_inputs
from cases_qwenimage import diffusers_kwargs as qwen_kwargs
from cases_qwenimage import inputs as qwen_inputs
from oracle import assert_bf16_equal, max_err
from safetensors import safe_open

import functional_dit as fd
from functional_dit import CastTensor
from functional_dit.nn.layerwise import stored_leaf

FP8 = torch.float8_e4m3fn
FLUX1, QWEN = fd.PRESETS["flux1-tiny"], fd.PRESETS["qwen-image-tiny"]
CASES = {
    "flux1": (FLUX1, lambda dtype: flux1_kwargs(flux1_inputs(FLUX1, dtype=dtype))),
    "flux2": (FLUX2, lambda dtype: flux2_kwargs(flux2_inputs(FLUX2, dtype=dtype))),
    "qwenimage": (QWEN, lambda dtype: qwen_kwargs(qwen_inputs(QWEN, dtype=dtype))),
}
# Adapter vs stock forward, both reading the same fp8 weights cast to the compute dtype. fp32:
# FLUX.1 and FLUX.2 run the stock ops in the stock order (measured bitwise on an AMD EPYC; the
# bound allows GEMM blockings that differ by CPU and shape); Qwen-Image's modulation is one
# batched matmul where the stock runs one per block (measured <= 4.8e-7 at |y| ~ 2, LoRA
# included). bf16: `assert_bf16_equal`, bitwise on a CPU (the README's bf16 claim).
FP32 = {"flux1": 1e-6, "flux2": 1e-6, "qwenimage": 1e-6}


def assert_close(got, want, name: str) -> None:
    if want.dtype == torch.bfloat16:
        assert_bf16_equal(got, want)
    else:
        assert got.dtype == want.dtype == torch.float32 and max_err(got, want) <= FP32[name]


LORA = dict(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False)


def pair(name: str, dtype=torch.float32, seed: int = 0):
    """(stock module, adapter over a copy of its weights), both in ``dtype``, eval mode."""
    cfg = fd.config_to_diffusers(CASES[name][0])
    torch.manual_seed(seed)
    stock = getattr(diffusers, cfg.pop("_class_name"))(**cfg).to(dtype).eval()
    ad = fd.DiffusersTransformer(torch.utils._pytree.tree_map(torch.clone, fd.from_diffusers(stock)))
    return stock, ad


def run(model, name: str, dtype) -> torch.Tensor:
    with torch.no_grad():
        return model(**CASES[name][1](dtype))[0]


def stored_names(stock) -> set[str]:
    return {n for n, p in stock.named_parameters() if p.dtype == FP8}


def cast_names(ad) -> set[str]:
    return {n for n, p in ad.named_parameters() if isinstance(p, CastTensor)}


def copy_factors(src, dst) -> None:
    """Give ``dst``'s PEFT factors ``src``'s values (same names: both hold them as PEFT does)."""
    want = {n: p for n, p in src.named_parameters() if ".lora_" in n}
    got = {n: p for n, p in dst.named_parameters() if ".lora_" in n}
    assert sorted(want) == sorted(got) and want
    with torch.no_grad():
        for n, p in got.items():
            p.copy_(want[n])


# ---------------------------------------------------------------- the adapter against the stock method


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_enable_layerwise_casting_as_stock(name, compute):
    stock, ad = pair(name, compute)
    stock.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=compute)
    ad.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=compute)
    assert cast_names(ad) == stored_names(stock)  # the same leaves, by the stock rules
    assert 0 < len(cast_names(ad)) < len(list(ad.parameters()))  # some cast, the norms and embeddings not
    own = dict(ad.named_parameters())
    for n, p in stock.named_parameters():  # the same bytes in the same dtype
        mine = own[n].stored if isinstance(own[n], CastTensor) else own[n]
        assert mine.dtype == p.dtype and torch.equal(mine.view(torch.uint8), p.view(torch.uint8)), n
    assert all(own[n].dtype == compute for n in cast_names(ad))  # read as the compute dtype
    assert ad.dtype == stock.dtype == compute
    assert ad.get_memory_footprint() == stock.get_memory_footprint()
    assert_close(run(ad, name, compute), run(stock, name, compute), name)


@pytest.mark.parametrize("preset", ["flux3-tiny", "qwen-image-2.1-tiny"])
def test_newer_families_as_stock(preset):
    """FLUX.3 and Qwen-Image 2.1: the same stock choice, bytes and outputs (fp32; the adapter
    equals the stock module there within 1.2e-6 uncast, README; measured <= 4.8e-7 cast)."""
    import cases_flux3
    import cases_qwenimage21

    case = {"flux3-tiny": cases_flux3, "qwen-image-2.1-tiny": cases_qwenimage21}[preset]
    cfg = fd.config_to_diffusers(fd.PRESETS[preset])
    torch.manual_seed(0)
    stock = getattr(diffusers, cfg.pop("_class_name"))(**cfg).eval()
    ad = fd.DiffusersTransformer(torch.utils._pytree.tree_map(torch.clone, fd.from_diffusers(stock)))
    for m in (stock, ad):
        m.enable_layerwise_casting(storage_dtype=FP8)
    assert cast_names(ad) == stored_names(stock) and cast_names(ad)
    own = dict(ad.named_parameters())
    assert all(
        torch.equal(own[n].stored.view(torch.uint8), p.view(torch.uint8))
        for n, p in stock.named_parameters()
        if n in cast_names(ad)
    )
    kw = case.diffusers_kwargs(case.inputs(case.TINY))
    with torch.no_grad():
        assert max_err(ad(**kw)[0], stock(**kw)[0]) <= 1.2e-6


@pytest.mark.parametrize("name", sorted(CASES))
def test_lora_before_and_after_casting(name):
    """The harness's order (add_adapter, then enable) and the other one: the factors stay in
    the compute dtype by default, as stock, and the output is the stock module's."""
    stock, ad = pair(name)
    stock.add_adapter(peft.LoraConfig(**LORA))
    ad.add_adapter(peft.LoraConfig(**LORA))
    copy_factors(stock, ad)
    stock.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    ad.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    assert cast_names(ad) == stored_names(stock)
    assert any(".base_layer." in n for n in cast_names(ad)) and not any(".lora_" in n for n in cast_names(ad))
    want = run(stock, name, torch.float32)
    assert_close(run(ad, name, torch.float32), want, name)

    _, late = pair(name)  # cast first, adapter after: the same weights and factors, the same output
    late.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    late.add_adapter(peft.LoraConfig(**LORA))
    copy_factors(stock, late)
    assert cast_names(late) == {n for n in cast_names(ad)}
    assert_close(run(late, name, torch.float32), want, name)


def test_user_patterns_and_classes_as_stock():
    """Given patterns replace the defaults (PEFT's factors are then cast too, as stock);
    classes skip a module and everything under it; anchored patterns see each level."""
    block = diffusers.models.transformers.transformer_flux.FluxTransformerBlock
    for kw in (
        dict(skip_modules_pattern=("^proj_out$", "single_transformer_blocks.0", "norm")),
        dict(skip_modules_pattern=("x_embedder",), skip_modules_classes=(block,)),
        dict(skip_modules_classes=(torch.nn.Linear,)),  # every linear: nothing left to cast
    ):
        stock, ad = pair("flux1")
        stock.add_adapter(peft.LoraConfig(**LORA))
        ad.add_adapter(peft.LoraConfig(**LORA))
        copy_factors(stock, ad)
        stock.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32, **kw)
        ad.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32, **kw)
        assert cast_names(ad) == stored_names(stock), kw
        if "skip_modules_pattern" in kw:
            assert any(".lora_A." in n for n in cast_names(ad))  # not protected by the defaults any more
        assert_close(run(ad, "flux1", torch.float32), run(stock, "flux1", torch.float32), "flux1")
    assert cast_names(ad) == set()


def test_fuse_lora_after_casting():
    """fuse_lora folds the adapter into the dequantized weight and stores the result, rounded
    to the storage dtype once; unfuse subtracts it again (rounded again: not bitwise)."""
    _, ad = pair("flux2")
    ad.add_adapter(peft.LoraConfig(**LORA))
    ad.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    on_the_fly = run(ad, "flux2", torch.float32)
    layer = ad.get_submodule("transformer_blocks.0.attn.to_q")
    w = layer.base_layer.weight
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    want = (w.stored.float() + layer.scaling["default"] * (b @ a)).to(FP8)
    ad.fuse_lora()
    w = layer.base_layer.weight
    assert isinstance(w, CastTensor) and w.stored.dtype == FP8
    assert torch.equal(w.stored.view(torch.uint8), want.view(torch.uint8))
    fused = run(ad, "flux2", torch.float32)
    # the merged weights are rounded to fp8 once more (<= 2^-4 relative each, mostly averaging
    # out over a dot product): measured 1.1e-3 of the output's largest entry; bound at 2%
    assert 0 < max_err(fused, on_the_fly) < 0.02 * on_the_fly.abs().max()
    ad.unfuse_lora()
    assert isinstance(layer.base_layer.weight, CastTensor)


def test_save_pretrained_writes_the_stored_dtype(tmp_path):
    stock, ad = pair("qwenimage")
    stock.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    ad.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    stock.save_pretrained(tmp_path / "stock")
    ad.save_pretrained(tmp_path / "ours")

    def dtypes(folder):
        with safe_open(str(folder / "diffusion_pytorch_model.safetensors"), "pt") as f:
            return {k: f.get_slice(k).get_dtype() for k in f.keys()}

    assert dtypes(tmp_path / "ours") == dtypes(tmp_path / "stock")
    cls = type(stock)
    a = cls.from_pretrained(tmp_path / "ours", torch_dtype=torch.float32).state_dict()
    b = cls.from_pretrained(tmp_path / "stock", torch_dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_device_moves_keep_the_storage_and_dtype_changes_are_refused():
    _, ad = pair("flux1")
    ad.enable_layerwise_casting(storage_dtype=FP8)  # compute_dtype None: the model's dtype
    assert ad.dtype == torch.float32
    before = {n: p.stored.clone() for n, p in ad.named_parameters() if isinstance(p, CastTensor)}
    ad.to("cpu")
    for bad in (lambda: ad.to(torch.bfloat16), ad.half, lambda: ad.to("cpu", torch.float16)):
        with pytest.raises(ValueError, match=r"dtype: layerwise casting is enabled .* not supported"):
            bad()
    now = dict(ad.named_parameters())
    assert all(isinstance(now[n], CastTensor) and torch.equal(now[n].stored, v) for n, v in before.items())
    assert all(p.dtype == torch.float32 for p in ad.parameters())  # nothing half-converted
    ad.to("meta")  # a device move: still stored as fp8, on the new device
    p = ad.get_submodule("x_embedder").weight
    assert isinstance(p, CastTensor) and p.stored.dtype == FP8 and p.device.type == "meta"


def test_refusals():
    _, ad = pair("flux1")
    with pytest.raises(ValueError, match="storage_dtype: expected a floating torch.dtype"):
        ad.enable_layerwise_casting(storage_dtype=torch.int8)
    with pytest.raises(ValueError, match="compute_dtype: expected None or one of"):
        ad.enable_layerwise_casting(compute_dtype=FP8)
    with pytest.raises(ValueError, match="skip_modules_pattern: expected None or a tuple"):
        ad.enable_layerwise_casting(skip_modules_pattern="norm")
    with pytest.raises(ValueError, match="skip_modules_classes: expected None or a tuple of classes"):
        ad.enable_layerwise_casting(skip_modules_classes=("RMSNorm",))
    # fd.apply computes in one dtype: fp32 norms with bf16 linears are refused (stock keeps them fp32)
    with pytest.raises(ValueError, match=r"compute_dtype: fd.apply computes in one dtype.*float32"):
        ad.enable_layerwise_casting(compute_dtype=torch.bfloat16)
    assert not cast_names(ad) and ad.layerwise_hook() is None  # a refusal changes nothing
    ad.enable_layerwise_casting()
    with pytest.raises(ValueError, match="enable_layerwise_casting: layerwise casting is already enabled"):
        ad.enable_layerwise_casting()
    with pytest.raises(ValueError, match="fuse_qkv_projections: layerwise casting is enabled"):
        ad.fuse_qkv_projections()
    with pytest.raises(ValueError, match="layerwise_casting: layerwise casting cannot be removed"):
        ad._diffusers_hook.remove_hook("layerwise_casting")


def test_cache_hook_after_casting():
    """The hook marking the cast sits on the adapter's forward with the step-cache hooks:
    a First-Block Cache run after casting matches the stock module's."""
    from diffusers.hooks import FirstBlockCacheConfig

    stock, ad = pair("flux1")
    for m in (stock, ad):
        m.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
        m.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    outs = []
    for m in (stock, ad):
        with m.cache_context("cond"):
            outs.append([run(m, "flux1", torch.float32) for _ in range(2)])
    for got, want in zip(outs[1], outs[0]):
        assert_close(got, want, "flux1")


# ---------------------------------------------------------------- the core transform


def _dequantized(params: fd.Params) -> fd.Params:
    return torch.utils._pytree.tree_map(lambda t: t.stored.to(t.dtype) if isinstance(t, CastTensor) else t, params)


def test_layerwise_cast_under_apply_equals_dequantized_params():
    params = fd.init("qwen-image-tiny", seed=0)
    cast = fd.layerwise_cast(params, FP8, skip=("norm", "pos_embed"))
    flat = cast.flat()
    assert all(isinstance(flat[k], CastTensor) == ("norm" not in k) for k in flat)
    assert all(t.stored.dtype == FP8 and t.dtype == torch.float32 for t in flat.values() if isinstance(t, CastTensor))
    stored = sum(stored_leaf(t).nbytes for t in flat.values())
    plain = sum(t.nbytes for t in params.leaves())
    assert stored < 0.3 * plain  # the cast leaves hold one byte per value instead of four
    kw = qwen_inputs(QWEN)
    x, t, txt = kw.pop("x"), kw.pop("t"), kw.pop("txt")
    ref = _dequantized(cast)
    assert torch.equal(fd.apply(cast, x, t, txt, **kw), fd.apply(ref, x, t, txt, **kw))
    prepared = fd.prepare(cast)  # the fused layout declines stored leaves: nothing changes
    assert all(a is b for a, b in zip(prepared.leaves(), cast.leaves()))
    assert torch.equal(fd.apply(prepared, x, t, txt, **kw), fd.apply(ref, x, t, txt, **kw))


def test_layerwise_cast_gradients():
    """Backward reads the stored weights again (autograd saves the wrapper, not a copy): the
    input's gradient, and a cast leaf's own (in the compute dtype), equal the dequantized ones."""
    params = fd.init("flux1-tiny", seed=0)
    cast = fd.layerwise_cast(params, FP8, skip=("norm",))
    ref = _dequantized(cast)
    key = "transformer_blocks.0.attn.to_q.weight"
    grads = []
    for p in (cast, ref):
        p.flat()[key].requires_grad_(True)
        kw = flux1_inputs(FLUX1)
        x = kw.pop("x").requires_grad_(True)
        fd.apply(p, x, kw.pop("t"), kw.pop("txt"), **kw).square().mean().backward()
        grads.append((x.grad, p.flat()[key].grad))
    (gx, gw), (rx, rw) = grads
    assert torch.equal(gx, rx) and type(gw) is torch.Tensor and gw.dtype == torch.float32 and torch.equal(gw, rw)


def test_layerwise_cast_under_torch_compile():
    """Traced over cast leaves (each block inline, not a region; the subclass traced through
    AOT autograd): the same ATen ops in the same order as eager, so bitwise; and inductor's
    code against plain inductor code over the same params dequantized (the same graph but
    the casts; measured bitwise here, bound at 1e-5: inductor may fuse a cast elsewhere)."""
    # one block of each kind: every op kind is traced once either way, and inductor's build
    # grows with the graph (two whole-model inductor builds took 100 s at 2 + 2 blocks)
    config = dataclasses.replace(FLUX1, num_layers=1, num_single_layers=1)
    cast = fd.layerwise_cast(fd.init(config, seed=0), FP8, skip=("norm",))
    kw = flux1_inputs(config)
    with torch.no_grad():
        torch._dynamo.reset()
        got = torch.compile(fd.apply, backend="aot_eager", fullgraph=True)(cast, **kw)
        assert torch.equal(got, fd.apply(cast, **kw))
        torch._dynamo.reset()
        got = torch.compile(fd.apply)(cast, **kw)
        torch._dynamo.reset()
        want = torch.compile(fd.apply)(_dequantized(cast), **kw)
        assert max_err(got, want) <= 1e-5


def test_in_place_writes_reach_the_storage():
    w = fd.layerwise_cast(fd.init("flux1-tiny", seed=0), FP8).flat()["x_embedder.weight"]
    with torch.no_grad():
        out = w.add_(0.5)
        assert out is w
        w[0].copy_(torch.full_like(w[0], 2.0))  # through a view
        torch.mul(w, 2.0, out=w)  # an out= argument
        torch._foreach_add_([w], [torch.ones_like(w)])  # a list of written tensors (foreach optimizers)
    assert torch.equal(w.stored[0].float(), torch.full_like(w[0], 5.0))
    assert w.stored.dtype == FP8


def test_load_state_dict_and_an_optimizer_step_write_the_storage():
    stock, ad = pair("flux1")
    ad.enable_layerwise_casting(storage_dtype=FP8)
    other = {k: torch.randn_like(v) for k, v in stock.state_dict().items()}
    ad.load_state_dict(other)
    for n, p in ad.named_parameters():
        want = other[n].to(FP8) if isinstance(p, CastTensor) else other[n]
        assert torch.equal(stored_leaf(p).view(torch.uint8), want.view(torch.uint8)), n
    w = ad.get_submodule("x_embedder").weight
    w.grad = torch.ones_like(w)  # a compute-dtype gradient, as backward leaves it
    before = w.stored.float()
    for foreach in (False, True):
        torch.optim.SGD([w], lr=0.5, foreach=foreach).step()
        want = (before - 0.5).to(FP8)  # the step in fp32, stored rounded to fp8
        assert isinstance(w, CastTensor) and torch.equal(w.stored.view(torch.uint8), want.view(torch.uint8))
        before = w.stored.float()


def test_cast_params_round_trip_a_safe_torch_load(tmp_path):
    cast = fd.layerwise_cast(fd.init("flux1-tiny", seed=0), FP8, skip=("norm",))
    torch.save(cast, tmp_path / "p.pt")
    back = torch.load(tmp_path / "p.pt", weights_only=True)
    for a, b in zip(back.leaves(), cast.leaves()):
        assert type(a) is type(b) and a.dtype == b.dtype and torch.equal(stored_leaf(a), stored_leaf(b))


def test_layerwise_cast_refusals():
    params = fd.init("flux1-tiny", seed=0)
    with pytest.raises(ValueError, match="storage_dtype: expected a floating torch.dtype"):
        fd.layerwise_cast(params, torch.int8)
    with pytest.raises(ValueError, match="compute_dtype: expected one of"):
        fd.layerwise_cast(params, FP8, torch.float8_e5m2)
    with pytest.raises(ValueError, match=r"compute_dtype: fd.apply computes in one dtype.*are torch.float32"):
        fd.layerwise_cast(params, FP8, torch.bfloat16, skip=("norm",))
    with pytest.raises(ValueError, match="params: expected functional_dit.Params"):
        fd.layerwise_cast(params.tree, FP8)


# ---------------------------------------------------------------- through the pipelines


@pytest.mark.parametrize("kind", ["flux", "flux2-klein", "qwen-image"])
def test_pipeline_with_layerwise_casting_equals_stock(kind):
    """As a user turns it on: ``pipe.transformer.enable_layerwise_casting(...)`` on a bf16
    pipeline, the stock transformer in one and the adapter in the other; model CPU offload
    (accelerate's device hooks move the adapter) keeps the latents."""
    from test_adapter import PROMPT, SEED, SHORT, adapter
    from test_adapter import run as run_pipe

    from functional_dit import tiny

    bf16 = dict(seed=SEED, dtype=torch.bfloat16)
    stock = tiny.pipeline(kind, **bf16)
    ours = tiny.pipeline(kind, **bf16, transformer=adapter(kind, torch.bfloat16))
    for pipe in (stock, ours):
        pipe.transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.bfloat16)
    assert cast_names(ours.transformer) == stored_names(stock.transformer)
    want = run_pipe(stock, prompt=PROMPT, **SHORT)
    got = run_pipe(ours, prompt=PROMPT, **SHORT)
    assert want.abs().max() > 0.1 and max_err(got, want) == 0.0  # bf16 on a CPU: bitwise (see FP32 above)
    ours.enable_model_cpu_offload(device="cpu")
    assert max_err(run_pipe(ours, prompt=PROMPT, **SHORT), got) == 0.0
    assert cast_names(ours.transformer) == stored_names(stock.transformer)  # still stored after the moves


SHARD_MESHES = (dict(tp=2), dict(sp=2), dict(fsdp=2), dict(ring=2))


def _stored(t):
    """The values a leaf holds, as stored (a DTensor's whole: ``full_tensor()``, a collective)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return stored_leaf(t)


def _sharded_storage(rank, world):
    """Per mesh of `SHARD_MESHES`: fp8-stored params sharded (`shard_params`) and sharded
    params stored (`fd.layerwise_cast` of DTensor leaves): each local leaf's stored dtype and
    placements, whether ``full_tensor()`` is the unsharded stored values, both orders' local
    shards bitwise alike, and `fd.apply`'s error against one process for both."""
    import sharding
    from functional_dit.nn.layerwise import is_cast

    plain = fd.init("flux1-tiny", seed=0)
    params = fd.layerwise_cast(plain, FP8)
    kw = flux1_inputs(params.config, batch=2, seed=0)
    with torch.no_grad():
        want = fd.apply(params, **kw)
    out = {}
    for axes in SHARD_MESHES:
        mesh = sharding.make_mesh(**axes, device_type="cpu")
        sharded = sharding.shard_params(params, mesh)
        after = fd.layerwise_cast(sharding.shard_params(plain, mesh), FP8)  # shard first, then store
        stored, full, alike = {}, {}, {}
        for key, leaf in sharded.flat().items():
            local, other = leaf.to_local(), after.flat()[key]
            stored[key] = (local.stored.dtype if is_cast(local) else local.dtype, str(leaf.placements))
            full[key] = torch.equal(_stored(leaf).float(), params.flat()[key].stored.float())
            same_place = other.placements == leaf.placements and is_cast(other.to_local())
            alike[key] = same_place and torch.equal(stored_leaf(other.to_local()), stored_leaf(local))
        with torch.no_grad():  # sharded vs one process over the same stored values: fp32 parity (docs/sharding.md)
            errs = [(fd.apply(p, **kw) - want).abs().max().item() for p in (sharded, after)]
        out[str(axes)] = (stored, full, alike, errs)
    return out, _sharded_adapter(sharding.make_mesh(tp=2, device_type="cpu"))


def _sharded_adapter(mesh) -> dict:
    """The tiny FLUX.1 pipeline with the adapter's ``enable_layerwise_casting`` (fp8 storage,
    fp32 compute) on params sharded over ``mesh`` and on the whole params: latents, memory
    footprints, how many leaves are stored (the local shards')."""
    from test_adapter import PROMPT, SHORT
    from test_adapter import run as run_pipe

    import sharding
    from functional_dit import tiny
    from functional_dit.nn.layerwise import is_cast

    params = fd.from_diffusers(tiny.pipeline("flux").transformer)
    out = {}
    for name, p in (("whole", params), ("sharded", sharding.shard_params(params, mesh))):
        model = fd.DiffusersTransformer(p)
        model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
        locals_ = [t.to_local() if hasattr(t, "to_local") else t for t in model.parameters()]
        latents = run_pipe(tiny.pipeline("flux", transformer=model), prompt=PROMPT, **SHORT)
        out[name] = (latents, model.get_memory_footprint(), sum(map(is_cast, locals_)))
    return out


def test_shard_params_keeps_fp8_storage():
    """``sharding.shard_params(fd.layerwise_cast(params), mesh)`` on tp=2, sp=2, fsdp=2 and
    ring=2: every leaf keeps its fp8 storage, the per-block-split ones (FLUX.1's single-block
    ``proj_mlp`` / ``proj_out``, whose slices are concatenated) included (before: those came
    back float32, 6 of 86 leaves); ``full_tensor()`` is the unsharded stored values and
    `fd.apply` equals one process (fp32 1e-5). The other order, ``fd.layerwise_cast`` of
    sharded params (refused before), gives the same local shards bitwise, placed alike; so
    does the adapter's ``enable_layerwise_casting`` on tp=2-sharded params (refused before):
    the pipeline's latents equal the whole params' cast, the footprint is the same."""
    results = spawn(_sharded_storage, 2, timeout=300)
    for _, adapter in results:  # the adapter's enable_layerwise_casting on tp=2 (refused before)
        (want, size, n), (got, sharded_size, sharded_n) = adapter["whole"], adapter["sharded"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # tp=2's row-parallel sums: fp32 1e-5
        assert (sharded_size, sharded_n) == (size, n) and n > 0
    results = [r for r, _ in results]
    for r in results:
        assert sorted(r) == sorted(map(str, SHARD_MESHES))
        for mesh, (stored, full, alike, errs) in r.items():
            assert max(errs) <= 1e-5, (mesh, errs)
            assert {k: d for k, (d, _) in stored.items() if d != FP8} == {}, mesh
            assert all(full.values()), (mesh, [k for k, ok in full.items() if not ok])
            assert all(alike.values()), (mesh, [k for k, ok in alike.items() if not ok])
    assert any("_StridedShard" in p for _, p in results[0][str(dict(tp=2))][0].values())  # per-block splits covered

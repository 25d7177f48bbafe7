"""`fd.DiffusersTransformer`'s stock-module surface, against the stock diffusers classes.

What diffusers' own model test suites check of a transformer class, covered here with our
own tests: ``from_pretrained`` / ``save_pretrained`` with the stock keywords, Qwen-Image's
float text mask, FLUX.2's KV cache as diffusers' ``Flux2KVCache``, training (gradients
equal to the stock module's), gradient checkpointing (the same gradients, fewer saved
activations), ``fuse_qkv_projections``, the PEFT entry points over `functional_dit.lora`,
and a ValueError for every stock method the adapter cannot honour. Each adapter wraps
the stock module's own weights (`fd.from_diffusers`), as a user swapping classes would.
"""

from __future__ import annotations

import diffusers
import peft
import pytest
import torch
from cases_flux1 import diffusers_kwargs as flux1_kwargs
from cases_flux1 import inputs as flux1_inputs
from cases_flux2 import TINY as FLUX2
from cases_flux2 import diffusers_kwargs as flux2_kwargs
from cases_flux2 import inputs as flux2_inputs
from cases_flux2 import use_kv_processors
from cases_qwenimage import diffusers_kwargs as qwen_kwargs
from cases_qwenimage import inputs as qwen_inputs
from diffusers.models.transformers.transformer_flux2 import Flux2KVCache
from oracle import max_err

import functional_dit as fd

FLUX1, QWEN = fd.PRESETS["flux1-tiny"], fd.PRESETS["qwen-image-tiny"]
CASES = {
    "flux1": (FLUX1, lambda: flux1_kwargs(flux1_inputs(FLUX1))),
    "flux2": (FLUX2, lambda: flux2_kwargs(flux2_inputs(FLUX2))),
    "qwenimage": (QWEN, lambda: qwen_kwargs(qwen_inputs(QWEN))),
}
FP32 = 1e-5  # adapter vs stock forward in fp32 (same maths, other op order; measured <= 1e-6)
GRAD = 1e-5  # gradients of the same loss (measured <= 2e-7 at these sizes)


def pair(name: str, seed: int = 0):
    """(stock module, adapter over its weights), both trainable as constructed."""
    cfg = fd.config_to_diffusers(CASES[name][0])
    torch.manual_seed(seed)
    stock = getattr(diffusers, cfg.pop("_class_name"))(**cfg)
    return stock, fd.DiffusersTransformer(fd.from_diffusers(stock))


def out(model, kw) -> torch.Tensor:
    return model(**kw)[0]


# ---------------------------------------------------------------- from_pretrained / save_pretrained


def test_from_pretrained_stock_keywords(tmp_path):
    stock, ad = pair("flux2")
    ad.save_pretrained(tmp_path / "plain")
    ad.save_pretrained(tmp_path / "v", variant="fp16", max_shard_size=20_000)  # sharded: index + shards
    pipe_dir = tmp_path / "pipe"
    ad.save_pretrained(pipe_dir / "transformer")
    cls = type(ad)
    for kw in (dict(torch_dtype=torch.bfloat16, low_cpu_mem_usage=True), dict(dtype=torch.float16)):
        got, want = cls.from_pretrained(tmp_path / "plain", **kw), type(stock).from_pretrained(tmp_path / "plain", **kw)
        assert got.dtype == want.dtype == next(iter(kw.values()))
        assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items())
    want = type(stock).from_pretrained(tmp_path / "v", variant="fp16", low_cpu_mem_usage=False)  # stock reads ours
    for model in (
        cls.from_pretrained(tmp_path / "v", variant="fp16", low_cpu_mem_usage=False),
        cls.from_pretrained(pipe_dir, subfolder="transformer", device_map="cpu"),
        cls.from_pretrained(tmp_path / "plain", device_map={"": "cpu"}, use_safetensors=True),
    ):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in want.state_dict().items())
    model, info = cls.from_pretrained(tmp_path / "plain", output_loading_info=True)
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    with pytest.raises(OSError, match="no file named diffusion_pytorch_model.bin"):  # as the stock class raises
        cls.from_pretrained(tmp_path / "v")
    for bad, match in (
        (dict(device_map="auto"), "device_map"),
        (dict(device_map={"transformer_blocks": 0, "": "cpu"}), "device_map"),
        (dict(torch_dtype=torch.float16, dtype=torch.bfloat16), "torch_dtype / dtype"),
        (dict(use_safetensors=False), "use_safetensors"),
        (dict(quantization_config=object()), "quantization_config"),
    ):
        with pytest.raises(ValueError, match=match):
            cls.from_pretrained(tmp_path / "plain", **bad)


# ---------------------------------------------------------------- forward inputs


def test_qwen_float_mask_keeps_nonzero():
    stock, ad = pair("qwenimage")
    kw = CASES["qwenimage"][1]()
    mask = kw["encoder_hidden_states_mask"].float() * torch.tensor([[0.5], [2.0]])  # any non-zero keeps
    with torch.no_grad():
        want = out(stock, dict(kw, encoder_hidden_states_mask=mask))
        assert max_err(out(ad, dict(kw, encoder_hidden_states_mask=mask)), want) <= FP32
        assert torch.equal(out(ad, dict(kw, encoder_hidden_states_mask=mask)), out(ad, kw))


def test_kv_cache_is_diffusers_type_both_ways():
    stock, ad = pair("flux2")
    use_kv_processors(stock)
    kw = flux2_inputs(FLUX2, ref_hw=(2, 2))
    step = flux2_kwargs(kw)
    del step["kv_cache_mode"], step["num_ref_tokens"]
    step = dict(step, kv_cache_mode="extract", num_ref_tokens=4)
    rest = dict(hidden_states=step["hidden_states"][:, 4:], img_ids=step["img_ids"][..., 4:, :])
    cached = lambda cache: dict(step, **rest, kv_cache=cache, kv_cache_mode="cached")  # noqa: E731
    with torch.no_grad():
        (y_s, c_s), (y_a, c_a) = stock(**step), ad(**step)
        assert isinstance(c_a, Flux2KVCache) and max_err(y_a, y_s) <= FP32
        assert c_a.num_ref_tokens == c_s.num_ref_tokens == 4
        for got, want in zip(c_a.double_block_caches + c_a.single_block_caches,
                             c_s.double_block_caches + c_s.single_block_caches):  # fmt: skip
            assert max_err(got.get()[0], want.get()[0]) <= FP32 and max_err(got.get()[1], want.get()[1]) <= FP32
        want = out(stock, cached(c_s))
        assert max_err(out(stock, cached(c_a)), want) <= FP32  # ours in the stock class
        assert max_err(out(ad, cached(c_s)), want) <= FP32  # the stock one in ours
        c_a.clear()
        assert c_a.cache is None
        with pytest.raises(ValueError, match="kv_cache"):
            ad(**cached(c_a))


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("name", list(CASES))
def test_training_gradients_equal_stock(name):
    stock, ad = pair(name)
    kw = CASES[name][1]()
    stock.train(), ad.train()
    for model in (stock, ad):
        out(model, kw).square().mean().backward()
    grads = dict(stock.named_parameters())
    reached = {k for k, p in ad.named_parameters() if p.grad is not None}
    assert reached == {k for k, p in grads.items() if p.grad is not None} and len(reached) > len(grads) / 2
    assert max(max_err(ad.get_parameter(k).grad, grads[k].grad) for k in reached) <= GRAD
    ad.requires_grad_(False)
    assert not out(ad, kw).requires_grad


def _saved_bytes(fn, params) -> int:
    """Bytes of the distinct activation storages (parameters left out) autograd saves for
    backward while ``fn`` runs. Under checkpointing the blocks' inputs, which the
    recomputation keeps by reference, are not counted: each is one (B, S, C) stream, a
    small part of a block's saved activations."""
    weights, seen = {p.untyped_storage().data_ptr() for p in params}, {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_gradient_checkpointing_same_grads_fewer_activations():
    stock, ad = pair("flux2")
    kw = CASES["flux2"][1]()
    assert not ad.is_gradient_checkpointing
    out(ad, kw).square().mean().backward()
    plain = {k: p.grad.clone() for k, p in ad.named_parameters()}
    ad.zero_grad()
    ad.enable_gradient_checkpointing()
    assert ad.is_gradient_checkpointing
    out(ad, kw).square().mean().backward()
    assert all(torch.equal(p.grad, plain[k]) for k, p in ad.named_parameters())  # the same ops, recomputed
    saved_ckpt = _saved_bytes(lambda: out(ad, kw), ad.parameters())
    ad.disable_gradient_checkpointing()
    assert not ad.is_gradient_checkpointing
    saved_plain = _saved_bytes(lambda: out(ad, kw), ad.parameters())
    assert saved_ckpt < saved_plain / 2  # per-block recomputation keeps only the blocks' inputs
    with pytest.raises(ValueError, match="gradient_checkpointing_func"):
        ad.enable_gradient_checkpointing(gradient_checkpointing_func=torch.utils.checkpoint.checkpoint)


def test_apply_checkpoint_keyword():
    params = fd.init(QWEN, seed=1)
    params = torch.utils._pytree.tree_map(lambda t: t.requires_grad_(True), params)
    kw = qwen_inputs(QWEN)
    grads = [
        torch.autograd.grad(
            fd.apply(params, checkpoint=c, **kw).square().mean(), list(params.leaves()), materialize_grads=True
        )
        for c in (False, True)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with pytest.raises(ValueError, match="checkpoint"):
        fd.apply(params, checkpoint="yes", **kw)


# ---------------------------------------------------------------- fused projections


def test_fuse_unfuse_qkv_projections():
    stock, ad = pair("flux1")
    kw = CASES["flux1"][1]()
    keys = set(ad.state_dict())
    q, k = (ad.get_submodule(f"transformer_blocks.0.attn.{n}").weight for n in ("to_q", "to_k"))
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
    with torch.no_grad():
        want = out(stock, kw)
        ad.fuse_qkv_projections()
        q, k = (ad.get_submodule(f"transformer_blocks.0.attn.{n}").weight for n in ("to_q", "to_k"))
        assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()  # fd.prepare's one buffer
        assert set(ad.state_dict()) == keys and all(p.requires_grad for p in ad.parameters())
        assert max_err(out(ad, kw), want) <= FP32  # one GEMM in place of three: other rounding
        ad.unfuse_qkv_projections()
        q, k = (ad.get_submodule(f"transformer_blocks.0.attn.{n}").weight for n in ("to_q", "to_k"))
        assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
        assert max_err(out(ad, kw), want) <= FP32


# ---------------------------------------------------------------- PEFT


def _peft_config(rank: int = 4, **kw) -> peft.LoraConfig:
    return peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v"], **kw)


def test_peft_adapters_equal_stock(tmp_path):
    from peft.utils import get_peft_model_state_dict

    stock, ad = pair("flux1")
    kw = CASES["flux1"][1]()
    for name, rank in (("a", 4), ("b", 2)):  # random B, so each adapter changes the output
        stock.add_adapter(_peft_config(rank, init_lora_weights=False), adapter_name=name)
        ad.load_lora_adapter(get_peft_model_state_dict(stock, adapter_name=name), prefix=None, adapter_name=name)
    with torch.no_grad():
        for names, weights in ((["a", "b"], [0.5, 1.5]), ("b", None), (["a"], 0.7)):
            stock.set_adapters(names, weights)
            ad.set_adapters(names, weights)
            assert max_err(out(ad, kw), out(stock, kw)) <= FP32
        assert ad.active_adapters() == ["a"]
        ad.disable_adapters(), stock.disable_adapters()
        assert max_err(out(ad, kw), out(stock, kw)) <= FP32
        ad.enable_adapters(), stock.enable_adapters()
        ad.save_lora_adapter(tmp_path, adapter_name="a")  # our file, read by the stock loader
        stock.delete_adapters(["a", "b"])
        stock.load_lora_adapter(tmp_path, prefix=None, adapter_name="a", use_safetensors=True)
        ad.delete_adapters("b")
        ad.set_adapters("a", 1.0)  # the stock one: "a" freshly loaded, at weight 1
        assert max_err(out(ad, kw), out(stock, kw)) <= FP32 and ad.active_adapters() == ["a"]
        ad.unload_lora(), stock.unload_lora()
        assert not any(".lora_" in k for k in ad.state_dict()) and ad.active_adapters() == []
        assert max_err(out(ad, kw), out(stock, kw)) <= FP32
    with pytest.raises(ValueError, match="not in the list of present adapters"):
        ad.set_adapters("a")


def test_peft_add_adapter_trains():
    stock, ad = pair("qwenimage")
    kw = CASES["qwenimage"][1]()
    ad.requires_grad_(False)
    with torch.no_grad():
        base = out(ad, kw)
    ad.load_lora_adapter({"text_encoder.x.lora_A.weight": torch.ones(1)}, prefix="transformer")  # none of ours
    assert ad.active_adapters() == [] and ad.peft_config == {}  # logged and skipped, as the stock method does
    ad.add_adapter(_peft_config(), adapter_name="mine")
    assert ad.active_adapters() == ["mine"] and isinstance(ad.peft_config["mine"], peft.LoraConfig)
    trainable = [k for k, p in ad.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A.mine." in k or ".lora_B.mine." in k for k in trainable)
    y = out(ad, kw)
    assert torch.equal(y.detach(), base)  # B starts at zero, as PEFT's
    y.square().mean().backward()
    torch.optim.SGD([p for p in ad.parameters() if p.requires_grad], lr=1.0).step()
    with torch.no_grad():
        assert max_err(out(ad, kw), base) > 1e-4  # the step moved the LoRA update off zero
    for bad, match in ((dict(bias="all"), "adapter_config.bias"), (dict(lora_dropout=0.1), "lora_dropout")):
        with pytest.raises(ValueError, match=match):
            ad.add_adapter(_peft_config(**bad), adapter_name="x")
    with pytest.raises(ValueError, match="already exists"):
        ad.add_adapter(_peft_config(), adapter_name="mine")


# ---------------------------------------------------------------- what the adapter cannot honour


def test_refuses_what_it_cannot_honour():
    from diffusers.models.attention_processor import AttnProcessor

    _, ad = pair("flux2")
    calls = {
        "set_attention_backend": lambda: ad.set_attention_backend("flash"),
        "enable_group_offload": lambda: ad.enable_group_offload("cpu"),
        "enable_xformers_memory_efficient_attention": ad.enable_xformers_memory_efficient_attention,
        "enable_lora_hotswap": lambda: ad.enable_lora_hotswap(target_rank=8),
        "_load_ip_adapter_weights": lambda: ad._load_ip_adapter_weights([{}]),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=name):
            call()
    with pytest.raises(ValueError, match="processor"):  # a block's attention keeps accepting only the stock ones
        ad.transformer_blocks[0].attn.set_processor(AttnProcessor())
    # every module's stock processor is reported; another processor changes none of them
    before = ad.attn_processors
    assert {type(p).__name__ for p in before.values()} == {"Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor"}
    with pytest.raises(ValueError, match="got AttnProcessor, which it cannot honour"):
        ad.set_attn_processor({**before, next(iter(before)): AttnProcessor()})
    assert all(a is b for a, b in zip(ad.attn_processors.values(), before.values()))
    with pytest.raises(ValueError, match="number of processors 1 does not match"):
        ad.set_attn_processor({next(iter(before)): AttnProcessor()})

"""`fd.DiffusersTransformer`'s PEFT tuner layers, ``fuse_lora`` and LoRA loading, against
the stock diffusers module with PEFT injected at the same weights.

What diffusers' own LoRA model tests check: the adapted linear modules are PEFT
``BaseTunerLayer`` s that PEFT's and diffusers' utilities read and set
(``get_peft_model_state_dict``, ``set_weights_and_activate_adapters``), ``fuse_lora`` /
``unfuse_lora`` (model and pipeline), the ``safe_fusing`` NaN refusal, the adapter
metadata, and the stock warnings for missing / unexpected LoRA keys.
"""

from __future__ import annotations

import json
import logging
import os

import diffusers
import peft
import pytest
import safetensors.torch
import torch
from cases_flux2 import TINY as FLUX2
from cases_flux2 import diffusers_kwargs, inputs
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from diffusers.utils.peft_utils import set_weights_and_activate_adapters
from oracle import max_err
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict

import functional_dit as fd
from functional_dit import tiny

FP32 = 1e-5  # adapter vs stock forward in fp32 (same maths, other op order; measured 0 at these sizes)
FUSED = 1e-6  # a fused / unfused weight vs the stock one: both W + s*B@A rounded to fp32, other op order
FILE = "pytorch_lora_weights.safetensors"


def _pair():
    cfg = fd.config_to_diffusers(FLUX2)
    torch.manual_seed(0)
    stock = getattr(diffusers, cfg.pop("_class_name"))(**cfg).eval()
    return stock, fd.DiffusersTransformer(fd.from_diffusers(stock)).eval()


def _config(rank=4, alpha=8):
    return peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
    )


def _with_adapters(tmp_path, names=("a", "b")):
    """(stock, adapter), both holding the stock module's random adapters ``names``, loaded
    into the adapter from the stock's own files."""
    stock, ad = _pair()
    for i, name in enumerate(names):
        torch.manual_seed(10 + i)
        stock.add_adapter(_config(rank=4 - i), adapter_name=name)
        stock.save_lora_adapter(tmp_path / name, adapter_name=name)
        ad.load_lora_adapter(tmp_path / name, prefix=None, adapter_name=name)
        assert ad.active_adapters() == stock.active_adapters() == [name]  # the newest alone, as stock
    for model in (stock, ad):
        model.set_adapters(list(names))
    return stock, ad


def _out(model, kw):
    with torch.no_grad():
        return model(**kw)[0]


def _layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def test_peft_layers_as_stock(tmp_path):
    stock, ad = _with_adapters(tmp_path)
    kw = diffusers_kwargs(inputs(FLUX2))
    theirs, ours = _layers(stock), _layers(ad)
    assert sorted(ours) == sorted(theirs) and ours
    for name, layer in ours.items():
        ref = theirs[name]
        for attr in ("r", "lora_alpha", "scaling"):
            assert getattr(layer, attr) == getattr(ref, attr), (name, attr)
        assert layer.active_adapters == ref.active_adapters == ["a", "b"]
        assert sorted(layer.lora_A) == sorted(ref.lora_A) and not layer.merged
    for name in ("a", "b"):
        assert ad.peft_config[name].to_dict() == stock.peft_config[name].to_dict()
        want, got = (
            get_peft_model_state_dict(stock, adapter_name=name),
            get_peft_model_state_dict(ad, adapter_name=name),
        )
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(ad.state_dict()) == sorted(stock.state_dict())  # base weights under base_layer, as PEFT's
    assert max_err(_out(ad, kw), _out(stock, kw)) <= FP32
    for model in (stock, ad):  # PEFT's per-layer setters, as diffusers' set_adapters calls them
        set_weights_and_activate_adapters(model, ["b"], [0.3])
    assert max_err(_out(ad, kw), _out(stock, kw)) <= FP32
    with pytest.raises(ValueError, match="not callable"):
        next(iter(ours.values()))(torch.zeros(1, 4))
    ad.unload_lora(), stock.unload_lora()
    assert not _layers(ad) and type(ad.get_submodule(next(iter(ours)))).__name__ == "_Node"
    assert max_err(_out(ad, kw), _out(stock, kw)) <= FP32


def test_fuse_unfuse_as_stock(tmp_path):
    stock, ad = _with_adapters(tmp_path)
    kw = diffusers_kwargs(inputs(FLUX2))
    q = "transformer_blocks.0.attn.to_q"
    before = ad.get_submodule(q).weight.detach().clone()
    for model in (stock, ad):
        model.set_adapters(["a", "b"], [0.5, 1.5])
        model.fuse_lora(lora_scale=0.7, adapter_names=["a"])
    assert ad.get_submodule(q).merged_adapters == stock.get_submodule(q).merged_adapters == ["a"]
    assert max_err(ad.get_submodule(q).weight, stock.get_submodule(q).base_layer.weight) <= FUSED
    assert max_err(ad.get_submodule(q).weight, before) > 1e-3  # the update is in the weight
    assert max_err(_out(ad, kw), _out(stock, kw)) <= FP32  # a merged layer applies none on the fly, as PEFT's
    for model in (stock, ad):
        model.unfuse_lora()
    # Unfusing subtracts the update again, as PEFT does: the weight is back up to fp32 rounding.
    assert max_err(ad.get_submodule(q).weight, before) <= FUSED
    assert max_err(ad.get_submodule(q).weight, stock.get_submodule(q).base_layer.weight) <= FUSED
    assert not ad.get_submodule(q).merged
    assert max_err(_out(ad, kw), _out(stock, kw)) <= FP32


def test_fuse_nan_refused_before_any_change():
    stock, ad = _pair()
    torch.manual_seed(1)
    stock.add_adapter(_config(), adapter_name="x")
    ad.load_lora_adapter(get_peft_model_state_dict(stock, adapter_name="x"), prefix=None, adapter_name="x")
    last = list(_layers(ad))[-1]
    with torch.no_grad():
        for model in (stock, ad):  # only the last layer is broken
            model.get_submodule(last).lora_A["x"].weight += float("inf")
    base = {k: v.clone() for k, v in ad.state_dict().items()}
    for model in (stock, ad):
        with pytest.raises(ValueError, match="NaNs detected in the merged weights. The adapter x seems to be broken"):
            model.fuse_lora(safe_fusing=True)
    assert all(torch.equal(v, base[k]) for k, v in ad.state_dict().items())  # nothing changed
    assert not any(m.merged for m in _layers(ad).values())
    kw = diffusers_kwargs(inputs(FLUX2))
    for model in (stock, ad):
        model.fuse_lora(safe_fusing=False)
        assert torch.isnan(_out(model, kw)).all()


class _Log(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _warnings_of(load) -> list[str]:
    """What ``load()`` logs on diffusers' PEFT-utils logger (where the stock loader warns)."""
    logger, log = diffusers.utils.logging.get_logger("diffusers.utils.peft_utils"), _Log()
    logger.addHandler(log)
    try:
        load()
    finally:
        logger.removeHandler(log)
    return log.lines


def _metadata(path) -> dict:
    """A LoRA file's LoraConfig metadata (``target_modules``, a set the stock writes in set order: sorted)."""
    with safetensors.safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()[LORA_ADAPTER_METADATA_KEY])
    return dict(meta, target_modules=sorted(meta["target_modules"]))


def test_lora_loading_as_stock(tmp_path):
    stock, ad = _pair()
    torch.manual_seed(2)
    cfg = _config()
    stock.add_adapter(cfg)
    stock.save_lora_adapter(tmp_path)
    state = safetensors.torch.load_file(tmp_path / FILE)
    kw = diffusers_kwargs(inputs(FLUX2))
    want = _out(stock, kw)
    ad.load_lora_adapter(tmp_path, prefix=None, low_cpu_mem_usage=True)  # metadata: the file's LoraConfig
    assert ad.peft_config["default_0"].to_dict() == cfg.to_dict()
    assert max_err(_out(ad, kw), want) <= FP32
    umask = os.umask(0o022)
    try:
        ad.save_lora_adapter(tmp_path / "ours", adapter_name="default_0")  # the stock file: tensors and metadata
    finally:
        os.umask(umask)
    assert oct(os.stat(tmp_path / "ours" / FILE).st_mode & 0o777) == "0o644"  # the umask's (the stock: 0600)
    ours, theirs = (_metadata(tmp_path / "ours" / FILE), _metadata(tmp_path / FILE))
    assert ours == theirs
    for model in (stock, ad):
        with pytest.raises(ValueError, match="Adapter name foo not found in the model."):
            model.save_lora_adapter(tmp_path, adapter_name="foo")
    stock.unload_lora(), ad.unload_lora()
    bad = dict(cfg.to_dict(), foo=1, target_modules=sorted(cfg.target_modules))
    for model in (stock, ad):
        with pytest.raises(TypeError, match="`LoraConfig` class could not be instantiated"):
            model.load_lora_adapter(dict(state), prefix=None, metadata=bad)
    missing = dict(state)
    del missing[next(k for k in state if "lora_A" in k)]
    unexpected = dict(state, **{next(k for k in state if "lora_A" in k) + ".diffusers_cat": torch.tensor(1.0)})
    for case in (missing, unexpected):
        logs = [_warnings_of(lambda m=m, c=case: m.load_lora_adapter(dict(c), prefix=None)) for m in (stock, ad)]
        assert logs[0] == logs[1] and len(logs[0]) == 1, logs
        stock.unload_lora(), ad.unload_lora()


def test_pipeline_fuse_lora_reaches_the_adapter(tmp_path):
    stock_pipe = tiny.pipeline("qwen-image", seed=0)
    params = fd.from_diffusers(stock_pipe.transformer)
    ours = tiny.pipeline("qwen-image", seed=0, transformer=fd.DiffusersTransformer(params))
    torch.manual_seed(3)
    stock_pipe.transformer.add_adapter(_config())
    state = get_peft_model_state_dict(stock_pipe.transformer, adapter_name="default")
    safetensors.torch.save_file({f"transformer.{k}": v for k, v in state.items()}, tmp_path / FILE)
    stock_pipe.transformer.unload_lora()
    run = dict(prompt="a red cube", height=32, width=32, num_inference_steps=2, output_type="latent")
    outs = []
    for pipe in (stock_pipe, ours):
        pipe.load_lora_weights(str(tmp_path))
        pipe.fuse_lora(lora_scale=0.5)
        assert pipe.transformer.get_submodule("transformer_blocks.0.attn.to_q").merged
        with torch.no_grad():
            fused = pipe(**run, generator=torch.Generator().manual_seed(0)).images
        pipe.unfuse_lora()
        assert not pipe.transformer.get_submodule("transformer_blocks.0.attn.to_q").merged
        outs.append(fused)
    assert max_err(outs[1], outs[0]) <= FP32


@pytest.mark.parametrize("field", ["use_dora", "lora_bias"])
def test_dora_and_bias_layers_as_stock(tmp_path, field):
    """A DoRA / LoRA-bias adapter saved by the stock module, loaded into the adapter: the
    tuner layers hold the magnitude / bias as PEFT's do, outputs and fusing equal stock's,
    and unfusing DoRA (a row rescaling, not additive) gives back the weights it replaced."""
    stock, ad = _pair()
    kw = diffusers_kwargs(inputs(FLUX2))
    torch.manual_seed(3)
    stock.add_adapter(peft.LoraConfig(**{**_config().to_dict(), field: True}), adapter_name="x")
    with torch.no_grad():  # non-trivial magnitudes / biases (PEFT starts them at ||W|| / 0)
        for n, p in stock.named_parameters():
            if "lora_magnitude_vector" in n or "lora_B" in n and n.endswith("bias"):
                p.mul_(1.3).add_(0.05)
    stock.save_lora_adapter(tmp_path, adapter_name="x")
    ad.load_lora_adapter(tmp_path, prefix=None, adapter_name="x")
    want, got = get_peft_model_state_dict(stock, adapter_name="x"), get_peft_model_state_dict(ad, adapter_name="x")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert any("lora_magnitude_vector" in k or k.endswith("lora_B.bias") for k in got)
    assert max_err(_out(ad, kw), _out(stock, kw)) <= FP32
    q = "transformer_blocks.0.attn.to_q"
    before = ad.get_submodule(q).base_layer.weight.detach().clone()
    if field == "lora_bias":  # FLUX.2's linears have no bias to fold b into: both refuse to fuse
        with pytest.raises(ValueError, match="bias"):
            ad.fuse_lora(lora_scale=0.7)
        assert torch.equal(ad.get_submodule(q).base_layer.weight, before) and not ad.get_submodule(q).merged
        with pytest.raises(RuntimeError, match="no bias"):  # last: the stock shares the adapter's weights
            stock.fuse_lora(lora_scale=0.7)
        return
    for model in (stock, ad):
        model.fuse_lora(lora_scale=0.7)
    assert max_err(_out(ad, kw), _out(stock, kw)) <= FP32
    ad.unfuse_lora()
    assert torch.equal(ad.get_submodule(q).base_layer.weight, before)

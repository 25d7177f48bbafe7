"""What diffusers' pipeline tests ask of a ``transformer`` beyond the model tests, on
`fd.DiffusersTransformer` against the stock classes (issue: "the drop-in must accept what
the stock classes accept"): pickled weights written and read back (loading only with
``torch.load(weights_only=True)``), ``set_default_attn_processor``, batch-1 conditioning
broadcast, per-batch ``img_shapes`` / ``img_mask``, Kohya ``.alpha`` entries in PEFT-keyed
LoRA files. Each through ``pipe(...)`` on the tiny pipelines, adapter vs stock at fp32.
"""

from __future__ import annotations

import os
import pickle
import re

import diffusers
import pytest
import torch

import functional_dit as fd
from functional_dit import tiny

SEED = 3
FP32 = 1e-5  # adapter vs stock through a whole pipeline (FLUX: 0; Qwen-Image: fp32 rounding)
PROMPT = "a red cube on a wooden table"
SHORT = dict(max_sequence_length=64)


def run(pipe, **kwargs) -> torch.Tensor:
    args = dict(height=32, width=32, num_inference_steps=2, output_type="latent")
    args.update(kwargs)
    return pipe(generator=torch.Generator().manual_seed(0), **args).images


def adapter(kind: str) -> fd.DiffusersTransformer:
    return fd.DiffusersTransformer(fd.init(tiny.transformer_config(kind), seed=SEED))


def max_err(a, b) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------- pickled weights


def test_pipeline_save_pickled_reloads(tmp_path):
    """``pipe.save_pretrained(safe_serialization=False)`` writes the stock ``.bin`` files
    (the names the stock method writes), stock diffusers loads the pipeline back, and the
    adapter reads them with ``torch.load(weights_only=True)``."""
    pipe = tiny.pipeline("flux", seed=SEED, transformer=adapter("flux"))
    pipe.save_pretrained(tmp_path / "ours", safe_serialization=False)
    tiny.pipeline("flux", seed=SEED).save_pretrained(tmp_path / "stock", safe_serialization=False)
    assert sorted(os.listdir(tmp_path / "ours" / "transformer")) == sorted(
        os.listdir(tmp_path / "stock" / "transformer")
    )
    assert sorted(os.listdir(tmp_path / "ours" / "transformer")) == ["config.json", "diffusion_pytorch_model.bin"]
    reloaded = diffusers.FluxPipeline.from_pretrained(tmp_path / "ours")
    assert type(reloaded.transformer) is diffusers.FluxTransformer2DModel
    reloaded.set_progress_bar_config(disable=True)
    expected = run(pipe, prompt=PROMPT, **SHORT)
    assert max_err(run(reloaded, prompt=PROMPT, **SHORT), expected) <= FP32
    again = fd.DiffusersTransformer.from_pretrained(tmp_path / "ours", subfolder="transformer")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in pipe.transformer.state_dict().items())
    reloaded.transformer = again  # a pipeline over the adapter read from the pickle
    assert max_err(run(reloaded, prompt=PROMPT, **SHORT), expected) <= FP32


@pytest.mark.parametrize("kw", [dict(variant="fp16"), dict(max_shard_size=20_000)])
def test_save_pickled_variant_and_shards(tmp_path, kw):
    ad = adapter("qwen-image")
    ad.save_pretrained(tmp_path / "ours", safe_serialization=False, **kw)
    tiny.stock_transformer("qwen-image", seed=SEED).save_pretrained(tmp_path / "stock", safe_serialization=False, **kw)
    names, stock_names = sorted(os.listdir(tmp_path / "ours")), sorted(os.listdir(tmp_path / "stock"))
    if "variant" in kw:
        assert names == stock_names == ["config.json", "diffusion_pytorch_model.fp16.bin"]
    else:  # the same index and shard names (weights.save groups the tensors into shards its own way)
        assert (
            "diffusion_pytorch_model.bin.index.json" in names
            and "diffusion_pytorch_model.bin.index.json" in stock_names
        )
        pattern = re.compile(r"diffusion_pytorch_model-\d{5}-of-\d{5}\.bin")
        assert all(pattern.fullmatch(n) for n in names + stock_names if n.endswith(".bin"))
    back = fd.DiffusersTransformer.from_pretrained(tmp_path / "ours", variant=kw.get("variant"), use_safetensors=False)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ad.state_dict().items())
    if "variant" in kw:  # stock diffusers reads the single-file pickle (it cannot read sharded .bin at all)
        stock = diffusers.QwenImageTransformer2DModel.from_pretrained(tmp_path / "ours", variant="fp16")
        assert all(torch.equal(stock.state_dict()[k], v) for k, v in ad.state_dict().items())


class _Boom:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickled_weights_load_weights_only(tmp_path):
    adapter("flux").save_pretrained(tmp_path, safe_serialization=False)
    state = torch.load(tmp_path / "diffusion_pytorch_model.bin", weights_only=True)
    marker = tmp_path / "unpickled"
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps({**state, "x": _Boom(str(marker))}))
    with pytest.raises(ValueError, match=r"diffusion_pytorch_model.bin: not a weights-only pickle"):
        fd.DiffusersTransformer.from_pretrained(tmp_path)
    assert not marker.exists()
    with pytest.raises(OSError, match=r"no file named diffusion_pytorch_model.fp16.bin"):
        fd.DiffusersTransformer.from_pretrained(tmp_path, variant="fp16", use_safetensors=False)


# ---------------------------------------------------------------- set_default_attn_processor


def test_set_default_attn_processor_is_the_default_maths():
    """diffusers' pipeline tests call ``set_default_attn_processor()`` on every component
    that has it; the adapter's default maths is already `fd.apply`'s, so it changes nothing."""
    pipe = tiny.pipeline("flux", seed=SEED, transformer=adapter("flux"))
    before = pipe.transformer.attn_processors
    pipe.transformer.set_default_attn_processor()
    assert all(a is b for a, b in zip(pipe.transformer.attn_processors.values(), before.values()))
    stock = run(tiny.pipeline("flux", seed=SEED), prompt=PROMPT, **SHORT)
    assert max_err(run(pipe, prompt=PROMPT, **SHORT), stock) <= FP32

"""weights.load / weights.save against diffusers' own save_pretrained / from_pretrained.

Every family's tiny config goes through each folder layout diffusers writes (one
file, sharded with an index, a pipeline's transformer/) and a bare .safetensors
file; loaded tensors must equal the module's bitwise, and fd.apply of them must
match the diffusers forward. The other way, weights.save must give a folder that
diffusers' from_pretrained loads to the very same module.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys

import diffusers
import pytest
import torch
from oracle import diffusers_model, max_err
from safetensors.torch import save_file

import functional_dit as fd
import weights

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md#numerics: fp32 parity with diffusers


def _case(family: str):
    """(cases module, tiny config) of a family."""
    cases = importlib.import_module(f"cases_{family}")
    return cases, cases.TINY


FAMILIES = ["flux1", "flux2", "qwenimage"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    cases, config = _case(request.param)
    module, params = diffusers_model(config, seed=3)
    kw = cases.inputs(config)
    return module, params, kw, module(**cases.diffusers_kwargs(kw))[0]


def _assert_same_params(loaded: fd.Params, ref: fd.Params):
    assert loaded.config == ref.config
    a, b = loaded.flat(), ref.flat()
    assert list(a) == list(b)  # diffusers state_dict order
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _write_folder(module, tmp_path, layout: str):
    """A checkpoint as diffusers writes it; returns (path to load, config= to pass)."""
    if layout == "folder":
        module.save_pretrained(tmp_path)
        return tmp_path, None
    if layout == "sharded":
        module.save_pretrained(tmp_path, max_shard_size="30KB")
        index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
        return tmp_path, None
    if layout == "pipeline":
        module.save_pretrained(tmp_path / "transformer")
        (tmp_path / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", type(module).__name__]}))
        return tmp_path, None
    path = tmp_path / "model.safetensors"
    save_file(module.state_dict(), path)
    return path, fd.config_from_diffusers(dict(module.config, _class_name=type(module).__name__))


@pytest.mark.parametrize("layout", ["folder", "sharded", "pipeline", "file"])
def test_load_what_diffusers_saves(model, tmp_path, layout):
    module, params, kw, ref = model
    path, config = _write_folder(module, tmp_path, layout)
    loaded = weights.load(path, config=config)
    _assert_same_params(loaded, params)
    torch.testing.assert_close(fd.apply(loaded, **kw), ref, **FP32)


def test_save_loads_in_diffusers(model, tmp_path):
    module, params, kw, ref = model
    for shard_size in ("30KB", "5GB"):  # sharded with an index, then one file (stale shards removed)
        weights.save(params, tmp_path, max_shard_size=shard_size)
        # AutoModel picks the class from config.json's _class_name: checks that too
        back = diffusers.AutoModel.from_pretrained(str(tmp_path)).eval()
        assert type(back) is type(module)
        public = lambda cfg: {k: v for k, v in cfg.items() if not k.startswith("_")}  # noqa: E731
        assert public(back.config) == public(module.config)
        # The same weights in the same diffusers code: bitwise equal outputs.
        assert max_err(back(**_diffusers_kwargs(module, kw))[0], ref) == 0
    assert sorted(os.listdir(tmp_path)) == ["config.json", "diffusion_pytorch_model.safetensors"]
    _assert_same_params(weights.load(tmp_path), params)


def _diffusers_kwargs(module, kw):
    family = {"FluxTransformer2DModel": "flux1", "Flux2Transformer2DModel": "flux2"}.get(type(module).__name__)
    return importlib.import_module(f"cases_{family or 'qwenimage'}").diffusers_kwargs(kw)


def test_save_sharded_layout(tmp_path):
    """Shards hold whole tensors in order, none over max_shard_size unless one tensor is."""
    params = fd.init(_case("flux1")[1], seed=0)
    weights.save(params, tmp_path, max_shard_size=20_000)
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [
        f"diffusion_pytorch_model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    flat = params.flat()
    assert list(index["weight_map"]) == list(flat)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in flat.values())
    for f in files:
        infos, meta = weights.read_header(str(tmp_path / f))
        size = sum(flat[k].numel() * 4 for k in infos)
        assert size <= 20_000 or len(infos) == 1, f


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_load_casts_while_reading(tmp_path, dtype):
    params = fd.init(_case("flux1")[1], seed=0)
    weights.save(params, tmp_path)
    stats = {}
    loaded = weights.load(tmp_path, dtype=dtype, stats=stats)
    for k, t in params.flat().items():
        assert torch.equal(loaded.flat()[k], t.to(dtype)), k
    n = sum(t.numel() for t in params.leaves())
    assert stats == {"bytes_read": 4 * n, "local_bytes": dtype.itemsize * n}


def test_save_keeps_dtypes_and_bf16_round_trip(tmp_path):
    params = fd.init(_case("flux1")[1], seed=0, dtype=torch.bfloat16)
    weights.save(params, tmp_path)
    _assert_same_params(weights.load(tmp_path), params)


def test_config_sources(tmp_path):
    """config.json wins when config= is None; a preset name or an equal config is accepted;
    a different one is an error; a single file needs config= and names what it found."""
    cases, config = _case("flux1")
    params = fd.init(config, seed=0)
    weights.save(params, tmp_path / "m")
    assert weights.load(tmp_path / "m", config="flux1-tiny").config == config
    with pytest.raises(
        ValueError, match=r"differs from the checkpoint's .*config.json in guidance_embeds=False vs True"
    ):
        weights.load(tmp_path / "m", config=dataclasses.replace(config, guidance_embeds=False))
    with pytest.raises(ValueError, match="expected a preset name"):
        weights.load(tmp_path / "m", config="flux1-nope")
    file = tmp_path / "m" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(ValueError, match=r"has no config.json; its keys are FLUX.1's \(diffusers layout\)"):
        weights.load(file)
    with pytest.raises(ValueError, match=r"a Qwen-Image config .* keys .* are those of FLUX.1"):
        weights.load(file, config=_case("qwenimage")[1])
    with pytest.raises(ValueError, match="dtype: expected None or a floating"):
        weights.load(file, config=config, dtype=torch.int8)
    with pytest.raises(ValueError, match="does not exist"):
        weights.load(tmp_path / "nothing")
    with pytest.raises(ValueError, match="pipeline folder"):
        weights.load(tmp_path)  # holds only m/


def test_progress_bar(tmp_path, capsys, monkeypatch):
    """By default a bar only on a terminal and for large checkpoints; progress= forces it
    on or off. (pytest's captured stderr is not a terminal.)"""
    params = fd.init(_case("flux1")[1], seed=0)
    weights.save(params, tmp_path, progress=False)
    weights.load(tmp_path)  # small: no bar
    monkeypatch.setattr(weights._load, "PROGRESS_MIN_BYTES", 0)  # every checkpoint counts as large now
    weights.load(tmp_path)  # not a terminal: no bar
    weights.save(params, tmp_path)
    weights.load(tmp_path, progress=False)  # asked for none
    assert capsys.readouterr().err == ""
    weights.load(tmp_path, progress=True)
    weights.save(params, tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "loading" in err and "saving" in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # a terminal: a bar by default
    weights.load(tmp_path)
    assert "loading" in capsys.readouterr().err
    weights.load(tmp_path, progress=False)
    assert capsys.readouterr().err == ""


def test_save_bad_arguments(tmp_path):
    params = fd.init(_case("flux1")[1], seed=0)
    for bad in ("5 parsecs", 0, -3, "GB", 1.5, "0.5B", "0.0001KB", True):
        with pytest.raises(ValueError, match="max_shard_size"):
            weights.save(params, tmp_path / "a", max_shard_size=bad)
    with pytest.raises(ValueError, match="params: expected functional_dit.Params"):
        weights.save(params.flat(), tmp_path / "a")
    with pytest.raises(ValueError, match="progress: expected None, True or False"):
        weights.save(params, tmp_path / "a", progress="yes")
    with pytest.raises(ValueError, match="path: expected a str or os.PathLike"):
        weights.save(params, None)
    with pytest.raises(ValueError, match="params: .* is on the meta device"):
        weights.save(fd.init(_case("flux1")[1], device="meta"), tmp_path / "a")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"path: .*file' is a file; expected a folder"):
        weights.save(params, tmp_path / "file")
    assert not (tmp_path / "a").exists()  # nothing written for a bad argument


@pytest.mark.parametrize("old_shards, new_shards", [("30KB", "30KB"), ("30KB", "5GB"), ("5GB", "30KB")])
def test_failed_overwrite_leaves_the_old_checkpoint(tmp_path, monkeypatch, old_shards, new_shards):
    """A save that fails half way (disk full, killed) over an existing checkpoint must not
    leave a folder that loads as a silent mix of old and new tensors: the old checkpoint
    loads as it was, and no temporary file is left behind."""
    config = _case("flux1")[1]
    old, new = fd.init(config, seed=0), fd.init(config, seed=1)
    weights.save(old, tmp_path, max_shard_size=old_shards)
    (tmp_path / "README.md").write_text("mine")
    before = sorted(os.listdir(tmp_path))
    real_write, count = weights._format.Writer.write, [0]

    def failing_write(self, name, tensor):
        count[0] += 1
        if count[0] > 40:  # of 112 tensors: past the first shards of a sharded save
            raise OSError(28, "No space left on device")
        real_write(self, name, tensor)

    monkeypatch.setattr(weights._format.Writer, "write", failing_write)
    with pytest.raises(OSError, match="No space left"):
        weights.save(new, tmp_path, max_shard_size=new_shards)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == before
    _assert_same_params(weights.load(tmp_path), old)
    weights.save(new, tmp_path, max_shard_size=new_shards)  # and a save that succeeds replaces it all
    _assert_same_params(weights.load(tmp_path), new)
    assert "README.md" in os.listdir(tmp_path)


def test_load_places_on_device(tmp_path):
    """device= puts every tensor there (the meta device stands in for an accelerator: no
    GPU in CI), cast on the way; the default leaves them on the CPU."""
    params = fd.init(_case("flux2")[1], seed=0)
    weights.save(params, tmp_path)
    meta = weights.load(tmp_path, device="meta", dtype=torch.bfloat16)
    for k, t in params.flat().items():
        m = meta.flat()[k]
        assert m.device.type == "meta" and m.dtype == torch.bfloat16 and m.shape == t.shape, k
    assert {t.device.type for t in weights.load(tmp_path, device=torch.device("cpu")).leaves()} == {"cpu"}

"""Bad checkpoints: strict key checks, refused pickles, truncated and corrupt files.

Each must raise one clear ValueError naming the file (and tensor) at fault; none may
crash the interpreter, hang, or unpickle anything. Headers and length fields are
fuzzed with hypothesis; whatever our validator accepts, safetensors must read.
"""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import functional_dit as fd
import weights
from weights import CheckpointError

CONFIG = fd.PRESETS["flux1-tiny"]
FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def state():
    return fd.to_state_dict(fd.init(CONFIG, seed=0))


def _save(tmp_path, state, name="m.safetensors"):
    path = tmp_path / name
    save_file(state, path)
    return path


# ----------------------------------------------------------------------------- strict keys


def test_missing_unexpected_misshaped_in_one_error(tmp_path, state):
    bad = dict(state)
    del bad["proj_out.bias"]
    bad["time_text_embed.extra.weight"] = torch.zeros(3)
    bad["x_embedder.weight"] = torch.zeros(5, 5)
    with pytest.raises(ValueError) as e:
        weights.load(_save(tmp_path, bad), config=CONFIG)
    msg = str(e.value)
    assert "Flux1Config (diffusers layout)" in msg and "m.safetensors" in msg
    assert "1 missing: ['proj_out.bias']" in msg
    assert "1 unexpected: ['time_text_embed.extra.weight']" in msg
    assert "1 mis-shaped: ['x_embedder.weight: expected (32, 16), got (5, 5)']" in msg


def test_key_report_lists_first_20_and_counts(tmp_path, state):
    keep = {k: v for k, v in state.items() if not k.startswith("transformer_blocks.")}
    with pytest.raises(ValueError, match=r"64 missing: \[.*\] \.\.\. and 44 more") as e:
        weights.load(_save(tmp_path, keep), config=CONFIG)
    assert str(e.value).count("transformer_blocks.") == 20


def test_non_float_tensor_is_named(tmp_path, state):
    bad = dict(state, **{"proj_out.bias": torch.zeros(16, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"m.safetensors: tensor 'proj_out.bias' has dtype I64"):
        weights.load(_save(tmp_path, bad), config=CONFIG)


# ----------------------------------------------------------------------------- pickles


class _Boom:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize(
    "name", ["model.bin", "model.pt", "model.ckpt", "model.pth", "transformer/diffusion_pytorch_model.bin"]
)
def test_pickles_are_refused_never_opened(tmp_path, name):
    marker = tmp_path / "unpickled"
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(pickle.dumps({"w": _Boom(str(marker))}))
    target = tmp_path if "/" in name else path
    with pytest.raises(ValueError, match=r"pickle-based checkpoint.*Convert it to safetensors"):
        weights.load(target, config=CONFIG)
    assert not marker.exists()


def test_pickle_named_safetensors_is_a_corrupt_header(tmp_path):
    marker = tmp_path / "unpickled"
    path = tmp_path / "m.safetensors"
    torch.save({"w": torch.zeros(2)}, path)  # a zip archive: its first 8 bytes are no header length
    with pytest.raises(ValueError, match=r"m.safetensors: corrupt header.*starts like a pickle \(torch.save\) file"):
        weights.load(path, config=CONFIG)
    assert not marker.exists()


# ----------------------------------------------------------------------------- truncated / corrupt


def test_truncated_data(tmp_path, state):
    path = _save(tmp_path, state)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"m.safetensors: the header describes \d+ bytes .* \(truncated\)"):
        weights.load(path, config=CONFIG)
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match=r"m.safetensors: truncated: 5 bytes"):
        weights.load(path, config=CONFIG)
    path.write_bytes(data + b"\0" * 8)
    with pytest.raises(ValueError, match=r"trailing bytes"):
        weights.load(path, config=CONFIG)


def test_truncated_shard_in_folder_is_named(tmp_path):
    weights.save(fd.init(CONFIG), tmp_path, max_shard_size=30_000)
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    name = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / name).write_bytes((tmp_path / name).read_bytes()[:-1])
    with pytest.raises(ValueError, match=f"{name}.*truncated"):
        weights.load(tmp_path)


def test_bad_index(tmp_path):
    weights.save(fd.init(CONFIG), tmp_path, max_shard_size=30_000)
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    good = json.loads(index.read_text())
    index.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid index"):
        weights.load(tmp_path)
    index.write_text(json.dumps({**good, "weight_map": {**good["weight_map"], "proj_out.bias": "../../etc.bin"}}))
    with pytest.raises(ValueError, match="pickle-based"):
        weights.load(tmp_path)
    wm = good["weight_map"]
    moved = {**wm, "proj_out.bias": wm["x_embedder.weight"]}
    index.write_text(json.dumps({**good, "weight_map": moved}))
    wrong, right = wm["x_embedder.weight"], wm["proj_out.bias"]
    with pytest.raises(ValueError, match=rf"index says 'proj_out.bias' is in {wrong}, but it is in .*{right}"):
        weights.load(tmp_path)


def _file(header: bytes, data: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


@pytest.mark.parametrize(
    "header, data, match",
    [
        pytest.param(b"[1, 2]", b"", "must start with '{'", id="array"),
        pytest.param(b'{"a": 1', b"", "not valid UTF-8 JSON", id="unclosed"),
        pytest.param(b'{"\xff\xfe": 1}', b"", "not valid UTF-8 JSON", id="not-utf8"),
        pytest.param(b'{"a":' + b"[" * 99_999 + b"]" * 99_999 + b"}", b"", "not valid UTF-8 JSON", id="deep"),
        (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', b"\0" * 4, "span 4 bytes, but F32 \\[2\\]"),
        (b'{"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4, "unsupported dtype 'Q7'"),
        (b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', b"\0" * 4, "corrupt shape"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8, "leave a gap"),
        (b'{"a": {"dtype": "F32", "shape": [1]}}', b"", "corrupt header entry"),
        (b'{"__metadata__": {"x": 1}}', b"", "__metadata__ must map strings"),
        (b' {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4, "must start with"),
    ],
)
def test_corrupt_headers(tmp_path, header, data, match):
    path = tmp_path / "c.safetensors"
    path.write_bytes(_file(header, data))
    with pytest.raises(CheckpointError, match=match):
        weights.read_header(str(path))
    with pytest.raises(ValueError, match="c.safetensors"):
        weights.load(path, config=CONFIG)


def test_huge_length_field_does_not_allocate(tmp_path):
    path = tmp_path / "c.safetensors"
    path.write_bytes(_file(b"{}", b"", length=2**63))
    with pytest.raises(CheckpointError, match="length field says 9223372036854775808 bytes"):
        weights.read_header(str(path))


# ----------------------------------------------------------------------------- fuzz


def _check_agrees_with_safetensors(path: str) -> None:
    """Our validator's verdict: a CheckpointError, or a header safetensors reads in full."""
    try:
        infos, _ = weights.read_header(path)
    except CheckpointError:
        return
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(infos)
        for name, info in infos.items():
            assert tuple(f.get_tensor(name).shape) == info.shape


_dtypes = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "F64", "BOOL", "X9", ""])
_ints = st.one_of(st.integers(0, 64), st.integers(-5, 2**65), st.just(2**64 - 1))
_entry = st.fixed_dictionaries(
    {"dtype": _dtypes, "shape": st.lists(_ints, max_size=3), "data_offsets": st.lists(_ints, min_size=0, max_size=3)}
)
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda c: st.lists(c) | st.dictionaries(st.text(max_size=5), c),
)
_header = st.dictionaries(st.text(max_size=8), _entry | _json_value, max_size=4)


@FUZZ
@given(header=_header, data_len=st.integers(0, 300), length_delta=st.sampled_from([0, 0, 0, -1, 1, 7, -8, 2**40]))
def test_fuzz_structured_headers(tmp_path, header, data_len, length_delta):
    raw = json.dumps(header).encode()
    path = tmp_path / "f.safetensors"
    path.write_bytes(_file(raw, os.urandom(data_len), max(0, len(raw) + length_delta)))
    _check_agrees_with_safetensors(str(path))


@FUZZ
@given(raw=st.binary(max_size=200), data_len=st.integers(0, 64), length=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_fuzz_raw_bytes(tmp_path, raw, data_len, length):
    path = tmp_path / "f.safetensors"
    path.write_bytes(_file(raw, b"\0" * data_len, length))
    _check_agrees_with_safetensors(str(path))


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "s.safetensors"
    save_file({"a": torch.randn(3, 4), "b": torch.randn(5).half(), "c": torch.zeros(0, 2)}, path)
    return path.read_bytes()


@FUZZ
@given(data=st.data())
def test_fuzz_mutated_and_truncated_files(tmp_path, small_file, data):
    """Flip bytes of a real file's header, or cut it anywhere: an error, or a file
    safetensors reads; and `load` always ends in a ValueError, never a crash or a hang."""
    blob = bytearray(small_file)
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, min(len(blob), 8 + 200) - 1)) if blob else None
        if i is not None:
            blob[i] = data.draw(st.integers(0, 255))
    path = tmp_path / "f.safetensors"
    path.write_bytes(bytes(blob))
    _check_agrees_with_safetensors(str(path))
    with pytest.raises(ValueError):
        weights.load(path, config=CONFIG)


# ----------------------------------------------------------------------------- not regular files, bad arguments


def _folder(tmp_path, name="m", **kw):
    weights.save(fd.init(CONFIG), tmp_path / name, **kw)
    return tmp_path / name


@pytest.mark.timeout(30)  # a FIFO used to block open() forever
@pytest.mark.parametrize("kind", ["dir", "fifo", "loop"])
def test_weights_file_that_is_not_a_regular_file(tmp_path, kind):
    """A directory, a FIFO or a symlink loop where the weights file should be: a ValueError
    naming it, never IsADirectoryError, a hang on open() or a misleading 'no weights'."""
    folder = _folder(tmp_path)
    file = folder / "diffusion_pytorch_model.safetensors"
    file.unlink()
    {"dir": file.mkdir, "fifo": lambda: os.mkfifo(file), "loop": lambda: file.symlink_to(file)}[kind]()
    with pytest.raises(ValueError, match=r"diffusion_pytorch_model.safetensors.* not a regular file"):
        weights.load(folder)


@pytest.mark.timeout(30)
def test_path_that_is_a_fifo(tmp_path):
    path = tmp_path / "f.safetensors"
    os.mkfifo(path)
    with pytest.raises(ValueError, match=r"path: .*f.safetensors.* not a regular file"):
        weights.load(path, config=CONFIG)


def test_index_naming_a_directory_or_itself_a_directory(tmp_path):
    folder = _folder(tmp_path, max_shard_size=30_000)
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    good = json.loads(index.read_text())
    (folder / "sub.safetensors").mkdir()
    good["weight_map"]["proj_out.bias"] = "sub.safetensors"
    index.write_text(json.dumps(good))
    with pytest.raises(ValueError, match=r"sub.safetensors.* not a regular file"):
        weights.load(folder)
    index.unlink()
    index.mkdir()
    with pytest.raises(ValueError, match=r"index.json.* not a regular file"):
        weights.load(folder)


def test_config_json_that_is_a_directory(tmp_path):
    folder = _folder(tmp_path)
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    with pytest.raises(ValueError, match=r"config.json.* not a regular file"):
        weights.load(folder)


def test_config_json_without_class_name_uses_the_keys(tmp_path):
    """The family comes from _class_name, else from the keys; an unknown class or bad field
    names the config.json at fault."""
    folder = _folder(tmp_path)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("_class_name")
    cfg_path.write_text(json.dumps(cfg))
    assert weights.load(folder).config == CONFIG
    cfg_path.write_text(json.dumps(dict(cfg, _class_name="SD3Transformer2DModel")))
    with pytest.raises(ValueError, match=r"config.json: _class_name 'SD3Transformer2DModel' is not one of"):
        weights.load(folder)
    cfg_path.write_text(json.dumps(dict(cfg, _class_name="FluxTransformer2DModel", num_attention_heads="x")))
    with pytest.raises(ValueError, match=r"config.json: .*num_attention_heads"):
        weights.load(folder)
    save_file({"foo.weight": torch.zeros(2)}, folder / "diffusion_pytorch_model.safetensors")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"config.json has no _class_name and the keys .* match no known .*'foo.weight'"
    ):
        weights.load(folder)


def test_header_over_the_safetensors_limit(tmp_path):
    """safetensors refuses headers over 100,000,000 bytes; so must we (a header we accept
    must be one safetensors reads)."""
    header = b"{}" + b" " * (100_000_008 - 2)
    path = tmp_path / "h.safetensors"
    path.write_bytes(_file(header, b""))
    with pytest.raises(CheckpointError, match="limit is 100000000"):
        weights.read_header(str(path))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(device="gpu0"), "device: expected a torch.device or a device string, got 'gpu0'"),
        (dict(device=3.5), "device: expected a torch.device or a device string, got 3.5"),
        (dict(stats=[]), "stats: expected None or a dict, got list"),
        (dict(progress="no"), "progress: expected None, True or False, got 'no'"),
    ],
)
def test_bad_load_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        weights.load(_folder(tmp_path), **kw)


@pytest.mark.parametrize("path", [None, 3])
def test_bad_path_type(path):
    with pytest.raises(ValueError, match="path: expected a str or os.PathLike"):
        weights.load(path, config=CONFIG)


_TENSOR_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.uint8]
_TENSOR_DTYPES += [torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
_tensors = st.dictionaries(
    st.text(alphabet="ab._0", min_size=1, max_size=6),
    st.tuples(st.sampled_from(_TENSOR_DTYPES), st.lists(st.integers(0, 5), max_size=3)),
    max_size=5,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


@FUZZ
@given(tensors=_tensors)
def test_fuzz_valid_files_are_accepted_and_written(tmp_path, tensors):
    """The other direction of the fuzz above: every file safetensors writes passes our
    validator and reads back bitwise through our Reader, and every file our Writer
    writes is one safetensors reads back bitwise (dtypes, zero-size and 0-d tensors)."""
    state = {n: (torch.randn(shape) * 4).to(dt) for n, (dt, shape) in tensors.items()}
    theirs, ours = str(tmp_path / "theirs.safetensors"), str(tmp_path / "ours.safetensors")
    save_file(state, theirs)
    infos, _ = weights.read_header(theirs)
    assert {n: (i.torch_dtype, i.shape) for n, i in infos.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in state.items()
    }
    reader = weights._format.Reader()
    for n, t in state.items():
        out = torch.empty_like(t)
        reader.read_into(infos[n], tuple(slice(0, s) for s in t.shape), out)
        assert torch.equal(_bits(out), _bits(t)), n
    writer = weights._format.Writer(ours, {n: (t.dtype, tuple(t.shape)) for n, t in state.items()})
    for n, t in state.items():
        writer.write(n, t)
    writer.close()
    back = safetensors.torch.load_file(ours)
    assert sorted(back) == sorted(state)
    for n, t in state.items():
        assert back[n].dtype == t.dtype and back[n].shape == t.shape and torch.equal(_bits(back[n]), _bits(t)), n

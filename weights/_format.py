"""The safetensors file format: a validated header parser, a byte-counting slice reader
and a streaming writer.

A safetensors file is ``u64 little-endian N | N bytes of JSON | data``; the JSON maps
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to
the data section, and the tensors tile that section exactly. We check all of it
ourselves before ``safetensors.safe_open`` sees the file, so a truncated or corrupt
file is a `ValueError` naming the file and the tensor, never a crash or a hang.
Pickle-based checkpoints are refused outright; nothing here ever unpickles.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import struct

import safetensors  # safe_open looked up per call: tests/test_weights_dist audits the bytes it hands out
import torch

# safetensors dtype name -> (torch dtype, bytes per element)
DTYPES = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
TORCH_TO_ST = {t: name for name, (t, _) in DTYPES.items()}

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# The data starts on a 64-byte boundary of the file (safetensors itself pads only to 8),
# so tensors mmap'ed from it are as aligned as torch's allocator makes them: MKL's
# single-row GEMV sums in another order for an operand that is not (docs/numerics.md).
ALIGN = 64
MAX_HEADER = 100_000_000  # the limit safetensors itself enforces (bytes, decimal)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: bad format, corrupt, truncated or mismatched."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a validated header; ``begin``/``end`` are absolute file offsets."""

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]


def refuse_pickle(path: str) -> None:
    if path.lower().endswith(PICKLE_SUFFIXES):
        raise CheckpointError(
            f"path: {path!r} is a pickle-based checkpoint; loading it could run arbitrary code, so it is "
            "refused. Convert it to safetensors first (e.g. safetensors.torch.save_file on a state dict you "
            "trust) and pass the .safetensors file."
        )


def check_regular_file(path: str) -> int:
    """The size of ``path``, which must be a regular file: a directory, a FIFO (whose
    open() would block forever), a device or a dangling link or symlink loop is a
    `CheckpointError` naming it."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: not a regular file ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO, socket or device"
        raise CheckpointError(f"{path}: not a regular file ({kind})")
    return st.st_size


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the header of the safetensors file ``path``.

    Returns ``({name: TensorInfo}, metadata)``. Raises `CheckpointError` naming the file
    (and the tensor, where one is at fault) for anything safetensors would reject.
    """
    refuse_pickle(path)
    size = check_regular_file(path)
    try:
        with open(path, "rb") as f:
            n, raw = _read_raw_header(path, f, size)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from None
    header = _parse_json(path, raw)
    data_size = size - 8 - n
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(f"{path}: corrupt header: __metadata__ must map strings to strings")
    infos = {name: _entry(path, name, entry, 8 + n) for name, entry in header.items()}
    _check_tiling(path, infos, 8 + n, data_size)
    return infos, metadata


def _read_raw_header(path: str, f, size: int) -> tuple[int, bytes]:
    """(N, the N header bytes) after checking N against the file size and the limit."""
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{path}: truncated: {size} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointError(
            f"{path}: corrupt header: its length field says {n} bytes, but the file has {size - 8} bytes "
            f"after it (and the limit is {MAX_HEADER}); not a safetensors file, or truncated" + _pickle_hint(head)
        )
    return n, f.read(n)


def _pickle_hint(head: bytes) -> str:
    """What to say of a file whose first bytes are torch.save's (a zip, or a raw pickle)."""
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return " (it starts like a pickle (torch.save) file, which is refused: convert it to safetensors)"
    return ""


def _parse_json(path: str, raw: bytes) -> dict:
    if not raw.startswith(b"{"):
        raise CheckpointError(f"{path}: corrupt header: must start with '{{', starts with {raw[:16]!r}")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt header: not valid UTF-8 JSON ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header: expected a JSON object, got {type(header).__name__}")
    return header


def _entry(path: str, name: str, entry, start: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{where}: corrupt header entry {entry!r:.200}; expected dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {dtype!r:.50}; expected one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_uint(s) for s in shape):
        raise CheckpointError(f"{where}: corrupt shape {shape!r:.200}; expected a list of ints >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise CheckpointError(f"{where}: corrupt data_offsets {offsets!r:.200}; expected [begin, end]")
    begin, end = offsets
    nbytes = DTYPES[dtype][1]
    for s in shape:  # as safetensors computes it: every partial product must fit in 64 bits
        nbytes *= s
        if nbytes >= 2**64 or s >= 2**64:
            raise CheckpointError(f"{where}: shape {shape} overflows 64-bit byte counts")
    if end - begin != nbytes:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} span {end - begin} bytes, but {dtype} {shape} needs {nbytes}"
        )
    return TensorInfo(path, name, dtype, tuple(shape), start + begin, start + end)


def _is_uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_tiling(path: str, infos: dict[str, TensorInfo], start: int, data_size: int) -> None:
    """The tensors must tile the data section exactly, in offset order, as safetensors requires."""
    pos = start
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        if info.begin != pos:
            raise CheckpointError(
                f"{path}: tensor {info.name!r}: data begins at byte {info.begin - start} of the data section, "
                f"expected {pos - start} (tensors overlap or leave a gap)"
            )
        pos = info.end
    if pos != start + data_size:
        raise CheckpointError(
            f"{path}: the header describes {pos - start} bytes of tensor data, but the file holds "
            f"{data_size}" + (" (truncated)" if pos > start + data_size else " (trailing bytes)")
        )


def read_tensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the safetensors file ``path`` and its metadata, the header
    validated by `read_header` first (so pickles and corrupt files are refused alike)."""
    infos, metadata = read_header(path)
    try:
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in infos}, metadata
    except Exception as e:  # safetensors raises its own error types; name the file
        raise CheckpointError(f"{path}: cannot be read: {e}") from e


class Reader:
    """Reads slices of tensors with ``safetensors.safe_open(...).get_slice`` and counts
    the bytes it reads (``bytes_read``), per file.

    The file is opened for each read and closed right after: safetensors memory-maps
    the file, and the pages a slice touches stay resident (and count in this process's
    RSS) for as long as the file is open, so a long-lived handle would make a rank's
    peak memory the whole file rather than its own shard.
    """

    def __init__(self):
        self.bytes_read = 0

    def read_into(self, info: TensorInfo, index: tuple[slice, ...], out: torch.Tensor) -> None:
        """Copy ``info``'s tensor at ``index`` (one slice per dim) into ``out``, casting
        to ``out.dtype`` on the way."""
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, info.shape))
        if shape != tuple(out.shape):
            raise AssertionError(f"{info.name}: slice {shape} does not fit {tuple(out.shape)}")
        try:
            with safetensors.safe_open(info.file, framework="pt", device="cpu") as f:
                out.copy_(f.get_slice(info.name)[index] if info.shape else f.get_tensor(info.name))
        except Exception as e:  # safetensors raises its own error types; name the file and tensor
            raise CheckpointError(f"{info.file}: tensor {info.name!r}: cannot be read: {e}") from e
        self.bytes_read += math.prod(shape) * info.itemsize


def _header_bytes(entries: dict[str, dict], metadata: dict[str, str]) -> bytes:
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    return header + b" " * (-(8 + len(header)) % ALIGN)  # spaces: the padding the format allows


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * DTYPES[TORCH_TO_ST[dtype]][1]


def data_order(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> list[str]:
    """The order `Writer` lays tensors out in (writing them in it is sequential IO): those
    whose size is a multiple of ``ALIGN`` first, so each of them starts ``ALIGN``-aligned."""
    return sorted(specs, key=lambda k: _nbytes(*specs[k]) % ALIGN != 0)


class Writer:
    """Writes one safetensors file tensor by tensor: the header first (from the
    names, dtypes and shapes given up front), then each tensor's bytes at its offset as
    it comes, so no more than one tensor is ever held for writing."""

    def __init__(self, path: str, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata=None):
        self.path, self.specs, self.offsets, entries, pos = path, specs, {}, {}, 0
        for name in data_order(specs):
            dtype, shape = specs[name]
            n = _nbytes(dtype, shape)
            entries[name] = {"dtype": TORCH_TO_ST[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            self.offsets[name], pos = pos, pos + n
        header = _header_bytes(entries, dict(metadata or {"format": "pt"}))
        self.start, self.written = 8 + len(header), set()
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(header)) + header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        dtype, shape = self.specs.get(name, (None, None))
        if name in self.written or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            expected = "a tensor not yet written" if name in self.written else f"{dtype} {shape}"
            raise ValueError(f"{self.path}: {name}: expected {expected}, got {tensor.dtype} {tuple(tensor.shape)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if self.file.tell() != self.start + self.offsets[name]:
            self.file.seek(self.start + self.offsets[name])
        self.file.write(memoryview(data.numpy()))
        self.written.add(name)

    def close(self) -> None:
        """Flushes the file to disk (``fsync``) before closing: a rename of it that
        survives a crash then names complete data."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if len(self.written) != len(self.specs):
            raise ValueError(f"{self.path}: closed after {len(self.written)} of {len(self.specs)} tensors")

"""`save`: `Params` -> a diffusers-format model folder (what ``save_pretrained`` writes).

Shards are written tensor by tensor, so at most one full tensor is held at a time;
sharded params are gathered one tensor at a time and written by rank 0 alone
(docs/weights.md, "Saving"). Replacing an old checkpoint atomically is `_commit`'s.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re

import torch

import functional_dit as fd
import sharding
from functional_dit.nn.layerwise import stored_leaf
from sharding.internal import is_dtensor
from sharding.tree import flatten

from . import _commit, _quant
from . import _format as F
from ._load import _bar, check_progress

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """``5_000_000`` or ``"5GB"`` (10^9) / ``"5GiB"`` (2^30) -> bytes, as huggingface_hub reads them."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size) if isinstance(size, str) else None
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()]) if m and m.group(2).upper() in _UNITS else 0
    if n < 1:  # "0.5B" is no size either
        raise ValueError(f"max_shard_size: expected a positive int or a size such as '5GB' or '500MiB', got {size!r}")
    return n


def shard_groups(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Keys grouped in order into shards of at most ``limit`` bytes (a bigger tensor
    gets a shard of its own)."""
    groups, current, total = [], [], 0
    for key, n in sizes.items():
        if current and total + n > limit:
            groups.append(current)
            current, total = [], 0
        current.append(key)
        total += n
    return groups + [current] if current else groups


def save(params: fd.Params, path, max_shard_size="5GB", *, progress: bool | None = None) -> None:
    """Write ``params`` as a diffusers-format model folder at ``path``.

    ``max_shard_size``: bytes per safetensors shard (an int or e.g. ``"5GB"``).
    ``progress``: a tqdm bar; None shows one on a terminal for checkpoints >= 1 GiB.
    With sharded params every rank must call ``save``; rank 0 writes, and if it fails
    every rank raises (none is left waiting in a gather).

    Overwriting an existing checkpoint is safe: a save that fails or is killed at any
    moment leaves a folder that loads as the old checkpoint or as the new one
    (`weights._commit`; docs/checkpoints.md).
    """
    path = _check_args(params, path, progress)
    limit = parse_size(max_shard_size)
    flat, specs, meta, sizes = _describe(params)
    groups = shard_groups(sizes, limit)
    mesh = _mesh_of(flat)
    writing = mesh is None or torch.distributed.get_rank() == 0
    out = _Folder(path, defer=mesh is not None) if writing else None
    if out is not None:
        out.run(out.prepare)
    names = _commit.shard_names(path, len(groups)) if writing else [None] * len(groups)
    label = f"saving {os.path.basename(os.path.normpath(path))}"
    with _bar(sum(sizes.values()), progress, mesh, label) as bar:
        for name, keys in zip(names, groups):
            _write_shard(out, name, keys, flat, specs, meta, bar)
    if out is not None:
        index = None
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": _weight_map(names, groups)}
        config = {**fd.config_to_diffusers(params.config), "_diffusers_version": _diffusers_version()}
        config.update(_quant.config_entry(params.flat()))
        out.run(out.commit, index, config)
    if mesh is not None:
        _agree(mesh, out)


def _check_args(params, path, progress) -> str:
    if not isinstance(params, fd.Params):
        raise ValueError(f"params: expected functional_dit.Params, got {type(params).__name__}")
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise ValueError(f"path: expected a str or os.PathLike naming a folder, got {path!r:.100}")
    check_progress(progress)
    return os.fspath(path)


def _describe(params: fd.Params):
    """``(flat params, flat specs, {key: (dtype, shape)}, {key: bytes})``, after checking
    that every leaf is one safetensors can store and the config's specs describe. A
    layerwise-cast leaf (`fd.layerwise_cast`) is written in the dtype it is stored in, an fp8
    leaf (`fd.quantize`) as its fp8 values and its scales (`weights._quant`)."""
    flat = {k: stored_leaf(t) for k, t in params.flat().items()}
    specs = flatten(fd.param_specs(params.config))
    if list(specs) != list(flat) or any(tuple(flat[k].shape) != s.shape for k, s in specs.items()):
        fd.from_state_dict(params.config, {k: v for k, v in flat.items()})  # raises the ValueError listing them
    flat = _quant.expand(flat)
    specs = {k: specs.get(k) for k in flat}  # a scale has no spec (never sharded: sharded fp8 is refused)
    meta = {k: (t.dtype, tuple(t.shape)) for k, t in flat.items()}
    for k, (dtype, _) in meta.items():
        if dtype not in F.TORCH_TO_ST:
            raise ValueError(f"params: {k} has dtype {dtype}, which safetensors cannot store")
        if flat[k].device.type == "meta":
            raise ValueError(f"params: {k} is on the meta device: it has a shape but no data to save")
    sizes = {k: F.TensorInfo("", k, F.TORCH_TO_ST[d], s, 0, 0).itemsize * math.prod(s) for k, (d, s) in meta.items()}
    return flat, specs, meta, sizes


def _write_shard(out, name: str, keys: list[str], flat: dict, specs: dict, meta: dict, bar) -> None:
    """One safetensors file: every rank gathers each leaf in turn; rank 0 (``out``) writes it."""
    if out is not None:
        out.run(out.open, name, {k: meta[k] for k in keys})
    for k in F.data_order({k: meta[k] for k in keys}):
        full = _full(flat[k], specs[k])  # every rank takes part in the gather
        if out is not None:
            out.run(out.write, k, full)
        bar.update(full.numel() * full.element_size())
        del full
    if out is not None:
        out.run(out.close)


def _agree(mesh, out) -> None:
    """Every rank learns whether rank 0 wrote the folder; all raise if it did not."""
    failed = torch.tensor([0 if out is None or out.error is None else 1], device=sharding.mesh_device(mesh))
    torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
    if out is not None and out.error is not None:
        raise out.error
    if failed.item():
        raise RuntimeError("save: rank 0 failed to write the checkpoint; its exception says why")


class _Folder:
    """The writing rank's side of `save`: shards go to temporary files; `commit` moves them
    into place. Every step goes through `run`, which, when ``defer`` (sharded params: the
    other ranks are still gathering), records the first failure instead of raising and
    turns later steps into no-ops, so the gathers stay matched across ranks."""

    def __init__(self, path: str, defer: bool):
        self.path, self.defer = path, defer
        self.error: BaseException | None = None
        self.temps: dict[str, str] = {}  # temporary file -> its final path
        self.writer = None

    def run(self, step, *args) -> None:
        if self.error is not None:
            return
        try:
            step(*args)
        except Exception as e:  # noqa: BLE001 - re-raised here or, for sharded params, after the gathers
            self.error = e
            self._discard()
            if not self.defer:
                raise

    def prepare(self) -> None:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"path: {self.path!r} is a file; expected a folder (new or existing)")
        os.makedirs(self.path, exist_ok=True)
        _commit.clean_leftovers(self.path)

    def open(self, name: str, specs: dict) -> None:
        final = os.path.join(self.path, name)
        temp = _commit.temp_name(final)
        self.temps[temp] = final
        self.writer = F.Writer(temp, specs)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        self.writer.write(key, tensor)

    def close(self) -> None:
        writer, self.writer = self.writer, None
        writer.close()

    def commit(self, index: dict | None, config: dict) -> None:
        temps, self.temps = self.temps, {}
        try:
            _commit.commit(self.path, temps, index, config)
        finally:  # a failed commit leaves the temporaries it did not rename: remove them
            self.temps = {t: f for t, f in temps.items() if os.path.lexists(t)}

    def _discard(self) -> None:
        """Close and delete the temporary files of a failed save; the old checkpoint stays."""
        if self.writer is not None:
            self.writer.file.close()
            self.writer = None
        for temp in self.temps:
            if os.path.lexists(temp):
                os.remove(temp)
        self.temps = {}


def _weight_map(names, groups) -> dict:
    return {k: name for name, keys in zip(names, groups) for k in keys}


def _diffusers_version() -> str:
    try:  # the installed version, without importing diffusers (seconds)
        return importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - diffusers is a dependency
        return "0.0.0"


def _mesh_of(flat: dict):
    meshes = {id(t.device_mesh): t.device_mesh for t in flat.values() if is_dtensor(t)}
    if len(meshes) > 1:
        raise ValueError(f"params: leaves live on {len(meshes)} different meshes; expected one")
    return next(iter(meshes.values()), None)


def _full(t: torch.Tensor, spec) -> torch.Tensor:
    """The whole tensor; a DTensor leaf is gathered with `sharding.unshard` (every rank
    takes part), one leaf at a time. The writer copies it to the host."""
    if not is_dtensor(t):
        return t.detach()
    placement = sharding.placement_of(t, spec)
    return sharding.unshard({"t": t}, plan={"t": placement})["t"].detach()

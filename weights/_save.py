"""`save`: `Params` -> a diffusers-format model folder.

The folder holds ``config.json`` (the diffusers ``_class_name`` and config keys),
``diffusion_pytorch_model.safetensors`` or, past ``max_shard_size``, numbered shards
plus ``diffusion_pytorch_model.safetensors.index.json`` — what diffusers'
``ModelMixin.save_pretrained`` writes, so ``from_pretrained`` loads it directly.

Each shard is written tensor by tensor (header first, then the bytes), so at most
one full tensor is held at a time. Sharded params (DTensor leaves) are gathered one
tensor at a time, every rank taking part, and written by rank 0 alone: no rank ever
holds the whole model.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re

import torch

import functional_dit as fd
import sharding
from functional_dit._pytree import flatten

from . import _format as F
from ._load import _bar
from ._source import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """``5_000_000`` or ``"5GB"`` (10^9) / ``"5GiB"`` (2^30) -> bytes, as huggingface_hub reads them."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size) if isinstance(size, str) else None
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size: expected a positive int or a size such as '5GB' or '500MiB', got {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


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
    With sharded params every rank must call ``save``; rank 0 writes.
    """
    if not isinstance(params, fd.Params):
        raise ValueError(f"params: expected functional_dit.Params, got {type(params).__name__}")
    path = os.fspath(path)
    cfg = fd.config_to_diffusers(params.config)
    flat = params.flat()
    specs = flatten(fd.param_specs(params.config))
    if list(specs) != list(flat) or any(tuple(flat[k].shape) != s.shape for k, s in specs.items()):
        fd.from_state_dict(params.config, {k: v for k, v in flat.items()})  # raises the ValueError listing them
    meta = {k: (t.dtype, tuple(t.shape)) for k, t in flat.items()}
    for k, (dtype, _) in meta.items():
        if dtype not in F.TORCH_TO_ST:
            raise ValueError(f"params: {k} has dtype {dtype}, which safetensors cannot store")
    sizes = {k: F.TensorInfo("", k, F.TORCH_TO_ST[d], s, 0, 0).itemsize * _numel(s) for k, (d, s) in meta.items()}
    groups = shard_groups(sizes, parse_size(max_shard_size))
    names = _shard_names(len(groups))
    mesh = _mesh_of(flat)
    writer_rank = mesh is None or torch.distributed.get_rank() == 0
    if writer_rank:
        os.makedirs(path, exist_ok=True)
        _remove_stale(path, set(names))
    with _bar(sum(sizes.values()), progress, mesh, f"saving {os.path.basename(os.path.normpath(path))}") as bar:
        for name, keys in zip(names, groups):
            _write_shard(os.path.join(path, name), keys, flat, specs, meta, writer_rank, bar)
    if writer_rank:
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": _weight_map(names, groups)}
            _write_json(os.path.join(path, INDEX_NAME), index)
        _write_json(os.path.join(path, CONFIG_NAME), {**cfg, "_diffusers_version": _diffusers_version()})
    if mesh is not None:
        torch.distributed.barrier()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return [WEIGHTS_NAME]
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    return [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _weight_map(names, groups) -> dict:
    return {k: name for name, keys in zip(names, groups) for k in keys}


_OURS = re.compile(r"diffusion_pytorch_model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?\Z")


def _remove_stale(path: str, keep: set[str]) -> None:
    """Old weight files a loader could pick up instead of ours (an index from an earlier
    sharded save, shards from a different count)."""
    for name in os.listdir(path):
        if _OURS.match(name) and name not in keep:
            os.remove(os.path.join(path, name))


def _write_shard(file: str, keys, flat, specs, meta, writer_rank: bool, bar) -> None:
    writer = F.Writer(file + ".tmp", {k: meta[k] for k in keys}) if writer_rank else None
    try:
        for k in keys:
            full = _full(flat[k], specs[k])
            if writer is not None:
                writer.write(k, full)
            bar.update(full.numel() * full.element_size())
            del full
    finally:
        if writer is not None:
            writer.file.close()
    if writer is not None:
        writer.close()
        os.replace(file + ".tmp", file)


def _write_json(file: str, obj) -> None:
    with open(file + ".tmp", "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(file + ".tmp", file)


def _diffusers_version() -> str:
    try:  # the installed version, without importing diffusers (seconds)
        return importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - diffusers is a dependency
        return "0.0.0"


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _mesh_of(flat: dict):
    meshes = {id(t.device_mesh): t.device_mesh for t in flat.values() if _is_dtensor(t)}
    if len(meshes) > 1:
        raise ValueError(f"params: leaves live on {len(meshes)} different meshes; expected one")
    return next(iter(meshes.values()), None)


def _full(t: torch.Tensor, spec) -> torch.Tensor:
    """The whole tensor on the CPU; a DTensor leaf is gathered with `sharding.unshard`
    (every rank takes part), one leaf at a time."""
    if not _is_dtensor(t):
        return t.detach().cpu()
    placement = _placement(t, spec)
    return sharding.unshard({"t": t}, plan={"t": placement})["t"].detach().cpu()


def _placement(t, spec):
    """The `sharding` placement a `shard_params` leaf was made with, read off its DTensor
    placements; a fused dim (``ParamSpec`` axis "packed") is split per block."""
    names = t.device_mesh.mesh_dim_names
    split = [(names[i], p.dim) for i, p in enumerate(t.placements) if p.is_shard()]
    if not split:
        return sharding.Replicate()
    if len(split) > 1:
        raise ValueError(f"params: a leaf is split over several mesh dims {split}; expected at most one")
    (axis, dim), blocks = split[0], None
    if spec.axes[dim] == fd.PACKED:
        blocks = tuple(b.size for b in spec.blocks)
    return sharding.Shard(dim, axis, blocks)

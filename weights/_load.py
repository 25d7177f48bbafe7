"""`load`: a checkpoint on disk -> `Params`, streamed tensor by tensor.

The parameter shapes come from `functional_dit.param_specs` (nothing is allocated
up front); each tensor is then allocated at its final (local) size and filled
straight from the file with ``safe_open(...).get_slice``, cast on the way. With a
mesh, each rank computes from the plan which index ranges of each tensor it holds
(per block for packed projections) and reads only those, so no rank ever
materialises a full tensor or another rank's shard.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
from collections.abc import Mapping

import torch
from tqdm.auto import tqdm

import functional_dit as fd
import sharding
from functional_dit import controlnet, families
from sharding.tree import flatten, mismatch_report, nest

from . import _commit, _quant
from . import _format as F
from . import _layouts as L
from ._format import CheckpointError
from ._source import CONFIG_NAME, Source, open_source

PROGRESS_MIN_BYTES = 1 << 30  # show a bar (on a terminal) from 1 GiB on


def load(
    path,
    config=None,
    mesh=None,
    plan=None,
    dtype: torch.dtype | None = None,
    device=None,
    *,
    progress: bool | None = None,
    stats: dict | None = None,
    variant: str | None = None,
) -> fd.Params:
    """Load a transformer checkpoint into `Params`.

    ``path``: a diffusers model folder (``config.json`` + one safetensors file or an
    index and shards), a pipeline folder (its ``transformer/`` is used), or one
    ``.safetensors`` file in diffusers or Black Forest Labs (FLUX.1, FLUX.2) layout
    (wrapped in ``model.diffusion_model.``, possibly next to a VAE and text encoders).
    ``config``: a preset name in ``fd.PRESETS``, a config object or a diffusers config
    mapping (anything `fd.as_config` takes); required for a
    single file, optional (and checked against config.json) for a folder. The family
    comes from config.json's ``_class_name``, else from the keys.
    ``mesh``/``plan``: shard as ``sharding.shard_params`` would, each rank reading only
    its own slices; ``plan`` defaults to ``sharding.plan(config, mesh)``.
    ``dtype``: cast every tensor to it while reading (default: keep the file's dtypes).
    ``progress``: a tqdm bar; None shows one on a terminal for checkpoints >= 1 GiB.
    ``stats``: if a dict, receives ``bytes_read`` and ``local_bytes`` for this rank.
    ``variant``: in a folder, read ``diffusion_pytorch_model.<variant>.safetensors`` (or its
    sharded index), as diffusers' ``from_pretrained(variant=...)`` does.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype: expected None or a floating torch.dtype, got {dtype!r}")
    check_progress(progress)
    if stats is not None and not isinstance(stats, dict):
        raise ValueError(f"stats: expected None or a dict, got {type(stats).__name__}")
    device = _device(device, mesh)
    src, config, specs, resolved, (scales, scheme) = _resolve(path, config, variant, dtype)
    plan = _flat_plan(config, specs, mesh, plan)
    regions = {k: _region(s.shape, mesh, plan and plan[k]) for k, s in specs.items()}
    flat = _fill(src, resolved, regions, dtype, device, mesh, progress, stats, fp8=scales)
    if scales:  # fp8 weights (fd.quantize): wrapped with their scales, computing in the others' dtype
        compute = dtype or next(t.dtype for k, t in flat.items() if k not in scales and t.is_floating_point())
        flat = _quant.wrap(flat, scales, scheme, regions, compute)
    return _finish(config, flat, specs, mesh, plan)


def inspect(path, config=None, *, dtype: torch.dtype | None = None, variant: str | None = None):
    """The config of the checkpoint at ``path`` after every check `load` makes before
    reading data (headers, family, keys, shapes, dtypes); reads no tensor. A ValueError
    (`CheckpointError` for a broken file) says what is wrong."""
    return _resolve(path, config, variant, dtype)[1]


def _resolve(path, config, variant, dtype):
    """``(source, config, flat specs, key resolution, (fp8 scales, scheme))``, every check passed."""
    src, scales, scheme = _quant.split(open_source(path, variant))
    if src.config_path is not None:  # a folder: temporaries of a killed save go
        _commit.clean_leftovers(os.path.dirname(src.config_path))
    detected = L.detect(src.tensors)
    config = _config(config, src, detected)
    cls = fd.config_to_diffusers(config)["_class_name"]
    layout = detected[1] if detected is not None and detected[0] == cls else "diffusers"
    specs = flatten(fd.param_specs(config))
    shapes = {k: s.shape for k, s in specs.items()}
    resolved = L.identity(shapes) if layout == "diffusers" else L.resolve(L.BFL_TABLES[cls], shapes)
    _check_keys(src, config, layout, resolved)
    _check_dtypes(src, resolved, dtype, quantized=scales)
    return src, config, specs, resolved, (scales, scheme)


# ----------------------------------------------------------------------------- config and keys


def _config(config, src: Source, detected):
    """The config from config.json, else from ``config=``; both must agree when given."""
    from_json = _json_config(src, detected) if src.config_json is not None else None
    given = _given_config(config)
    if from_json is not None and given is not None and from_json != given:
        raise ValueError(
            f"config: {type(given).__name__} differs from the checkpoint's {src.config_path} in "
            f"{_differences(given, from_json)}; pass config=None to use the file's"
        )
    config = given or from_json
    if config is None:
        raise ValueError(_no_config_message(src, detected))
    cls = fd.config_to_diffusers(config)["_class_name"]
    # A ControlNet's keys include its family's blocks (detected as that family): diffusers layout.
    # So do the keys of a family laid out as another one (its own keys, exactly): tests/test_toy_family.py.
    own = (
        detected is not None and detected[1] == "diffusers" and set(src.tensors) == set(flatten(fd.param_specs(config)))
    )
    if detected is not None and detected[0] != cls and cls not in controlnet.BY_DIFFUSERS_CLASS and not own:
        raise ValueError(
            f"config: a {L.FAMILY_NAMES.get(cls, cls)} config ({type(config).__name__}), but the keys of "
            f"{src.path} are those of {L.FAMILY_NAMES[detected[0]]} ({detected[1]} layout)"
        )
    return config


def _json_config(src: Source, detected):
    """config.json as a config; without ``_class_name`` the family comes from the keys."""
    cfg = _quant.config_json(src.config_json)
    if "_class_name" not in cfg:
        if detected is None:
            found = sorted(src.tensors)
            raise CheckpointError(
                f"{src.config_path} has no _class_name and the keys of {src.path} match no known layout "
                f"(FLUX.1, FLUX.2, Qwen-Image); found {len(found)} keys such as {found[:8]}"
            )
        cfg = {**cfg, "_class_name": detected[0]}
    try:
        return fd.config_from_diffusers(cfg)
    except ValueError as e:
        raise CheckpointError(f"{src.config_path}: {str(e).removeprefix('cfg: ')}") from None


def _differences(a, b) -> str:
    """``field: a vs b`` for the fields where two configs of one class differ."""
    if type(a) is not type(b) or not dataclasses.is_dataclass(a):
        return f"the family ({type(b).__name__} in the file)"
    fields = [f.name for f in dataclasses.fields(a)]
    return ", ".join(f"{n}={getattr(a, n)!r} vs {getattr(b, n)!r}" for n in fields if getattr(a, n) != getattr(b, n))


def _given_config(config):
    """``config=``: a preset name, a config or a diffusers config mapping (`fd.as_config`)."""
    return None if config is None else fd.as_config(config)


def _no_config_message(src: Source, detected) -> str:
    found = sorted(src.tensors)
    if detected is None:
        return (
            f"config: {src.path} has no {CONFIG_NAME} and its keys match no known layout "
            f"({', '.join(fam.NAME for fam in families.FAMILIES)} in diffusers or Black Forest Labs layout); "
            f"found {len(found)} keys "
            f"such as {found[:8]}. Pass config= a preset name in {sorted(fd.PRESETS)} or a config."
        )
    cls, layout = detected
    return (
        f"config: {src.path} has no {CONFIG_NAME}; its keys are {L.FAMILY_NAMES[cls]}'s ({layout} layout). "
        f"Pass config= a preset name (one of {sorted(fd.PRESETS)}) or a config object."
    )


def _check_keys(src: Source, config, layout: str, resolved: L.Resolved) -> None:
    """One ValueError listing every missing, unexpected and mis-shaped source key."""
    if resolved.unmatched:  # a table that misses a parameter is our bug, not the file's
        raise AssertionError(f"{layout} table has no rule for {resolved.unmatched[:20]}")
    wanted = resolved.source_shapes
    feeds: dict[str, list[str]] = {}
    for key, pieces in resolved.pieces.items():
        for p in pieces:
            feeds.setdefault(p.src, []).append(key)
    missing = [_named(k, feeds, layout) for k in wanted if k not in src.tensors]
    dropped = L.DROPPED.get(fd.config_to_diffusers(config)["_class_name"], ()) if layout != "diffusers" else ()
    unexpected = [k for k in src.tensors if k not in wanted and not k.startswith(dropped)]
    shapes = [
        f"{_named(k, feeds, layout)}: expected {s}, got {src.tensors[k].shape}"
        for k, s in wanted.items()
        if k in src.tensors and src.tensors[k].shape != tuple(s)
    ]
    if missing or unexpected or shapes:
        name = f"{type(config).__name__} ({layout} layout) in {src.path}"
        raise CheckpointError(mismatch_report(f"state dict does not match {name}", missing, unexpected, shapes))


def _named(src_key: str, feeds: dict, layout: str) -> str:
    if layout == "diffusers":
        return src_key
    return f"{src_key} (-> {', '.join(dict.fromkeys(feeds[src_key]))})"


def _check_dtypes(src: Source, resolved: L.Resolved, dtype, quantized=()) -> None:
    bad = [
        f"{info.file}: tensor {k!r} has dtype {info.dtype}"
        for k in resolved.source_shapes
        if (info := src.tensors[k]).dtype not in F.FLOAT_DTYPES
    ]
    if bad:
        more = f" ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise CheckpointError(f"expected floating-point parameters ({', '.join(F.FLOAT_DTYPES)}): {bad[:20]}{more}")
    by_dtype: dict[str, list[str]] = {}
    for k in resolved.source_shapes:
        if k in quantized:  # fp8 weights with scales: stored fp8, computed in the others' dtype
            continue
        by_dtype.setdefault(src.tensors[k].dtype, []).append(k)
    if dtype is None and len(by_dtype) > 1:
        found = {d: (len(ks), ks[:3]) for d, ks in by_dtype.items()}
        raise ValueError(
            f"dtype: the checkpoint mixes dtypes {found} as (count, first keys) and fd.apply computes in one; "
            f"expected dtype= one of them (e.g. torch.bfloat16) to cast while reading, got None"
        )


# ----------------------------------------------------------------------------- regions and filling


def _flat_plan(config, specs: dict, mesh, plan) -> dict | None:
    """``{key: placement}``: ``plan`` or ``sharding.plan(config, mesh)``; None without a mesh."""
    if mesh is None:
        if plan is not None:
            raise ValueError("plan: a plan needs a mesh; got plan= without mesh=")
        return None
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not names:
        raise ValueError(f"mesh: expected a named DeviceMesh (sharding.make_mesh), got {mesh!r}")
    if plan is not None and not isinstance(plan, Mapping):
        raise ValueError(f"plan: expected None or a mapping shaped like the params (sharding.plan), got {plan!r:.100}")
    plan = flatten(sharding.plan(config, mesh) if plan is None else plan)
    if set(plan) != set(specs):
        missing, extra = sorted(set(specs) - set(plan))[:10], sorted(set(plan) - set(specs))[:10]
        raise ValueError(f"plan: expected the keys of the params; missing {missing}, unexpected {extra}")
    sizes = sharding.mesh_sizes(mesh)
    for key, placement in plan.items():  # one sharding.plan could have made; fused dims per block
        sharding.check_placement(key, placement, specs[key], sizes)
    return plan


def _region(shape, mesh, placement) -> tuple[list[tuple[int, int]], ...]:
    """The index ranges of a ``shape`` tensor this rank holds: a list of (start, stop)
    per dim, concatenated in order (several for a dim split per fused block)."""
    region = [[(0, n)] for n in shape]
    if placement is not None:
        ranges = sharding.local_slices(shape, placement, mesh)
        for d in {d for d, _, _ in ranges}:  # a fully sharded leaf has ranges on two dims
            region[d] = [(a, b) for e, a, b in ranges if e == d]
    return tuple(region)


def _device(device, mesh):
    """Where the tensors go: ``device``, or the mesh's device (``device`` must agree)."""
    given = device
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device: expected a torch.device or a device string, got {given!r}") from None
    if mesh is None:
        return device
    if not getattr(mesh, "mesh_dim_names", None):
        raise ValueError(f"mesh: expected a named DeviceMesh (sharding.make_mesh), got {mesh!r}")
    want = sharding.mesh_device(mesh)
    if device is not None and device.type != want.type:
        raise ValueError(f"device: the mesh's shards live on {want.type}, got device={given!r}")
    return want


def _fill(src: Source, resolved: L.Resolved, regions: dict, dtype, device, mesh, progress, stats, fp8=()) -> dict:
    reader = F.Reader()
    sizes = {k: [sum(b - a for a, b in r) for r in regions[k]] for k in resolved.pieces}
    file_dtype = lambda k: src.tensors[resolved.pieces[k][0].src].torch_dtype  # noqa: E731
    out_dtype = lambda k: file_dtype(k) if k in fp8 else dtype or file_dtype(k)  # noqa: E731
    total = sum(math.prod(s) * out_dtype(k).itemsize for k, s in sizes.items())
    flat = {}
    with _bar(total, progress, mesh, f"loading {os.path.basename(os.path.normpath(src.path))}") as bar:
        for key, pieces in resolved.pieces.items():
            dest = torch.empty(sizes[key], dtype=out_dtype(key))
            _fill_one(reader, src, pieces, regions[key], dest)
            flat[key] = dest if device is None else dest.to(device)
            bar.update(dest.numel() * dest.element_size())
    if stats is not None:
        stats.update(bytes_read=reader.bytes_read, local_bytes=total)
    return flat


def _fill_one(reader: F.Reader, src: Source, pieces: list[L.Piece], region, dest: torch.Tensor) -> None:
    """Copy the ``region`` of a diffusers tensor, assembled from its source ``pieces``,
    into ``dest`` (the region's local layout: ranges concatenated per dim)."""
    rows, *rest = region
    rest_index = [list(zip(ranges, _offsets(ranges))) for ranges in rest]
    for (r0, r1), d0 in zip(rows, _offsets(rows)):
        for p in pieces:
            a, b = max(r0, p.dst), min(r1, p.dst + p.rows)
            if a >= b:
                continue
            src_rows = slice(p.src_row + a - p.dst, p.src_row + b - p.dst)
            dst_rows = slice(d0 + a - r0, d0 + b - r0)
            for combo in itertools.product(*rest_index):
                src_idx = (src_rows, *(slice(s, e) for (s, e), _ in combo))
                dst_idx = (dst_rows, *(slice(o, o + e - s) for (s, e), o in combo))
                reader.read_into(src.tensors[p.src], src_idx, dest[dst_idx])


def _offsets(ranges) -> list[int]:
    """Where each range starts in the local (concatenated) layout."""
    out, pos = [], 0
    for a, b in ranges:
        out.append(pos)
        pos += b - a
    return out


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        pass


def check_progress(progress) -> None:
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"progress: expected None, True or False, got {progress!r}")


def _bar(total: int, progress: bool | None, mesh, desc: str):
    """A tqdm bar over bytes: on a terminal for large checkpoints, or when progress=True;
    only rank 0 of a mesh draws it."""
    if progress is None:
        progress = total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
    if not progress or (mesh is not None and torch.distributed.get_rank() != 0):
        return _NoBar()
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)


def _finish(config, flat: dict, specs: dict, mesh, plan) -> fd.Params:
    if mesh is None:
        return fd.Params(config, nest(flat))
    return fd.Params(
        config, nest({k: sharding.dtensor_from_local(t, specs[k].shape, plan[k], mesh) for k, t in flat.items()})
    )

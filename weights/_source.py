"""Where a checkpoint's tensors live: resolving a path to its safetensors files, their
validated headers, and its config.json."""

from __future__ import annotations

import dataclasses
import json
import os

from . import _format as F
from ._format import CheckpointError, TensorInfo
from ._layouts import STRIP_PREFIXES

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
CONFIG_NAME = "config.json"


@dataclasses.dataclass
class Source:
    path: str  # what the user passed
    files: list[str]
    tensors: dict[str, TensorInfo]  # key (prefix stripped) -> where it is
    config_json: dict | None  # the folder's config.json, if any
    config_path: str | None = None  # where it is


def variant_names(variant: str | None) -> tuple[str, str]:
    """(weights file, index file) names of a diffusers folder, for ``variant`` as
    diffusers' ``from_pretrained(variant=...)`` names them: ``diffusion_pytorch_model.fp16.safetensors``
    and ``diffusion_pytorch_model.safetensors.index.fp16.json``."""
    if variant is None:
        return WEIGHTS_NAME, INDEX_NAME
    if not isinstance(variant, str) or not variant or any(c in variant for c in "./\\"):
        raise ValueError(f"variant: expected None or a name such as 'fp16' (no '.', '/'), got {variant!r}")
    return f"diffusion_pytorch_model.{variant}.safetensors", f"{WEIGHTS_NAME}.index.{variant}.json"


def open_source(path, variant: str | None = None) -> Source:
    """Resolve ``path`` (model folder, pipeline folder or one .safetensors file); in a
    folder, ``variant`` picks the weights files of that variant."""
    names = variant_names(variant)
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise ValueError(f"path: expected a str or os.PathLike naming a folder or a file, got {path!r:.100}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"path: {path!r} does not exist")
    F.refuse_pickle(path)
    if not os.path.isdir(path):
        if not os.path.isfile(path):
            raise ValueError(f"path: {path!r} is not a regular file or a folder (a FIFO, socket or device)")
        if not path.endswith(".safetensors"):
            raise ValueError(f"path: expected a .safetensors file or a diffusers folder, got the file {path!r}")
        if variant is not None:
            raise ValueError(f"variant: names files in a folder; expected None for the file {path!r}, got {variant!r}")
        return Source(path, [path], _tensors([path]), None)
    folder = _model_folder(path, names)
    files = _folder_files(folder, names)
    config = _config(folder)
    return Source(path, files, _tensors(files, _index(folder, names)), config, os.path.join(folder, CONFIG_NAME))


def _model_folder(path: str, names: tuple[str, str]) -> str:
    """A pipeline folder (model_index.json) holds the transformer in transformer/."""
    if os.path.lexists(os.path.join(path, CONFIG_NAME)) or _has_weights(path, names):
        return path
    sub = os.path.join(path, "transformer")
    if os.path.isdir(sub):
        return sub
    raise ValueError(
        f"path: {path!r} is neither a diffusers model folder (config.json and {names[0]} or {names[1]}) "
        f"nor a pipeline folder with a transformer/ subfolder; it holds {sorted(os.listdir(path))[:20]}"
    )


def _has_weights(folder: str, names: tuple[str, str]) -> bool:
    # lexists: a broken link or a directory in their place is reported as such by read_header
    return any(os.path.lexists(os.path.join(folder, n)) for n in names)


def _folder_files(folder: str, names: tuple[str, str]) -> list[str]:
    index = _index(folder, names)
    if index is not None:
        return sorted({os.path.join(folder, f) for f in index.values()})
    single = os.path.join(folder, names[0])
    if os.path.lexists(single):
        return [single]
    pickles = [n for n in sorted(os.listdir(folder)) if n.lower().endswith(F.PICKLE_SUFFIXES)]
    if pickles:
        F.refuse_pickle(os.path.join(folder, pickles[0]))
    raise ValueError(f"path: {folder!r} has no {names[0]} or {names[1]}; it holds {sorted(os.listdir(folder))}")


def _index(folder: str, names: tuple[str, str]) -> dict[str, str] | None:
    """The weight_map of the folder's index json: {key: file name}, validated."""
    path = os.path.join(folder, names[1])
    if not os.path.lexists(path):
        return None
    F.check_regular_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not a valid index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: weight_map must map tensor names to file names")
    for name in set(weight_map.values()):
        F.refuse_pickle(name)
        if os.path.basename(name) != name or not os.path.exists(os.path.join(folder, name)):
            raise CheckpointError(f"{path}: names the shard {name!r}, which is not a file in {folder}")
    return weight_map


def _config(folder: str) -> dict | None:
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.lexists(path):
        return None
    F.check_regular_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _tensors(files: list[str], index: dict[str, str] | None = None) -> dict[str, TensorInfo]:
    """Every tensor of every file, keyed by name; a key in two files, or one the index
    places in a file that lacks it, is an error."""
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        infos, _ = F.read_header(file)
        for name, info in infos.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].file} and {file}")
            tensors[name] = info
    if index is not None:
        for name, file in index.items():
            if name in tensors and os.path.basename(tensors[name].file) != file:
                raise CheckpointError(f"index says {name!r} is in {file}, but it is in {tensors[name].file}")
            if name not in tensors:
                raise CheckpointError(f"index says {name!r} is in {file}, but that file does not hold it")
    return _strip_prefix(tensors)


def _strip_prefix(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The transformer's tensors of a file that wraps them in a prefix, without it. An
    all-in-one file also holds the VAE and text encoders under other prefixes
    (``first_stage_model.``, ``text_encoders.``, ...); those are not the transformer's
    keys and are left out, as diffusers' single-file loader does."""
    for prefix in STRIP_PREFIXES:
        if any(k.startswith(prefix) for k in tensors):
            return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    return tensors

"""The stock ``from_pretrained`` / ``save_pretrained`` keywords of `DiffusersTransformer`,
mapped onto `weights.load` / `weights.save` (diffusers' ``ModelMixin`` meanings).

``torch_dtype`` (alias ``dtype``) casts while reading; ``variant`` picks
``diffusion_pytorch_model.<variant>.safetensors``; ``subfolder`` a folder inside the path;
``device_map`` one device (``"cpu"``, ``"cuda:0"``, an int, ``{"": device}``: the whole
model there; splitting it over devices is what ``mesh=`` does); ``low_cpu_mem_usage``
either way (`weights.load` always reads each tensor into its destination once);
``use_safetensors`` as stock (None: safetensors if the folder has them, else the pickled
``.bin`` files, read with ``torch.load(weights_only=True)`` only; False: the ``.bin``
files); ``save_pretrained(safe_serialization=False)`` writes those ``.bin`` files as the
stock method does; ``output_loading_info`` the stock report (loading is
strict, so its lists are empty). The hub's keywords (``cache_dir``, ``revision``, ...)
only matter for downloads, which this adapter does not do; anything else raises a
ValueError naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

import functional_dit as fd
import sharding
import weights
from weights.internal import read_tensors, variant_names

# Keywords that only steer a hub download; a local path ignores them (as the stock class does).
_HUB_ONLY = {"cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "mirror", "user_agent"}


class NoWeightsError(OSError, ValueError):
    """A model folder without the weights asked for (an OSError, as diffusers raises)."""


def _dtype(kwargs: dict):
    torch_dtype, dtype = kwargs.pop("torch_dtype", None), kwargs.pop("dtype", None)
    if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
        raise ValueError(f"torch_dtype / dtype: aliases, got both and they differ ({torch_dtype} vs {dtype})")
    return torch_dtype if torch_dtype is not None else dtype


def _device_map(device_map, device):
    """``device_map`` as one device, or ValueError for a map that splits the model."""
    if device_map is None:
        return device
    one = device_map
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            raise ValueError(
                f"device_map: only a single device ({{'': device}}) is supported, got {device_map!r}; "
                "shard the model over devices with mesh= instead"
            )
        one = device_map[""]
    if isinstance(one, str) and one in ("auto", "balanced", "balanced_low_0", "sequential"):
        raise ValueError(f"device_map: {one!r} splits the model over devices; pass one device or use mesh=")
    try:
        one = torch.device(one)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device_map: expected a device, an int or {{'': device}}, got {device_map!r}") from None
    if device is not None and torch.device(device) != one:
        raise ValueError(f"device / device_map: both given and they differ ({device!r} vs {device_map!r})")
    return one


def load_options(kwargs: dict, device) -> dict:
    """``weights.load``'s ``dtype`` / ``device`` / ``variant`` and ``output_loading_info``
    from the stock keywords in ``kwargs`` (consumed); ValueError for the others."""
    kwargs = dict(kwargs)
    out = dict(dtype=_dtype(kwargs), variant=kwargs.pop("variant", None))
    out["device"] = _device_map(kwargs.pop("device_map", None), device)
    low = kwargs.pop("low_cpu_mem_usage", True)
    if low is not None and not isinstance(low, bool):
        raise ValueError(f"low_cpu_mem_usage: expected True, False or None, got {low!r}")
    out["use_safetensors"] = kwargs.pop("use_safetensors", None)
    if out["use_safetensors"] not in (None, True, False):
        raise ValueError(f"use_safetensors: expected None, True or False, got {out['use_safetensors']!r}")
    out["output_loading_info"] = bool(kwargs.pop("output_loading_info", False))
    for key in _HUB_ONLY & set(kwargs):
        kwargs.pop(key)
    if kwargs:
        raise ValueError(
            f"from_pretrained: {sorted(kwargs)} not supported by functional_dit's adapter "
            "(supported: torch_dtype/dtype, variant, subfolder, device_map, low_cpu_mem_usage, use_safetensors, "
            "output_loading_info, mesh, plan, device)"
        )
    return out


def pickled(path: str, variant, use_safetensors) -> list[str] | None:
    """The pickled ``.bin`` files to read for the model folder ``path``, as the stock
    loader chooses: with ``use_safetensors=False`` only those (NoWeightsError if absent),
    with None those when the folder has no safetensors weights of ``variant``; None means
    read safetensors (`weights.load`)."""
    if use_safetensors is True or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = pickle_files(path, variant)
    if use_safetensors is False and files is None:
        name = _stock_name("diffusion_pytorch_model.safetensors", variant, True)
        raise NoWeightsError(
            f"Error no file named {name} found in directory {path} "
            "(use_safetensors=False reads only the pickled .bin weights)"
        )
    if use_safetensors is None and any(os.path.lexists(os.path.join(path, n)) for n in variant_names(variant)):
        return None
    return files


def check_weights(path: str, variant) -> None:
    """NoWeightsError when ``path`` is a model folder (a config.json) lacking the weights
    of ``variant``, worded as diffusers words it."""
    single, index = variant_names(variant)
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        return
    if any(os.path.lexists(os.path.join(path, n)) for n in (single, index)):
        return
    bin_name = single.replace(".safetensors", ".bin")
    others = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".json")) and n != "config.json")
    raise NoWeightsError(
        f"Error no file named {bin_name} found in directory {path} (nor {single} or {index}; functional_dit reads "
        f"safetensors only); it holds {others}" + (" — pass the variant= they were saved with" if others else "")
    )


def loading_info() -> dict:
    """The stock ``output_loading_info`` report: loading is strict, so nothing to list."""
    return {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}


def _stock_name(name: str, variant, pickle: bool) -> str:
    """The name diffusers' ``save_pretrained`` gives what `weights.save` named ``name``:
    ``.safetensors`` -> ``.bin`` when pickling, the variant before the extension
    (``diffusion_pytorch_model-00001-of-00002.fp16.bin``), and for the index file
    diffusers' ``_add_variant`` of ``diffusion_pytorch_model.{safetensors,bin}.index.json``."""
    ext = ".bin" if pickle else ".safetensors"
    if name.endswith(".index.json"):
        stem = f"diffusion_pytorch_model{ext}.index"
        return f"{stem}.{variant}.json" if variant else f"{stem}.json"
    return name.replace(".safetensors", f".{variant}{ext}" if variant else ext)


def save_renamed(params, directory: str, variant, max_shard_size, pickle: bool) -> None:
    """`weights.save` under diffusers' names for a ``variant`` and / or the pickle format
    (``safe_serialization=False``: each shard's state dict written with ``torch.save``, as
    the stock method writes it); other files in ``directory`` are left alone."""
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        weights.save(params, tmp, max_shard_size=max_shard_size)
        names = sorted(n for n in os.listdir(tmp) if n.endswith((".safetensors", ".index.json")))
        renames = {n: _stock_name(n, variant, pickle) for n in names}
        for old, new in renames.items():
            src, dst = os.path.join(tmp, old), os.path.join(directory, new)
            if old.endswith(".index.json"):
                with open(src, encoding="utf-8") as f:
                    idx = json.load(f)
                idx["weight_map"] = {k: renames[v] for k, v in idx["weight_map"].items()}
                with open(dst, "w", encoding="utf-8") as f:
                    json.dump(idx, f, indent=2, sort_keys=True)
            elif pickle:
                torch.save(read_tensors(src)[0], dst)
            else:
                os.replace(src, dst)
        shutil.copyfile(os.path.join(tmp, "config.json"), os.path.join(directory, "config.json"))


def pickle_files(path: str, variant) -> list[str] | None:
    """The ``.bin`` weights files of the diffusers model folder ``path`` for ``variant``
    (the single file, or the shards its index names), or None if it has none."""
    single = _stock_name("diffusion_pytorch_model.safetensors", variant, True)
    index = _stock_name("diffusion_pytorch_model.safetensors.index.json", variant, True)
    if os.path.isfile(os.path.join(path, index)):
        with open(os.path.join(path, index), encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in files]
    if os.path.isfile(os.path.join(path, single)):
        return [os.path.join(path, single)]
    return None


def load_pickled(path: str, files: list[str], dtype, device, mesh, plan):
    """`Params` from the config and pickled weights ``files`` of the model folder ``path``,
    read with ``torch.load(weights_only=True)`` only (tensors and plain containers; torch
    refuses any other global before it can run code), strict as `fd.from_state_dict`,
    cast to ``dtype``, on ``device``, sharded by ``mesh`` / ``plan`` when given."""
    state = {}
    for file in files:
        try:
            part = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # torch's UnpicklingError names the refused global
            raise ValueError(
                f"{file}: not a weights-only pickle of tensors (torch.load(weights_only=True)): {e}"
            ) from e
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise ValueError(f"{file}: expected a state dict of tensors, got {type(part).__name__}")
        state.update(part)
    state = {k: v.to(device=device, dtype=dtype if dtype is not None else v.dtype) for k, v in state.items()}
    params = fd.from_state_dict(fd.config_from_diffusers(os.path.join(path, "config.json")), state)
    if mesh is None:
        return params
    return sharding.shard_params(params, mesh, plan=plan)

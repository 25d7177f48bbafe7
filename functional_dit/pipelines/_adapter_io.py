"""The stock ``from_pretrained`` / ``save_pretrained`` keywords of `DiffusersTransformer`,
mapped onto `weights.load` / `weights.save` (diffusers' ``ModelMixin`` meanings).

``torch_dtype`` (alias ``dtype``) casts while reading; ``variant`` picks
``diffusion_pytorch_model.<variant>.safetensors``; ``subfolder`` a folder inside the path;
``device_map`` one device (``"cpu"``, ``"cuda:0"``, an int, ``{"": device}``: the whole
model there; splitting it over devices is what ``mesh=`` does); ``low_cpu_mem_usage``
either way (`weights.load` always reads each tensor into its destination once);
``use_safetensors`` True or None; ``output_loading_info`` the stock report (loading is
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
    if kwargs.pop("use_safetensors", None) is False:
        raise ValueError("use_safetensors: only safetensors are read (pickled .bin files are refused), got False")
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


def check_weights(path: str, variant) -> None:
    """NoWeightsError when ``path`` is a model folder (a config.json) lacking the weights
    of ``variant``, worded as diffusers words it."""
    from weights.internal import variant_names

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


def save_variant(params, directory: str, variant: str, max_shard_size) -> None:
    """`weights.save` under diffusers' variant file names: ``diffusion_pytorch_model.<v>
    .safetensors``, or shards ``...-0000i-of-0000n.<v>.safetensors`` with the index
    ``diffusion_pytorch_model.safetensors.index.<v>.json``; other files are left alone."""
    import weights
    from weights.internal import variant_names

    single, index = variant_names(variant)
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        weights.save(params, tmp, max_shard_size=max_shard_size)
        names = sorted(os.listdir(tmp))
        renames = {n: n.replace(".safetensors", f".{variant}.safetensors") for n in names if n.endswith(".safetensors")}
        if "diffusion_pytorch_model.safetensors.index.json" in names:
            with open(os.path.join(tmp, "diffusion_pytorch_model.safetensors.index.json"), encoding="utf-8") as f:
                idx = json.load(f)
            idx["weight_map"] = {k: renames[v] for k, v in idx["weight_map"].items()}
            with open(os.path.join(directory, index), "w", encoding="utf-8") as f:
                json.dump(idx, f, indent=2, sort_keys=True)
        for old, new in renames.items():
            os.replace(os.path.join(tmp, old), os.path.join(directory, new))
        shutil.copyfile(os.path.join(tmp, "config.json"), os.path.join(directory, "config.json"))

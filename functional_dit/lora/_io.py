"""Reading and writing LoRA files: the diffusers/PEFT layout, Kohya's and the BFL names.

`from_state_dict` resolves every key through `_layouts` (strict: one ValueError lists
every unknown module, missing or extra factor, rank or shape mismatch), reads the
scaling from ``alpha`` keys or diffusers' ``lora_adapter_metadata`` (``lora_alpha``,
``alpha_pattern``, ``use_rslora``). PEFT's ``lora_B.bias`` (``lora_bias``) and
``lora_magnitude_vector`` (DoRA) keys are read; Kohya's ``dora_scale`` is refused.
`load` reads only safetensors, through `weights`' reader (``weights.internal``):
pickles can run code when loaded and are refused, and a corrupt header is the same
`weights.CheckpointError` (a ValueError) a checkpoint's would be.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping

import torch

import sharding
from sharding.tree import flatten, nest
from weights.internal import read_tensors, write_file

from .. import families
from ..params import Params
from . import _layouts
from ._adapter import Adapter, LoraConfig, base_config, linear_modules

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes
METADATA_KEY = "lora_adapter_metadata"  # diffusers' safetensors metadata entry


def _family(config) -> str:
    return families.of(config).DIFFUSERS_CLASS


def _index(config) -> dict:
    """``{source module name: [Target]}`` for ``config``: diffusers names, BFL names and
    both in Kohya's underscored form."""
    shapes = {m: s.shape for m, s in linear_modules(config).items()}
    index = _layouts.source_index(_layouts.bfl_table(_family(config)), shapes)
    index.update({_layouts.kohya_name(k): v for k, v in list(index.items())})
    return index


def _split_key(key: str):
    """(module name, factor "A"/"B"/"alpha", layout) of a file key, or None if it is no LoRA key."""
    for suffix, (factor, layout) in _layouts.FACTORS.items():
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], factor, layout
    if key.endswith(".alpha"):
        name = key[: -len(".alpha")]
        for suffix in _layouts.FACTORS:  # an alpha hung on a factor: "<module>.lora_A.weight.alpha", as diffusers
            if name.endswith("." + suffix):  # reads it (any key with "alpha" is the module's network alpha)
                return name[: -len(suffix) - 1], "alpha", None
        return name, "alpha", None
    return None


def _strip(name: str) -> str:
    for p in _layouts.PREFIXES:
        if name.startswith(p):
            return name[len(p) :]
    return name


def _refuse_unsupported(state: Mapping) -> None:
    dora = [k for k in state if k.endswith("." + _layouts.KOHYA_DORA)]
    if dora:
        raise ValueError(
            f"lora: Kohya/LyCORIS DoRA keys (dora_scale) are not supported: the file has {len(dora)} such as "
            f"{dora[:3]}; PEFT/diffusers DoRA files (lora_magnitude_vector) are read"
        )


def _flags(sources: dict, meta: dict, problems: list) -> tuple[bool, bool]:
    """``(lora_bias, use_dora)``: whether any module has a bias / magnitude key (as
    diffusers reads them), or the metadata says so (then every module must have one);
    keys the metadata denies (``lora_bias: false``) are a problem."""
    out = []
    for x, field in (("bias", "lora_bias"), ("magnitude", "use_dora")):
        keys = any(x in f for f in sources.values())
        if keys and meta.get(field, True) is False:
            problems.append(f"{_layouts.ROW_LEAVES[x]} keys in the file, but its metadata says {field}=False")
        out.append(keys or bool(meta.get(field)))
    return out[0], out[1]


def _metadata(metadata: Mapping | None) -> dict:
    """diffusers' ``lora_adapter_metadata`` (``transformer.``-prefixed LoraConfig fields)."""
    if not metadata or METADATA_KEY not in metadata:
        return {}
    raw = json.loads(metadata[METADATA_KEY]) if isinstance(metadata[METADATA_KEY], str) else metadata[METADATA_KEY]
    out = {k[len("transformer.") :]: v for k, v in raw.items() if k.startswith("transformer.")}
    return out or {k: v for k, v in raw.items() if "." not in k}


def _pattern_value(patterns: Mapping, module: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: a key matches a module path ending in it."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def from_state_dict(state: Mapping[str, torch.Tensor], params_or_config, metadata: Mapping | None = None) -> Adapter:
    """An `Adapter` for the model ``params_or_config`` (Params or a config) from a LoRA
    state dict in the diffusers/PEFT, Kohya or BFL layout. ``metadata``: the safetensors
    metadata (diffusers stores the LoraConfig there). Strict: one ValueError lists every
    problem. Text-encoder LoRA keys are skipped with a warning."""
    config = base_config(params_or_config)
    meta = _metadata(metadata)
    _refuse_unsupported(state)
    index, known = _index(config), linear_modules(config)
    sources, problems = _group(state, index, config)
    flags = _flags(sources, meta, problems)
    flat, modules, assumed = {}, [], []
    seen: dict[str, str] = {}  # diffusers module -> the source module that gave it
    for name, f in sources.items():
        err = _check_source(name, f, index[name], known) or _check_rows(name, f, index[name], flags)
        if err:
            problems.append(err)
            continue
        for tgt in index[name]:
            if tgt.module in seen:
                problems.append(f"{tgt.module}: given twice (as {seen[tgt.module]!r} and {name!r})")
                continue
            seen[tgt.module] = name
            modules.append(_target_module(tgt, f, meta, problems, assumed))
            flat[f"{tgt.module}.lora_A.weight"], flat[f"{tgt.module}.lora_B.weight"] = f["A"], _rows(f["B"], tgt)
            flat.update({f"{tgt.module}.{k}": _rows(f[x], tgt) for x, k in _layouts.ROW_LEAVES.items() if x in f})
    if problems or not modules:
        raise ValueError(_report(config, problems or ["no LoRA factors in the file"], state))
    if assumed:
        warnings.warn(_ASSUMED_ALPHA.format(n=len(assumed), of=len(modules), first=assumed[0]), stacklevel=3)
    return _adapter(config, modules, flat, meta, known, flags)


def _group(state: Mapping, index: dict, config) -> tuple[dict[str, dict], list[str]]:
    """``({source module: {"A": t, "B": t, "alpha": t}}, problems)`` from the file's keys;
    keys of other pipeline components are skipped with a warning."""
    other = [k for k in state if k.startswith(_layouts.OTHER_COMPONENTS)]
    if other:
        warnings.warn(f"lora: skipped {len(other)} keys of other pipeline components, e.g. {other[:2]}", stacklevel=4)
    sources, problems, skip = {}, [], set(other)
    for key, value in state.items():
        if key in skip:
            continue
        parts = _split_key(key)
        if parts is None:
            problems.append(
                f"{key}: not a LoRA factor (expected .lora_A/.lora_B/.lora_down/.lora_up.weight, "
                f".lora_B.bias, .lora_magnitude_vector or .alpha)"
            )
            continue
        name = _strip(parts[0])
        if name not in index:
            problems.append(f"{key}: no linear layer {name!r} in {type(config).__name__}")
            continue
        sources.setdefault(name, {})[parts[1]] = value
    return sources, problems


def _rows(B: torch.Tensor, tgt) -> torch.Tensor:
    """The target's rows of a source's up factor, halves swapped where its layout says so."""
    b = B if (tgt.start, tgt.stop) == (0, B.shape[0]) else B[tgt.start : tgt.stop].contiguous()
    return torch.cat(b.chunk(2, 0)[::-1], 0) if tgt.swap else b


def _target_module(tgt, f: dict, meta: dict, problems: list, assumed: list) -> tuple[str, int, float]:
    """``(module, rank, alpha)`` of one target: alpha from the source's ``.alpha`` key, else
    the metadata's ``alpha_pattern`` / ``lora_alpha``, else the rank (noted in ``assumed``);
    a rank the metadata contradicts is a problem."""
    r = f["A"].shape[0]
    alpha = float(f["alpha"]) if "alpha" in f else _pattern_value(meta.get("alpha_pattern"), tgt.module, None)
    if alpha is None and "lora_alpha" not in meta:
        assumed.append(tgt.module)
    want_r = _pattern_value(meta.get("rank_pattern"), tgt.module, meta.get("r", r))
    if want_r != r:
        problems.append(f"{tgt.module}: rank {r} in the factors, {want_r} in the file's metadata")
    return tgt.module, r, float(meta.get("lora_alpha", r) if alpha is None else alpha)


def _adapter(config, modules: list, flat: dict, meta: dict, known: dict, flags: tuple) -> Adapter:
    """The `Adapter` of ``modules`` in the base model's module order; ``flags``:
    ``(lora_bias, use_dora)``."""
    order = {m: i for i, m in enumerate(known)}
    modules.sort(key=lambda m: order[m[0]])
    lcfg = LoraConfig(config, tuple(modules), bool(meta.get("use_rslora", False)), *flags)
    return Adapter(lcfg, nest({k: flat[k] for k in flatten(lcfg.param_specs())}))


_ASSUMED_ALPHA = (
    "lora: no alpha for {n} of {of} layers (e.g. {first}: no .alpha key, no lora_alpha metadata); "
    "assuming alpha = rank (scale 1). An adapter trained with another alpha (PEFT's lora_alpha = 2r is "
    "common) then acts at another strength: set the scale with lora=[(adapter, scale)] or lora.merge(scale=...)"
)


def _check_rows(name: str, f: dict, targets, flags: tuple) -> str | None:
    """A problem with ``name``'s bias / magnitude: missing where the file has them
    elsewhere (or its metadata says so), or not of the up factor's rows."""
    for x, on in zip(("bias", "magnitude"), flags):
        key = _layouts.ROW_LEAVES[x]
        if on and x not in f:
            return f"{name}: no {key} (other modules or the metadata have them: lora_bias / use_dora)"
        if on and tuple(f[x].shape) != (f["B"].shape[0],):
            return f"{name}: expected {key} of shape ({f['B'].shape[0]},), got {tuple(f[x].shape)}"
    return None


def _check_source(name: str, f: dict, targets, known) -> str | None:
    missing = [x for x in ("A", "B") if x not in f]
    if missing:
        return f"{name}: missing factor(s) {['lora_A' if x == 'A' else 'lora_B' for x in missing]}"
    A, B = f["A"], f["B"]
    if A.ndim != 2 or B.ndim != 2:
        return f"{name}: expected 2-D factors, got lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}"
    if A.shape[0] != B.shape[1]:
        return (
            f"{name}: rank mismatch: lora_A {tuple(A.shape)} is rank {A.shape[0]}, lora_B {tuple(B.shape)} {B.shape[1]}"
        )
    out_dim = sum(t.stop - t.start for t in targets)
    in_dim = known[targets[0].module].shape[1]
    if tuple(A.shape[1:]) != (in_dim,) or B.shape[0] != out_dim:
        return (
            f"{name}: expected lora_A (r, {in_dim}) and lora_B ({out_dim}, r) for {[t.module for t in targets]}, "
            f"got {tuple(A.shape)} and {tuple(B.shape)}"
        )
    if "alpha" in f and (not isinstance(f["alpha"], torch.Tensor) or f["alpha"].numel() != 1):
        return f"{name}: alpha must be a scalar, got {f['alpha']!r}"
    return None


def _report(config, problems, state, limit=20) -> str:
    name, hint = type(config).__name__, _other_family(config, state)
    shown = problems[: 3 if hint else limit]  # with a family hint, a few examples suffice
    more = f" ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    if hint:
        return f"lora: not a LoRA for this {name}: {hint}; {len(problems)} problems, e.g. " + "; ".join(shown) + more
    return f"lora: the file does not match {name} ({len(problems)} problems): " + "; ".join(shown) + more


def _other_family(config, state) -> str:
    """A hint when the keys fit another family's layout better (a LoRA for the wrong model)."""
    names = {_strip(p[0]) for k in state if (p := _split_key(k)) is not None}
    names = {re.sub(r"\.\d+\.", ".{}.", n) for n in names}
    best = None
    for preset in families.presets().values():
        if type(preset) is type(config):
            continue
        idx = {re.sub(r"\.\d+\.", ".{}.", k) for k in _index(preset)}
        hits = len(names & idx)
        if hits and (best is None or hits > best[1]):
            best = (type(preset).__name__, hits)
    if best and best[1] > len(names & {re.sub(r"\.\d+\.", ".{}.", k) for k in _index(config)}):
        return f"the keys look like a LoRA for {best[0]}"
    fits = _fitting_presets(config, state)
    if fits:
        return f"its factors fit {', '.join(fits)}"
    return ""


def _fitting_presets(config, state) -> list[str]:
    """The presets (other than ``config``) every LoRA layer of ``state`` fits, names and shapes."""
    groups: dict[str, dict] = {}
    for key, value in state.items():
        parts = _split_key(key)
        if parts is not None and parts[1] in ("A", "B") and not key.startswith(_layouts.OTHER_COMPONENTS):
            groups.setdefault(_strip(parts[0]), {})[parts[1]] = value
    fits = []
    for name, preset in families.presets().items():
        if preset == config or not groups:
            continue
        index, known = _index(preset), linear_modules(preset)
        if all(n in index and _check_source(n, f, index[n], known) is None for n, f in groups.items()):
            fits.append(f"{name} ({type(preset).__name__})")
    return fits


def _read(path) -> tuple[dict, dict]:
    """The tensors and metadata of a LoRA file (a folder: diffusers' file in it), read by
    `weights`' one policy: pickles refused, the header validated before any tensor."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, DIFFUSERS_FILE)
    return read_tensors(path)


def load(path, params, mesh=None, dtype=None, device=None) -> Adapter:
    """Read a LoRA safetensors file (or a folder with ``pytorch_lora_weights.safetensors``)
    for ``params`` (Params or a config). ``dtype`` / ``device`` convert the factors.
    With a ``mesh`` — or when ``params`` are sharded, on their mesh — the factors are
    placed by `sharding.shard_params` from the base weights' plan."""
    state, metadata = _read(path)
    ad = from_state_dict(state, params, metadata)
    if dtype is not None or device is not None:
        ad = ad.replace(nest({k: v.to(device=device, dtype=dtype) for k, v in ad.flat().items()}))
    if mesh is None and isinstance(params, Params):
        _, mesh = sharding.local_view(params)
    return ad if mesh is None else sharding.shard_params(ad, mesh)


def to_state_dict(adapter: Adapter, prefix: str = "transformer.") -> dict:
    """The diffusers/PEFT state dict (``transformer.``-prefixed, as pipelines save it)."""
    return {prefix + k: v for k, v in adapter.flat().items()}


def save(adapter: Adapter, path, prefix: str = "transformer.") -> None:
    """Write ``adapter`` as a diffusers LoRA file (its LoraConfig in the metadata), which
    ``pipe.load_lora_weights`` and `load` read back. Sharded factors are gathered first.
    ``prefix=""`` writes a model-level file (keys and metadata unprefixed), as a diffusers
    model's ``save_lora_adapter`` does. The file is replaced atomically (a temporary,
    renamed) and its mode follows the umask, as `weights.save`'s files do."""
    ad = sharding.unshard(adapter) if sharding.local_view(adapter)[1] is not None else adapter
    ranks = {m: r for m, r, _ in ad.config.modules}
    alphas = {m: a for m, _, a in ad.config.modules}
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    fields = {
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted(ranks),
        "use_rslora": ad.config.use_rslora,
        "rank_pattern": {m: v for m, v in ranks.items() if v != r},
        "alpha_pattern": {m: v for m, v in alphas.items() if v != alpha},
        "lora_bias": ad.config.lora_bias,
        "use_dora": ad.config.use_dora,
    }
    meta = {prefix + k: v for k, v in fields.items()}
    state = {k: v.detach().contiguous() for k, v in to_state_dict(ad, prefix).items()}
    write_file(path, state, {"format": "pt", METADATA_KEY: json.dumps(meta, sort_keys=True)})  # diffusers' metadata

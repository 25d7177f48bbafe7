"""``generate --prompts FILE --out-dir DIR``: many images, resumable, over dp groups.

``FILE`` holds one prompt a line or JSON lines (a ``prompt`` and optional per-request
settings); request ``i`` becomes ``DIR/{i:05d}.png`` (written through a rename, its
metadata in a PNG text chunk) and a line of ``DIR/manifest.jsonl``. A run started again
skips the requests whose PNG is complete and redoes the rest; each dp group takes one
``--batch-size`` of pending requests a round. The file format: docs/cli.md.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time

import torch.distributed as dist
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from tqdm.auto import tqdm

import functional_dit as fd
import sharding

from ..pipelines import placement as _placement
from . import _cache_report, _lora
from ._args import CLIError
from ._files import write_image
from ._progress import advance

META_KEY = "functional_dit"
MANIFEST = "manifest.jsonl"
KEYS = ("prompt", "seed", "height", "width", "size", "steps", "guidance", "true_cfg", "negative_prompt", "lora")
# The settings that must be equal for requests to share one fd.sample call.
SHARED = ("height", "width", "steps", "guidance", "true_cfg")


# ----------------------------------------------------------------------------- requests


def _size(v, where: str) -> tuple[int, int]:
    """(height, width) from ``size``: an int (square) or "WxH"."""
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v, v
    if isinstance(v, str) and "x" in v:
        w, _, h = v.partition("x")
        if w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0:
            return int(h), int(w)
    raise CLIError(f"--prompts: {where}: size: expected a positive int or 'WxH', got {v!r}")


def _check_value(key: str, v, where: str) -> None:
    kinds = {"prompt": str, "negative_prompt": (str, type(None)), "guidance": (int, float, type(None))}
    kinds |= {"true_cfg": (int, float, type(None)), "seed": int, "height": int, "width": int, "steps": int}
    ok = isinstance(v, kinds[key]) and not isinstance(v, bool)
    if ok and key in ("height", "width", "steps"):
        ok = v > 0
    if ok and key in ("guidance", "true_cfg") and v is not None:
        ok = math.isfinite(v) and v >= 0  # as the command line's --guidance / --true-cfg
    if not ok:
        raise CLIError(f"--prompts: {where}: {key}: expected {_want(key)}, got {v!r}")


def _want(key: str) -> str:
    return {"prompt": "a string", "negative_prompt": "a string or null", "seed": "an int"}.get(
        key, "a finite number >= 0 or null" if key in ("guidance", "true_cfg") else "a positive int"
    )


def _line(text: str, where: str, jsonl: bool, indent: int = 0) -> dict:
    """One request's own fields from one line of the file (``indent``: the characters
    stripped before ``text``, for the column of a JSON error)."""
    if not jsonl:
        return {"prompt": text}
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise CLIError(f"--prompts: {where}, column {e.colno + indent}: not JSON ({e.msg})") from None
    if not isinstance(row, dict) or "prompt" not in row:
        raise CLIError(f"--prompts: {where}: expected a JSON object with a 'prompt', got {text[:60]!r}")
    unknown = sorted(set(row) - set(KEYS))
    if unknown:
        raise CLIError(f"--prompts: {where}: unknown keys {unknown}; expected some of {list(KEYS)}")
    if "size" in row:
        row["height"], row["width"] = _size(row.pop("size"), where)
    if "lora" in row:
        row["lora"] = _lora.field(row["lora"], where)
    for k, v in row.items():
        if k != "lora":
            _check_value(k, v, where)
    return row


def read_requests(path: str, args) -> list[dict]:
    """Every request of ``path``, complete (command-line defaults filled in), in order."""
    if not os.path.isfile(path):
        raise CLIError(f"--prompts: {path} does not exist")
    with open(path, encoding="utf-8") as f:
        lines = [(n + 1, line.strip(), len(line) - len(line.lstrip())) for n, line in enumerate(f) if line.strip()]
    if not lines:
        raise CLIError(f"--prompts: {path} holds no prompts")
    jsonl = path.endswith(".jsonl") or all(text.startswith("{") for _, text, _ in lines)
    defaults = dict(height=args.height, width=args.width, steps=args.steps, guidance=args.guidance)
    defaults |= dict(true_cfg=args.true_cfg, negative_prompt=args.negative_prompt)
    defaults |= {"lora": args.lora} if getattr(args, "lora", None) else {}  # absent: as before --lora existed
    out = []
    for i, (n, text, indent) in enumerate(lines):
        row = defaults | {"seed": args.seed + i} | _line(text, f"{path}:{n}", jsonl, indent)
        out.append({"index": i, **row})
    return out


# ----------------------------------------------------------------------------- files


def image_path(out_dir: str, request: dict) -> str:
    return os.path.join(out_dir, f"{request['index']:05d}.png")


def _meta_of(path: str) -> dict | None:
    """The metadata of a complete PNG at ``path``; None if absent, partial or foreign."""
    try:
        with Image.open(path) as img:
            img.load()  # a truncated file fails here
            return json.loads(img.text[META_KEY])
    except (OSError, KeyError, ValueError, SyntaxError):
        return None


def is_done(out_dir: str, request: dict, model: str) -> bool:
    meta = _meta_of(image_path(out_dir, request))
    return meta is not None and {k: meta.get(k) for k in request} == request and meta.get("model") == model


def remove_partials(out_dir: str) -> None:
    """Temporary files of killed runs (`_files.write_image` names them .NAME.partial-PID)."""
    for name in os.listdir(out_dir):
        if name.startswith(".") and ".partial-" in name:
            os.remove(os.path.join(out_dir, name))


def write(out_dir: str, request: dict, image, model: str, seconds: float) -> dict:
    """The PNG with its metadata in the text chunk, atomically; one manifest line appended."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = dict(request, model=model, seconds=round(seconds, 3), created=now)
    info = PngInfo()
    info.add_text(META_KEY, json.dumps(meta))
    info.add_text("prompt", request["prompt"])
    write_image(image, image_path(out_dir, request), pnginfo=info)
    with open(os.path.join(out_dir, MANIFEST), "a", encoding="utf-8") as f:
        f.write(json.dumps(dict(meta, file=os.path.basename(image_path(out_dir, request)))) + "\n")
    return meta


def rewrite_manifest(out_dir: str, requests: list[dict]) -> int:
    """The manifest rebuilt from the PNGs (one line per finished request, in order),
    atomically; returns the number of lines."""
    lines = []
    for r in requests:
        meta = _meta_of(image_path(out_dir, r))
        if meta is not None:
            lines.append(json.dumps(dict(meta, file=os.path.basename(image_path(out_dir, r)))))
    tmp = os.path.join(out_dir, f".{MANIFEST}.partial-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(tmp, os.path.join(out_dir, MANIFEST))
    return len(lines)


# ----------------------------------------------------------------------------- rounds


def rounds(pending: list[dict], per_round: int) -> list[list[dict]]:
    """Pending requests in rounds of at most ``per_round`` that share the settings of one
    `fd.sample` call, in file order within each setting."""
    by_key: dict = {}
    for r in pending:
        by_key.setdefault(tuple(r[k] for k in SHARED), []).append(r)
    return [group[i : i + per_round] for group in by_key.values() for i in range(0, len(group), per_round)]


def sample_round(
    fd, params, pipe, group: list[dict], images, batch_size: int, placement: dict | None = None, adapters=None
):
    """One `fd.sample` call for ``group``: (requests this dp group owns, their PIL images);
    each request with its own LoRA adapters (``adapters``: path -> loaded adapter)."""
    first = group[0]
    negatives = [r["negative_prompt"] or "" for r in group]
    owned, pil = fd.sample(
        params,
        pipe,
        [r["prompt"] for r in group],
        seed=[r["seed"] for r in group],
        **{k: first[k] for k in ("height", "width", "steps", "guidance", "true_cfg")},
        negative_prompt=negatives,
        image=images,
        batch_size=batch_size,
        output_type="pil",
        local=True,
        lora=_lora.argument([r.get("lora") for r in group], adapters or {}),
        **(placement or {}),  # generate --encoders, --vae-tiling, --cache
    )
    return [group[i] for i in owned], pil


def _agreed_pending(out_dir: str, requests: list[dict], model: str) -> list[dict]:
    """Rank 0 decides what is left (and clears killed runs' temporary files); every rank
    gets the same list."""
    box = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        remove_partials(out_dir)
        box = [[r for r in requests if not is_done(out_dir, r, model)]]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _writes(params) -> bool:
    """True on the first rank of each dp group (sp and tp coordinates 0)."""
    _, mesh = sharding.local_view(params)
    if mesh is None:
        return not dist.is_initialized() or dist.get_rank() == 0
    names = mesh.mesh_dim_names
    return all(mesh.get_local_rank(a) == 0 for a in names if a != "dp")


def run_many(args, params, pipe, images, model: str, rank0: bool, dp: int) -> int:
    """Generate every pending request of ``args.prompts`` into ``args.out_dir``."""
    requests = read_requests(args.prompts, args)
    pending = _agreed_pending(args.out_dir, requests, model)
    adapters = _lora.load(params, [r.get("lora") for r in pending])  # each file once
    fmt = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}]"  # img/s, never s/img
    bar = tqdm(total=len(requests), initial=len(requests) - len(pending), unit="img", bar_format=fmt, disable=not rank0)
    writer, start, runs = _writes(params), time.perf_counter(), []
    try:
        for group in rounds(pending, dp * args.batch_size):
            t0 = time.perf_counter()
            runs.append(None if getattr(args, "cache", None) is None else fd.CacheRun(args.cache))
            kw = dict(_placement.cli_kwargs(args), cache=runs[-1])  # generate --encoders, --vae-tiling, --cache
            try:
                mine, pil = sample_round(fd, params, pipe, group, images, args.batch_size, kw, adapters)
            except ValueError as e:
                raise CLIError(str(e).splitlines()[0]) from None
            seconds = (time.perf_counter() - t0) / max(len(mine), 1)
            for r, img in zip(mine, pil) if writer else ():
                write(args.out_dir, r, img, model, seconds)
            advance(bar, len(group))
    finally:
        bar.close()
    if dist.is_initialized():
        dist.barrier()
    if rank0:
        n = rewrite_manifest(args.out_dir, requests)
        took = time.perf_counter() - start
        print(
            f"wrote {len(pending)} images to {args.out_dir} ({len(requests) - len(pending)} were done; "
            f"{n} of {len(requests)} in {MANIFEST}); {len(pending) / took if pending else 0.0:.3f} images/s"
        )
        _cache_report.report(runs, params.config)
    return 0

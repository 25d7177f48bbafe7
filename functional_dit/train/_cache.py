"""The latent and text-embedding cache on disk: one safetensors file per image latent (at its
bucket's size) and per caption embedding, each named by the hash of what it depends on, so
a changed image, caption, bucket, resolution or encoder is encoded again and the rest is
reused; a step reads only its own items' files (`Data.batch`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import functional_dit as fd

from ..pipelines.families import product
from . import _data
from ._buckets import describe, image_tensor, make_buckets, nearest_bucket, upright_size

CACHE_VERSION = 4  # 4: per-entry safetensors files, aspect-ratio buckets
KEY_FILE = "key.json"  # what the entries of the last run were encoded from (for a reader; names carry the hashes)


def cache_dir(a) -> str:
    """``--cache-dir``, or ``<output-dir>/cache``."""
    return a.cache_dir or os.path.join(a.output_dir, "cache")


def encoder_stamp(path: str) -> str:
    """What the encoders are: ``tiny[:kind]`` as named, or a pipeline folder's every file
    but the transformer's (relative path, size, mtime)."""
    if path.startswith("tiny"):
        return path
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not (root == path and d == "transformer"))
        for n in sorted(names):
            st = os.stat(os.path.join(root, n))
            files.append((os.path.relpath(os.path.join(root, n), path), st.st_size, st.st_mtime_ns))
    return json.dumps([os.path.abspath(path), files])


def _hash(*parts) -> str:
    return hashlib.sha256(json.dumps([CACHE_VERSION, *parts]).encode()).hexdigest()[:32]


def _file_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@dataclasses.dataclass
class Plan:
    """What the cache holds for a run: each item's bucket and latent file, each text row's
    file (row N: the empty caption), and the buckets."""

    fam: object  # the family (`functional_dit.families`): its product module encodes
    kind: str  # the pipeline's class name (the entries' names hash it)
    buckets: list  # the candidate buckets, (height, width)
    item_bucket: list  # per item
    latent_files: list  # per item
    text_files: list  # per caption row, N + 1
    captions: list  # per caption row
    paths: list  # per item: the image


def plan(a, items, fam, kind: str, stamp: str) -> Plan:
    """The buckets (`make_buckets`), each image's (nearest aspect ratio) and the entry
    files: a latent's name hashes the encoders, the image's bytes and its bucket; a text's
    the encoders, the caption and the text length (FLUX.3's: all captions too, it encodes
    them at the longest one's padded length)."""
    root = cache_dir(a)
    buckets = make_buckets(a.resolution, a.bucket_step, a.max_aspect_ratio)
    item_bucket, latent_files = [], []
    for path, _ in items:
        with Image.open(path) as img:
            hw = nearest_bucket(upright_size(img), buckets)
        item_bucket.append(hw)
        latent_files.append(os.path.join(root, f"latent-{_hash(stamp, kind, _file_hash(path), hw)}.safetensors"))
    captions = [c for _, c in items] + [""]
    together = sorted(set(captions)) if product(fam).TRAIN_TEXTS_TOGETHER else None
    text_files = [
        os.path.join(root, f"text-{_hash(stamp, kind, c, a.max_sequence_length, together)}.safetensors")
        for c in captions
    ]
    return Plan(fam, kind, buckets, item_bucket, latent_files, text_files, captions, [p for p, _ in items])


def _save(tensors: dict, path: str) -> None:
    """``tensors`` to ``path`` whole (a temporary renamed over it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def fill(pipe, p: Plan, max_len: int) -> int:
    """Encode the entries of ``p`` not on disk yet; returns how many were encoded."""
    done = 0
    for path, hw, file in zip(p.paths, p.item_bucket, p.latent_files):
        if not os.path.isfile(file):
            z, extra = _data.encode_latent(pipe, p.fam, image_tensor(path, hw)[None])
            _save({"latent": z, **_tensors(extra)}, file)
            done += 1
    missing = [i for i, f in enumerate(p.text_files) if not os.path.isfile(f)]
    if missing:
        rows = _data.encode_texts(pipe, p.fam, [p.captions[i] for i in missing], p.captions, max_len)
        for i, (e, second, extra) in zip(missing, rows):
            named = {"txt": e, **({} if second is None else {product(p.fam).TRAIN_SECOND: second}), **_tensors(extra)}
            _save(named, p.text_files[i])
            done += 1
    return done


def _tensors(extra: dict) -> dict:
    """A latent's or text's position inputs as tensors (Qwen-Image's ``img_shapes``: one
    row per frame)."""
    return {k: torch.tensor(v) if k == "img_shapes" else v for k, v in extra.items()}


def write_key(a, p: Plan, stamp: str) -> None:
    """``key.json`` in the cache folder: what this run's entries were made from."""
    rows = [
        [os.path.basename(x), list(hw), os.path.basename(f)] for x, hw, f in zip(p.paths, p.item_bucket, p.latent_files)
    ]
    key = {"version": CACHE_VERSION, "encoders": stamp, "resolution": a.resolution, "buckets": p.buckets}
    key |= {"images": rows, "texts": [[c, os.path.basename(f)] for c, f in zip(p.captions, p.text_files)]}
    with open(os.path.join(cache_dir(a), KEY_FILE), "w") as f:
        json.dump(key, f, indent=1)


def bucket_counts(p: Plan) -> dict:
    """``{(height, width): images}`` over the buckets with images."""
    counts = {}
    for hw in p.item_bucket:
        counts[hw] = counts.get(hw, 0) + 1
    return counts


def summary(a, p: Plan) -> str:
    """The buckets line printed at start."""
    return describe(p.buckets, bucket_counts(p), a.resolution, a.bucket_step)


def check_step(fam, step: int) -> None:
    """A ``ValueError`` naming --bucket-step unless it is a multiple of family ``fam``'s
    latent multiple (`_data.latent_multiple`; ``fam`` None: not known yet)."""
    multiple = _data.latent_multiple(fam)
    if step % multiple:
        name = "this family" if fam is None else fam.NAME
        raise ValueError(f"--bucket-step: expected a multiple of {multiple} for {name}, got {step}")


@dataclasses.dataclass
class Data:
    """The cached training data, read a batch at a time (`batch`): the plan, the items of
    each bucket with images (``groups``, in bucket order) and the longest text (Qwen-Image's
    captions are padded to it and masked)."""

    plan: Plan
    groups: list
    txt_len: int

    @property
    def n(self) -> int:
        """The number of items (row ``n`` of the texts: the empty caption)."""
        return len(self.plan.paths)

    def batch(self, idx: list[int], rows: list[int] | None = None) -> dict:
        """Items ``idx`` (one bucket) with the text rows ``rows`` (default their own
        captions'), as the transformer takes them: ``latents`` (B, S, C), ``txt``, and the
        family's ``pooled``, ``txt_mask``, ``img_ids``, ``txt_ids``, ``img_shapes``,
        ``img_mask``."""
        if len({self.plan.item_bucket[i] for i in idx}) != 1:
            raise ValueError(f"idx: expected items of one bucket, got {idx}")
        lat = [load_file(self.plan.latent_files[i]) for i in idx]
        txt = [load_file(self.plan.text_files[r]) for r in (idx if rows is None else rows)]
        out = {"latents": torch.stack([x["latent"] for x in lat])}
        if "txt_mask" in txt[0]:  # Qwen-Image (2.1): padded to the longest caption, masked
            pad = [self.txt_len - len(t["txt"]) for t in txt]
            out["txt"] = torch.stack([torch.nn.functional.pad(t["txt"], (0, 0, 0, p)) for t, p in zip(txt, pad)])
            out["txt_mask"] = torch.stack([torch.nn.functional.pad(t["txt_mask"], (0, p)) for t, p in zip(txt, pad)])
        else:
            out["txt"] = torch.stack([t["txt"] for t in txt])
        if "pooled" in txt[0]:
            out["pooled"] = torch.stack([t["pooled"] for t in txt])
        out |= {
            k: v for k, v in (("img_ids", lat[0].get("img_ids")), ("txt_ids", txt[0].get("txt_ids"))) if v is not None
        }
        if "img_shapes" in lat[0]:
            out["img_shapes"] = [tuple(int(v) for v in row) for row in lat[0]["img_shapes"]]
        return out | product(self.plan.fam).train_inputs(out, self.txt_len)


def load(p: Plan) -> Data:
    """The `Data` of a filled plan: the groups by bucket and the longest text (read from the
    files' headers)."""
    groups = [[i for i, hw in enumerate(p.item_bucket) if hw == b] for b in p.buckets]
    lengths = []
    for f in p.text_files:
        with safe_open(f, "pt") as st:
            lengths.append(st.get_slice("txt").get_shape()[0])
    return Data(p, [g for g in groups if g], max(lengths))


def prepare(a, rank: int, barrier):
    """The cached training data (rank 0 encodes what is missing, prints the buckets and
    what it encoded; the other ranks wait) and the transformer params (fp32, full) from
    the pipeline."""
    os.makedirs(a.output_dir, exist_ok=True)
    items = _data.with_trigger(_data.find_items(a.data), a.trigger)
    pipe = _data.load_pipeline(a.pipeline)
    fam = _data.family(pipe)
    _data.check_resolution(fam, a.resolution)
    check_step(fam, a.bucket_step)
    stamp = encoder_stamp(a.pipeline)
    p = plan(a, items, fam, type(pipe).__name__, stamp)
    if rank == 0:
        os.makedirs(cache_dir(a), exist_ok=True)
        encoded = fill(pipe, p, a.max_sequence_length)
        write_key(a, p, stamp)
        total = len(p.latent_files) + len(p.text_files)
        print(summary(a, p), flush=True)
        print(f"cache {cache_dir(a)}: {encoded} of {total} entries encoded, {total - encoded} reused", flush=True)
    barrier()
    return load(p), fd.from_diffusers(pipe.transformer)

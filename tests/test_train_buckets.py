"""The trainer's aspect-ratio buckets and its cache on disk (`functional_dit.train`), in
process on the tiny FLUX.1 pipeline, fp32.

- The buckets of ``--resolution`` are multiples of ``--bucket-step``, at most its square
  in area, within ``--max-aspect-ratio``; an image goes to the nearest aspect ratio.
- A folder of landscape (64 x 40) and portrait (40 x 64) images at ``--resolution 64
  --bucket-step 16``: the buckets and counts are printed, every batch the trainer reads is
  from one aspect ratio (each step's items recorded), every item is read in an epoch, the
  eval loss falls, and the stock FluxPipeline's ``load_lora_weights`` gives the latents of
  our merged LoRA (fp32 1e-5).
- The cache: a second run encodes nothing (the encode calls counted) and reads the
  same tensors; a changed caption encodes that caption only, a changed image that latent
  only; ``--cache-dir`` is shared between output folders.
- Stopped after step 2's checkpoint and resumed to step 4, a run with buckets ends with
  the LoRA file and loss log bitwise equal to the straight run's.
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch
from _train_data import image_folder, one_thread
from PIL import Image

from functional_dit.train import _cache, _data, _loop, main
from functional_dit.train._buckets import batch_indices, make_buckets, nearest_bucket

FP32 = dict(rtol=1e-5, atol=1e-5)
ARGS = ["--resolution", "64", "--bucket-step", "16", "--max-sequence-length", "32", "--rank", "2", "--alpha", "4"]
ARGS += ["--batch-size", "2", "--lr", "2e-2", "--checkpoint-every", "2", "--steps", "4", "--dtype", "float32"]
ARGS += ["--no-progress"]
WIDE, TALL = (40, 64), (64, 40)  # (height, width) of the images

one_thread = pytest.fixture(one_thread)


@pytest.fixture
def data(tmp_path) -> str:
    """Two landscape images (0, 1) and three portrait ones (t0, t1, t2)."""
    folder = image_folder(tmp_path / "images", ("a red square", "a blue circle"), hw=WIDE)
    tall = image_folder(tmp_path / "tall", ("a tall one", "a tall two", "a tall three"), hw=TALL, seed=1)
    for name in os.listdir(tall):
        shutil.move(os.path.join(tall, name), os.path.join(folder, "t" + name))
    return folder


@pytest.mark.parametrize("resolution, step, ratio", [(512, 64, 2.0), (1024, 64, 2.0), (64, 16, 2.0), (1024, 32, 4.0)])
def test_buckets_are_multiples_within_the_area_and_ratio(resolution, step, ratio):
    buckets = make_buckets(resolution, step, ratio)
    assert (resolution, resolution) in buckets and len(buckets) > 2, buckets
    for h, w in buckets:
        assert h % step == 0 and w % step == 0 and h * w <= resolution**2, (h, w)
        assert max(h, w) <= ratio * min(h, w) and h * w > 0.85 * resolution**2, (h, w)
    assert [w / h for h, w in buckets] == sorted({w / h for h, w in buckets})  # one per ratio, ascending
    assert make_buckets(resolution, step, 1.0) == [(resolution, resolution)]
    assert nearest_bucket((300, 300), buckets) == (resolution, resolution)
    wide = nearest_bucket((1920, 1080), buckets)  # (width, height): the nearest ratio in log
    assert all(abs(math.log(wide[1] / wide[0] * 9 / 16)) <= abs(math.log(w / h * 9 / 16)) for h, w in buckets)
    assert nearest_bucket((1080, 1920), buckets) == wide[::-1]


def test_batch_plan_keeps_buckets_apart_and_covers_every_item():
    groups = [[0, 3, 5], [1, 2], [4]]
    for step in range(12):
        idx, plan = batch_indices(step, 2, groups, seed=3)
        assert any(set(idx) <= set(g) for g in groups), idx
        assert plan.shape == (4, 2)  # ceil(3/2) + 1 + 1 batches per epoch
    epoch = {i for s in range(4) for i in batch_indices(s, 2, groups, seed=3)[0]}
    assert epoch == set(range(6))
    assert batch_indices(5, 2, groups, 3)[0] == batch_indices(5, 2, groups, 3)[0]
    assert [batch_indices(s, 2, groups, 3)[0] for s in range(4)] != [
        batch_indices(s, 2, groups, 4)[0] for s in range(4)
    ]


def _latents(pipe) -> torch.Tensor:
    kw = dict(height=48, width=80, num_inference_steps=2, max_sequence_length=32, output_type="latent")
    return pipe(prompt="a red square", generator=torch.Generator().manual_seed(3), **kw).images


def test_two_aspect_ratios_never_mix_and_the_stock_pipeline_loads_the_result(
    data, tmp_path, one_thread, monkeypatch, capsys
):
    import functional_dit as fd
    import functional_dit.lora as lora
    from functional_dit import tiny

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    read, steps, batch, plan = [], [], _cache.Data.batch, _loop.batch_indices
    monkeypatch.setattr(
        _cache.Data, "batch", lambda self, idx, rows=None: read.append(list(idx)) or batch(self, idx, rows)
    )
    monkeypatch.setattr(_loop, "batch_indices", lambda *a: steps.append(plan(*a)[0]) or plan(*a))
    out = str(tmp_path / "run")
    got = main(["--data", data, "--output-dir", out, *ARGS, "--steps", "6"])
    printed = capsys.readouterr().out
    assert "buckets (height x width: images): 80x48: 3, 48x80: 2 (of 3 buckets of about 64^2 pixels" in printed
    shapes = {i: Image.open(p).size for i, (p, _) in enumerate(_data.find_items(data))}
    assert {shapes[i] for i in range(5)} == {(64, 40), (40, 64)}
    assert len(steps) == 6 and len(read) == 6 + 2 * 3, (steps, read)  # the steps', the evals' (3 batches each)
    assert all(len({shapes[i] for i in idx}) == 1 for idx in read), read  # never mixed
    assert steps == read[3:-3] and {i for idx in steps[:3] for i in idx} == set(range(5)), steps  # an epoch: all
    assert got["eval_loss_after"] < 0.97 * got["eval_loss_before"], got

    stock = tiny.pipeline("flux", seed=0)
    before = _latents(stock)
    stock.load_lora_weights(out)
    theirs = _latents(stock)
    params = fd.from_diffusers(tiny.stock_transformer("flux", seed=0))
    module = tiny.stock_transformer("flux", seed=0)
    module.load_state_dict(fd.to_state_dict(lora.merge(params, lora.load(out, params))))
    torch.testing.assert_close(theirs, _latents(tiny.pipeline("flux", seed=0, transformer=module)), **FP32)
    assert (theirs - before).abs().max() > 1e-3


def _counting(monkeypatch) -> dict:
    """Count the images and captions the trainer encodes."""
    calls = {"images": 0, "captions": 0}
    latent, texts = _data.encode_latent, _data.encode_texts

    def encode_latent(pipe, fam, image):
        calls["images"] += 1
        return latent(pipe, fam, image)

    def encode_texts(pipe, fam, captions, every, max_len):
        calls["captions"] += len(captions)
        return texts(pipe, fam, captions, every, max_len)

    monkeypatch.setattr(_data, "encode_latent", encode_latent)
    monkeypatch.setattr(_data, "encode_texts", encode_texts)
    return calls


def test_the_cache_is_reused_and_encoded_again_where_its_inputs_change(data, tmp_path, one_thread, monkeypatch):
    from functional_dit.train import _loop, check_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cache = str(tmp_path / "cache")
    args = ["--data", data, *ARGS, "--cache-dir", cache]

    def load(out: str, expect: dict) -> dict:
        calls = _counting(monkeypatch)
        r, _ = _loop.begin(check_args([*args, "--output-dir", str(tmp_path / out)]))
        assert calls == expect, (out, calls)
        return {i: r.data.batch([i]) for i in range(5)}

    first = load("a", {"images": 5, "captions": 6})  # 5 captions and the empty one
    again = load("b", {"images": 0, "captions": 0})  # another run, the same --cache-dir: nothing encoded
    for i in range(5):
        assert all(torch.equal(first[i][k], again[i][k]) for k in first[i]), i
    calls, full = _counting(monkeypatch), tmp_path / "full"  # a whole run in a new folder, the cache elsewhere
    main([*args, "--output-dir", str(full), "--steps", "1"])
    assert calls == {"images": 0, "captions": 0} and (full / "pytorch_lora_weights.safetensors").is_file(), calls
    with open(os.path.join(data, "t1.txt"), "w") as f:
        f.write("a changed caption")
    changed = load("c", {"images": 0, "captions": 1})
    names = [os.path.basename(p) for p, _ in _data.find_items(data)]
    t1 = names.index("t1.png")
    assert not torch.equal(changed[t1]["txt"], first[t1]["txt"])
    assert all(torch.equal(changed[i]["txt"], first[i]["txt"]) for i in range(5) if i != t1)
    arr = np.asarray(Image.open(os.path.join(data, "0.png"))).copy()
    arr[0, 0] = 255 - arr[0, 0]
    Image.fromarray(arr).save(os.path.join(data, "0.png"))
    load("d", {"images": 1, "captions": 0})
    calls = _counting(monkeypatch)  # another resolution: every latent again, the captions reused
    _loop.begin(check_args([*args, "--output-dir", str(tmp_path / "f"), "--resolution", "48"]))
    assert calls == {"images": 5, "captions": 0}, calls


def test_resumed_with_buckets_is_bitwise_the_straight_run(data, tmp_path, one_thread, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    options = ["--grad-accum", "2", "--caption-dropout", "0.3", "--max-grad-norm", "0.5", "--ema-decay", "0.5"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    main(["--data", data, "--output-dir", straight, *ARGS, *options])
    main(["--data", data, "--output-dir", resumed, *ARGS, *options, "--steps", "2"])
    assert main(["--data", data, "--output-dir", resumed, *ARGS, *options, "--resume"])["start"] == 2
    logs = [open(os.path.join(d, "losses.jsonl")).read() for d in (straight, resumed)]
    assert logs[0] == logs[1] and logs[0].count("\n") == 4, logs
    for sub in ("", "ema"):
        a, b = (load_file(os.path.join(d, sub, "pytorch_lora_weights.safetensors")) for d in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub


CLIP = ["--max-grad-norm", "0.05", "--steps", "2", "--checkpoint-every", "2"]


def _fsdp_tp_run(rank, world, data, out):
    return main(["--data", data, "--output-dir", out, *ARGS, *CLIP, "--fsdp", "2", "--tp", "2"])["losses"]


@pytest.mark.slow
def test_clipping_under_fsdp_x_tp_equals_one_process(data, tmp_path, one_thread, monkeypatch):
    """4 gloo ranks, ``--fsdp 2 --tp 2``, buckets on, clipping that bites: the logged global
    gradient norms (every rank's shards, replicas counted once) equal one process's to
    1e-5 relative, the losses too, and the LoRA file to fp32 1e-5."""
    import json

    from _dist import spawn
    from safetensors.torch import load_file

    mesh = str(tmp_path / "mesh")
    losses = spawn(_fsdp_tp_run, 4, data, mesh, timeout=900)
    assert all(x == losses[0] for x in losses), losses  # the same loss on every rank
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one = str(tmp_path / "one")
    main(["--data", data, "--output-dir", one, *ARGS, *CLIP])
    logs = [[json.loads(ln) for ln in open(os.path.join(d, "losses.jsonl"))] for d in (mesh, one)]
    assert min(ln["grad_norm"] for ln in logs[1]) > 0.05, logs[1]  # it clips
    for x, y in zip(*logs, strict=True):
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5) and x["loss"] == pytest.approx(
            y["loss"], rel=1e-5
        )
    a, b = (load_file(os.path.join(d, "pytorch_lora_weights.safetensors")) for d in (mesh, one))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **FP32)


def test_an_exif_rotated_image_goes_to_its_upright_bucket(tmp_path):
    """A 64 x 40 (w x h) JPEG tagged "rotate 90" (orientation 6) is a portrait image: its
    bucket is the portrait one and its tensor the upright pixels (as diffusers' scripts'
    ``exif_transpose``)."""
    from PIL import ImageOps

    from functional_dit.train._buckets import image_tensor, upright_size

    path = tmp_path / "r.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray((np.random.default_rng(0).random((40, 64, 3)) * 255).astype(np.uint8)).save(path, exif=exif)
    buckets = make_buckets(64, 16, 2.0)
    with Image.open(path) as img:
        assert img.size == (64, 40) and upright_size(img) == (40, 64)
        assert nearest_bucket(upright_size(img), buckets) == (80, 48)
        upright = ImageOps.exif_transpose(img)
    x = image_tensor(str(path), (64, 40))
    want = torch.from_numpy(np.array(upright.convert("RGB"))).permute(2, 0, 1).float() / 127.5 - 1
    assert x.shape == (3, 64, 40) and torch.equal(x, want)  # (already the bucket's size: no resize)

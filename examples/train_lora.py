"""LoRA fine-tuning of a FLUX.1 / FLUX.2 / FLUX.2-klein / Qwen-Image transformer on an
image-caption folder, fully sharded.

    torchrun --nproc-per-node 2 examples/train_lora.py --data my_images --output-dir run \\
        --fsdp 2 --steps 500 --checkpoint-every 100            # add --resume to continue
    python examples/train_lora.py --data my_images --output-dir run --pipeline /path/to/FLUX.1-dev

The data folder holds images (``.png``, ``.jpg``, ``.jpeg``, ``.webp``) and, next to each,
a caption with the same name and ``.txt``. ``--pipeline`` is a diffusers FluxPipeline,
Flux2Pipeline, Flux2KleinPipeline or QwenImagePipeline folder (read offline) or ``tiny``
(default: `functional_dit.tiny.pipeline("flux")`, random tiny weights, for trying the
script and for the tests; ``tiny:flux2-klein``, ``tiny:qwen-image`` the other tiny ones).

What it does, in order:

1. Checks every argument (a bad one exits naming it, the expected and the actual value)
   before anything is loaded. An ``--output-dir`` holding an earlier run (checkpoints,
   ``losses.jsonl``, ``eval.json``, the LoRA file) is refused unless ``--resume`` continues
   it (``--steps`` at least its newest checkpoint's step; equal to it and the LoRA file
   written: nothing to train, exit 0) or ``--overwrite`` starts over (those files are
   removed once the pipeline has loaded; ``cache.pt`` is kept, re-encoded if stale).
2. Rank 0 encodes the data once with the pipeline's VAE and text encoders and writes
   ``<output-dir>/cache.pt``: each image resized (shorter side) and centre-cropped to
   ``--resolution``, its VAE latent mean (``latent_dist.mode()``) normalised and packed as
   the pipeline does (FLUX.1: shifted and scaled, packed 2x2; FLUX.2: patchified 2x2 and
   batch-normed, ``_encode_vae_image``; Qwen-Image: a one-frame latent normalised by the
   VAE's ``latents_mean`` / ``latents_std``, packed 2x2), and the caption's embeddings
   (FLUX.1: T5 + CLIP pooled; FLUX.2: the Mistral / Qwen3 hidden-state stack; Qwen-Image:
   Qwen2.5-VL's, padded to the longest caption with a ``txt_mask``). The other ranks wait
   and read it; the VAE and text encoders are then dropped.
3. The transformer (``fd.from_diffusers(pipe.transformer)``, frozen, stored in ``--dtype``)
   and a fresh LoRA (``lora.init``: PEFT's init, ``B`` = 0, the attention projections by
   default) are sharded over ``sharding.make_mesh(fsdp=--fsdp, tp=--tp)``; the LoRA
   factors stay fp32 (the master weights) and AdamW updates each rank's shards.
4. Each step takes the next ``--batch-size`` items of a per-epoch permutation (seeded by
   ``--seed`` and the epoch), draws noise and timesteps and computes the rectified-flow
   loss: ``x_t = (1 - t) x0 + t noise``, the model predicts ``noise - x0``, mean squared
   error. ``t`` is logit-normal (``sigmoid(N(0, 1))``, SD3's and diffusers' FLUX scripts'
   default ``--timesteps logit_normal``) or ``--timesteps uniform``. Every rank draws the
   same batch; ``fd.apply`` splits it over dp x fsdp and the loss is the same on every
   rank. ``--dtype bfloat16`` (the default, the field's convention) stores the frozen
   weights in bf16 and runs the forward under bf16 autocast, with fp32 LoRA weights,
   gradients and AdamW state; ``--dtype float32`` runs everything in fp32.
   ``--reshard-after-forward``: the gathered block weights are not kept for backward but
   gathered again there (``sharding.fsdp_options(reshard_after_forward=True)``).
5. Every ``--checkpoint-every`` steps and after the last, a DCP checkpoint
   ``<output-dir>/checkpoints/step_<n>``: the LoRA factors and AdamW moments (sharded as
   they are), AdamW's step counts, the step, the noise RNG state and the epoch's data
   order. It is written to ``step_<n>.tmp`` and renamed when complete, so a run killed
   mid-save leaves the last good checkpoint as it was. ``--resume`` continues from the
   newest complete one (same data, seed and batch size; another mesh works too) bitwise as
   if the run had not stopped (tests/test_train_lora.py). In one process DCP runs under a
   one-rank gloo group (an in-memory store), as it does under torchrun.
6. ``<output-dir>/losses.jsonl`` gets one ``{"step", "loss"}`` line per step (rank 0; a
   resumed run rewrites the lines after its checkpoint), a tqdm bar shows loss and it/s,
   and ``<output-dir>/eval.json`` the loss on a fixed set of (item, noise, t) before and
   after the run. The LoRA is saved as ``<output-dir>/pytorch_lora_weights.safetensors``
   (`functional_dit.lora.save`: the diffusers/PEFT layout that the pipeline's
   ``load_lora_weights(<output-dir>)`` reads; mode 0644 under umask 022). stdout says
   ``resumed from step N (PATH)`` and the paths of the LoRA file and ``eval.json``.

FLUX.3 and Qwen-Image 2.1 are not supported yet (their encode steps are not written).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time

import torch

IMAGES = (".png", ".jpg", ".jpeg", ".webp")
CACHE = "cache.pt"
LORA_FILE = "pytorch_lora_weights.safetensors"
EVAL_SEED = 12345  # the fixed (noise, t) of the eval loss


# ----------------------------------------------------------------------------- arguments


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawTextHelpFormatter):
    """``--help`` with every option's default, the description's lines kept as written."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Help)
    need = dict(required=True, default=argparse.SUPPRESS)  # (no "default: None" in --help)
    p.add_argument("--data", **need, help="folder of images with same-name .txt captions")
    p.add_argument("--output-dir", **need, help="cache, checkpoints, logs and the LoRA file")
    p.add_argument(
        "--pipeline",
        default="tiny",
        help="a FLUX.1 / FLUX.2 / FLUX.2-klein / Qwen-Image pipeline folder, or tiny[:kind]",
    )
    p.add_argument("--resolution", type=int, default=512, help="square training size, a multiple of 16")
    p.add_argument("--max-sequence-length", type=int, default=512, help="text tokens per caption")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (None: the rank)")
    p.add_argument("--targets", nargs="+", default=None, help="module suffixes to adapt (None: attention)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="AdamW weight decay")
    p.add_argument("--batch-size", type=int, default=1, help="global batch per step (split over dp x fsdp)")
    p.add_argument("--steps", type=int, default=1000, help="train until this step (with --resume: the new end)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--timesteps", choices=("logit_normal", "uniform"), default="logit_normal", help="t's law")
    p.add_argument("--guidance", type=float, default=1.0, help="guidance input of guidance-distilled models")
    p.add_argument("--seed", type=int, default=0, help="LoRA init, data order, noise and t")
    p.add_argument("--fsdp", type=int, default=1, help="fully sharded degree")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="frozen weights, autocast")
    p.add_argument("--reshard-after-forward", action="store_true", help="re-gather weights in backward (fsdp)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    p.add_argument(
        "--overwrite", action="store_true", help="start over in an --output-dir that holds a run (its files removed)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _bad(p, name: str, expected: str, got) -> None:
    p.error(f"{name}: expected {expected}, got {got!r}")


def check_args(argv=None) -> argparse.Namespace:
    """The parsed arguments, each checked (exit 2 naming it) before anything loads."""
    p = parser()
    a = p.parse_args(argv)
    if not os.path.isdir(a.data):
        _bad(p, "--data", "a folder of images and captions", a.data)
    items = find_items(a.data)
    if not items:
        _bad(p, "--data", f"images ({', '.join(IMAGES)}) each with a same-name .txt caption", a.data)
    tiny = ("tiny", *(f"tiny:{k}" for k in TINY_KINDS))
    if a.pipeline not in tiny and not os.path.isfile(os.path.join(a.pipeline, "model_index.json")):
        _bad(p, "--pipeline", f"one of {tiny} or a diffusers pipeline folder (with model_index.json)", a.pipeline)
    for name, low in (("resolution", 16), ("max_sequence_length", 1), ("rank", 1), ("batch_size", 1)):
        if getattr(a, name) < low:
            _bad(p, "--" + name.replace("_", "-"), f"an int >= {low}", getattr(a, name))
    if a.resolution % 16:
        _bad(p, "--resolution", "a multiple of 16 (the VAE's 8 x FLUX's 2x2 packing)", a.resolution)
    for name in ("steps", "checkpoint_every", "fsdp", "tp"):
        if getattr(a, name) < 1:
            _bad(p, "--" + name.replace("_", "-"), "a positive int", getattr(a, name))
    if not a.lr > 0:
        _bad(p, "--lr", "a positive float", a.lr)
    if a.weight_decay < 0:
        _bad(p, "--weight-decay", "a float >= 0", a.weight_decay)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.fsdp * a.tp != world:
        _bad(p, "--fsdp x --tp", f"the world size {world} (WORLD_SIZE)", f"{a.fsdp} x {a.tp} = {a.fsdp * a.tp}")
    _check_run(p, a)
    return a


RUN_FILES = ("checkpoints", "losses.jsonl", "eval.json", LORA_FILE)  # what a run leaves (cache.pt: reusable)


def previous_run(output_dir: str) -> list[str]:
    """The files of an earlier run in ``output_dir`` (empty if none)."""
    return [n for n in RUN_FILES if os.path.lexists(os.path.join(output_dir, n))]


def _check_run(p, a) -> None:
    """--output-dir against --resume / --overwrite / --steps: continue a run, start one in
    a folder without one, or start over only when asked."""
    if os.path.exists(a.output_dir) and not os.path.isdir(a.output_dir):
        _bad(p, "--output-dir", "a folder (new or existing)", a.output_dir)
    if a.resume and a.overwrite:
        p.error("--resume, --overwrite: expected one of them (one continues the run, the other starts over), got both")
    if a.resume:
        ckpt = latest_checkpoint(a.output_dir)
        if ckpt is None:
            _bad(p, "--resume", f"a complete checkpoint in {os.path.join(a.output_dir, 'checkpoints')}", None)
        if a.steps < (step := checkpoint_step(ckpt)):
            _bad(p, "--steps", f"an int >= {step} (the step of {ckpt}, which --resume continues)", a.steps)
    elif not a.overwrite and (found := previous_run(a.output_dir)):
        p.error(
            f"--output-dir: expected a folder without a previous run, got {a.output_dir!r} holding "
            f"{', '.join(found)}: pass --resume to continue that run or --overwrite to start over"
        )


def find_items(folder: str) -> list[tuple[str, str]]:
    """``(image path, caption)`` of every image with a same-name ``.txt``, sorted by name."""
    out = []
    for name in sorted(os.listdir(folder)):
        stem, ext = os.path.splitext(name)
        caption = os.path.join(folder, stem + ".txt")
        if ext.lower() in IMAGES and os.path.isfile(caption):
            with open(caption, encoding="utf-8") as f:
                out.append((os.path.join(folder, name), f.read().strip()))
    return out


# ----------------------------------------------------------------------------- data


TINY_KINDS = ("flux", "flux2-klein", "qwen-image")  # --pipeline tiny[:kind]
PIPELINES = (
    "FluxPipeline",
    "Flux2Pipeline",
    "Flux2KleinPipeline",
    "QwenImagePipeline",
)  # the encode steps written here


def load_pipeline(path: str):
    """The pipeline at ``path`` (offline, fp32), or a tiny one (``tiny``: FLUX.1,
    ``tiny:flux2-klein``)."""
    if path.startswith("tiny"):
        from functional_dit import tiny

        return tiny.pipeline(path.partition(":")[2] or "flux", seed=0)
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float32, local_files_only=True)
    if type(pipe).__name__ not in PIPELINES:
        raise ValueError(f"--pipeline: expected one of {PIPELINES}, got a {type(pipe).__name__}")
    return pipe


def image_tensor(path: str, size: int) -> torch.Tensor:
    """The image resized (shorter side to ``size``, bicubic) and centre-cropped, as
    (3, size, size) in [-1, 1]."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    scale = size / min(img.size)
    img = img.resize((max(size, round(img.width * scale)), max(size, round(img.height * scale))), Image.BICUBIC)
    left, top = (img.width - size) // 2, (img.height - size) // 2
    img = img.crop((left, top, left + size, top + size))
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3)
    return x.permute(2, 0, 1).float() / 127.5 - 1


@torch.no_grad()
def encode(pipe, items, resolution: int, max_len: int) -> dict:
    """The training tensors of ``items`` as the pipeline prepares them: ``latents`` (N, S, C)
    packed, ``txt`` (N, L, D) text embeddings, and what the family's transformer takes
    besides: FLUX.1 ``pooled`` (N, P) and position ids, FLUX.2 position ids, Qwen-Image
    ``txt_mask`` (N, L) (captions padded to the longest) and ``img_shapes``."""
    kind = type(pipe).__name__
    out: dict = {"latents": [], "txt": [], "key": cache_key_of(items, resolution, max_len)}
    pooled, masks = [], []
    for path, caption in items:
        image = image_tensor(path, resolution)[None]
        if kind == "FluxPipeline":  # shifted and scaled, packed 2x2; T5 + CLIP pooled
            z = pipe.vae.encode(image).latent_dist.mode()
            z = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
            _, c, h, w = z.shape
            out["latents"].append(pipe._pack_latents(z, 1, c, h, w)[0])
            e, p, out["txt_ids"] = pipe.encode_prompt(caption, prompt_2=None, max_sequence_length=max_len)
            pooled.append(p[0])
            out["img_ids"] = pipe._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
        elif kind == "QwenImagePipeline":  # a one-frame video latent, normalised, packed 2x2
            z = pipe.vae.encode(image[:, :, None]).latent_dist.mode()
            shape = (1, -1, 1, 1, 1)
            z = (z - torch.tensor(pipe.vae.config.latents_mean).view(shape)) / torch.tensor(
                pipe.vae.config.latents_std
            ).view(shape)
            _, c, _, h, w = z.shape
            out["latents"].append(pipe._pack_latents(z, 1, c, h, w)[0])
            e, m = pipe.encode_prompt(caption, max_sequence_length=max_len)
            masks.append(torch.ones(e.shape[1], dtype=torch.long) if m is None else m[0].long())
            out["img_shapes"] = [(1, h // 2, w // 2)]
        else:  # FLUX.2: patchified 2x2 and batch-normed (_encode_vae_image), packed
            z = pipe._encode_vae_image(image, generator=None)
            out["latents"].append(pipe._pack_latents(z)[0])
            e, txt_ids = pipe.encode_prompt(caption, max_sequence_length=max_len)
            out["img_ids"], out["txt_ids"] = pipe._prepare_latent_ids(z)[0], txt_ids[0]
        out["txt"].append(e[0])
    if masks:  # captions of different lengths: padded with zeros, masked out
        L = max(len(m) for m in masks)
        out["txt"] = [torch.nn.functional.pad(e, (0, 0, 0, L - len(e))) for e in out["txt"]]
        out["txt_mask"] = torch.stack([torch.nn.functional.pad(m, (0, L - len(m))) for m in masks])
    if pooled:
        out["pooled"] = torch.stack(pooled)
    return {**out, "latents": torch.stack(out["latents"]), "txt": torch.stack(out["txt"])}


def cache_key_of(items, resolution: int, max_len: int) -> str:
    stamp = [(os.path.basename(p), os.path.getmtime(p), c) for p, c in items]
    return json.dumps([stamp, resolution, max_len])


def prepare(a, rank: int, barrier):
    """The cached training tensors (rank 0 encodes them once) and the transformer params
    (fp32, full) from the pipeline."""
    import functional_dit as fd

    os.makedirs(a.output_dir, exist_ok=True)
    items = find_items(a.data)
    path = os.path.join(a.output_dir, CACHE)
    pipe = load_pipeline(a.pipeline)
    if rank == 0:
        cached = torch.load(path) if os.path.isfile(path) else None
        if cached is None or cached["key"] != cache_key_of(items, a.resolution, a.max_sequence_length):
            tmp = path + ".tmp"
            torch.save(encode(pipe, items, a.resolution, a.max_sequence_length), tmp)
            os.replace(tmp, path)
    barrier()
    data = torch.load(path)
    return data, fd.from_diffusers(pipe.transformer)


# ----------------------------------------------------------------------------- steps


def batch_indices(step: int, batch: int, n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """The items of ``step``: the next ``batch`` of a permutation per epoch (seeded by
    ``seed`` and the epoch), continuing into the next epoch; and the step's epoch order."""
    out, order = [], None
    for c in range(step * batch, (step + 1) * batch):
        epoch, pos = divmod(c, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append(int(order[pos]))
    return out, order


def sample_t(n: int, how: str, gen: torch.Generator) -> torch.Tensor:
    """Flow-matching times: logit-normal ``sigmoid(N(0, 1))`` or uniform in [0, 1)."""
    if how == "uniform":
        return torch.rand(n, generator=gen)
    return torch.sigmoid(torch.randn(n, generator=gen))


def inputs(data: dict, idx: list[int], noise: torch.Tensor, t: torch.Tensor, guidance, params, device) -> tuple:
    """``fd.apply`` keywords for items ``idx`` at times ``t``, and the velocity target."""
    x0, dtype = data["latents"][idx], next(iter(params.leaves())).dtype
    tt = t[:, None, None]
    kw = dict(
        x=((1 - tt) * x0 + tt * noise).to(device, dtype),  # (in the weights' dtype, as fd.apply asks)
        t=t.to(device),
        txt=data["txt"][idx].to(device, dtype),
    )
    if "pooled" in data:
        kw["pooled"] = data["pooled"][idx].to(device, dtype)
    if "txt_mask" in data:
        kw["txt_mask"] = data["txt_mask"][idx].to(device)
    kw.update({k: data[k].to(device) for k in ("img_ids", "txt_ids") if k in data})
    if "img_shapes" in data:
        kw["img_shapes"] = [data["img_shapes"]] * len(idx)
    if getattr(params.config, "guidance_embeds", False):
        kw["guidance"] = torch.full((len(idx),), guidance, device=device)
    return kw, (noise - x0).to(device)


def loss_of(params, adapter, kw, target, autocast: bool, reshard: bool = False):
    import torch.nn.functional as F

    import functional_dit as fd
    import sharding

    with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=autocast):
        with sharding.fsdp_options(reshard_after_forward=reshard):
            out = fd.apply(params, **kw, lora=[(adapter, 1.0)])
    return F.mse_loss(out.float(), target.float())


@torch.no_grad()
def eval_loss(params, adapter, data, a, device) -> float:
    """The loss on every item with fixed noise and times (`EVAL_SEED`): comparable across runs."""
    n = data["latents"].shape[0]
    gen = torch.Generator().manual_seed(EVAL_SEED)
    noise = torch.randn(data["latents"].shape, generator=gen)
    t = sample_t(n, a.timesteps, gen)
    kw, target = inputs(data, list(range(n)), noise, t, a.guidance, params, device)
    return float(loss_of(params, adapter, kw, target, a.dtype == "bfloat16"))


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_state(adapter, opt, extra: dict) -> dict:
    """What DCP saves and loads in place: examples/finetune_tp.py's layout of the LoRA
    factors, AdamW's moments (as ``sharding.checkpoint_state`` lays them out, sharded) and
    step counts, and ``extra`` (the next step, RNG state, data order: plain tensors, the
    same on every rank)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "finetune_tp.py")
    spec = importlib.util.spec_from_file_location("finetune_tp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {**module.checkpoint_state(adapter, opt), **extra}


_STEP_DIR = re.compile(r"step_(\d+)$")


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint folder (``step_<n>``; ``.tmp`` ones are partial)."""
    root = os.path.join(output_dir, "checkpoints")
    found = [(int(m.group(1)), n) for n in os.listdir(root) if (m := _STEP_DIR.match(n))] if os.path.isdir(root) else []
    return os.path.join(root, max(found)[1]) if found else None


def checkpoint_step(path: str) -> int:
    """The step a checkpoint folder ``step_<n>`` was saved after (the step it resumes at)."""
    return int(_STEP_DIR.search(path).group(1))


def finished(a) -> str | None:
    """With --resume and --steps the checkpoint's step: the line saying there is nothing to
    train if the LoRA file was written from that checkpoint (after it), else None (a run
    killed between its last checkpoint and the file: resuming writes the file)."""
    ckpt = latest_checkpoint(a.output_dir) if a.resume else None
    if ckpt is None or a.steps != checkpoint_step(ckpt):
        return None
    lora_file, done = os.path.join(a.output_dir, LORA_FILE), os.path.join(ckpt, ".metadata")
    if not os.path.isfile(lora_file) or os.path.getmtime(lora_file) < os.path.getmtime(done):
        return None
    return f"nothing to train: {ckpt} is at step {a.steps} = --steps and {lora_file} was written from it"


def start_over(output_dir: str) -> list[str]:
    """Remove an earlier run's files (--overwrite), the checkpoints first moved aside in one
    rename so that no --resume can ever find a mix of the two runs; returns what went."""
    found = previous_run(output_dir)
    ckpts = os.path.join(output_dir, "checkpoints")
    if os.path.lexists(ckpts):
        gone = f"{ckpts}.{os.getpid()}.old"
        os.rename(ckpts, gone)
        shutil.rmtree(gone)
    for name in found:
        if name != "checkpoints":
            os.remove(os.path.join(output_dir, name))
    return found


@contextlib.contextmanager
def _dcp_group():
    """Around a DCP save or load in one process: a one-rank gloo group (an in-memory store,
    no network), so DCP coordinates as it does on ranks instead of warning that
    torch.distributed is uninitialised (torch 2.13 warns so even given ``no_dist=True``).
    Under torchrun the run's own group serves."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def save_checkpoint(state: dict, output_dir: str, step: int, rank: int, barrier) -> str:
    """DCP-save ``state`` to ``checkpoints/step_<step>.tmp``, then rename it to
    ``step_<step>`` (atomic): a kill mid-save leaves no ``step_<n>`` that is partial."""
    import torch.distributed.checkpoint as dcp

    final = os.path.join(output_dir, "checkpoints", f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    with _dcp_group():
        dcp.save(state, checkpoint_id=tmp)
    barrier()
    if rank == 0:
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
    barrier()
    return final


# ----------------------------------------------------------------------------- the run


def _dist(a):
    """(rank, mesh or None, barrier, device) for this process."""
    import torch.distributed as dist

    import sharding

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not dist.is_initialized():
        return 0, None, lambda: None, device
    mesh = sharding.make_mesh(fsdp=a.fsdp, tp=a.tp, device_type=device.type)
    return dist.get_rank(), mesh, dist.barrier, device


def train(a) -> dict:
    """The run of `main` for checked arguments ``a``; returns what rank 0 logged."""
    import sharding

    rank, mesh, barrier, device = _dist(a)
    data, params = prepare(a, rank, barrier)
    params, adapter, opt = setup(a, params, mesh, device)
    gen = torch.Generator().manual_seed(a.seed)
    n = data["latents"].shape[0]
    start = 0
    if a.resume:
        start, rng = resume(a, adapter, opt, n, gen.get_state(), rank)
        gen.set_state(rng)
    log_path = start_log(a, start) if rank == 0 else None
    losses = []
    before = eval_loss(params, adapter, data, a, device)
    bar = progress(a, start) if rank == 0 else None
    t0 = time.perf_counter()
    for step in range(start, a.steps):
        value, order = train_step(params, adapter, opt, data, a, step, gen, device)
        losses.append(value)
        if rank == 0:
            log_step(log_path, bar, step, value)
        if (step + 1) % a.checkpoint_every == 0 or step + 1 == a.steps:
            extra = {"next": torch.tensor(step + 1), "rng": gen.get_state(), "order": order}
            save_checkpoint(checkpoint_state(adapter, opt, extra), a.output_dir, step + 1, rank, barrier)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    after = eval_loss(params, adapter, data, a, device)
    full = sharding.unshard(adapter) if mesh is not None else adapter  # (a collective: every rank)
    if rank == 0:
        evals = {"eval_loss_before": before, "eval_loss_after": after, "steps": a.steps - start, "seconds": seconds}
        write_results(a, full, evals)
    barrier()
    return {"losses": losses, "eval_loss_before": before, "eval_loss_after": after, "start": start}


def setup(a, params, mesh, device) -> tuple:
    """The frozen params in ``--dtype`` on ``device``, a fresh fp32 LoRA (`lora.init`), both
    sharded over ``mesh`` if there is one, and AdamW over the LoRA factors."""
    import functional_dit.lora as lora
    import sharding

    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    params = params.replace(sharding.tree.map_tree(lambda _, v: v.to(device, dtype), params.tree))
    adapter = lora.init(params, rank=a.rank, alpha=a.alpha, targets=a.targets, seed=a.seed, device=device)
    if mesh is not None:
        params, adapter = sharding.shard_params(params, mesh), sharding.shard_params(adapter, mesh)
    leaves = [x.requires_grad_() for x in adapter.leaves()]
    return params, adapter, torch.optim.AdamW(leaves, lr=a.lr, weight_decay=a.weight_decay)


def train_step(params, adapter, opt, data: dict, a, step: int, gen, device) -> tuple[float, torch.Tensor]:
    """One AdamW step on step ``step``'s batch (noise and t drawn from ``gen``); returns
    its loss and the epoch's data order."""
    idx, order = batch_indices(step, a.batch_size, data["latents"].shape[0], a.seed)
    noise = torch.randn((len(idx), *data["latents"].shape[1:]), generator=gen)
    t = sample_t(len(idx), a.timesteps, gen)
    kw, target = inputs(data, idx, noise, t, a.guidance, params, device)
    loss = loss_of(params, adapter, kw, target, a.dtype == "bfloat16", a.reshard_after_forward)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()  # on the DTensor leaves: each rank updates its own shards
    return float(loss.detach()), order


def progress(a, start: int):
    """Rank 0's tqdm bar (on stderr), or None with --no-progress."""
    if a.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=a.steps, initial=start, desc="train_lora", unit="step", dynamic_ncols=True)


def log_step(path: str, bar, step: int, value: float) -> None:
    """Rank 0: the step's line in ``losses.jsonl`` and on the bar."""
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "loss": value}) + "\n")
    if bar is not None:
        bar.set_postfix(loss=f"{value:.4f}")
        bar.update(1)


def resume(a, adapter, opt, n: int, rng: torch.Tensor, rank: int) -> tuple[int, torch.Tensor]:
    """--resume: DCP loads the newest checkpoint in place into ``adapter``'s factors and
    ``opt``'s state; returns its step and noise RNG state (``rng``: this run's, for the
    layout) after checking that its data order is this run's."""
    import torch.distributed.checkpoint as dcp

    ckpt = latest_checkpoint(a.output_dir)
    extra = {"next": torch.tensor(0), "rng": rng, "order": torch.zeros(n, dtype=torch.long)}
    state = checkpoint_state(adapter, opt, extra)
    with _dcp_group():
        dcp.load(state, checkpoint_id=ckpt)  # in place: factors, moments, extra
    start = int(state["next"])
    if start and not torch.equal(state["order"], batch_indices(start - 1, a.batch_size, n, a.seed)[1]):
        raise ValueError("--resume: the checkpoint's data order differs from this run's (--data, --seed)")
    if rank == 0:
        print(f"resumed from step {start} ({ckpt})", flush=True)
    return start, state["rng"]


def start_log(a, start: int) -> str:
    """Rank 0's ``losses.jsonl``, cut back to the steps before ``start`` (--resume) or new;
    with --overwrite the earlier run's files are removed first (now, once the pipeline has
    loaded and before this run writes anything)."""
    if a.overwrite and (gone := start_over(a.output_dir)):
        print(f"--overwrite: removed the previous run's {', '.join(gone)} in {a.output_dir}", flush=True)
    path, kept = os.path.join(a.output_dir, "losses.jsonl"), []
    if a.resume and os.path.isfile(path):
        with open(path) as f:
            kept = [ln for ln in f if json.loads(ln)["step"] < start]
    with open(path, "w") as f:
        f.writelines(kept)
    return path


def write_results(a, adapter, evals: dict) -> None:
    """Rank 0: the LoRA file and ``eval.json``, each path printed."""
    import functional_dit.lora as lora
    import sharding

    path = os.path.join(a.output_dir, LORA_FILE)
    lora.save(lora.Adapter(adapter.config, sharding.tree.map_tree(lambda _, v: v.detach().cpu(), adapter.tree)), path)
    print(f"wrote {path}", flush=True)
    with open(os.path.join(a.output_dir, "eval.json"), "w") as f:
        json.dump(evals, f)
    loss = f"eval loss {evals['eval_loss_before']:.4f} -> {evals['eval_loss_after']:.4f}"
    print(f"wrote {os.path.join(a.output_dir, 'eval.json')} ({loss})", flush=True)


def main(argv=None) -> dict:
    a = check_args(argv)
    done = finished(a)
    if done is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(done, flush=True)
        return {"losses": [], "start": a.steps}
    return train(a)


if __name__ == "__main__":
    main(sys.argv[1:])

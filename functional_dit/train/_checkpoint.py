"""The run's folder: DCP checkpoints (written atomically, resumed in place), the files an
earlier run left and starting over."""

from __future__ import annotations

import contextlib
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import sharding

from ._buckets import batch_indices
from ._report import LOSS_PNG, TENSORBOARD

LORA_FILE = "pytorch_lora_weights.safetensors"
EMA_DIR = "ema"  # --ema-decay: ema/pytorch_lora_weights.safetensors


RUN_FILES = (
    "checkpoints",
    "losses.jsonl",
    "eval.json",
    LORA_FILE,
    EMA_DIR,
    LOSS_PNG,
    TENSORBOARD,
    "samples",  # --validation-prompt's grids (_validate.SAMPLES)
)  # what a run leaves (cache/: reusable)


def previous_run(output_dir: str) -> list[str]:
    """The files of an earlier run in ``output_dir`` (empty if none)."""
    return [n for n in RUN_FILES if os.path.lexists(os.path.join(output_dir, n))]


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's


def checkpoint_state(adapter, opt, extra: dict, ema=None) -> dict:
    """What DCP saves and loads in place: the LoRA factors and AdamW's moments, each as
    ``sharding.checkpoint_state`` lays them out (sharded as they are), AdamW's step counts,
    the EMA's factors (``ema``, laid out like them) and ``extra`` (the next step, RNG state,
    data order: plain tensors, the same on every rank). Before the first step AdamW's state
    is created zeroed, as AdamW creates it, to load into."""
    paths, leaves = zip(*adapter.flat().items())
    for leaf in leaves:
        if leaf not in opt.state:
            zeros = torch.zeros_like(leaf.detach())  # a DTensor stays one, same placements
            opt.state[leaf] = {"step": torch.tensor(0.0), **{m: zeros.clone() for m in MOMENTS}}
    state = {"params": sharding.checkpoint_state(adapter)}
    for m in MOMENTS:
        tree = sharding.tree.nest({p: opt.state[leaf][m] for p, leaf in zip(paths, leaves)})
        state[m] = sharding.checkpoint_state(adapter, tree)
    state["step"] = {p: opt.state[leaf]["step"] for p, leaf in zip(paths, leaves)}
    if ema is not None:
        state["ema"] = sharding.checkpoint_state(adapter, ema.tree)
    return {**state, **extra}


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
        path = os.path.join(output_dir, name)
        if name != "checkpoints":
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    return found


@contextlib.contextmanager
def _dcp_group():
    """Around a DCP save or load in one process: a one-rank gloo group (an in-memory store,
    no network), so DCP coordinates as it does on ranks instead of warning that
    torch.distributed is uninitialised (torch 2.13 warns so even given ``no_dist=True``).
    Under torchrun the run's own group serves."""
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


def has_ema(ckpt: str) -> bool:
    """Whether the checkpoint folder ``ckpt`` holds an EMA (saved with --ema-decay)."""
    return any(k.startswith("ema.") for k in FileSystemReader(ckpt).read_metadata().state_dict_metadata)


def resume(a, adapter, opt, groups: list, rng: torch.Tensor, rank: int, ema=None) -> tuple[int, torch.Tensor]:
    """--resume: DCP loads the newest checkpoint in place into ``adapter``'s factors,
    ``opt``'s state and the EMA's factors; returns its step and noise RNG state (``rng``:
    this run's, for the layout) after checking that its data order (the epoch's batches of
    the items of each bucket, ``groups``) is this run's."""
    ckpt = latest_checkpoint(a.output_dir)
    n = a.batch_size * a.grad_accum
    extra = {"next": torch.tensor(0), "rng": rng, "order": torch.zeros_like(batch_indices(0, n, groups, a.seed)[1])}
    state = checkpoint_state(adapter, opt, extra, ema)
    with _dcp_group():
        dcp.load(state, checkpoint_id=ckpt)  # in place: factors, moments, extra
    start = int(state["next"])
    if start and not torch.equal(state["order"], batch_indices(start - 1, n, groups, a.seed)[1]):
        raise ValueError("--resume: the checkpoint's data order differs from this run's (--data, --seed, buckets)")
    if rank == 0:
        print(f"resumed from step {start} ({ckpt})", flush=True)
    return start, state["rng"]

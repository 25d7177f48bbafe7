"""The training run: setup, the steps, the eval loss, the logs and the files written."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import functional_dit as fd
import functional_dit.lora as lora
import sharding

from . import _checkpoint, _memory, _report, _validate
from ._buckets import batch_indices
from ._cache import prepare
from ._checkpoint import EMA_DIR, LORA_FILE, resume, start_over
from ._data import caption_rows
from ._memory import FP8_SKIP
from ._optim import clip_, ema_init, ema_update_, lr_at

EVAL_SEED = 12345  # the fixed (noise, t) of the eval loss


def _dist(a):
    """(rank, mesh or None, barrier, device) for this process."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not dist.is_initialized():
        return 0, None, lambda: None, device
    mesh = sharding.make_mesh(fsdp=a.fsdp, tp=a.tp, device_type=device.type)
    return dist.get_rank(), mesh, dist.barrier, device


@dataclasses.dataclass
class Run:
    """What a run holds: this process's place, the data, the frozen params, the LoRA, its
    optimizer, its EMA (None without --ema-decay) and the noise generator."""

    rank: int
    mesh: object
    barrier: object
    device: torch.device
    data: dict
    params: object
    adapter: object
    opt: torch.optim.Optimizer
    ema: object
    gen: torch.Generator
    encoders: object = None  # the pipeline without its transformer, for --validation-prompt


def train(a) -> dict:
    """The run of `main` for checked arguments ``a``; returns what rank 0 logged."""
    r, start = begin(a)
    log_path = start_log(a, start) if r.rank == 0 else None
    losses = []
    before = eval_loss(r.params, r.adapter, r.data, a, r.device)
    bar = progress(a, start) if r.rank == 0 else None
    board = _report.tensorboard_writer(a, start) if r.rank == 0 else None
    t0, base = time.perf_counter(), _memory.start(r.device)
    for step in range(start, a.steps):
        line, order = train_step(r, a, step)
        losses.append(line["loss"])
        if r.rank == 0:
            log_step(log_path, bar, line, board)
        if (step + 1) % a.checkpoint_every == 0 or step + 1 == a.steps:
            extra = {"next": torch.tensor(step + 1), "rng": r.gen.get_state(), "order": order}
            state = _checkpoint.checkpoint_state(r.adapter, r.opt, extra, r.ema)
            _checkpoint.save_checkpoint(state, a.output_dir, step + 1, r.rank, r.barrier)
            if r.rank == 0:
                _report.plot_losses(a.output_dir)
        if _validate.due(a, step + 1) and (path := _validate.validate(r, a, r.encoders, step + 1)):
            print(f"wrote {path}", flush=True)
    for closing in (bar, board):
        if closing is not None:
            closing.close()
    memory = _memory.figures(r.device, base, r.params, r.adapter)
    evals = finish(r, a, before, a.steps - start, time.perf_counter() - t0, memory)
    return {"losses": losses, **evals, "start": start}


def begin(a) -> tuple[Run, int]:
    """The run set up (the data cached, the LoRA fresh or resumed) and its first step."""
    rank, mesh, barrier, device = _dist(a)
    data, params = prepare(a, rank, barrier)
    params, adapter, opt = setup(a, params, mesh, device)
    ema = ema_init(adapter) if a.ema_decay is not None else None
    gen = torch.Generator().manual_seed(a.seed)
    start = 0
    if a.resume:
        start, rng = resume(a, adapter, opt, data.groups, gen.get_state(), rank, ema)
        gen.set_state(rng)
    encoders = _validate.load_encoders(a.pipeline) if a.validation_prompt else None
    return Run(rank, mesh, barrier, device, data, params, adapter, opt, ema, gen, encoders), start


def finish(r: Run, a, before: float, steps: int, seconds: float, memory: dict) -> dict:
    """The eval loss after the run (of the EMA too), the LoRA file(s) and ``eval.json``
    written by rank 0 (with its ``memory`` figures), each rank's memory line; returns the
    evals."""
    evals = {"eval_loss_before": before, "eval_loss_after": eval_loss(r.params, r.adapter, r.data, a, r.device)}
    if r.ema is not None:
        evals["eval_loss_after_ema"] = eval_loss(r.params, r.ema, r.data, a, r.device)
    evals |= {"steps": steps, "seconds": seconds, "memory": memory}
    gather = sharding.unshard if r.mesh is not None else (lambda x: x)  # (a collective: every rank)
    full, ema = gather(r.adapter), (gather(r.ema) if r.ema is not None else None)
    if r.rank == 0:
        write_results(a, full, evals, ema)
    r.barrier()
    print(_memory.line(r.rank, memory), flush=True)
    return evals


def setup(a, params, mesh, device) -> tuple:
    """The frozen params in ``--dtype`` on ``device`` (``--base-dtype fp8``: stored in float8
    e4m3 by `fd.layerwise_cast`, but for `FP8_SKIP`), a fresh fp32 LoRA (`lora.init`), both
    sharded over ``mesh`` if there is one, and AdamW over the LoRA factors."""
    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    params = params.replace(sharding.tree.map_tree(lambda _, v: v.to(device, dtype), params.tree))
    if a.base_dtype == "fp8":  # stored in fp8, read in --dtype at each op (before sharding: each shard stored)
        params = fd.layerwise_cast(params, torch.float8_e4m3fn, dtype, skip=FP8_SKIP)
    kw = dict(rank=a.rank, alpha=a.alpha, targets=a.targets, seed=a.seed, device=device, use_dora=a.dora)
    adapter = lora.init(params, **kw)
    if mesh is not None:
        params, adapter = sharding.shard_params(params, mesh), sharding.shard_params(adapter, mesh)
    leaves = [x.requires_grad_() for x in adapter.leaves()]
    return params, adapter, torch.optim.AdamW(leaves, lr=a.lr, weight_decay=a.weight_decay)


def train_step(r: Run, a, step: int) -> tuple[dict, torch.Tensor]:
    """One AdamW step on step ``step``'s batch: ``--grad-accum`` micro-batches of
    ``--batch-size`` items (noise and t drawn from ``r.gen`` for all of them at once, as
    for one batch that large), each loss divided by their number, the gradients summed;
    clipped by their global norm (``--max-grad-norm``), the step's learning rate, then the
    EMA. Returns its log line (step, loss, lr, grad norm) and the epoch's data order."""
    n, accum, size = a.batch_size * a.grad_accum, a.grad_accum, a.batch_size
    idx, order = batch_indices(step, n, r.data.groups, a.seed)
    rows = caption_rows(idx, a.caption_dropout, r.gen, r.data.n)  # (row N: the empty caption)
    batch = r.data.batch(idx, rows)  # (one bucket: its files read now)
    noise = torch.randn(batch["latents"].shape, generator=r.gen)
    t = sample_t(n, a.timesteps, r.gen)
    r.opt.zero_grad(set_to_none=True)
    value = 0.0
    for m in range(0, n, size):
        part = slice(m, m + size)
        kw, target = inputs(_part(batch, part), noise[part], t[part], a.guidance, r.params, r.device)
        loss = loss_of(
            r.params, r.adapter, kw, target, a.dtype == "bfloat16", a.reshard_after_forward, a.checkpoint_blocks
        )
        loss = loss / accum if accum > 1 else loss
        loss.backward()  # (the gradients add up over the micro-batches)
        value += float(loss.detach())
    line = {"step": step, "loss": value, "lr": lr_at(step, a.lr, a.lr_scheduler, a.warmup_steps, a.steps)}
    if a.max_grad_norm is not None:
        line["grad_norm"] = clip_([x.grad for x in r.adapter.leaves()], a.max_grad_norm)
    for group in r.opt.param_groups:
        group["lr"] = line["lr"]
    r.opt.step()  # on the DTensor leaves: each rank updates its own shards
    if r.ema is not None:
        ema_update_(r.ema, r.adapter, a.ema_decay)
    return line, order


def sample_t(n: int, how: str, gen: torch.Generator) -> torch.Tensor:
    """Flow-matching times: logit-normal ``sigmoid(N(0, 1))`` or uniform in [0, 1)."""
    if how == "uniform":
        return torch.rand(n, generator=gen)
    return torch.sigmoid(torch.randn(n, generator=gen))


def _part(batch: dict, part: slice) -> dict:
    """The micro-batch ``part`` of a batch (`Data.batch`): its per-item tensors cut, the
    position inputs shared."""
    per_item = ("latents", "txt", "pooled", "txt_mask")
    return {k: (v[part] if k in per_item else v) for k, v in batch.items()}


def inputs(batch: dict, noise, t: torch.Tensor, guidance, params, device) -> tuple:
    """``fd.apply`` keywords for a batch (`Data.batch`) at times ``t``, and the velocity
    target."""
    x0, dtype = batch["latents"], _compute_dtype(params)
    n = len(x0)
    tt = t[:, None, None]
    kw = dict(
        x=((1 - tt) * x0 + tt * noise).to(device, dtype),  # (in the weights' dtype, as fd.apply asks)
        t=t.to(device),
        txt=batch["txt"].to(device, dtype),
    )
    if "pooled" in batch:
        kw["pooled"] = batch["pooled"].to(device, dtype)
    if "txt_mask" in batch:
        kw["txt_mask"] = batch["txt_mask"].to(device)
    kw.update({k: batch[k].to(device) for k in ("img_ids", "txt_ids") if k in batch})
    if "img_shapes" in batch:
        kw["img_shapes"] = [batch["img_shapes"]] * n
    if "img_mask" in batch:  # Qwen-Image 2.1: one layout for the batch
        kw["img_mask"] = batch["img_mask"].expand(n, -1).to(device)
    if getattr(params.config, "guidance_embeds", False):
        kw["guidance"] = torch.full((n,), guidance, device=device)
    return kw, (noise - x0).to(device)


def _compute_dtype(params) -> torch.dtype:
    """The dtype ``fd.apply`` computes in: the params' (a stored fp8 leaf reads as it)."""
    return next(iter(params.leaves())).dtype


def loss_of(params, adapter, kw, target, autocast: bool, reshard: bool = False, checkpoint: bool = False):
    """The rectified-flow loss; ``checkpoint``: ``fd.apply``'s per-block activation
    checkpointing (--checkpoint-blocks)."""
    out = predict(params, adapter, kw, target.shape[1], autocast, reshard, checkpoint)
    return F.mse_loss(out.float(), target.float())


def predict(params, adapter, kw, tokens: int, autocast: bool, reshard: bool = False, checkpoint: bool = False):
    """The transformer's velocity on the ``tokens`` image tokens, with the LoRA on the fly
    (under bf16 autocast when ``autocast``)."""
    with torch.autocast(next(iter(kw.values())).device.type, dtype=torch.bfloat16, enabled=autocast):
        with sharding.fsdp_options(reshard_after_forward=reshard):
            out = fd.apply(params, **kw, lora=[(adapter, 1.0)], checkpoint=checkpoint)
    if out.shape[1] != tokens:  # Qwen-Image 2.1 returns the whole joint sequence: its image tokens last
        out = out[:, -tokens:]
    return out


@torch.no_grad()
def eval_loss(params, adapter, data, a, device) -> float:
    """The mean loss over every item with fixed noise and times (`EVAL_SEED` and the item's
    index: comparable across runs), bucket by bucket in batches of --batch-size (the last
    one completed from the bucket's start, the repeats not counted)."""
    total = 0.0
    for group in data.groups:
        for s in range(0, len(group), a.batch_size):
            idx = [group[(s + i) % len(group)] for i in range(a.batch_size)]
            batch = data.batch(idx)
            draws = [_eval_draw(i, batch["latents"].shape[1:], a.timesteps) for i in idx]
            noise, t = torch.stack([d[0] for d in draws]), torch.cat([d[1] for d in draws])
            kw, target = inputs(batch, noise, t, a.guidance, params, device)
            out = predict(params, adapter, kw, target.shape[1], a.dtype == "bfloat16")
            per_item = F.mse_loss(out.float(), target.float(), reduction="none").mean((1, 2))
            total += float(per_item[: min(a.batch_size, len(group) - s)].sum())
    return total / data.n


def _eval_draw(item: int, shape, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The eval noise and time of ``item``."""
    gen = torch.Generator().manual_seed(EVAL_SEED + item)
    return torch.randn(shape, generator=gen), sample_t(1, how, gen)


def progress(a, start: int):
    """Rank 0's tqdm bar (on stderr), or None with --no-progress."""
    if a.no_progress:
        return None
    return tqdm(total=a.steps, initial=start, desc="train_lora", unit="step", dynamic_ncols=True)


def log_step(path: str, bar, line: dict, board=None) -> None:
    """Rank 0: the step's line in ``losses.jsonl`` (step, loss, learning rate, and the
    gradient norm before clipping with --max-grad-norm), on the bar and in TensorBoard."""
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    if board is not None:
        _report.tensorboard_line(board, line)
    if bar is not None:
        bar.set_postfix(loss=f"{line['loss']:.4f}", lr=f"{line['lr']:.2e}")
        bar.update(1)


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


def write_results(a, adapter, evals: dict, ema=None) -> None:
    """Rank 0: the LoRA file, the EMA's (``ema/``, with --ema-decay) and ``eval.json``, each
    path printed."""
    for folder, tree in ((a.output_dir, adapter), (os.path.join(a.output_dir, EMA_DIR), ema)):
        if tree is not None:
            print(f"wrote {save_lora(tree, folder)}", flush=True)
    with open(os.path.join(a.output_dir, "eval.json"), "w") as f:
        json.dump(evals, f)
    loss = f"eval loss {evals['eval_loss_before']:.4f} -> {evals['eval_loss_after']:.4f}"
    if "eval_loss_after_ema" in evals:
        loss += f", EMA {evals['eval_loss_after_ema']:.4f}"
    print(f"wrote {os.path.join(a.output_dir, 'eval.json')} ({loss})", flush=True)


def save_lora(adapter, folder: str) -> str:
    """``adapter`` (full tensors) as ``folder/pytorch_lora_weights.safetensors``; its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LORA_FILE)
    lora.save(lora.Adapter(adapter.config, sharding.tree.map_tree(lambda _, v: v.detach().cpu(), adapter.tree)), path)
    return path

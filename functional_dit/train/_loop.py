"""The training run: setup, the steps, the eval loss, the logs and the files written."""

from __future__ import annotations

import json
import os
import time

import torch

from . import _checkpoint
from ._checkpoint import LORA_FILE, resume, start_over
from ._data import batch_indices, prepare

EVAL_SEED = 12345  # the fixed (noise, t) of the eval loss


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
            _checkpoint.save_checkpoint(
                _checkpoint.checkpoint_state(adapter, opt, extra), a.output_dir, step + 1, rank, barrier
            )
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

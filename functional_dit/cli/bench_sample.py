"""``bench --sampling``: the per-image time of `fd.sample` against the stock diffusers
pipeline at the same settings, and images per second with 1 rank against ``dp=2``.

The pipeline is the offline tiny one (`functional_dit.pipelines.tiny`: its text encoders and VAE)
around a mid-size FLUX.1 transformer (the bench's mid config, 8 heads x 64, 2 + 4 blocks,
at the tiny encoders' widths), 512 x 512 pixels = 1024 image tokens, random weights (the
same in both). The dp figure runs every rank with the same thread count as the single
rank, on the CPU over gloo; both make the same images (``batch_size=1``: bitwise).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import functional_dit as fd
import sharding
from functional_dit.cli import _bench_models as bench
from functional_dit.pipelines import tiny

PROMPTS = ["a red fox in the snow", "a lighthouse at dusk", "a bowl of ramen", "a bicycle against a wall"]
SETTINGS = dict(height=512, width=512, steps=4)


def pipeline():
    """(stock FluxPipeline with the mid transformer, our params of the same weights)."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    tc = tiny.transformer_config("flux")
    mid = bench.mid_configs()["flux1"]
    config = dataclasses.replace(mid, in_channels=tc.in_channels, joint_attention_dim=tc.joint_attention_dim,
                                 pooled_projection_dim=tc.pooled_projection_dim)  # fmt: skip
    params = fd.init(config, seed=0)
    cfg = {k: v for k, v in fd.config_to_diffusers(config).items() if not k.startswith("_")}
    module = diffusers.FluxTransformer2DModel(**cfg)
    module.load_state_dict(fd.to_state_dict(params))
    pipe = tiny.pipeline("flux", transformer=module.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe, params


def _stock(pipe, prompts, seed):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    kw = dict(height=SETTINGS["height"], width=SETTINGS["width"], num_inference_steps=SETTINGS["steps"])
    return pipe(prompts, generator=gens, output_type="latent", **kw).images


def per_image(runs: int, images: int = 2) -> dict:
    """Seconds per image, fd.sample vs the stock pipeline, alternating, median of ``runs``."""
    pipe, params = pipeline()
    prompts = PROMPTS[:images]
    ours = lambda: fd.sample(params, pipe, prompts, seed=0, output_type="latent", **SETTINGS)  # noqa: E731
    stock = lambda: _stock(pipe, prompts, 0)  # noqa: E731
    times: dict = {"ours": [], "stock": []}
    for _ in range(runs + 1):  # the first round warms up
        for name, fn in (("ours", ours), ("stock", stock)):
            t0 = time.perf_counter()
            with torch.no_grad():
                fn()
            times[name].append(time.perf_counter() - t0)
    with torch.no_grad():
        got, want = ours(), stock()
    want = want if want.ndim == 3 else pipe._pack_latents(want, *want.shape[:2], *want.shape[2:])
    med = {k: statistics.median(v[1:]) / images for k, v in times.items()}
    return {
        "ours_s": med["ours"],
        "stock_s": med["stock"],
        "images": images,
        "max_abs_err": (got - want).abs().max().item(),
    }


def _dp_worker(rank, world, port, threads, out_dir):  # mp.spawn's signature
    """One rank: warm up once, then time every prompt over this mesh (dp = world)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    pipe, params = pipeline()
    if world > 1:
        params = sharding.shard_params(params, sharding.make_mesh(dp=world, device_type="cpu"))
    kw = dict(seed=0, batch_size=1, output_type="latent", **SETTINGS)
    fd.sample(params, pipe, PROMPTS[:world], **(kw | dict(steps=1)))  # warm-up
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    out = fd.sample(params, pipe, PROMPTS, **kw)
    took = time.perf_counter() - t0
    torch.save({"seconds": took, "latents": out}, os.path.join(out_dir, f"rank{rank}.pt"))
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dp_scaling(threads: int = 1) -> dict:
    """Images per second on 1 rank and on dp=2 (``threads`` each), and whether they agree."""
    res = {}
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_dp_worker, args=(world, _free_port(), threads, d), nprocs=world, join=True)
            outs = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]
        res[world] = {"images_per_s": len(PROMPTS) / max(o["seconds"] for o in outs), "latents": outs[0]["latents"]}
    same = torch.equal(res[1]["latents"], res[2]["latents"])
    one, two = res[1]["images_per_s"], res[2]["images_per_s"]
    return {"one_rank": one, "dp2": two, "ratio": two / one, "bitwise_same": same, "threads": threads}


def markdown(per: dict, dp: dict, command: str, started, machine: str) -> str:
    s = SETTINGS
    return "\n".join(
        [
            "",
            "## Sampling: fd.sample vs the stock pipeline, and dp scaling",
            "",
            f"- date: {started:%Y-%m-%d %H:%M} UTC; command: `{command}`; machine: {machine} (shared, noisy)",
            f"- FluxPipeline (tiny offline encoders and VAE) around the mid FLUX.1 transformer (2 + 4 blocks, "
            f"8 heads x 64), {s['height']}x{s['width']} px = 1024 image tokens, {s['steps']} steps, fp32, "
            "random weights (the same in both)",
            "",
            "| figure | value |",
            "|---|---|",
            f"| fd.sample s/image ({per['images']} images a call, median, alternating) | {per['ours_s']:.3f} |",
            f"| stock pipeline s/image (same settings, stock transformer) | {per['stock_s']:.3f} |",
            f"| fd.sample / stock | {per['ours_s'] / per['stock_s']:.2f} |",
            f"| max abs latent difference | {per['max_abs_err']:.2e} |",
            f"| images/s, 1 rank ({dp['threads']} thread), {len(PROMPTS)} images one a call | {dp['one_rank']:.3f} |",
            f"| images/s, dp=2 ({dp['threads']} thread per rank, gloo) | {dp['dp2']:.3f} |",
            f"| dp=2 / 1 rank | {dp['ratio']:.2f} |",
            f"| dp=2 images bitwise equal to 1 rank's | {dp['bitwise_same']} |",
            "",
        ]
    )


def run(args) -> int:
    """``bench --sampling``: both figures, printed and appended to ``--out``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.datetime.now(datetime.timezone.utc)
    per = per_image(max(args.runs, 1))
    print(f"sampling per image: {per}", flush=True)
    dp = dp_scaling(threads=args.threads or 1)
    print(f"sampling dp scaling: {dp}", flush=True)
    command = "python -m functional_dit " + " ".join(getattr(args, "argv", sys.argv[1:]))
    text = markdown(per, dp, command, started, bench.machine())
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
        print(f"appended to {args.out}")
    return 0

"""Wall time per `fd.apply` forward of Ulysses (sp=4), ring attention (ring=4) and USP
(sp=2 x ring=2) on 4 CPU gloo ranks, side by side in one run: the three meshes are made
once and the forwards alternate round by round, so load from other processes on the
machine falls on all three alike. Reports each layout's median and fastest time and its
ratio to Ulysses (the median over rounds of each round's ratio).

The model: FLUX.1's architecture at a mid size for a CPU (4 heads x 64, 2 double + 4
single blocks, fp32), a 48 x 48 latent grid (2,304 image tokens, a 768² image) and 128
text tokens, batch 1, no grad. Every layout computes the same output (checked).

    python examples/sequence_parallel_bench.py [--rounds 5] [--side 48]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

import functional_dit as fd
import sharding

CONFIG = fd.Flux1Config(
    in_channels=64,
    num_layers=2,
    num_single_layers=4,
    attention_head_dim=64,
    num_attention_heads=4,
    joint_attention_dim=256,
    pooled_projection_dim=64,
    guidance_embeds=True,
    axes_dims_rope=(8, 28, 28),
)
LAYOUTS = {"Ulysses sp=4": dict(sp=4), "ring=4": dict(ring=4), "USP sp=2 x ring=2": dict(sp=2, ring=2)}


def inputs(side: int, txt: int = 128) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(side) * 1.0, torch.arange(side) * 1.0, indexing="ij"), -1
    )
    return dict(
        x=torch.randn(1, side * side, CONFIG.in_channels, generator=g),
        t=torch.rand(1, generator=g),
        txt=torch.randn(1, txt, CONFIG.joint_attention_dim, generator=g),
        pooled=torch.randn(1, CONFIG.pooled_projection_dim, generator=g),
        guidance=torch.full((1,), 3.5),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.zeros(txt, 3),
    )


def _rank(rank: int, world: int, port: int, rounds: int, side: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    kw, params = inputs(side), fd.init(CONFIG, seed=0)
    sharded = {name: sharding.shard_params(params, sharding.make_mesh(**m)) for name, m in LAYOUTS.items()}
    times = {name: [] for name in LAYOUTS}
    outs = {}
    with torch.no_grad():
        for name, p in sharded.items():  # warm-up (and the outputs compared below)
            outs[name] = fd.apply(p, **kw)
        for _ in range(rounds):
            for name, p in sharded.items():
                torch.distributed.barrier()
                start = time.perf_counter()
                fd.apply(p, **kw)
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        first = next(iter(outs.values()))
        err = max((o - first).abs().max().item() for o in outs.values())
        torch.save(dict(times=times, err=err), out)
    torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--side", type=int, default=48)
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sp_bench_{os.getpid()}.pt")
    mp.spawn(_rank, args=(4, port, args.rounds, args.side, out), nprocs=4)
    r = torch.load(out)
    os.remove(out)
    base = r["times"]["Ulysses sp=4"]
    S = args.side**2 + 128
    print(f"FLUX.1 architecture, 4 heads x 64, 6 blocks, {S} tokens, fp32, 4 gloo ranks, {args.rounds} rounds")
    print(f"max |output - Ulysses output| over layouts: {r['err']:.1e}")
    print("| layout | median s / forward | min s | vs Ulysses (median of per-round ratios) |")
    print("|---|---|---|---|")
    for name, ts in r["times"].items():
        ratio = statistics.median(t / b for t, b in zip(ts, base))  # each round against its own Ulysses run
        print(f"| {name} | {statistics.median(ts):.3f} | {min(ts):.3f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()

"""When does one padded model call over images of several sizes (mixed resolutions) beat
one call per size (the serving engine's per-size round robin)? Two measurements, side by
side in one run, alternating rounds so both modes share the machine's load:

1. ``calls``: for pairs of sizes (``--pairs``), one `sampling.step` over both batches
   merged (``merge(..., mixed=True)``: one padded call) against a step of each batch
   alone (two calls); the call's padding (padded over real tokens) and the ratio.
2. ``serve``: the serving engine in process (`functional_dit.serve._engine.Engine`, no
   HTTP) making ``--requests`` images of those sizes submitted at once, mixed
   resolutions on (``--max-padding``, the engine's default unless given) and off:
   images/s and the ratio.

    python examples/bench_mixed.py [--model flux] [--steps 4] [--batch 2] [--rounds 5]

Prints Markdown tables (docs/serving.md, "Mixed resolutions").
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

import functional_dit as fd
from functional_dit import sampling, tiny
from functional_dit.serve import _engine

MSL = 32


def _state(params, ctx, size: tuple, n: int, steps: int, seed: int = 0) -> sampling.State:
    reqs = [
        sampling.Request(f"image {seed + j}", *size, steps, seed=seed + j, max_sequence_length=MSL) for j in range(n)
    ]
    return sampling.init(params, ctx, reqs)


def time_calls(params, ctx, a, b, rounds: int) -> tuple[float, float]:
    """Median seconds of one step of ``a`` and ``b`` merged (one call) and of each alone."""
    merged, packed, split = sampling.merge(a, b, mixed=True), [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sampling.step(params, merged)
        packed.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sampling.step(params, a), sampling.step(params, b)
        split.append(time.perf_counter() - t0)
    return statistics.median(packed), statistics.median(split)


def calls_table(params, ctx, pairs, batch: int, rounds: int) -> list[str]:
    rows = [
        "| sizes | images | padding | one padded call, ms | a call per size, ms | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for sa, sb in pairs:
        a, b = _state(params, ctx, sa, batch, 4), _state(params, ctx, sb, batch, 4, seed=100)
        sampling.step(params, sampling.merge(a, b, mixed=True))  # warm-up (kernel choices, allocator)
        packed, split = time_calls(params, ctx, a, b, rounds)
        pad = sampling.padding(a.items + b.items)
        name = f"{sa[1]}x{sa[0]} + {sb[1]}x{sb[0]}"
        rows.append(
            f"| {name} | {2 * batch} | {pad:.2f} | {packed * 1e3:.1f} | {split * 1e3:.1f} | {split / packed:.2f}x |"
        )
    return rows


def serve_once(params, pipe, sizes, requests: int, steps: int, mixed: bool, max_batch: int, pad: float) -> float:
    """Images/s of the engine making ``requests`` images (sizes in turn) submitted at once."""
    engine = _engine.Engine(params, pipe, max_batch=max_batch, max_queue=10 * requests, mixed=mixed, max_padding=pad)
    done = threading.Semaphore(0)
    reqs = [
        sampling.Request(f"image {j}", *sizes[j % len(sizes)], steps, seed=j, max_sequence_length=MSL)
        for j in range(requests)
    ]
    jobs = [_engine.Job(str(j), [r], lambda images, error: done.release()) for j, r in enumerate(reqs)]
    engine.start()
    t0 = time.perf_counter()
    for job in jobs:
        engine.submit(job)
    for _ in jobs:
        done.acquire(timeout=600)
    dt = time.perf_counter() - t0
    engine.stop()
    if engine.error is not None:
        raise engine.error
    return requests / dt


def serve_table(params, pipe, pairs, requests: int, steps: int, rounds: int, max_batch: int, pad: float) -> list[str]:
    rows = ["| sizes | requests | mixed on, img/s | mixed off, img/s | ratio |", "|---|---|---|---|---|"]
    for pair in pairs:
        serve_once(params, pipe, pair, 2, 1, True, max_batch, pad)  # warm-up
        on, off = [], []
        for _ in range(rounds):
            on.append(serve_once(params, pipe, pair, requests, steps, True, max_batch, pad))
            off.append(serve_once(params, pipe, pair, requests, steps, False, max_batch, pad))
        a, b = statistics.median(on), statistics.median(off)
        name = " + ".join(f"{w}x{h}" for h, w in pair)
        rows.append(f"| {name} | {requests} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    return rows


def _pairs(text: str) -> list:
    """'32x32+64x64,...' -> [((h, w), (h, w)), ...] (sizes as WxH)."""
    size = lambda s: tuple(int(v) for v in reversed(s.split("x")))  # noqa: E731
    return [tuple(size(s) for s in pair.split("+")) for pair in text.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="flux", help="a tiny pipeline kind")
    p.add_argument("--pairs", type=_pairs, default=_pairs("32x32+32x48,32x32+64x64,32x32+128x128,64x64+128x128"))
    p.add_argument("--batch", type=int, default=2, help="images of each size in a call (calls)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-padding", type=float, default=_engine.MAX_PADDING, help="the engine's (serve)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--skip", choices=("calls", "serve"), default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    pipe = tiny.pipeline(args.model)
    params = fd.from_diffusers(pipe.transformer)
    ctx = sampling.context(params, pipe)
    print(f"{args.model}, {torch.get_num_threads()} threads, {args.rounds} rounds (medians)\n")
    if args.skip != "calls":
        print("\n".join(calls_table(params, ctx, args.pairs, args.batch, 3 * args.rounds)) + "\n")
    if args.skip != "serve":
        print(
            "\n".join(
                serve_table(
                    params, pipe, args.pairs, args.requests, args.steps, args.rounds, args.max_batch, args.max_padding
                )
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Throughput and latency of ``python -m functional_dit serve`` with continuous batching
against the same server with batching off (``--max-batch 1``: one image at a time), in
one run on one machine: images/s and p50/p95 request latency at concurrency 1, 4 and 16,
and at 16 with half the requests using a LoRA.

    python examples/bench_serve.py [--model flux] [--size 64x64] [--steps 4] [--requests 16]

Both servers are started as users start them (subprocesses on 127.0.0.1) and stay up
together; each row drives one then the other, so they share the machine's load. N client
threads send max(--requests, N) requests, each thread one after another (distinct seeds). Prints a
Markdown table (BENCHMARKS.md, "serve").
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import tiny


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, max_batch: int, lora_path: str):
    port = _port()
    cmd = [sys.executable, "-m", "functional_dit", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--max-batch", str(max_batch), "--max-queue", "256", "--size", args.size, "--steps", str(args.steps)]
    cmd += ["--lora", f"style={lora_path}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 600
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def drive(url: str, concurrency: int, requests: int, with_lora: bool) -> dict:
    """``requests`` requests from ``concurrency`` threads; every other one with the LoRA."""
    lat, lock, counter = [], threading.Lock(), iter(range(requests))

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            body = {"prompt": f"a scene number {i}", "seed": i}
            if with_lora and i % 2:
                body["lora"] = [{"name": "style", "scale": 0.8}]
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/images/generations", json=body, timeout=1800)
            r.raise_for_status()
            with lock:
                lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    q = statistics.quantiles(lat, n=20, method="inclusive") if len(lat) > 1 else lat * 19
    return {"images_s": requests / wall, "p50": statistics.median(lat), "p95": q[18]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="flux")
    p.add_argument("--size", default="64x64")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="requests per row")
    args = p.parse_args(argv)
    params = fd.from_diffusers(tiny.pipeline(args.model).transformer) if args.model in tiny.KINDS else None
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "style.safetensors")
    lora.save(lora.init(params.config, rank=8, alpha=8.0, seed=1, zero_b=False), path)
    rows = [(1, False), (4, False), (16, False), (16, True)]
    results, servers = {}, {}
    try:
        for mode, max_batch in (("batching", 16), ("off", 1)):  # both up at once: each row runs both in turn
            servers[mode] = start(args, max_batch, path)
        for c, lo in rows:
            for mode, (_, url) in servers.items():
                drive(url, 1, 1, False)  # warm-up
                results[(mode, c, lo)] = drive(url, c, max(args.requests, c), lo)
                print(mode, c, lo, results[(mode, c, lo)], flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(120)
    print(f"\n{args.model}, {args.size}, {args.steps} steps, {args.requests} requests per row, {os.cpu_count()} CPUs\n")
    print("| concurrency | LoRA | batching images/s | p50 s | p95 s | off images/s | p50 s | p95 s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c, lo in rows:
        b, o = results[("batching", c, lo)], results[("off", c, lo)]
        print(
            f"| {c} | {'half' if lo else 'none'} | {b['images_s']:.2f} | {b['p50']:.2f} | {b['p95']:.2f} | "
            f"{o['images_s']:.2f} | {o['p50']:.2f} | {o['p95']:.2f} | {b['images_s'] / o['images_s']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

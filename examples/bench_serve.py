"""Throughput and latency of ``python -m functional_dit serve`` with continuous batching
against the same server with batching off (``--max-batch 1``: one image at a time), in
one run on one machine.

Two ways to load it:

* ``--arrivals closed`` (the default): N client threads, each sending its next request when
  the last one is answered; rows at concurrency 1, 4 and 16, and 16 with half the requests
  on a LoRA (``--requests`` per row), ``--rounds`` times each: the medians, and batching /
  off per round.
* ``--arrivals poisson --rate R1,R2,...``: open-loop Poisson arrivals (seeded) at each
  offered load (requests/s) for ``--duration`` s: each request is sent at its arrival time
  whether or not the earlier ones were answered, as users arrive. Every request is a mix:
  a size from ``--sizes``, a LoRA on ``--lora-share`` of them, priority 1 on
  ``--priority-share`` (else 0). Per offered load and mode: achieved images/s and the p50 /
  p95 / p99 latency (from each request's arrival time to its answer). ``--out-md`` writes
  the table, ``--out-png`` the picture (latency and throughput against offered load).

    python examples/bench_serve.py --size 32x32 --steps 2 --requests 8
    python examples/bench_serve.py --arrivals poisson --rate 2,4,8 --duration 8 --rounds 2 \\
        --sizes 32x32,48x48 --steps 2 --out-md serve.md --out-png docs/img/bench_serve.png

Both servers are started as users start them (subprocesses on 127.0.0.1) and stay up
together; each row (each round of each offered load) drives one then the other, the order
alternating from round to round, so they share the machine's load. The 1-minute load
average is read at every run and reported with the table (BENCHMARKS.md, "serve"); the
table is printed, and written to ``--out-md``. ``--baseline DIR`` adds a third server,
batching on the code under DIR (``git worktree add DIR COMMIT``): before and after a
change in one run, under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
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

BASELINE = "batching, baseline"  # --baseline DIR's server: batching on the code under DIR


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def modes(args) -> dict:
    """The servers to compare: mode -> (its --max-batch, the PYTHONPATH it runs under or None)."""
    out = {"batching": (args.max_batch, None), "off": (1, None)}
    if args.baseline:
        out[BASELINE] = (args.max_batch, os.path.abspath(args.baseline))
    return out


def start(args, max_batch: int, lora_path: str, pythonpath: str | None = None):
    port = _port()
    cmd = [sys.executable, "-m", "functional_dit", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--max-batch", str(max_batch), "--max-queue", "1024", "--size", args.size, "--steps", str(args.steps)]
    cmd += ["--lora", f"style={lora_path}"]
    env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    # python -m puts the working directory first on sys.path: the baseline's server runs in its tree
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=pythonpath)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 600
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
        if proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"the server ({' '.join(cmd)}) did not start")


def percentile(values, q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated (one value: itself)."""
    v = sorted(values)
    if not v:
        return math.nan
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


# ----------------------------------------------------------------------------- closed loop


def drive(url: str, concurrency: int, requests: int, with_lora: bool) -> dict:
    """``requests`` requests from ``concurrency`` threads (each with its own connection);
    every other one with the LoRA."""
    lat, lock, counter = [], threading.Lock(), iter(range(requests))

    def client():
        with httpx.Client(timeout=1800) as http:
            while (i := _next(lock, counter)) is not None:
                body = {"prompt": f"a scene number {i}", "seed": i}
                if with_lora and i % 2:
                    body["lora"] = [{"name": "style", "scale": 0.8}]
                t0 = time.perf_counter()
                http.post(url + "/v1/images/generations", json=body).raise_for_status()
                with lock:
                    lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    return {"images_s": requests / wall, "p50": percentile(lat, 0.5), "p95": percentile(lat, 0.95)}


def _next(lock, counter):
    with lock:
        return next(counter, None)


CLOSED_ROWS = ((1, False), (4, False), (16, False), (16, True))  # (concurrency, half the requests on the LoRA)


def closed(args, servers: dict) -> str:
    """The closed-loop rows, ``--rounds`` times on every server (the order alternating);
    the table."""
    results: dict = {}
    for r in range(args.rounds):
        for k, (c, lo) in enumerate(CLOSED_ROWS):
            for mode in _order(servers, r + k):
                (proc, url), n = servers[mode], max(args.requests, c)
                drive(url, 1, 1, False)  # warm-up
                cpu = cpu_seconds(proc.pid)
                run = drive(url, c, n, lo)
                run.update(cpu_image=(cpu_seconds(proc.pid) - cpu) / n, load=os.getloadavg()[0])
                results.setdefault((mode, c, lo), []).append(run)
                print(f"round {r}", mode, c, lo, {k: round(v, 3) for k, v in run.items()}, flush=True)
    return closed_table(args, results)


def closed_table(args, results: dict) -> str:
    """A row per concurrency and mode (medians over rounds), then batching / off per round."""
    loads = [run["load"] for runs in results.values() for run in runs]
    lines = [
        f"{args.model}, {args.size}, {args.steps} steps, max({args.requests}, concurrency) requests per row, "
        f"{args.rounds} round(s), {os.cpu_count()} CPUs, 1-minute load average {min(loads):.1f}-{max(loads):.1f}",
        "",
        "| concurrency | LoRA | mode | images/s | CPU ms/image | p50 s | p95 s |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for c, lo in CLOSED_ROWS:
        for mode in modes(args):
            runs = results[(mode, c, lo)]
            med = {k: statistics.median(run[k] for run in runs) for k in ("images_s", "cpu_image", "p50", "p95")}
            lines.append(f"| {c} | {'half' if lo else 'none'} | {mode} | {med['images_s']:.2f} "
                         f"| {1000 * med['cpu_image']:.0f} | {med['p50']:.2f} | {med['p95']:.2f} |")  # fmt: skip
        per = [b["images_s"] / o["images_s"] for b, o in zip(results[("batching", c, lo)], results[("off", c, lo)])]
        ratios.append(f"- concurrency {c}{', half LoRA' if lo else ''}: images/s batching / off per round "
                      + " / ".join(f"{x:.2f}" for x in per) + f" (median {statistics.median(per):.2f})")  # fmt: skip
    return "\n".join(lines + ["", *ratios]) + "\n"


def _order(servers: dict, r: int) -> list:
    """The modes in round ``r``'s order: as listed in even rounds, reversed in odd ones."""
    modes = list(servers)
    return modes if r % 2 == 0 else modes[::-1]


# ----------------------------------------------------------------------------- open loop


def schedule(rate: float, duration: float, seed: int, args) -> list:
    """The seeded arrivals of one run: (arrival s, body), exponential gaps at ``rate``/s
    over ``duration`` s; each body a size, maybe the LoRA, a priority (module docstring)."""
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < duration:
        body = {"prompt": f"a scene number {len(out)}", "seed": len(out), "size": rng.choice(args.sizes)}
        if rng.random() < args.lora_share:
            body["lora"] = [{"name": "style", "scale": 0.8}]
        body["priority"] = 1 if rng.random() < args.priority_share else 0
        out.append((t, body))
    return out


async def _open_loop(url: str, arrivals: list) -> tuple:
    """Send each body at its arrival time; (latencies of the 200s, other statuses, wall s
    from the start of the arrivals' window to the last answer)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as http:
        t0 = time.perf_counter()

        async def one(at: float, body: dict):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            r = await http.post(url + "/v1/images/generations", json=body)
            return r.status_code, time.perf_counter() - (t0 + at)

        answers = await asyncio.gather(*(one(at, body) for at, body in arrivals))
        wall = time.perf_counter() - t0
    lat = [s for code, s in answers if code == 200]
    return lat, [code for code, _ in answers if code != 200], wall


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, every thread) process ``pid`` has used; NaN where
    /proc is not there (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def run_poisson(server: tuple, rate: float, seed: int, args) -> dict:
    """One run at ``rate``: offered and achieved load, latency percentiles, the server's CPU
    seconds per image (what the machine's other load does not change much), the load average."""
    (proc, url), arrivals = server, schedule(rate, args.duration, seed, args)
    cpu = cpu_seconds(proc.pid)
    lat, errors, wall = asyncio.run(_open_loop(url, arrivals))
    return {
        "offered": len(arrivals) / args.duration,
        "images_s": len(lat) / max(wall, args.duration),  # the window, or longer while a queue drains
        "cpu_image": (cpu_seconds(proc.pid) - cpu) / max(len(lat), 1),
        "lat": lat,
        "errors": errors,
        "load": os.getloadavg()[0],
    }


def poisson(args, servers: dict) -> dict:
    """Every round of every rate on both servers, the modes' order alternating; {(rate,
    mode): [run, ...]}."""
    for _, url in servers.values():  # warm-up: every size, with and without the LoRA
        for size in args.sizes:
            for extra in ({}, {"lora": [{"name": "style", "scale": 0.8}]}):
                httpx.post(url + "/v1/images/generations", json={"prompt": "warm", "size": size, **extra}, timeout=600)
    runs: dict = {}
    for r in range(args.rounds):
        for k, rate in enumerate(args.rate):
            for mode in _order(servers, r + k):
                run = run_poisson(servers[mode], rate, args.seed + 1000 * r + k, args)
                runs.setdefault((rate, mode), []).append(run)
                p50 = percentile(run["lat"], 0.5)
                print(f"round {r} rate {rate} {mode}: {run['images_s']:.2f} images/s, p50 {p50:.2f} s, "
                      f"{1000 * run['cpu_image']:.0f} CPU ms/image, {len(run['errors'])} errors, "
                      f"load {run['load']:.1f}", flush=True)  # fmt: skip
    return runs


def summary(runs: list) -> dict:
    """One row of a mode at one rate: each figure the median over rounds (a round's
    percentiles over its answers; rounds under different machine load are not pooled)."""
    med = lambda f: statistics.median(f(run) for run in runs)  # noqa: E731
    row = {q: med(lambda run, q=q: percentile(run["lat"], int(q[1:]) / 100)) for q in ("p50", "p95", "p99")}
    return {
        "offered": med(lambda run: run["offered"]),
        "images_s": med(lambda run: run["images_s"]),
        "cpu_ms": 1000 * med(lambda run: run["cpu_image"]),
        **row,
        "answered": sum(len(run["lat"]) for run in runs),
        "errors": sum(len(run["errors"]) for run in runs),
    }


def table(args, runs: dict) -> str:
    """The Markdown table: a row per offered load and mode, then per round what batching
    gains over off (and over the baseline)."""
    lines = [
        "| offered req/s | mode | achieved images/s | CPU ms/image | p50 s | p95 s | p99 s | answered | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for rate in args.rate:
        for mode in modes(args):
            row = summary(runs[(rate, mode)])
            lines.append(
                f"| {row['offered']:.2f} | {mode} | {row['images_s']:.2f} | {row['cpu_ms']:.0f} | {row['p50']:.2f} "
                f"| {row['p95']:.2f} | {row['p99']:.2f} | {row['answered']} | {row['errors']} |"
            )
        notes.append(f"- {rate:g} req/s, batching against off: {gains(runs[(rate, 'batching')], runs[(rate, 'off')])}")
        if args.baseline:
            notes[-1] += f"; against the baseline: {gains(runs[(rate, 'batching')], runs[(rate, BASELINE)])}"
    return "\n".join(lines + ["", "Per round (each pair run back to back):", "", *notes])


def gains(ours: list, theirs: list) -> str:
    """Per round: images/s ours / theirs, p50 and CPU per image theirs / ours (> 1: ours better)."""
    per = lambda f: " / ".join(f"{f(a, b):.2f}" for a, b in zip(ours, theirs))  # noqa: E731
    p50 = lambda run: percentile(run["lat"], 0.5)  # noqa: E731
    return (
        f"images/s x{per(lambda a, b: a['images_s'] / b['images_s'])}, "
        f"p50 x{per(lambda a, b: p50(b) / p50(a))}, CPU/image x{per(lambda a, b: b['cpu_image'] / a['cpu_image'])}"
    )


def report(args, runs: dict, argv) -> str:
    """The table with what was run and the machine's load during it."""
    loads = [run["load"] for rs in runs.values() for run in rs]
    head = (
        f"`python examples/bench_serve.py {' '.join(argv)}`: {args.model}, sizes {', '.join(args.sizes)}, "
        f"{args.steps} steps, LoRA on {args.lora_share:.0%} and priority 1 on {args.priority_share:.0%} of the "
        f"requests, {args.duration:g} s of arrivals per run, {args.rounds} round(s) per offered load, batching "
        f"`--max-batch {args.max_batch}` vs off `--max-batch 1`; {os.cpu_count()} CPUs, 1-minute load average "
        f"{min(loads):.1f}-{max(loads):.1f} during the runs. Latency from each request's arrival time to its answer"
        "; CPU ms/image: the server process's CPU time (every thread) per image, what the other load on the "
        "machine changes least. Each figure is the median over rounds; the ratios below are per round (> 1: "
        "batching better)."
    )
    if args.baseline:
        head += f' "{BASELINE}": the batching server on the code of {_revision(args.baseline)}.'
    return head + "\n\n" + table(args, runs) + "\n"


def _revision(path: str) -> str:
    """The commit checked out at ``path`` (its short hash), else the path."""
    git = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"commit {git.stdout.strip()}" if git.returncode == 0 else path


def picture(args, runs: dict, path: str) -> None:
    """Latency (p50 solid, p95 dashed) and achieved images/s against offered load, both modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat_ax, thr_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, color in zip(modes(args), ("tab:blue", "tab:orange", "tab:green")):
        rows = [summary(runs[(rate, mode)]) for rate in args.rate]
        x = [row["offered"] for row in rows]
        lat_ax.plot(x, [row["p50"] for row in rows], "o-", color=color, label=f"{mode} p50")
        lat_ax.plot(x, [row["p95"] for row in rows], "s--", color=color, label=f"{mode} p95")
        thr_ax.plot(x, [row["images_s"] for row in rows], "o-", color=color, label=mode)
    top = max(row["offered"] for rs in runs.values() for row in rs)
    thr_ax.plot([0, top], [0, top], ":", color="gray", label="achieved = offered")
    lat_ax.set(xlabel="offered load (requests/s)", ylabel="latency (s, log scale)", title="latency", yscale="log")
    thr_ax.set(xlabel="offered load (requests/s)", ylabel="achieved images/s", title="throughput")
    for ax in (lat_ax, thr_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"serve, {args.model} {', '.join(args.sizes)}, {args.steps} steps: batching vs off", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def _rates(text: str) -> list:
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests/s such as 1,2,4; got {text!r}") from None
    if not rates or not all(0 < r < math.inf for r in rates):
        raise argparse.ArgumentTypeError(f"expected positive requests/s such as 1,2,4; got {text!r}")
    return rates


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="flux")
    p.add_argument("--size", default="64x64", help="closed loop: the size of every request")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=16, help="the batching server's --max-batch")
    p.add_argument("--requests", type=int, default=16, help="closed loop: requests per row")
    p.add_argument("--arrivals", choices=("closed", "poisson"), default="closed")
    p.add_argument("--rate", type=_rates, default=[1.0, 2.0, 4.0], help="poisson: offered loads, requests/s")
    p.add_argument("--duration", type=float, default=10.0, help="poisson: seconds of arrivals per run")
    p.add_argument("--rounds", type=int, default=2, help="runs per row (offered load or concurrency) and server")
    p.add_argument("--seed", type=int, default=0, help="poisson: the arrivals' and the mix's seed")
    p.add_argument("--sizes", type=lambda s: s.split(","), default=["32x32", "48x48"], help="poisson: the sizes' mix")
    p.add_argument("--lora-share", type=float, default=0.5, help="poisson: the share of requests on the LoRA")
    p.add_argument("--priority-share", type=float, default=0.25, help="poisson: the share at priority 1")
    p.add_argument("--out-md", default=None, help="write the table here")
    p.add_argument("--out-png", default=None, help="poisson: write the picture here")
    p.add_argument("--out-json", default=None, help="poisson: write every run's figures here")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="also a batching server on the code under DIR (a git worktree of an older commit)",
    )
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    if args.arrivals == "poisson" and args.size not in args.sizes:
        args.size = args.sizes[0]  # the servers' default size, one the mix uses
    params = fd.from_diffusers(tiny.pipeline(args.model).transformer)
    path = os.path.join(tempfile.mkdtemp(), "style.safetensors")
    lora.save(lora.init(params.config, rank=8, alpha=8.0, seed=1, zero_b=False), path)
    servers = {}
    try:
        for mode, (max_batch, pythonpath) in modes(args).items():  # all up at once: each row runs each in turn
            servers[mode] = start(args, max_batch, path, pythonpath)
        if args.arrivals == "closed":
            return _write(args, closed(args, servers), None)
        runs = poisson(args, servers)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(120)
    return _write(args, report(args, runs, argv), runs)


def _write(args, text: str, runs: dict | None) -> int:
    """Print the table; write it to ``--out-md`` and (poisson) the picture to ``--out-png``."""
    print("\n" + text)
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(text)
    if args.out_png and runs is not None:
        picture(args, runs, args.out_png)
    if args.out_json and runs is not None:  # every run's figures, every latency: to redraw or recount
        with open(args.out_json, "w") as f:
            json.dump([{"rate": rate, "mode": mode, "runs": rs} for (rate, mode), rs in runs.items()], f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
